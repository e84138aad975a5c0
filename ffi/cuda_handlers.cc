#include "cuda_handlers.h"

#include <cuda_runtime_api.h>

#include <array>
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <exception>
#include <numeric>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "fp8_guard.h"
#include "result_lending.h"
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

// The dimensions of `t` from the outermost in memory to the innermost (for a tensor over a
// whole buffer, the order in which it is contiguous).
std::vector<int64_t> MemoryOrder(const at::Tensor& t) {
  std::vector<int64_t> order(t.dim());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return t.stride(a) > t.stride(b); });
  return order;
}

// How the ops' results reached XLA's buffers since the module was loaded.
std::atomic<int64_t> results_in_place{0};
std::atomic<int64_t> results_copied{0};

// Runs `op` with XLA's result buffers (tensors in the layouts the lowering declared) lent to
// its allocations (result_lending.h); then copies with one kernel whatever did not land in its
// buffer in its layout, honouring the strides the op returned. The op returns its two results
// in the order of `buffers`.
void RunIntoResults(std::string_view op, const OpArgs& args, cudaStream_t stream,
                    const std::array<at::Tensor, 2>& buffers,
                    const std::array<const char*, 2>& names) {
  std::vector<at::Tensor> results;
  {
    LendResultBuffers lending({buffers[0], buffers[1]});
    results = CallTorchOp(op, args);
  }
  if (results.size() < 2)
    throw std::runtime_error(std::string("expected (") + names[0] + ", " + names[1] + ")");
  StridedCopy copies[2] = {};
  for (int i = 0; i < 2; ++i) {
    if (IsResultBuffer(results[i], buffers[i])) {
      ++results_in_place;
      continue;
    }
    // The copies must not overwrite a result that lives in a lent buffer: move it aside
    // (torch's copy, ordered on this stream before the copy kernel).
    if (LivesIn(results[i], buffers[0]) || LivesIn(results[i], buffers[1]))
      results[i] = results[i].clone();
    // PlanResultCopy wants a contiguous destination: both in the order dst lies in memory.
    const std::vector<int64_t> order = MemoryOrder(buffers[i]);
    copies[i] = PlanResultCopy(results[i].permute(order), buffers[i].permute(order), names[i]);
    ++results_copied;
  }
  ThrowOnError(LaunchStridedCopies(copies[0], copies[1], stream),
               "copying FlashMLA's results into XLA's buffers");
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
    const at::Tensor metadata = Wrap(*tile_scheduler_metadata, device);
    RunIntoResults(op, args, stream, {metadata, Wrap(*num_splits, device)},
                   {"tile_scheduler_metadata", "num_splits"});
    // The scheduler leaves the rows' last fields unwritten (uninitialised memory);
    // zeroing them keeps XLA's buffer deterministic.
    metadata.narrow(1, written_fields, metadata.size(1) - written_fields).zero_();
  });
}

// lse's buffer as the lowering lays it out (lowering._result_layouts): for s_q > 1, FlashMLA's
// (b, s_q, h_q) memory seen as (b, h_q, s_q), just what the op returns (a transposed view).
at::Tensor WrapLse(ffi::ResultBuffer<ffi::F32> lse, int32_t device) {
  const at::Tensor buffer = Wrap(*lse, device);
  const int64_t batch = buffer.size(0), h_q = buffer.size(1), s_q = buffer.size(2);
  return s_q == 1 ? buffer : buffer.view({batch, s_q, h_q}).transpose(1, 2);
}

// FlashMLA allocates out and lse itself (its ops take no output buffers): both allocations get
// XLA's result buffers, where the op writes them in place.
void RunDecode(std::string_view op, const OpArgs& args, cudaStream_t stream, int32_t device,
               ffi::Result<ffi::AnyBuffer> out, ffi::ResultBuffer<ffi::F32> lse) {
  RunIntoResults(op, args, stream, {Wrap(*out, device), WrapLse(lse, device)}, {"out", "lse"});
}

ffi::Error MlaDecodeCudaImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer q,
                             ffi::AnyBuffer kv_cache, ffi::Buffer<ffi::S32> block_table,
                             ffi::Buffer<ffi::S32> seq_lens,
                             ffi::Buffer<ffi::S32> tile_scheduler_metadata,
                             ffi::Buffer<ffi::S32> num_splits, std::string_view op,
                             float softmax_scale, bool causal, ffi::Result<ffi::AnyBuffer> out,
                             ffi::ResultBuffer<ffi::F32> lse) {
  return OnXlaStream(stream, device, op, [&] {
    OpArgs args = DecodeArgs(device, q, kv_cache, Wrap(block_table, device),
                             Wrap(seq_lens, device), tile_scheduler_metadata, num_splits,
                             softmax_scale, causal, out->dimensions().back());
    Slot(args, OpArg::kIsFp8) = false;
    RunDecode(op, args, stream, device, out, lse);
  });
}

// The copies of block_table and seq_lens that FlashMLA's FP8 kernel reads: requests of
// length 0 as length 1 over page 0 (fp8_guard.h). CUDA alone, no torch.
ffi::Error Fp8GuardCudaImpl(cudaStream_t stream, ffi::Buffer<ffi::S32> block_table,
                            ffi::Buffer<ffi::S32> seq_lens,
                            ffi::ResultBuffer<ffi::S32> kernel_block_table,
                            ffi::ResultBuffer<ffi::S32> kernel_seq_lens) {
  const auto dims = block_table.dimensions();
  if (dims.size() != 2 || dims[1] == 0 ||
      static_cast<int64_t>(seq_lens.element_count()) != dims[0])
    return ffi::Error::InvalidArgument(
        "the FP8 guard needs a (batch, max_pages >= 1) block_table and (batch,) seq_lens");
  const cudaError_t status = LaunchGuardEmptyRequests(
      seq_lens.typed_data(), block_table.typed_data(), dims[0], dims[1],
      kernel_seq_lens->typed_data(), kernel_block_table->typed_data(), stream);
  if (status != cudaSuccess)
    return ffi::Error::Internal(std::string("the FP8 guard's launch failed: ") +
                                cudaGetErrorString(status));
  return ffi::Error::Success();
}

