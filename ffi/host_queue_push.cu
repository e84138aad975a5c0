// The kernel of host_queue_push.h.
#include "host_queue_push.h"

namespace jax_flashmla {
namespace {

constexpr int kThreads = 256;

__global__ void HostQueuePushKernel(const uint8_t* payload, int64_t bytes, uint8_t* slots,
                                    int64_t slot_bytes, int64_t depth,
                                    unsigned long long* pushes) {
  __shared__ unsigned long long sequence;
  if (threadIdx.x == 0) {
    sequence = atomicAdd(pushes, 1ULL) + 1;
    uint8_t* slot = slots + ((sequence - 1) % depth) * slot_bytes;
    *reinterpret_cast<volatile uint64_t*>(slot) = sequence | kHostQueueWriting;
    __threadfence_system();
  }
  __syncthreads();
  uint8_t* slot = slots + ((sequence - 1) % depth) * slot_bytes;
  uint8_t* out = slot + kHostQueueHeaderBytes;
  // 16-byte copies where both ends allow them (XLA's buffers and the slots are aligned).
  const int64_t wide = reinterpret_cast<uintptr_t>(payload) % 16 == 0 ? bytes / 16 : 0;
  for (int64_t i = threadIdx.x; i < wide; i += blockDim.x)
    reinterpret_cast<uint4*>(out)[i] = reinterpret_cast<const uint4*>(payload)[i];
  for (int64_t i = wide * 16 + threadIdx.x; i < bytes; i += blockDim.x) out[i] = payload[i];
  __threadfence_system();  // the payload reaches the host before the sequence number
  __syncthreads();
  if (threadIdx.x == 0) *reinterpret_cast<volatile uint64_t*>(slot) = sequence;
}

}  // namespace

cudaError_t LaunchHostQueuePush(const void* payload, int64_t bytes, const HostQueue& queue,
                                cudaStream_t stream) {
  HostQueuePushKernel<<<1, kThreads, 0, stream>>>(static_cast<const uint8_t*>(payload), bytes,
                                                  queue.slots, queue.slot_bytes, queue.depth,
                                                  queue.pushes);
  return cudaGetLastError();
}

}  // namespace jax_flashmla
