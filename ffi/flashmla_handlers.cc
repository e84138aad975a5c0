// XLA FFI handlers of FlashMLA's kernels, reached through the torch ops of SGLang's kernel
// packages, on XLA's stream and buffers.
#include "flashmla_handlers.h"

#include <cuda_runtime_api.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include <ATen/core/Tensor.h>

#include "cuda_error.h"
#include "cuda_handlers.h"
#include "empty_requests.h"
#include "layouts.h"
#include "operands.h"
#include "torch_bridge.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jax_flashmla {
namespace {

// The arguments both decode ops take.
OpArgs DecodeArgs(int32_t device, ffi::AnyBuffer q, ffi::AnyBuffer kv_cache,
                  const at::Tensor& block_table, const at::Tensor& seq_lens,
                  ffi::Buffer<ffi::S32> tile_scheduler_metadata, ffi::Buffer<ffi::S32> num_splits,
                  float softmax_scale, bool causal, int64_t head_dim_v) {
  OpArgs args;
  Slot(args, OpArg::kQ) = WrapBuffer(q, device);
  Slot(args, OpArg::kKvCache) = WrapBuffer(kv_cache, device);
  Slot(args, OpArg::kHeadDimV) = head_dim_v;
  Slot(args, OpArg::kSeqLens) = seq_lens;
  Slot(args, OpArg::kBlockTable) = block_table;
  Slot(args, OpArg::kSoftmaxScale) = static_cast<double>(softmax_scale);
  Slot(args, OpArg::kCausal) = causal;
  Slot(args, OpArg::kTileSchedulerMetadata) = WrapBuffer(tile_scheduler_metadata, device);
  Slot(args, OpArg::kNumSplits) = WrapBuffer(num_splits, device);
  return args;
}

ffi::Error MlaMetadataCudaImpl(cudaStream_t stream, int32_t device,
                               ffi::Buffer<ffi::S32> seq_lens, std::string_view op,
                               int64_t num_q_tokens_per_head_k, int64_t num_heads_k,
                               int64_t num_heads_q, int64_t written_fields,
                               ffi::ResultBuffer<ffi::S32> tile_scheduler_metadata,
                               ffi::ResultBuffer<ffi::S32> num_splits) {
  return OnXlaStream(stream, device, op, [&] {
    OpArgs args;
    Slot(args, OpArg::kSeqLens) = WrapBuffer(seq_lens, device);
    Slot(args, OpArg::kQTokensPerHeadK) = num_q_tokens_per_head_k;
    Slot(args, OpArg::kNumHeadsK) = num_heads_k;
    Slot(args, OpArg::kNumHeadsQ) = num_heads_q;
    Slot(args, OpArg::kIsFp8) = false;
    CallTorchOp(op, args,
                {WrapBuffer(*tile_scheduler_metadata, device), WrapBuffer(*num_splits, device)},
                {{"tile_scheduler_metadata", 0}, {"num_splits", 1}});
    // The scheduler leaves the rows' last fields unwritten (uninitialised memory); zeroing
    // them keeps XLA's buffer deterministic.
    const auto dims = tile_scheduler_metadata->dimensions();
    const size_t row_bytes = dims[1] * sizeof(int32_t);
    const size_t written_bytes = written_fields * sizeof(int32_t);
    if (dims[0] == 0 || written_bytes >= row_bytes) return ffi::Error::Success();
    char* unwritten =
        static_cast<char*>(tile_scheduler_metadata->untyped_data()) + written_bytes;
    return CudaError("zeroing the scheduler rows' unused fields",
                     cudaMemset2DAsync(unwritten, row_bytes, 0, row_bytes - written_bytes,
                                       dims[0], stream));
  });
}

// What the decode ops write, as the lowering lays it out: out; lse (b, h_q, s_q) as FlashMLA's
// (b, s_q, h_q) memory, which the op returns as a transposed view for s_q > 1
// (custom_calls._decode_layouts); then the split-KV accumulators, which FlashMLA allocates after
// its results.
at::Tensor LseBuffer(ffi::ResultBuffer<ffi::F32> lse, int32_t device) {
  const at::Tensor buffer = WrapBuffer(*lse, device);
  const int64_t batch = buffer.size(0), h_q = buffer.size(1), s_q = buffer.size(2);
  return s_q == 1 ? buffer : buffer.view({batch, s_q, h_q}).transpose(1, 2);
}

std::vector<at::Tensor> DecodeBuffers(int32_t device, ffi::Result<ffi::AnyBuffer> out,
                                      ffi::ResultBuffer<ffi::F32> lse,
                                      ffi::ResultBuffer<ffi::F32> out_accum,
                                      ffi::ResultBuffer<ffi::F32> lse_accum) {
  return {WrapBuffer(*out, device), LseBuffer(lse, device), WrapBuffer(*out_accum, device),
          WrapBuffer(*lse_accum, device)};
}

ffi::Error MlaDecodeCudaImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer q,
                             ffi::AnyBuffer kv_cache, ffi::Buffer<ffi::S32> block_table,
                             ffi::Buffer<ffi::S32> seq_lens,
                             ffi::Buffer<ffi::S32> tile_scheduler_metadata,
                             ffi::Buffer<ffi::S32> num_splits, float softmax_scale, bool causal,
                             std::string_view op, ffi::Result<ffi::AnyBuffer> out,
                             ffi::ResultBuffer<ffi::F32> lse,
                             ffi::ResultBuffer<ffi::F32> out_accum,
                             ffi::ResultBuffer<ffi::F32> lse_accum) {
  return OnXlaStream(stream, device, op, [&] {
    OpArgs args = DecodeArgs(device, q, kv_cache, WrapBuffer(block_table, device),
                             WrapBuffer(seq_lens, device), tile_scheduler_metadata, num_splits,
                             softmax_scale, causal, out->dimensions().back());
    Slot(args, OpArg::kIsFp8) = false;
    CallTorchOp(op, args, DecodeBuffers(device, out, lse, out_accum, lse_accum),
                {{"out", 0}, {"lse", 1}});
    return ffi::Error::Success();
  });
}

