// The CUDA push of host_queue.h: one block on the stream.
#ifndef JAX_FLASHMLA_FFI_HOST_QUEUE_PUSH_H_
#define JAX_FLASHMLA_FFI_HOST_QUEUE_PUSH_H_

#include <cuda_runtime_api.h>

#include <cstdint>

#include "host_queue.h"

namespace jax_flashmla {

// Copies `bytes` from device memory `payload` into the queue's next slot after the work
// before it on `stream` (a plain launch: it starts once that work has finished).
cudaError_t LaunchHostQueuePush(const void* payload, int64_t bytes, const HostQueue& queue,
                                cudaStream_t stream);

}  // namespace jax_flashmla

#endif  // JAX_FLASHMLA_FFI_HOST_QUEUE_PUSH_H_
