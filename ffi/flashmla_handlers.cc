// XLA FFI handlers of FlashMLA's kernels, reached through the torch ops of SGLang's kernel
// packages, on XLA's stream and buffers.
#include "flashmla_handlers.h"

#include <array>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <exception>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "buffer_lending.h"
#include "cuda_handlers.h"
#include "empty_requests.h"
#include "operands.h"
#include "torch_bridge.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jax_flashmla {
namespace {


at::Tensor Wrap(ffi::AnyBuffer buffer, int device) {
  return WrapBuffer(buffer.untyped_data(), buffer.dimensions(), buffer.element_type(), device);
}

template <ffi::DataType T>
at::Tensor Wrap(ffi::Buffer<T> buffer, int device) {
  return WrapBuffer(buffer.untyped_data(), buffer.dimensions(), T, device);
}

// Runs `body` with XLA's stream as torch's current stream, turning any exception (a torch
// check inside the op, a missing op) into an XLA error that JAX raises in Python.
template <typename Body>
ffi::Error OnXlaStream(cudaStream_t stream, int32_t device, std::string_view what, Body body) {
  try {
    c10::cuda::CUDAStreamGuard guard(
        c10::cuda::getStreamFromExternal(stream, static_cast<c10::DeviceIndex>(device)));
    body();
    return ffi::Error::Success();
  } catch (const std::exception& e) {
    return ffi::Error::Internal(std::string(what) + " failed: " + e.what());
  } catch (...) {
    return ffi::Error::Internal(std::string(what) + " failed with an unknown exception");
  }
}

void ThrowOnError(cudaError_t status, std::string_view what) {
  if (status != cudaSuccess)
    throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(status));
}

// The arguments both decode ops take.
OpArgs DecodeArgs(int32_t device, ffi::AnyBuffer q, ffi::AnyBuffer kv_cache,
                  const at::Tensor& block_table, const at::Tensor& seq_lens,
                  ffi::Buffer<ffi::S32> tile_scheduler_metadata, ffi::Buffer<ffi::S32> num_splits,
                  float softmax_scale, bool causal, int64_t head_dim_v) {
  OpArgs args;
  Slot(args, OpArg::kQ) = Wrap(q, device);
  Slot(args, OpArg::kKvCache) = Wrap(kv_cache, device);
  Slot(args, OpArg::kHeadDimV) = head_dim_v;
  Slot(args, OpArg::kSeqLens) = seq_lens;
  Slot(args, OpArg::kBlockTable) = block_table;
  Slot(args, OpArg::kSoftmaxScale) = static_cast<double>(softmax_scale);
  Slot(args, OpArg::kCausal) = causal;
  Slot(args, OpArg::kTileSchedulerMetadata) = Wrap(tile_scheduler_metadata, device);
  Slot(args, OpArg::kNumSplits) = Wrap(num_splits, device);
  return args;
}

// A tensor the op returns, in the op's order: its name, and which lent buffer it must be.
struct Returned {
  const char* name;
  size_t buffer;
};

// Runs `op` with XLA's buffers `buffers` (tensors in the layouts the lowering declared, in the
// order the op allocates them: equal sizes are lent first come, first served) lent to its
// allocations; fails if the op allocated anything else (buffer_lending.h) or returned one of
// `returned` elsewhere than in its buffer.
void RunInBuffers(std::string_view op, const OpArgs& args, const std::vector<at::Tensor>& buffers,
                  const std::vector<Returned>& returned) {
  std::vector<at::Tensor> results;
  std::string refusal;
  {
    LendBuffers lending(buffers, op);
    results = CallTorchOp(op, args);
    refusal = lending.Refusal();
  }
  if (!refusal.empty()) throw std::runtime_error(refusal);
  if (results.size() < returned.size())
    throw std::runtime_error(std::string(op) + " returned " + std::to_string(results.size()) +
                             " tensors, fewer than jax_flashmla's " +
                             std::to_string(returned.size()) + " results");
  for (size_t i = 0; i < returned.size(); ++i) {
    const at::Tensor& buffer = buffers[returned[i].buffer];
    if (!IsBuffer(results[i], buffer))
      throw std::runtime_error(std::string(op) + " returned its " + returned[i].name +
                               " elsewhere than in XLA's buffer, or in another layout (shape " +
                               c10::str(results[i].sizes()) + ", strides " +
                               c10::str(results[i].strides()) + "; XLA's buffer: shape " +
                               c10::str(buffer.sizes()) + ", strides " +
                               c10::str(buffer.strides()) + ")");
  }
}

