// The operands, attributes and results of each custom call, stated once for the CPU and the
// CUDA handlers (jax_flashmla/custom_calls.py states them once for Python). A platform's handler
// binds its context first (CUDA: the stream and the device), then everything here, then its own
// attributes (CUDA: the torch op's name), then the results; its function takes them in that
// order.
#ifndef JAX_FLASHMLA_FFI_OPERANDS_H_
#define JAX_FLASHMLA_FFI_OPERANDS_H_

#include <utility>

#include "xla/ffi/api/ffi.h"

namespace jax_flashmla {

namespace ffi = xla::ffi;

template <typename Binding>
auto BindMetadataOperands(Binding binding) {
  return std::move(binding).template Arg<ffi::Buffer<ffi::S32>>();  // seq_lens
}

template <typename Binding>
auto BindMetadataResults(Binding binding) {
  return std::move(binding).template Ret<ffi::Buffer<ffi::S32>>()   // tile_scheduler_metadata
      .template Ret<ffi::Buffer<ffi::S32>>();            // num_splits
}

template <typename Binding>
auto BindDecodeOperands(Binding binding) {
  return std::move(binding).template Arg<ffi::AnyBuffer>()          // q
      .template Arg<ffi::AnyBuffer>()                    // kv_cache
      .template Arg<ffi::Buffer<ffi::S32>>()             // block_table
      .template Arg<ffi::Buffer<ffi::S32>>()             // seq_lens
      .template Arg<ffi::Buffer<ffi::S32>>()             // tile_scheduler_metadata
      .template Arg<ffi::Buffer<ffi::S32>>()             // num_splits
      .template Attr<float>("softmax_scale")
      .template Attr<bool>("causal");
}

// The FP8 decode's kernel reads copies of the block table and the lengths with requests of
// length 0 as length 1 over page 0 (fp8.py's guard_empty_requests), and takes the per-tensor
// scales of q and the cache as (1,) float32 buffers.
template <typename Binding>
auto BindDecodeFp8Operands(Binding binding) {
  return std::move(binding).template Arg<ffi::AnyBuffer>()          // q
      .template Arg<ffi::AnyBuffer>()                    // kv_cache
      .template Arg<ffi::Buffer<ffi::S32>>()             // kernel_block_table
      .template Arg<ffi::Buffer<ffi::S32>>()             // kernel_seq_lens
      .template Arg<ffi::Buffer<ffi::S32>>()             // seq_lens
      .template Arg<ffi::Buffer<ffi::S32>>()             // tile_scheduler_metadata
      .template Arg<ffi::Buffer<ffi::S32>>()             // num_splits
      .template Arg<ffi::Buffer<ffi::F32>>()             // descale_q
      .template Arg<ffi::Buffer<ffi::F32>>()             // descale_k
      .template Attr<float>("softmax_scale")
      .template Attr<bool>("causal");
}

// out and lse, then FlashMLA's split-KV accumulators: out_accum (batch + num_sm_parts, h_q,
// s_q, 512) and lse_accum (batch + num_sm_parts, h_q, s_q) float32, scratch that XLA owns, so
// that a decode allocates no memory of its own (and can be captured in a command buffer).
template <typename Binding>
auto BindDecodeResults(Binding binding) {
  return std::move(binding).template Ret<ffi::AnyBuffer>()          // out
      .template Ret<ffi::Buffer<ffi::F32>>()             // lse
      .template Ret<ffi::Buffer<ffi::F32>>()             // out_accum
      .template Ret<ffi::Buffer<ffi::F32>>();            // lse_accum
}

// DeepSeek-V3.2's sparse decode: q, the (num_pages, 64, 1, 656) byte cache, a stack of the
// slots each query reads (layers, batch, s_q, topk) of which it reads row `layer`, the per-head
// sink logits (read only with with_sink), the schedule: the scheduler's rows (parts, 8)
// flattened, then num_splits (batch + 1).
template <typename Binding>
auto BindSparseDecodeOperands(Binding binding) {
  return std::move(binding).template Arg<ffi::AnyBuffer>()          // q
      .template Arg<ffi::Buffer<ffi::U8>>()              // kv_cache
      .template Arg<ffi::Buffer<ffi::S32>>()             // indices
      .template Arg<ffi::Buffer<ffi::F32>>()             // attn_sink
      .template Arg<ffi::Buffer<ffi::S32>>()             // schedule
      .template Attr<float>("softmax_scale")
      .template Attr<bool>("with_sink")
      .template Attr<int64_t>("layer");
}

// DeepSeek-V4's sparse decode (FlashMLA's MODEL1 form): q (batch, s_q, h_q, 512), the main
// cache (num_pages, 65, 576) bytes (jax_flashmla/caches/v4.py) with the slots each query reads
// (batch, s_q, topk) and their lengths (batch,), the extra (window) cache and its slots and
// lengths in the same forms (read only with with_extra), the per-head sink logits (read only
// with with_sink), and the schedule as for V3.2: rows (parts, 8) flattened, then num_splits.
template <typename Binding>
auto BindSparseDecodeV4Operands(Binding binding) {
  return std::move(binding).template Arg<ffi::AnyBuffer>()          // q
      .template Arg<ffi::Buffer<ffi::U8>>()              // kv_cache
      .template Arg<ffi::Buffer<ffi::S32>>()             // indices
      .template Arg<ffi::Buffer<ffi::S32>>()             // topk_length
      .template Arg<ffi::Buffer<ffi::U8>>()              // extra_kv_cache
      .template Arg<ffi::Buffer<ffi::S32>>()             // extra_indices
      .template Arg<ffi::Buffer<ffi::S32>>()             // extra_topk_length
      .template Arg<ffi::Buffer<ffi::F32>>()             // attn_sink
      .template Arg<ffi::Buffer<ffi::S32>>()             // schedule
      .template Attr<float>("softmax_scale")
      .template Attr<bool>("with_extra")
      .template Attr<bool>("with_sink");
}

// DeepSeek-V3.2's sparse prefill: q (tokens, h_q, 576), kv (keys, 1, 576) and indices (tokens,
// 1, topk) rows, the per-head sink logits (read only with with_sink).
template <typename Binding>
auto BindSparsePrefillOperands(Binding binding) {
  return std::move(binding).template Arg<ffi::AnyBuffer>()          // q
      .template Arg<ffi::AnyBuffer>()                    // kv
      .template Arg<ffi::Buffer<ffi::S32>>()             // indices
      .template Arg<ffi::Buffer<ffi::F32>>()             // attn_sink
      .template Arg<ffi::Buffer<ffi::S32>>()             // topk_length
      .template Attr<float>("softmax_scale")
      .template Attr<bool>("with_sink")
      .template Attr<bool>("with_topk_length");
}

// out, the base-2 lse and the largest logits (tokens, h_q), in the order the op allocates them.
template <typename Binding>
auto BindSparsePrefillResults(Binding binding) {
  return std::move(binding).template Ret<ffi::AnyBuffer>()          // out
      .template Ret<ffi::Buffer<ffi::F32>>()             // lse_base2
      .template Ret<ffi::Buffer<ffi::F32>>();            // max_logits
}

// host_queue.h's push: the array, and the queue by the id it was registered under.
template <typename Binding>
auto BindHostQueuePushOperands(Binding binding) {
  return std::move(binding).template Arg<ffi::AnyBuffer>()          // payload
      .template Attr<uint64_t>("queue_id");
}

// DeepSeek-V3.2's indexer (index_topk.h): query rows' e4m3 values (rows, heads, 128) and head
// weights (rows, heads), the index-key cache (num_pages, kIndexPageBytes) bytes (layouts.h),
// each row's block table (rows, max_pages) and visible tokens (rows,); the positions of each
// row's top k scores (rows, k), then the scores themselves (rows, max(max_pages * 64, k)),
// which the selection reads.
template <typename Binding>
auto BindIndexTopkOperands(Binding binding) {
  return std::move(binding).template Arg<ffi::AnyBuffer>()          // values (e4m3)
      .template Arg<ffi::Buffer<ffi::F32>>()             // weights
      .template Arg<ffi::Buffer<ffi::U8>>()              // cache
      .template Arg<ffi::Buffer<ffi::S32>>()             // block_table
      .template Arg<ffi::Buffer<ffi::S32>>();            // visible
}

template <typename Binding>
auto BindIndexTopkResults(Binding binding) {
  return std::move(binding).template Ret<ffi::Buffer<ffi::S32>>()   // positions
      .template Ret<ffi::Buffer<ffi::F32>>()             // scores
      .template Ret<ffi::Buffer<ffi::S32>>();            // the top-k's scratch
}

}  // namespace jax_flashmla

#endif  // JAX_FLASHMLA_FFI_OPERANDS_H_
