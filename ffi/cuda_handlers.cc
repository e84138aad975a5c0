// The XLA FFI handlers of our own CUDA kernels: the host queue's push (host_queue.h) and
// DeepSeek-V3.2's indexer (index_topk.h). No torch: this module links the CUDA runtime alone,
// so that neither needs torch nor FlashMLA's kernels.
#include "cuda_handlers.h"

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>

#include "cuda_error.h"
#include "host_queue.h"
#include "host_queue_push.h"
#include "index_topk.h"
#include "layouts.h"
#include "operands.h"
#include "targets.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jax_flashmla {
namespace {

// This module's CUDA runtime is its own: make XLA's device its current one before a launch.
ffi::Error OnDevice(int32_t device, const char* target) {
  const cudaError_t status = cudaSetDevice(device);
  if (status == cudaSuccess) return ffi::Error::Success();
  return CudaError(std::string(target) + ": cudaSetDevice(" + std::to_string(device) + ")",
                   status);
}

// host_queue.h's push: a kernel on XLA's stream, so that XLA captures it with the step.
ffi::Error HostQueuePushCudaImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer payload,
                                 uint64_t queue_id) {
  const int64_t bytes = static_cast<int64_t>(payload.size_bytes());
  std::string error;
  const HostQueue* queue = QueueForPush(queue_id, device, bytes, error);
  if (queue == nullptr) return ffi::Error::InvalidArgument(error);
  if (ffi::Error err = OnDevice(device, kHostQueuePushTarget); err.failure()) return err;
  return CudaError(kHostQueuePushTarget,
                   LaunchHostQueuePush(payload.untyped_data(), bytes, *queue, stream));
}

// Shapes are jax_flashmla/custom_calls.py's, checked at trace time; checked again here
// because a kernel reading past a buffer would fail silently.
ffi::Error IndexTopkCudaImpl(cudaStream_t stream, int32_t device,
                             ffi::AnyBuffer values, ffi::Buffer<ffi::F32> weights,
                             ffi::Buffer<ffi::U8> cache, ffi::Buffer<ffi::S32> block_table,
                             ffi::Buffer<ffi::S32> visible,
                             ffi::ResultBuffer<ffi::S32> positions,
                             ffi::ResultBuffer<ffi::F32> scores,
                             ffi::ResultBuffer<ffi::S32> scratch) {
  const auto v = values.dimensions(), t = block_table.dimensions();
  const auto p = positions->dimensions(), s = scores->dimensions(), r = scratch->dimensions();
  const auto count = [](auto buffer) { return static_cast<int64_t>(buffer.element_count()); };
  if (values.element_type() != ffi::DataType::F8E4M3FN || v.size() != 3 ||
      v[2] != kIndexKeyDim || v[1] < 1 || v[1] > kIndexMaxHeads ||
      count(weights) != v[0] * v[1] || cache.dimensions().size() != 2 ||
      cache.dimensions()[1] != kIndexPageBytes || t.size() != 2 || t[0] != v[0] ||
      count(visible) != v[0] || p.size() != 2 || p[0] != v[0] || s.size() != 2 ||
      s[0] != v[0] || s[1] < t[1] * kPageTokens || s[1] < p[1] || r.size() != 2 ||
      r[0] != v[0] || r[1] != TopkScratchWidth(s[1], p[1]))
    return ffi::Error::InvalidArgument(std::string(kIndexTopkTarget) +
                                       ": operand shapes disagree");
  if (ffi::Error err = OnDevice(device, kIndexTopkTarget); err.failure()) return err;
  const int64_t rows = v[0];
  if (ffi::Error err = CudaError(
          kIndexTopkTarget,
          LaunchIndexScores(static_cast<const uint8_t*>(values.untyped_data()),
                            weights.typed_data(), rows, v[1], cache.typed_data(),
                            cache.dimensions()[0], block_table.typed_data(), t[1],
                            visible.typed_data(), scores->typed_data(), s[1], stream));
      err.failure())
    return err;
  return CudaError(kIndexTopkTarget,
                   LaunchTopkPositions(scores->typed_data(), rows, s[1], p[1],
                                       positions->typed_data(), scratch->typed_data(), stream));
}

auto CudaContext() {
  return ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>().Ctx<ffi::DeviceOrdinal>();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(kHostQueuePushCuda, HostQueuePushCudaImpl,
                              BindHostQueuePushOperands(CudaContext()), {kCudaTargetTraits});

XLA_FFI_DEFINE_HANDLER_SYMBOL(kIndexTopkCuda, IndexTopkCudaImpl,
                              BindIndexTopkResults(BindIndexTopkOperands(CudaContext())),
                              {kCudaTargetTraits});

}  // namespace jax_flashmla