ffi::Error MlaMetadataCudaImpl(cudaStream_t stream, int32_t device,
                               ffi::Buffer<ffi::S32> seq_lens, std::string_view op,
                               int64_t num_q_tokens_per_head_k, int64_t num_heads_k,
                               int64_t num_heads_q, int64_t written_fields,
                               ffi::ResultBuffer<ffi::S32> tile_scheduler_metadata,
                               ffi::ResultBuffer<ffi::S32> num_splits) {
  return OnXlaStream(stream, device, op, [&] {
    OpArgs args;
    Slot(args, OpArg::kSeqLens) = Wrap(seq_lens, device);
    Slot(args, OpArg::kQTokensPerHeadK) = num_q_tokens_per_head_k;
    Slot(args, OpArg::kNumHeadsK) = num_heads_k;
    Slot(args, OpArg::kNumHeadsQ) = num_heads_q;
    Slot(args, OpArg::kIsFp8) = false;
    RunInBuffers(op, args, {Wrap(*tile_scheduler_metadata, device), Wrap(*num_splits, device)},
                 {{"tile_scheduler_metadata", 0}, {"num_splits", 1}});
    // The scheduler leaves the rows' last fields unwritten (uninitialised memory); zeroing
    // them keeps XLA's buffer deterministic.
    const auto dims = tile_scheduler_metadata->dimensions();
    const size_t row_bytes = dims[1] * sizeof(int32_t);
    const size_t written_bytes = written_fields * sizeof(int32_t);
    if (dims[0] > 0 && written_bytes < row_bytes)
      ThrowOnError(cudaMemset2DAsync(reinterpret_cast<char*>(tile_scheduler_metadata->untyped_data()) +
                                         written_bytes,
                                     row_bytes, 0, row_bytes - written_bytes, dims[0], stream),
                   "zeroing the scheduler rows' unused fields");
  });
}

// What the decode ops write, as the lowering lays it out: out; lse (b, h_q, s_q) as FlashMLA's
// (b, s_q, h_q) memory, which the op returns as a transposed view for s_q > 1
// (custom_calls._decode_layouts); then the split-KV accumulators, which FlashMLA allocates after
// its results.
at::Tensor LseBuffer(ffi::ResultBuffer<ffi::F32> lse, int32_t device) {
  const at::Tensor buffer = Wrap(*lse, device);
  const int64_t batch = buffer.size(0), h_q = buffer.size(1), s_q = buffer.size(2);
  return s_q == 1 ? buffer : buffer.view({batch, s_q, h_q}).transpose(1, 2);
}

