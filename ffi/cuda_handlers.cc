// The XLA FFI handler of our own small CUDA kernel, the host queue's push (host_queue.h). No
// torch: this module links the CUDA runtime alone, so that a host queue needs neither torch
// nor FlashMLA's kernels.
#include "cuda_handlers.h"

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>

#include "host_queue.h"
#include "host_queue_push.h"
#include "operands.h"
#include "targets.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jax_flashmla {
namespace {

// This module's CUDA runtime is its own: make XLA's device its current one before a launch.
ffi::Error OnDevice(int32_t device, const std::string& what) {
  if (cudaError_t status = cudaSetDevice(device); status != cudaSuccess)
    return ffi::Error::Internal(what + ": cudaSetDevice(" + std::to_string(device) +
                                "): " + cudaGetErrorString(status));
  return ffi::Error::Success();
}

// host_queue.h's push: a kernel on XLA's stream, so that XLA captures it with the step.
ffi::Error HostQueuePushCudaImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer payload,
                                 uint64_t queue_id) {
  const int64_t bytes = static_cast<int64_t>(payload.size_bytes());
  std::string error;
  const HostQueue* queue = QueueForPush(queue_id, device, bytes, error);
  if (queue == nullptr) return ffi::Error::InvalidArgument(error);
  if (ffi::Error err = OnDevice(device, kHostQueuePushTarget); err.failure()) return err;
  if (cudaError_t status = LaunchHostQueuePush(payload.untyped_data(), bytes, *queue, stream);
      status != cudaSuccess)
    return ffi::Error::Internal(std::string(kHostQueuePushTarget) + ": " +
                                cudaGetErrorString(status));
  return ffi::Error::Success();
}

auto CudaContext() {
  return ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>().Ctx<ffi::DeviceOrdinal>();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(kHostQueuePushCuda, HostQueuePushCudaImpl,
                              BindHostQueuePushOperands(CudaContext()), {kCudaTargetTraits});

}  // namespace jax_flashmla
