// XLA FFI handlers of the CPU custom-call targets (the C++ reference of FlashMLA, and the
// host queue's push).
#ifndef JAX_FLASHMLA_FFI_CPU_HANDLERS_H_
#define JAX_FLASHMLA_FFI_CPU_HANDLERS_H_

#include "targets.h"
#include "xla/ffi/api/ffi.h"

namespace jax_flashmla {

XLA_FFI_DECLARE_HANDLER_SYMBOL(kMlaDecodeCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(kMlaDecodeFp8Cpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(kMlaMetadataCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(kHostQueuePushCpu);

inline constexpr Target kCpuTargets[] = {
    {kMlaDecodeTarget, kMlaDecodeCpu},   {kMlaDecodeFp8Target, kMlaDecodeFp8Cpu},
    {kMlaMetadataTarget, kMlaMetadataCpu}, {kHostQueuePushTarget, kHostQueuePushCpu}};

}  // namespace jax_flashmla

#endif  // JAX_FLASHMLA_FFI_CPU_HANDLERS_H_
