// Lets a FlashMLA op allocate its results straight in XLA's result buffers.
//
// FlashMLA's ops take no output buffers: they allocate out and lse with torch's CUDA allocator,
// and copying out into XLA's buffer costs ~3.5% of a decode at h_q=128 on the H200
// (benchmarks/NOTES.md). While a LendResultBuffers lives, torch's CUDA allocator is a thin
// wrapper of the one it replaced: an allocation made on this thread whose byte size equals a
// lent buffer's (each buffer once) gets that buffer, in a DataPtr that frees nothing (XLA owns
// it); everything else goes to the wrapped allocator unchanged. Whether the op's results then
// are XLA's buffers, in XLA's layout, is checked after the call (IsResultBuffer); where they
// are not, they are copied as before: a kernel release that allocates otherwise is slower,
// never wrong.
#ifndef JAX_FLASHMLA_FFI_RESULT_LENDING_H_
#define JAX_FLASHMLA_FFI_RESULT_LENDING_H_

#include <cstddef>
#include <vector>

#include <ATen/core/Tensor.h>

namespace jax_flashmla {

// One lent buffer, as the allocator sees it.
struct BufferLoan {
  void* data;
  size_t bytes;
  c10::DeviceIndex device;
  bool taken;
};

class LendResultBuffers {
 public:
  // Lends `buffers` (tensors over XLA's result buffers, each over all of its buffer, in any
  // layout) to the allocations this thread makes until destruction. Handle the op's results
  // after that: a copy made while lending could take a buffer not yet taken.
  explicit LendResultBuffers(const std::vector<at::Tensor>& buffers);
  ~LendResultBuffers();
  LendResultBuffers(const LendResultBuffers&) = delete;
  LendResultBuffers& operator=(const LendResultBuffers&) = delete;

 private:
  std::vector<BufferLoan> loans_;
  std::vector<BufferLoan>* previous_loans_ = nullptr;  // this thread's enclosing lender's
  bool lending_;  // false when someone else replaced torch's allocator
};

// Whether the op's `result` is the buffer `dst` itself, in dst's shape, dtype and layout (the
// strides of every dimension longer than 1): nothing to copy.
bool IsResultBuffer(const at::Tensor& result, const at::Tensor& dst);

// Whether `result` lives in `buffer`. Such a result that is not that buffer in its layout must
// be copied aside before anything is written into `buffer`.
bool LivesIn(const at::Tensor& result, const at::Tensor& buffer);

}  // namespace jax_flashmla

#endif  // JAX_FLASHMLA_FFI_RESULT_LENDING_H_