// FlashMLA's dense FP8 decode (fwd_kvcache_mla_fp8): q and the cache in e4m3fn, the per-tensor
// scales as (1,) float32 buffers on the device, out bfloat16. The kernel reads
// kernel_block_table and kernel_seq_lens, where a request of length 0 is one of length 1 over
// page 0; requests whose seq_lens are 0 then get out 0, lse +inf (empty_requests.h).
ffi::Error MlaDecodeFp8CudaImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer q,
                                ffi::AnyBuffer kv_cache, ffi::Buffer<ffi::S32> kernel_block_table,
                                ffi::Buffer<ffi::S32> kernel_seq_lens,
                                ffi::Buffer<ffi::S32> seq_lens,
                                ffi::Buffer<ffi::S32> tile_scheduler_metadata,
                                ffi::Buffer<ffi::S32> num_splits, ffi::Buffer<ffi::F32> descale_q,
                                ffi::Buffer<ffi::F32> descale_k, float softmax_scale, bool causal,
                                std::string_view op, ffi::Result<ffi::AnyBuffer> out,
                                ffi::ResultBuffer<ffi::F32> lse,
                                ffi::ResultBuffer<ffi::F32> out_accum,
                                ffi::ResultBuffer<ffi::F32> lse_accum) {
  return OnXlaStream(stream, device, op, [&] {
    OpArgs args = DecodeArgs(device, q, kv_cache, WrapBuffer(kernel_block_table, device),
                             WrapBuffer(kernel_seq_lens, device), tile_scheduler_metadata,
                             num_splits, softmax_scale, causal, out->dimensions().back());
    Slot(args, OpArg::kDescaleQ) = WrapBuffer(descale_q, device);
    Slot(args, OpArg::kDescaleK) = WrapBuffer(descale_k, device);
    CallTorchOp(op, args, DecodeBuffers(device, out, lse, out_accum, lse_accum),
                {{"out", 0}, {"lse", 1}});
    const int64_t batch = seq_lens.element_count();
    if (batch == 0) return ffi::Error::Success();
    return CudaError("setting the results of requests of length 0",
                     LaunchClearEmptyRequests(seq_lens.typed_data(), batch, out->untyped_data(),
                                              out->element_count() / batch, lse->typed_data(),
                                              lse->element_count() / batch, stream));
  });
}

