// The kernel of empty_requests.h.
#include "empty_requests.h"

#include <cstdint>

namespace jax_flashmla {
namespace {

constexpr int kThreads = 256;

// 16-byte stores where a request's out is a whole number of them (always, for 512-wide rows).
// Launched as a programmatic dependent of the decode's last kernel (LaunchClearEmptyRequests):
// it waits here until that kernel, and so the whole decode, has finished and its writes are
// visible, and only its launch overlaps the decode's tail.
__global__ void ClearEmptyRequestsKernel(const int32_t* seq_lens, void* out,
                                         int64_t out_per_request, float* lse,
                                         int64_t lse_per_request) {
  asm volatile("griddepcontrol.wait;" ::: "memory");
  const int64_t request = blockIdx.x;
  if (seq_lens[request] != 0) return;
  const int64_t out_bytes = out_per_request * 2;  // bfloat16
  char* row = static_cast<char*>(out) + request * out_bytes;
  if (out_bytes % 16 == 0 && reinterpret_cast<uintptr_t>(row) % 16 == 0) {
    for (int64_t i = threadIdx.x; i < out_bytes / 16; i += blockDim.x)
      reinterpret_cast<uint4*>(row)[i] = make_uint4(0, 0, 0, 0);
  } else {
    for (int64_t i = threadIdx.x; i < out_per_request; i += blockDim.x)
      reinterpret_cast<uint16_t*>(row)[i] = 0;
  }
  for (int64_t i = threadIdx.x; i < lse_per_request; i += blockDim.x)
    lse[request * lse_per_request + i] = __int_as_float(0x7f800000);  // +inf
}

}  // namespace

cudaError_t LaunchClearEmptyRequests(const int32_t* seq_lens, int64_t batch, void* out,
                                     int64_t out_per_request, float* lse,
                                     int64_t lse_per_request, cudaStream_t stream) {
  if (batch == 0) return cudaSuccess;
  // Programmatic dependent launch (Hopper): the GPU may launch this grid while the previous
  // one on the stream drains, instead of after it; the kernel's griddepcontrol.wait keeps
  // the order of their memory effects.
  cudaLaunchAttribute dependent_launch = {};
  dependent_launch.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  dependent_launch.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(static_cast<unsigned>(batch));
  config.blockDim = dim3(kThreads);
  config.stream = stream;
  config.attrs = &dependent_launch;
  config.numAttrs = 1;
  return cudaLaunchKernelEx(&config, ClearEmptyRequestsKernel, seq_lens, out, out_per_request,
                            lse, lse_per_request);
}

}  // namespace jax_flashmla
