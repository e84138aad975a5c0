#include "cpu_handlers.h"

#include <cstdint>
#include <cstring>
#include <string>

#include "host_queue.h"
#include "operands.h"
#include "reference_mla.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jax_flashmla {
namespace {

// Shapes are validated in Python at trace time; these checks only guard the memory the
// reference touches, so that a malformed direct call is an error and not a crash.
ffi::Error CheckRank(const char* name, ffi::Span<const int64_t> dims, size_t rank) {
  if (dims.size() != rank)
    return ffi::Error::InvalidArgument(std::string(name) + " must have rank " +
                                       std::to_string(rank) + ", got " +
                                       std::to_string(dims.size()));
  return ffi::Error::Success();
}

ffi::Error MlaMetadataCpuImpl(ffi::Buffer<ffi::S32> seq_lens,
                              ffi::ResultBuffer<ffi::S32> tile_scheduler_metadata,
                              ffi::ResultBuffer<ffi::S32> num_splits) {
  const auto md_dims = tile_scheduler_metadata->dimensions();
  if (auto err = CheckRank("tile_scheduler_metadata", md_dims, 2); err.failure()) return err;
  if (md_dims[1] != kMetadataFields || md_dims[0] < 1)
    return ffi::Error::InvalidArgument("tile_scheduler_metadata must be (num_sm_parts >= 1, 8)");
  const int64_t batch = static_cast<int64_t>(seq_lens.element_count());
  if (static_cast<int64_t>(num_splits->element_count()) != batch + 1)
    return ffi::Error::InvalidArgument("num_splits must have batch + 1 elements");
  ScheduleDecode(seq_lens.typed_data(), batch, md_dims[0],
                 reinterpret_cast<SchedulerRow*>(tile_scheduler_metadata->typed_data()),
                 num_splits->typed_data());
  return ffi::Error::Success();
}

// The decode on checked shapes; types and scales come from the handler of each target.
ffi::Error RunDecode(ffi::AnyBuffer q, ffi::AnyBuffer kv_cache, ffi::Buffer<ffi::S32> block_table,
                     ffi::Buffer<ffi::S32> seq_lens,
                     ffi::Buffer<ffi::S32> tile_scheduler_metadata,
                     ffi::Buffer<ffi::S32> num_splits, float softmax_scale, bool causal,
                     ElementType in_type, ElementType out_type, float q_scale, float k_scale,
                     ffi::Result<ffi::AnyBuffer> out, ffi::ResultBuffer<ffi::F32> lse,
                     ffi::ResultBuffer<ffi::F32> out_accum,
                     ffi::ResultBuffer<ffi::F32> lse_accum) {
  const auto q_dims = q.dimensions();
  const auto kv_dims = kv_cache.dimensions();
  const auto bt_dims = block_table.dimensions();
  const auto md_dims = tile_scheduler_metadata.dimensions();
  const auto out_dims = out->dimensions();
  if (auto err = CheckRank("q", q_dims, 4); err.failure()) return err;
  if (auto err = CheckRank("kv_cache", kv_dims, 4); err.failure()) return err;
  if (auto err = CheckRank("block_table", bt_dims, 2); err.failure()) return err;
  if (auto err = CheckRank("tile_scheduler_metadata", md_dims, 2); err.failure()) return err;
  if (auto err = CheckRank("out", out_dims, 4); err.failure()) return err;
  DecodeProblem problem{in_type,    out_type,    q_dims[0],  q_dims[1],     q_dims[2],
                        q_dims[3],  out_dims[3], kv_dims[0], bt_dims[1],    md_dims[0],
                        softmax_scale, causal};
  problem.q_scale = q_scale;
  problem.k_scale = k_scale;
  const int64_t num_lens = static_cast<int64_t>(seq_lens.element_count());
  const int64_t num_split_entries = static_cast<int64_t>(num_splits.element_count());
  if (kv_dims[1] != kPageTokens || kv_dims[2] != 1 || kv_dims[3] != problem.head_dim ||
      bt_dims[0] != problem.batch || num_lens != problem.batch ||
      num_split_entries != problem.batch + 1 || md_dims[1] != kMetadataFields ||
      problem.head_dim_v > problem.head_dim)
    return ffi::Error::InvalidArgument("mla_decode operands have inconsistent shapes");
  const int64_t accum_rows = problem.batch + problem.num_parts;
  const int64_t rows_per_request = problem.seqlen_q * problem.heads_q;
  if (static_cast<int64_t>(lse_accum->element_count()) != accum_rows * rows_per_request ||
      static_cast<int64_t>(out_accum->element_count()) !=
          accum_rows * rows_per_request * problem.head_dim_v)
    return ffi::Error::InvalidArgument(
        "out_accum and lse_accum must hold batch + num_sm_parts splits");
  const std::string message = DecodeReference(
      problem, q.untyped_data(), kv_cache.untyped_data(), block_table.typed_data(),
      seq_lens.typed_data(),
      reinterpret_cast<const SchedulerRow*>(tile_scheduler_metadata.typed_data()),
      num_splits.typed_data(), out->untyped_data(), lse->typed_data(),
      SplitAccumulators{out_accum->typed_data(), lse_accum->typed_data(), accum_rows});
  if (!message.empty()) return ffi::Error::InvalidArgument(message);
  return ffi::Error::Success();
}

ffi::Error MlaDecodeCpuImpl(ffi::AnyBuffer q, ffi::AnyBuffer kv_cache,
                            ffi::Buffer<ffi::S32> block_table, ffi::Buffer<ffi::S32> seq_lens,
                            ffi::Buffer<ffi::S32> tile_scheduler_metadata,
                            ffi::Buffer<ffi::S32> num_splits, float softmax_scale, bool causal,
                            ffi::Result<ffi::AnyBuffer> out, ffi::ResultBuffer<ffi::F32> lse,
                            ffi::ResultBuffer<ffi::F32> out_accum,
                            ffi::ResultBuffer<ffi::F32> lse_accum) {
  if (q.element_type() != kv_cache.element_type() || q.element_type() != out->element_type())
    return ffi::Error::InvalidArgument("q, kv_cache and out must share one dtype");
  ElementType dtype;
  if (q.element_type() == ffi::DataType::BF16) {
    dtype = ElementType::kBFloat16;
  } else if (q.element_type() == ffi::DataType::F16) {
    dtype = ElementType::kFloat16;
  } else {
    return ffi::Error::InvalidArgument("q must be bfloat16 or float16");
  }
  return RunDecode(q, kv_cache, block_table, seq_lens, tile_scheduler_metadata, num_splits,
                   softmax_scale, causal, dtype, dtype, 1.f, 1.f, out, lse, out_accum,
                   lse_accum);
}

// FlashMLA's FP8 decode: q and the cache in e4m3fn with per-tensor scales of shape (1,)
// (the kernel's descale_q, descale_k), out bfloat16. The C++ model takes requests of length 0
// as they are (out 0, lse +inf), so it reads seq_lens, not kernel_seq_lens (fp8.py's
// guard_empty_requests); kernel_block_table differs from the block table only where such a
// request reads nothing.
ffi::Error MlaDecodeFp8CpuImpl(ffi::AnyBuffer q, ffi::AnyBuffer kv_cache,
                               ffi::Buffer<ffi::S32> kernel_block_table,
                               ffi::Buffer<ffi::S32> kernel_seq_lens,
                               ffi::Buffer<ffi::S32> seq_lens,
                               ffi::Buffer<ffi::S32> tile_scheduler_metadata,
                               ffi::Buffer<ffi::S32> num_splits, ffi::Buffer<ffi::F32> descale_q,
                               ffi::Buffer<ffi::F32> descale_k, float softmax_scale, bool causal,
                               ffi::Result<ffi::AnyBuffer> out, ffi::ResultBuffer<ffi::F32> lse,
                               ffi::ResultBuffer<ffi::F32> out_accum,
                               ffi::ResultBuffer<ffi::F32> lse_accum) {
  if (q.element_type() != ffi::DataType::F8E4M3FN ||
      kv_cache.element_type() != ffi::DataType::F8E4M3FN)
    return ffi::Error::InvalidArgument("q and kv_cache of the FP8 decode must be float8_e4m3fn");
  if (descale_q.element_count() != 1 || descale_k.element_count() != 1)
    return ffi::Error::InvalidArgument("descale_q and descale_k must have one element each");
  if (out->element_type() != ffi::DataType::BF16)
    return ffi::Error::InvalidArgument("out of the FP8 decode must be bfloat16");
  if (kernel_seq_lens.element_count() != seq_lens.element_count())
    return ffi::Error::InvalidArgument("kernel_seq_lens and seq_lens must have one length each");
  return RunDecode(q, kv_cache, kernel_block_table, seq_lens, tile_scheduler_metadata,
                   num_splits, softmax_scale, causal, ElementType::kFloat8E4M3FN,
                   ElementType::kBFloat16,
                   descale_q.typed_data()[0], descale_k.typed_data()[0], out, lse, out_accum,
                   lse_accum);
}

ffi::Error HostQueuePushCpuImpl(ffi::AnyBuffer payload, uint64_t queue_id) {
  const int64_t bytes = static_cast<int64_t>(payload.size_bytes());
  std::string error;
  const HostQueue* queue = QueueForPush(queue_id, -1, bytes, error);
  if (queue == nullptr) return ffi::Error::InvalidArgument(error);
  const uint64_t sequence = __atomic_add_fetch(queue->pushes, 1, __ATOMIC_ACQ_REL);
  uint8_t* slot = queue->slots + ((sequence - 1) % queue->depth) * queue->slot_bytes;
  auto* slot_sequence = reinterpret_cast<uint64_t*>(slot);
  __atomic_store_n(slot_sequence, sequence | kHostQueueWriting, __ATOMIC_RELEASE);
  __atomic_thread_fence(__ATOMIC_SEQ_CST);
  std::memcpy(slot + kHostQueueHeaderBytes, payload.untyped_data(), bytes);
  __atomic_store_n(slot_sequence, sequence, __ATOMIC_RELEASE);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(kHostQueuePushCpu, HostQueuePushCpuImpl,
                              BindHostQueuePushOperands(ffi::Ffi::Bind()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(kMlaMetadataCpu, MlaMetadataCpuImpl,
                              BindMetadataResults(BindMetadataOperands(ffi::Ffi::Bind())));

XLA_FFI_DEFINE_HANDLER_SYMBOL(kMlaDecodeCpu, MlaDecodeCpuImpl,
                              BindDecodeResults(BindDecodeOperands(ffi::Ffi::Bind())));

XLA_FFI_DEFINE_HANDLER_SYMBOL(kMlaDecodeFp8Cpu, MlaDecodeFp8CpuImpl,
                              BindDecodeResults(BindDecodeFp8Operands(ffi::Ffi::Bind())));

}  // namespace jax_flashmla