// The (parts, 8) rows and the (batch + 1) num_splits of a schedule array (rows flattened,
// then num_splits), as the tensors the sparse decodes take; an error where its size is not
// that of whole rows and batch + 1 splits.
ffi::Error ScheduleTensors(std::string_view op, ffi::Buffer<ffi::S32> schedule, int64_t batch,
                           int32_t device, at::Tensor* rows, at::Tensor* splits) {
  const int64_t rows_size = static_cast<int64_t>(schedule.element_count()) - (batch + 1);
  if (rows_size < kMetadataFields || rows_size % kMetadataFields != 0) {
    return ffi::Error::InvalidArgument(
        std::string(op) + ": a schedule of " + std::to_string(schedule.element_count()) +
        " int32 is not (parts, 8) rows and num_splits of batch + 1 = " +
        std::to_string(batch + 1));
  }
  const std::array<int64_t, 2> rows_dims{rows_size / kMetadataFields, kMetadataFields};
  const std::array<int64_t, 1> splits_dims{batch + 1};
  *rows = WrapBuffer(schedule.typed_data(), {rows_dims.data(), rows_dims.size()},
                     ffi::DataType::S32, device);
  *splits = WrapBuffer(schedule.typed_data() + rows_size,
                       {splits_dims.data(), splits_dims.size()}, ffi::DataType::S32, device);
  return ffi::Error::Success();
}

// Runs a sparse decode op (V3.2's or V4's sparse_decode_fwd) on `args` and the schedule's
// tensors, its results and accumulators lent in the order it allocates them: out, lse, then
// lse_accum before out_accum.
void CallSparseDecode(std::string_view op, OpArgs& args, const at::Tensor& rows,
                      const at::Tensor& splits, float softmax_scale, int32_t device,
                      ffi::Result<ffi::AnyBuffer> out, ffi::ResultBuffer<ffi::F32> lse,
                      ffi::ResultBuffer<ffi::F32> out_accum,
                      ffi::ResultBuffer<ffi::F32> lse_accum) {
  Slot(args, OpArg::kTileSchedulerMetadata) = rows;
  Slot(args, OpArg::kNumSplits) = splits;
  Slot(args, OpArg::kHeadDimV) = out->dimensions().back();
  Slot(args, OpArg::kSoftmaxScale) = static_cast<double>(softmax_scale);
  CallTorchOp(op, args,
              {WrapBuffer(*out, device), LseBuffer(lse, device), WrapBuffer(*lse_accum, device),
               WrapBuffer(*out_accum, device)},
              {{"out", 0}, {"lse", 1}});
}

// DeepSeek-V3.2's sparse decode (sparse_decode_fwd) over the 656-byte token cache, viewed as
// the float8_e4m3fn bytes the op takes, on a schedule the metadata call made (one array: its
// rows (parts, 8), then num_splits (batch + 1)); its results and accumulators in XLA's buffers
// (listed in the order it allocates them).
// `indices` is a stack (layers, batch, s_q, topk) of which the decode reads row `layer` in
// place: a layer's slice handed over as an offset, where XLA would compute its address on the
// host at every execution (a dynamic-slice thunk per call).
ffi::Error MlaSparseDecodeCudaImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer q,
                                   ffi::Buffer<ffi::U8> kv_cache, ffi::Buffer<ffi::S32> indices,
                                   ffi::Buffer<ffi::F32> attn_sink,
                                   ffi::Buffer<ffi::S32> schedule, float softmax_scale,
                                   bool with_sink, int64_t layer, std::string_view op,
                                   ffi::Result<ffi::AnyBuffer> out,
                                   ffi::ResultBuffer<ffi::F32> lse,
                                   ffi::ResultBuffer<ffi::F32> out_accum,
                                   ffi::ResultBuffer<ffi::F32> lse_accum) {
  const auto stack = indices.dimensions();
  if (stack.size() != 4 || layer < 0 || layer >= stack[0]) {
    return ffi::Error::InvalidArgument(
        std::string(op) + ": layer " + std::to_string(layer) + " of an indices stack of " +
        std::to_string(stack.size() == 4 ? stack[0] : 0) +
        " layers (rank 4: layers, batch, s_q, topk)");
  }
  const int64_t row = stack[1] * stack[2] * stack[3];
  at::Tensor rows, splits;
  if (ffi::Error error = ScheduleTensors(op, schedule, stack[1], device, &rows, &splits);
      error.failure()) {
    return error;
  }
  return OnXlaStream(stream, device, op, [&] {
    OpArgs args;
    Slot(args, OpArg::kQ) = WrapBuffer(q, device);
    Slot(args, OpArg::kKvCache) = WrapBuffer(kv_cache.untyped_data(), kv_cache.dimensions(),
                                             ffi::DataType::F8E4M3FN, device);
    Slot(args, OpArg::kIndices) = WrapBuffer(indices.typed_data() + layer * row,
                                             stack.last(3), ffi::DataType::S32, device);
    if (with_sink) Slot(args, OpArg::kAttnSink) = WrapBuffer(attn_sink, device);
    CallSparseDecode(op, args, rows, splits, softmax_scale, device, out, lse, out_accum,
                     lse_accum);
    return ffi::Error::Success();
  });
}

