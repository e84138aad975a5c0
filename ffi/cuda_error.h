// A CUDA runtime status as an XLA FFI error, for every handler and module that calls CUDA:
// handlers return it, never exit or abort.
#ifndef JAX_FLASHMLA_FFI_CUDA_ERROR_H_
#define JAX_FLASHMLA_FFI_CUDA_ERROR_H_

#include <cuda_runtime_api.h>

#include <string>
#include <string_view>

#include "xla/ffi/api/ffi.h"

namespace jax_flashmla {

// Success for cudaSuccess; else an internal error "<what>: <CUDA's description>".
inline xla::ffi::Error CudaError(std::string_view what, cudaError_t status) {
  if (status == cudaSuccess) return xla::ffi::Error::Success();
  return xla::ffi::Error::Internal(std::string(what) + ": " + cudaGetErrorString(status));
}

}  // namespace jax_flashmla

#endif  // JAX_FLASHMLA_FFI_CUDA_ERROR_H_
