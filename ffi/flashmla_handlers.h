// XLA FFI handlers of FlashMLA's kernels: the decode, the FP8 decode, the scheduler and
// DeepSeek-V3.2's sparse decode and prefill, reached through the torch ops of SGLang's kernel
// packages on XLA's stream and buffers.
#ifndef JAX_FLASHMLA_FFI_FLASHMLA_HANDLERS_H_
#define JAX_FLASHMLA_FFI_FLASHMLA_HANDLERS_H_

#include "targets.h"
#include "xla/ffi/api/ffi.h"

namespace jax_flashmla {

XLA_FFI_DECLARE_HANDLER_SYMBOL(kMlaDecodeCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(kMlaDecodeFp8Cuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(kMlaMetadataCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(kMlaSparseDecodeCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(kMlaSparseDecodeV4Cuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(kMlaSparsePrefillCuda);

inline constexpr Target kFlashMlaTargets[] = {{kMlaDecodeTarget, kMlaDecodeCuda},
                                              {kMlaDecodeFp8Target, kMlaDecodeFp8Cuda},
                                              {kMlaMetadataTarget, kMlaMetadataCuda},
                                              {kMlaSparseDecodeTarget, kMlaSparseDecodeCuda},
                                              {kMlaSparseDecodeV4Target, kMlaSparseDecodeV4Cuda},
                                              {kMlaSparsePrefillTarget, kMlaSparsePrefillCuda}};

}  // namespace jax_flashmla

#endif  // JAX_FLASHMLA_FFI_FLASHMLA_HANDLERS_H_