// A DeepSeek-V4 cache (num_pages, 65, 576) as the (num_pages, 64, 1, 584) float8_e4m3fn view
// FlashMLA's MODEL1 kernel takes: a page's stride stays 65 rows, a token's is 584 bytes (the
// kernel finds the token rows and the scale row within the page itself).
at::Tensor V4CacheView(ffi::Buffer<ffi::U8> cache, int32_t device) {
  const int64_t pages = cache.dimensions()[0];
  const at::Tensor bytes = WrapBuffer(cache.untyped_data(), cache.dimensions(),
                                      ffi::DataType::F8E4M3FN, device);
  return bytes.as_strided({pages, kPageTokens, 1, kV4KernelTokenBytes},
                          {kV4PageRows * kV4RowBytes, kV4KernelTokenBytes, kV4KernelTokenBytes,
                           1});
}

// DeepSeek-V4's sparse decode (sparse_decode_fwd with a q of 512: FlashMLA's MODEL1 kernel)
// over the main cache and, with with_extra, the extra (window) cache, on a schedule the
// metadata call made over the requests' combined lengths; results and accumulators in XLA's
// buffers, in the order the op allocates them.
ffi::Error MlaSparseDecodeV4CudaImpl(
    cudaStream_t stream, int32_t device, ffi::AnyBuffer q, ffi::Buffer<ffi::U8> kv_cache,
    ffi::Buffer<ffi::S32> indices, ffi::Buffer<ffi::S32> topk_length,
    ffi::Buffer<ffi::U8> extra_kv_cache, ffi::Buffer<ffi::S32> extra_indices,
    ffi::Buffer<ffi::S32> extra_topk_length, ffi::Buffer<ffi::F32> attn_sink,
    ffi::Buffer<ffi::S32> schedule, float softmax_scale, bool with_extra, bool with_sink,
    std::string_view op, ffi::Result<ffi::AnyBuffer> out, ffi::ResultBuffer<ffi::F32> lse,
    ffi::ResultBuffer<ffi::F32> out_accum, ffi::ResultBuffer<ffi::F32> lse_accum) {
  at::Tensor rows, splits;
  if (ffi::Error error = ScheduleTensors(op, schedule, q.dimensions()[0], device, &rows, &splits);
      error.failure()) {
    return error;
  }
  return OnXlaStream(stream, device, op, [&] {
    OpArgs args;
    Slot(args, OpArg::kQ) = WrapBuffer(q, device);
    Slot(args, OpArg::kKvCache) = V4CacheView(kv_cache, device);
    Slot(args, OpArg::kIndices) = WrapBuffer(indices, device);
    Slot(args, OpArg::kTopkLength) = WrapBuffer(topk_length, device);
    if (with_extra) {
      Slot(args, OpArg::kExtraKv) = V4CacheView(extra_kv_cache, device);
      Slot(args, OpArg::kExtraIndices) = WrapBuffer(extra_indices, device);
      Slot(args, OpArg::kExtraTopkLength) = WrapBuffer(extra_topk_length, device);
    }
    if (with_sink) Slot(args, OpArg::kAttnSink) = WrapBuffer(attn_sink, device);
    CallSparseDecode(op, args, rows, splits, softmax_scale, device, out, lse, out_accum,
                     lse_accum);
    return ffi::Error::Success();
  });
}

