// XLA FFI handlers of the CUDA custom-call targets: FlashMLA's kernels, reached through the
// torch ops of SGLang's kernel packages, on XLA's stream and buffers.
#ifndef JAX_FLASHMLA_FFI_CUDA_HANDLERS_H_
#define JAX_FLASHMLA_FFI_CUDA_HANDLERS_H_

#include <cstdint>

#include "xla/ffi/api/ffi.h"

namespace jax_flashmla {

// How many of the decodes' results (out and lse, each counted) FlashMLA wrote straight into
// XLA's buffers, and how many were copied there, since the module was loaded.
struct DecodeResultCounts {
  int64_t in_place;
  int64_t copied;
};
DecodeResultCounts DecodeResultCountsSoFar();

XLA_FFI_DECLARE_HANDLER_SYMBOL(kMlaDecodeCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(kMlaDecodeFp8Cuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(kFp8GuardCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(kMlaMetadataCuda);

}  // namespace jax_flashmla

#endif  // JAX_FLASHMLA_FFI_CUDA_HANDLERS_H_
