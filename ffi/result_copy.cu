// The kernel of result_copy.h: a grid-stride loop over the units of both copies.
#include "result_copy.h"

#include <algorithm>
#include <cstdint>

namespace jax_flashmla {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 8192;

template <typename Unit>
__device__ void CopyUnit(const StridedCopy& copy, int64_t i) {
  static_cast<Unit*>(copy.dst)[i] = static_cast<const Unit*>(copy.src)[SourceUnit(copy, i)];
}

__device__ void CopyUnitOf(const StridedCopy& copy, int64_t i) {
  switch (copy.unit_bytes) {
    case 16:
      CopyUnit<uint4>(copy, i);
      break;
    case 4:
      CopyUnit<uint32_t>(copy, i);
      break;
    case 2:
      CopyUnit<uint16_t>(copy, i);
      break;
    default:
      CopyUnit<uint8_t>(copy, i);
  }
}

__global__ void StridedCopiesKernel(StridedCopy first, StridedCopy second) {
  const int64_t total = first.units + second.units;
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += step) {
    if (i < first.units) {
      CopyUnitOf(first, i);
    } else {
      CopyUnitOf(second, i - first.units);
    }
  }
}

}  // namespace

cudaError_t LaunchStridedCopies(const StridedCopy& first, const StridedCopy& second,
                                cudaStream_t stream) {
  const int64_t total = first.units + second.units;
  if (total == 0) return cudaSuccess;
  const int64_t blocks = std::min((total + kThreads - 1) / kThreads, kMaxBlocks);
  StridedCopiesKernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(first, second);
  return cudaGetLastError();
}

}  // namespace jax_flashmla