// The sparse prefill (sparse_prefill_fwd) on bf16 rows, V3.2's or V4's (with_topk_length: V4's
// alone, whose kernel skips each row's indices from its length on); no scratch. It allocates
// out, lse, max_logits (FlashMLA's sparse_fwd.h) and returns out, max_logits, lse. lse and
// max_logits are the same size, so only the lending order tells them apart: a release that
// allocated them the other way round fails the check on max_logits.
ffi::Error MlaSparsePrefillCudaImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer q,
                                    ffi::AnyBuffer kv, ffi::Buffer<ffi::S32> indices,
                                    ffi::Buffer<ffi::F32> attn_sink,
                                    ffi::Buffer<ffi::S32> topk_length, float softmax_scale,
                                    bool with_sink, bool with_topk_length, std::string_view op,
                                    ffi::Result<ffi::AnyBuffer> out,
                                    ffi::ResultBuffer<ffi::F32> lse_base2,
                                    ffi::ResultBuffer<ffi::F32> max_logits) {
  return OnXlaStream(stream, device, op, [&] {
    OpArgs args;
    Slot(args, OpArg::kQ) = WrapBuffer(q, device);
    Slot(args, OpArg::kKvCache) = WrapBuffer(kv, device);
    Slot(args, OpArg::kIndices) = WrapBuffer(indices, device);
    if (with_sink) Slot(args, OpArg::kAttnSink) = WrapBuffer(attn_sink, device);
    if (with_topk_length) Slot(args, OpArg::kTopkLength) = WrapBuffer(topk_length, device);
    Slot(args, OpArg::kHeadDimV) = out->dimensions().back();
    Slot(args, OpArg::kSoftmaxScale) = static_cast<double>(softmax_scale);
    CallTorchOp(op, args,
                {WrapBuffer(*out, device), WrapBuffer(*lse_base2, device),
                 WrapBuffer(*max_logits, device)},
                {{"out", 0}, {"max_logits", 2}, {"lse", 1}});
    return ffi::Error::Success();
  });
}

auto CudaContext() {
  return ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>().Ctx<ffi::DeviceOrdinal>();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(kMlaMetadataCuda, MlaMetadataCudaImpl,
                              BindMetadataResults(BindMetadataOperands(CudaContext())
                                                      .Attr<std::string_view>("op")
                                                      .Attr<int64_t>("num_q_tokens_per_head_k")
                                                      .Attr<int64_t>("num_heads_k")
                                                      .Attr<int64_t>("num_heads_q")
                                                      .Attr<int64_t>("written_fields")),
                              {kCudaTargetTraits});

XLA_FFI_DEFINE_HANDLER_SYMBOL(kMlaDecodeCuda, MlaDecodeCudaImpl,
    BindDecodeResults(BindDecodeOperands(CudaContext()).Attr<std::string_view>("op")),
    {kCudaTargetTraits});

XLA_FFI_DEFINE_HANDLER_SYMBOL(kMlaSparseDecodeCuda, MlaSparseDecodeCudaImpl,
    BindDecodeResults(BindSparseDecodeOperands(CudaContext()).Attr<std::string_view>("op")),
    {kCudaTargetTraits});

XLA_FFI_DEFINE_HANDLER_SYMBOL(kMlaSparseDecodeV4Cuda, MlaSparseDecodeV4CudaImpl,
    BindDecodeResults(BindSparseDecodeV4Operands(CudaContext()).Attr<std::string_view>("op")),
    {kCudaTargetTraits});

XLA_FFI_DEFINE_HANDLER_SYMBOL(kMlaSparsePrefillCuda, MlaSparsePrefillCudaImpl,
    BindSparsePrefillResults(
        BindSparsePrefillOperands(CudaContext()).Attr<std::string_view>("op")),
    {kCudaTargetTraits});

XLA_FFI_DEFINE_HANDLER_SYMBOL(kMlaDecodeFp8Cuda, MlaDecodeFp8CudaImpl,
    BindDecodeResults(BindDecodeFp8Operands(CudaContext()).Attr<std::string_view>("op")),
    {kCudaTargetTraits});

}  // namespace jax_flashmla
