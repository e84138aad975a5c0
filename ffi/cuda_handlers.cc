// XLA FFI handlers of our own small CUDA kernels: the FP8 decode's guard for empty requests
// (fp8_guard.h) and the host queue's push (host_queue.h). No torch: this module links the CUDA
// runtime alone, so that a host queue needs neither torch nor FlashMLA's kernels.
#include "cuda_handlers.h"

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>

#include "fp8_guard.h"
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

// The copies of block_table and seq_lens that FlashMLA's FP8 kernel reads: requests of
// length 0 as length 1 over page 0 (fp8_guard.h).
ffi::Error Fp8GuardCudaImpl(cudaStream_t stream, int32_t device,
                            ffi::Buffer<ffi::S32> block_table, ffi::Buffer<ffi::S32> seq_lens,
                            ffi::ResultBuffer<ffi::S32> kernel_block_table,
                            ffi::ResultBuffer<ffi::S32> kernel_seq_lens) {
  const auto dims = block_table.dimensions();
  if (dims.size() != 2 || dims[1] == 0 ||
      static_cast<int64_t>(seq_lens.element_count()) != dims[0])
    return ffi::Error::InvalidArgument(
        "the FP8 guard needs a (batch, max_pages >= 1) block_table and (batch,) seq_lens");
  if (ffi::Error err = OnDevice(device, "the FP8 guard"); err.failure()) return err;
  const cudaError_t status = LaunchGuardEmptyRequests(
      seq_lens.typed_data(), block_table.typed_data(), dims[0], dims[1],
      kernel_seq_lens->typed_data(), kernel_block_table->typed_data(), stream);
  if (status != cudaSuccess)
    return ffi::Error::Internal(std::string("the FP8 guard's launch failed: ") +
                                cudaGetErrorString(status));
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

XLA_FFI_DEFINE_HANDLER_SYMBOL(kFp8GuardCuda, Fp8GuardCudaImpl,
                              BindFp8GuardResults(BindFp8GuardOperands(CudaContext())),
                              {kCudaTargetTraits});

XLA_FFI_DEFINE_HANDLER_SYMBOL(kHostQueuePushCuda, HostQueuePushCudaImpl,
                              BindHostQueuePushOperands(CudaContext()), {kCudaTargetTraits});

}  // namespace jax_flashmla