std::vector<at::Tensor> DecodeBuffers(int32_t device, ffi::Result<ffi::AnyBuffer> out,
                                      ffi::ResultBuffer<ffi::F32> lse,
                                      ffi::ResultBuffer<ffi::F32> out_accum,
                                      ffi::ResultBuffer<ffi::F32> lse_accum) {
  return {Wrap(*out, device), LseBuffer(lse, device), Wrap(*out_accum, device),
          Wrap(*lse_accum, device)};
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
    OpArgs args = DecodeArgs(device, q, kv_cache, Wrap(block_table, device),
                             Wrap(seq_lens, device), tile_scheduler_metadata, num_splits,
                             softmax_scale, causal, out->dimensions().back());
    Slot(args, OpArg::kIsFp8) = false;
    RunInBuffers(op, args, DecodeBuffers(device, out, lse, out_accum, lse_accum),
                 {{"out", 0}, {"lse", 1}});
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
    OpArgs args = DecodeArgs(device, q, kv_cache, Wrap(kernel_block_table, device),
                             Wrap(kernel_seq_lens, device), tile_scheduler_metadata, num_splits,
                             softmax_scale, causal, out->dimensions().back());
    Slot(args, OpArg::kDescaleQ) = Wrap(descale_q, device);
    Slot(args, OpArg::kDescaleK) = Wrap(descale_k, device);
    RunInBuffers(op, args, DecodeBuffers(device, out, lse, out_accum, lse_accum),
                 {{"out", 0}, {"lse", 1}});
    const int64_t batch = seq_lens.element_count();
    if (batch > 0)
      ThrowOnError(LaunchClearEmptyRequests(seq_lens.typed_data(), batch, out->untyped_data(),
                                            out->element_count() / batch, lse->typed_data(),
                                            lse->element_count() / batch, stream),
                   "setting the results of requests of length 0");
  });
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
  constexpr int64_t kFields = 8;  // of a scheduler row
  const int64_t rows_size = static_cast<int64_t>(schedule.element_count()) - (stack[1] + 1);
  if (rows_size < kFields || rows_size % kFields != 0) {
    return ffi::Error::InvalidArgument(
        std::string(op) + ": a schedule of " + std::to_string(schedule.element_count()) +
        " int32 is not (parts, 8) rows and num_splits of batch + 1 = " +
        std::to_string(stack[1] + 1));
  }
  const std::array<int64_t, 2> rows_dims{rows_size / kFields, kFields};
  const std::array<int64_t, 1> splits_dims{stack[1] + 1};
  return OnXlaStream(stream, device, op, [&] {
    OpArgs args;
    Slot(args, OpArg::kQ) = Wrap(q, device);
    Slot(args, OpArg::kKvCache) = WrapBuffer(kv_cache.untyped_data(), kv_cache.dimensions(),
                                             ffi::DataType::F8E4M3FN, device);
    Slot(args, OpArg::kIndices) = WrapBuffer(indices.typed_data() + layer * row,
                                             stack.last(3), ffi::DataType::S32, device);
    if (with_sink) Slot(args, OpArg::kAttnSink) = Wrap(attn_sink, device);
    Slot(args, OpArg::kTileSchedulerMetadata) = WrapBuffer(
        schedule.typed_data(), {rows_dims.data(), rows_dims.size()}, ffi::DataType::S32, device);
    Slot(args, OpArg::kNumSplits) =
        WrapBuffer(schedule.typed_data() + rows_size, {splits_dims.data(), splits_dims.size()},
                   ffi::DataType::S32, device);
    Slot(args, OpArg::kHeadDimV) = out->dimensions().back();
    Slot(args, OpArg::kSoftmaxScale) = static_cast<double>(softmax_scale);
    RunInBuffers(op, args,
                 {Wrap(*out, device), LseBuffer(lse, device), Wrap(*lse_accum, device),
                  Wrap(*out_accum, device)},
                 {{"out", 0}, {"lse", 1}});
  });
}

// DeepSeek-V3.2's sparse prefill (sparse_prefill_fwd) on bf16 rows; no scratch. It allocates
// out, lse, max_logits (FlashMLA's sparse_fwd.h) and returns out, max_logits, lse. lse and
// max_logits are the same size, so only the lending order tells them apart: a release that
// allocated them the other way round fails the check on max_logits.
ffi::Error MlaSparsePrefillCudaImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer q,
                                    ffi::AnyBuffer kv, ffi::Buffer<ffi::S32> indices,
                                    ffi::Buffer<ffi::F32> attn_sink, float softmax_scale,
                                    bool with_sink, std::string_view op,
                                    ffi::Result<ffi::AnyBuffer> out,
                                    ffi::ResultBuffer<ffi::F32> lse_base2,
                                    ffi::ResultBuffer<ffi::F32> max_logits) {
  return OnXlaStream(stream, device, op, [&] {
    OpArgs args;
    Slot(args, OpArg::kQ) = Wrap(q, device);
    Slot(args, OpArg::kKvCache) = Wrap(kv, device);
    Slot(args, OpArg::kIndices) = Wrap(indices, device);
    if (with_sink) Slot(args, OpArg::kAttnSink) = Wrap(attn_sink, device);
    Slot(args, OpArg::kHeadDimV) = out->dimensions().back();
    Slot(args, OpArg::kSoftmaxScale) = static_cast<double>(softmax_scale);
    RunInBuffers(op, args,
                 {Wrap(*out, device), Wrap(*lse_base2, device), Wrap(*max_logits, device)},
                 {{"out", 0}, {"max_logits", 2}, {"lse", 1}});
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

XLA_FFI_DEFINE_HANDLER_SYMBOL(kMlaSparsePrefillCuda, MlaSparsePrefillCudaImpl,
    BindSparsePrefillResults(
        BindSparsePrefillOperands(CudaContext()).Attr<std::string_view>("op")),
    {kCudaTargetTraits});

XLA_FFI_DEFINE_HANDLER_SYMBOL(kMlaDecodeFp8Cuda, MlaDecodeFp8CudaImpl,
    BindDecodeResults(BindDecodeFp8Operands(CudaContext()).Attr<std::string_view>("op")),
    {kCudaTargetTraits});

}  // namespace jax_flashmla
