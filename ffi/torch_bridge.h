// Calls FlashMLA's compiled torch ops on XLA's buffers: wraps buffers as tensors without a
// copy, and fills an op's arguments by name from its schema (the schemas differ between kernel
// releases).
#ifndef JAX_FLASHMLA_FFI_TORCH_BRIDGE_H_
#define JAX_FLASHMLA_FFI_TORCH_BRIDGE_H_

#include <array>
#include <string>
#include <string_view>
#include <vector>

#include <ATen/core/ivalue.h>
#include <ATen/core/Tensor.h>

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
  kCount,
};

using OpArgs = std::array<c10::IValue, static_cast<size_t>(OpArg::kCount)>;

inline c10::IValue& Slot(OpArgs& args, OpArg which) { return args[static_cast<size_t>(which)]; }

// Runs the op named `qualified_name` ("namespace::name") with `args` on the current stream and
// returns the tensors it produced, in order. Throws std::runtime_error or c10::Error.
std::vector<at::Tensor> CallTorchOp(std::string_view qualified_name, const OpArgs& args);

// A tensor over an XLA buffer on CUDA device `device` (no copy; XLA keeps ownership).
at::Tensor WrapBuffer(void* data, xla::ffi::Span<const int64_t> dims,
                      xla::ffi::DataType dtype, int device);

}  // namespace jax_flashmla

#endif  // JAX_FLASHMLA_FFI_TORCH_BRIDGE_H_
