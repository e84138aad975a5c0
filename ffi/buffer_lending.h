// Lets a FlashMLA op allocate its results and its scratch straight in XLA's buffers, and
// nothing else.
//
// FlashMLA's ops take no output buffers: they allocate out, lse and their split-KV
// accumulators with torch's CUDA allocator. While a LendBuffers lives, torch's CUDA allocator
// is a thin wrapper of the one it replaced: an allocation made on this thread whose byte size
// equals a lent buffer's (each buffer once, in the order given) gets that buffer, in a DataPtr
// that frees nothing (XLA owns it). Any other allocation on this thread is recorded as
// refused (and served by the wrapped allocator, so that the op runs to its end instead of
// failing inside kernel code that may not survive an exception); the caller then fails the
// call with Refusal()'s message. So an op run under it either touches no memory but XLA's,
// and its launches can be captured into a CUDA graph that XLA replays, or the call is an
// error: an address torch's allocator handed out during a capture would be baked into the
// graph while torch gives the memory to others. Other threads' allocations go to the wrapped
// allocator unchanged.
#ifndef JAX_FLASHMLA_FFI_BUFFER_LENDING_H_
#define JAX_FLASHMLA_FFI_BUFFER_LENDING_H_

#include <cstddef>
#include <string>
#include <string_view>
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

// This thread's loans, the op they are lent to, and the byte sizes of its allocations that
// matched none of them.
struct Loans {
  std::vector<BufferLoan> buffers;
  std::string op;
  std::vector<size_t> refused;
};

class LendBuffers {
 public:
  // Lends `buffers` (tensors over XLA's buffers, each over all of its buffer, in any layout)
  // to the allocations this thread makes for `op` until destruction. Throws where torch's
  // allocator was replaced by someone else since the first lending, which could not refuse.
  LendBuffers(const std::vector<at::Tensor>& buffers, std::string_view op);
  ~LendBuffers();
  LendBuffers(const LendBuffers&) = delete;
  LendBuffers& operator=(const LendBuffers&) = delete;

  // Empty when every allocation of the op got a lent buffer; else what it asked for, and what
  // was lent.
  std::string Refusal() const;

 private:
  Loans loans_;
  Loans* previous_loans_ = nullptr;  // this thread's enclosing lender's
};

// Whether the op's `result` is the buffer `buffer` itself, in its shape, dtype and layout (the
// strides of every dimension longer than 1).
bool IsBuffer(const at::Tensor& result, const at::Tensor& buffer);

}  // namespace jax_flashmla

#endif  // JAX_FLASHMLA_FFI_BUFFER_LENDING_H_
