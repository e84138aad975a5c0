// One kernel launch that copies the results of a FlashMLA op that did not land in XLA's result
// buffers in their layout (result_lending.h; a kernel release that allocates otherwise) into
// those buffers, where
// two torch copy_ calls would be two TensorIterator dispatches on the host and two dependent
// operations on the stream. On the H200 its GPU time about equals the two copies'
// (benchmarks/NOTES.md, 2026-11-30 session 2). Plain C++ but for SourceUnit's annotation: the
// handlers include it.
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

#if defined(__CUDACC__)
#define JAX_FLASHMLA_HOST_DEVICE __host__ __device__
#else
#define JAX_FLASHMLA_HOST_DEVICE
#endif

// Where unit i of the destination is in the source, in units. The kernel's index arithmetic,
// here so that the layout planning can be tested on a machine without a GPU.
inline JAX_FLASHMLA_HOST_DEVICE int64_t SourceUnit(const StridedCopy& copy, int64_t i) {
  if (copy.src_contiguous) return i;
  int64_t offset = 0;
  for (int d = kMaxCopyRank - 1; d >= 0; --d) {
    offset += (i % copy.sizes[d]) * copy.src_strides[d];
    i /= copy.sizes[d];
  }
  return offset;
}

// Enqueues both copies on `stream` as one kernel; returns the launch's error.
cudaError_t LaunchStridedCopies(const StridedCopy& first, const StridedCopy& second,
                                cudaStream_t stream);

}  // namespace jax_flashmla

#endif  // JAX_FLASHMLA_FFI_RESULT_COPY_H_
