// One kernel launch that copies what a FlashMLA decode returns (out and lse, as the op laid
// them out) into XLA's result buffers. Two cudaMemcpyAsync calls cost two operations on the
// stream, each with the GPU's gap between dependent operations: at b=128, h_q=16 on the H200
// that was ~6 us, 4% of the decode (benchmarks/NOTES.md). Plain C++: the handlers include it.
#ifndef JAX_FLASHMLA_FFI_RESULT_COPY_H_
#define JAX_FLASHMLA_FFI_RESULT_COPY_H_

#include <cuda_runtime_api.h>

#include <cstdint>

namespace jax_flashmla {

inline constexpr int kMaxCopyRank = 4;

// A copy from a strided source into a contiguous destination of the same shape, counted in
// units of `unit_bytes` (1, 2, 4 or 16): sizes and strides (outermost first) are in units.
struct StridedCopy {
  const void* src;
  void* dst;
  int64_t sizes[kMaxCopyRank];
  int64_t src_strides[kMaxCopyRank];
  int64_t units;
  int32_t unit_bytes;
  bool src_contiguous;  // then unit i of dst is unit i of src, without index arithmetic
};

// Enqueues both copies on `stream` as one kernel; returns the launch's error.
cudaError_t LaunchStridedCopies(const StridedCopy& first, const StridedCopy& second,
                                cudaStream_t stream);

}  // namespace jax_flashmla

#endif  // JAX_FLASHMLA_FFI_RESULT_COPY_H_
