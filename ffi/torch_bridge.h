// Calls FlashMLA's compiled torch ops on XLA's stream and buffers: tensors over XLA's buffers
// without a copy; an op's arguments filled by name from its schema (the schemas differ between
// kernel releases); XLA's result buffers lent to the op's allocations (buffer_lending.h) and
// its results checked to be them.
#ifndef JAX_FLASHMLA_FFI_TORCH_BRIDGE_H_
#define JAX_FLASHMLA_FFI_TORCH_BRIDGE_H_

#include <cuda_runtime_api.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <string>
#include <string_view>
#include <vector>

#include <ATen/core/ivalue.h>
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "xla/ffi/api/ffi.h"

namespace jax_flashmla {

// What jax_flashmla knows how to pass to a FlashMLA op. Each schema argument is matched to
// one of these by name (kernel releases spell some of them differently).
enum class OpArg {
  kQ,
  kKvCache,
  kHeadDimV,
  kSeqLens,
  kBlockTable,
  kSoftmaxScale,
  kCausal,
  kTileSchedulerMetadata,
  kNumSplits,
  kIsFp8,
  kQTokensPerHeadK,
  kNumHeadsK,
  kNumHeadsQ,
  kDescaleQ,  // the FP8 decode's per-tensor scales of q and the cache
  kDescaleK,
  kIndices,  // the sparse ops' indices, and their sink logits
  kAttnSink,
  kTopkLength,  // DeepSeek-V4's decode and prefill: the indices' lengths; the extra cache's
  kExtraKv,
  kExtraIndices,
  kExtraTopkLength,
  kCount,
};

using OpArgs = std::array<c10::IValue, static_cast<size_t>(OpArg::kCount)>;

inline c10::IValue& Slot(OpArgs& args, OpArg which) { return args[static_cast<size_t>(which)]; }

// A tensor over an XLA buffer on CUDA device `device` (no copy; XLA keeps ownership).
at::Tensor WrapBuffer(void* data, xla::ffi::Span<const int64_t> dims,
                      xla::ffi::DataType dtype, int device);

inline at::Tensor WrapBuffer(xla::ffi::AnyBuffer buffer, int device) {
  return WrapBuffer(buffer.untyped_data(), buffer.dimensions(), buffer.element_type(), device);
}

template <xla::ffi::DataType T>
at::Tensor WrapBuffer(xla::ffi::Buffer<T> buffer, int device) {
  return WrapBuffer(buffer.untyped_data(), buffer.dimensions(), T, device);
}

// A tensor the op returns, in the op's order: its name, and which lent buffer it must be.
struct Returned {
  const char* name;
  size_t buffer;
};

// Runs the op named `qualified_name` ("namespace::name") with `args` on the current stream,
// with XLA's `buffers` (tensors in the layouts the lowering declared, in the order the op
// allocates them: equal sizes are lent first come, first served) lent to its allocations.
// Throws std::runtime_error or c10::Error where the op is missing or takes an argument that
// OpArg has no slot for, where it allocated anything else (buffer_lending.h), or where it
// returned one of `returned` elsewhere than in its buffer.
void CallTorchOp(std::string_view qualified_name, const OpArgs& args,
                 const std::vector<at::Tensor>& buffers, const std::vector<Returned>& returned);

// Runs `body` (which returns an xla::ffi::Error) with XLA's stream as torch's current stream.
// A failure it returns, or an exception it throws (a torch check inside the op, a missing op),
// becomes an error naming `op`, which JAX raises in Python.
template <typename Body>
xla::ffi::Error OnXlaStream(cudaStream_t stream, int32_t device, std::string_view op,
                            Body body) {
  try {
    c10::cuda::CUDAStreamGuard guard(
        c10::cuda::getStreamFromExternal(stream, static_cast<c10::DeviceIndex>(device)));
    xla::ffi::Error error = body();
    if (error.success()) return error;
    return xla::ffi::Error(*error.errc(), std::string(op) + " failed: " + error.message());
  } catch (const std::exception& e) {
    return xla::ffi::Error::Internal(std::string(op) + " failed: " + e.what());
  } catch (...) {
    return xla::ffi::Error::Internal(std::string(op) + " failed with an unknown exception");
  }
}

}  // namespace jax_flashmla

#endif  // JAX_FLASHMLA_FFI_TORCH_BRIDGE_H_
