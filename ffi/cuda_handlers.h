// The XLA FFI handlers of the CUDA targets that need no torch: the host queue's push
// (host_queue.h) and DeepSeek-V3.2's indexer (index_topk.h). FlashMLA's are in
// flashmla_handlers.h.
#ifndef JAX_FLASHMLA_FFI_CUDA_HANDLERS_H_
#define JAX_FLASHMLA_FFI_CUDA_HANDLERS_H_

#include "targets.h"
#include "xla/ffi/api/ffi.h"

namespace jax_flashmla {

// Every CUDA target launches the same device work for the same shapes and attributes,
// allocates nothing and never waits for the host: XLA may capture it into a command buffer
// (a CUDA graph) and replay it. Compiled into each handler, whose metadata XLA reads when the
// target is registered.
inline constexpr xla::ffi::Traits kCudaTargetTraits = xla::ffi::Traits::kCmdBufferCompatible;

XLA_FFI_DECLARE_HANDLER_SYMBOL(kHostQueuePushCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(kIndexTopkCuda);

inline constexpr Target kCudaTargets[] = {{kHostQueuePushTarget, kHostQueuePushCuda},
                                          {kIndexTopkTarget, kIndexTopkCuda}};

}  // namespace jax_flashmla

#endif  // JAX_FLASHMLA_FFI_CUDA_HANDLERS_H_