// FlashMLA's dense FP8 decode (fwd_kvcache_mla_fp8): q and the cache in e4m3fn, the per-tensor
// scales as (1,) float32 buffers on the device, out bfloat16. The kernel reads the guard's
// copies of block_table and seq_lens; requests whose seq_lens are 0 then get out 0, lse +inf
// (fp8_guard.h).
ffi::Error MlaDecodeFp8CudaImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer q,
                                ffi::AnyBuffer kv_cache, ffi::Buffer<ffi::S32> kernel_block_table,
                                ffi::Buffer<ffi::S32> kernel_seq_lens,
                                ffi::Buffer<ffi::S32> seq_lens,
                                ffi::Buffer<ffi::S32> tile_scheduler_metadata,
                                ffi::Buffer<ffi::S32> num_splits, ffi::Buffer<ffi::F32> descale_q,
                                ffi::Buffer<ffi::F32> descale_k, std::string_view op,
                                float softmax_scale, bool causal,
                                ffi::Result<ffi::AnyBuffer> out,
                                ffi::ResultBuffer<ffi::F32> lse) {
  return OnXlaStream(stream, device, op, [&] {
    OpArgs args = DecodeArgs(device, q, kv_cache, Wrap(kernel_block_table, device),
                             Wrap(kernel_seq_lens, device), tile_scheduler_metadata, num_splits,
                             softmax_scale, causal, out->dimensions().back());
    Slot(args, OpArg::kDescaleQ) = Wrap(descale_q, device);
    Slot(args, OpArg::kDescaleK) = Wrap(descale_k, device);
    RunDecode(op, args, stream, device, out, lse);
    const int64_t batch = seq_lens.element_count();
    if (batch > 0)
      ThrowOnError(LaunchClearEmptyRequests(seq_lens.typed_data(), batch, out->untyped_data(),
                                            out->element_count() / batch, lse->typed_data(),
                                            lse->element_count() / batch, stream),
                   "setting the results of requests of length 0");
  });
}

}  // namespace

DecodeResultCounts DecodeResultCountsSoFar() {
  return {results_in_place.load(), results_copied.load()};
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(kMlaMetadataCuda, MlaMetadataCudaImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::Buffer<ffi::S32>>()     // seq_lens
                                  .Attr<std::string_view>("op")
                                  .Attr<int64_t>("num_q_tokens_per_head_k")
                                  .Attr<int64_t>("num_heads_k")
                                  .Attr<int64_t>("num_heads_q")
                                  .Attr<int64_t>("written_fields")
                                  .Ret<ffi::Buffer<ffi::S32>>()     // tile_scheduler_metadata
                                  .Ret<ffi::Buffer<ffi::S32>>());   // num_splits

XLA_FFI_DEFINE_HANDLER_SYMBOL(kMlaDecodeCuda, MlaDecodeCudaImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()            // q
                                  .Arg<ffi::AnyBuffer>()            // kv_cache
                                  .Arg<ffi::Buffer<ffi::S32>>()     // block_table
                                  .Arg<ffi::Buffer<ffi::S32>>()     // seq_lens
                                  .Arg<ffi::Buffer<ffi::S32>>()     // tile_scheduler_metadata
                                  .Arg<ffi::Buffer<ffi::S32>>()     // num_splits
                                  .Attr<std::string_view>("op")
                                  .Attr<float>("softmax_scale")
                                  .Attr<bool>("causal")
                                  .Ret<ffi::AnyBuffer>()            // out
                                  .Ret<ffi::Buffer<ffi::F32>>());   // lse

XLA_FFI_DEFINE_HANDLER_SYMBOL(kFp8GuardCuda, Fp8GuardCudaImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()     // block_table
                                  .Arg<ffi::Buffer<ffi::S32>>()     // seq_lens
                                  .Ret<ffi::Buffer<ffi::S32>>()     // kernel_block_table
                                  .Ret<ffi::Buffer<ffi::S32>>());   // kernel_seq_lens

XLA_FFI_DEFINE_HANDLER_SYMBOL(kMlaDecodeFp8Cuda, MlaDecodeFp8CudaImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()            // q
                                  .Arg<ffi::AnyBuffer>()            // kv_cache
                                  .Arg<ffi::Buffer<ffi::S32>>()     // kernel_block_table
                                  .Arg<ffi::Buffer<ffi::S32>>()     // kernel_seq_lens
                                  .Arg<ffi::Buffer<ffi::S32>>()     // seq_lens
                                  .Arg<ffi::Buffer<ffi::S32>>()     // tile_scheduler_metadata
                                  .Arg<ffi::Buffer<ffi::S32>>()     // num_splits
                                  .Arg<ffi::Buffer<ffi::F32>>()     // descale_q
                                  .Arg<ffi::Buffer<ffi::F32>>()     // descale_k
                                  .Attr<std::string_view>("op")
                                  .Attr<float>("softmax_scale")
                                  .Attr<bool>("causal")
                                  .Ret<ffi::AnyBuffer>()            // out
                                  .Ret<ffi::Buffer<ffi::F32>>());   // lse

}  // namespace jax_flashmla
