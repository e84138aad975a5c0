#include "buffer_lending.h"

#include <cuda_runtime_api.h>

#include <cstddef>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/util/Exception.h>
#include <torch/csrc/cuda/CUDAPluggableAllocator.h>

namespace jax_flashmla {
namespace {

namespace cca = c10::cuda::CUDACachingAllocator;
using torch::cuda::CUDAPluggableAllocator::CUDAPluggableAllocator;

// The loans of this thread's innermost LendBuffers; null when it lends none.
thread_local Loans* thread_loans = nullptr;

// XLA owns a lent buffer: dropping the tensor over it frees nothing.
void KeepXlaBuffer(void*) {}

std::string LentSizes(const Loans& loans) {
  std::string sizes;
  for (const BufferLoan& loan : loans.buffers)
    sizes += (sizes.empty() ? "" : ", ") + std::to_string(loan.bytes) +
             (loan.taken ? " (taken)" : "");
  return sizes;
}

// torch's CUDA allocator, wrapped: allocate() hands out a lent buffer, or records a refusal,
// on a lending thread; everything else is the wrapped allocator's. CUDAPluggableAllocator is the
// base only because it implements the whole allocator interface, whose pure virtual methods
// change between torch releases; the methods an op calls (allocating, freeing, recordStream,
// initialisation) are forwarded here. The rest are the plugin's, and only for as long as an
// op runs under the wrapper.
class LendingAllocator final : public CUDAPluggableAllocator {
 public:
  explicit LendingAllocator(cca::CUDAAllocator* wrapped)
      : CUDAPluggableAllocator(
            [wrapped](size_t bytes, int, cudaStream_t stream) {
              return wrapped->raw_alloc_with_stream(bytes, stream);
            },
            [wrapped](void* data, size_t, int, cudaStream_t) { wrapped->raw_delete(data); }),
        wrapped_(wrapped) {}

  cca::CUDAAllocator* wrapped() const { return wrapped_; }

  c10::DataPtr allocate(size_t bytes) override {
    if (thread_loans == nullptr) return wrapped_->allocate(bytes);
    const c10::DeviceIndex device = c10::cuda::current_device();
    const c10::Device cuda(c10::DeviceType::CUDA, device);
    if (bytes == 0) return c10::DataPtr(nullptr, cuda);  // an empty tensor takes no memory
    for (BufferLoan& loan : thread_loans->buffers) {
      if (!loan.taken && loan.bytes == bytes && loan.device == device) {
        loan.taken = true;
        return c10::DataPtr(loan.data, loan.data, &KeepXlaBuffer, cuda);
      }
    }
    thread_loans->refused.push_back(bytes);
    return wrapped_->allocate(bytes);
  }
  c10::DeleterFnPtr raw_deleter() const override { return wrapped_->raw_deleter(); }
  void* raw_alloc(size_t bytes) override {
    if (thread_loans != nullptr) thread_loans->refused.push_back(bytes);
    return wrapped_->raw_alloc(bytes);
  }
  void* raw_alloc_with_stream(size_t bytes, cudaStream_t stream) override {
    if (thread_loans != nullptr) thread_loans->refused.push_back(bytes);
    return wrapped_->raw_alloc_with_stream(bytes, stream);
  }
  void raw_delete(void* data) override { wrapped_->raw_delete(data); }
  void init(int device_count) override { wrapped_->init(device_count); }
  bool initialized() override { return wrapped_->initialized(); }
  void recordStream(const c10::DataPtr& data, c10::cuda::CUDAStream stream) override {
    if (data.get_deleter() != &KeepXlaBuffer && data.get() != nullptr)
      wrapped_->recordStream(data, stream);
  }
  std::string name() override { return wrapped_->name(); }

 private:
  cca::CUDAAllocator* const wrapped_;
};

// The wrapper is installed while any thread lends: the first lender installs it, the last one
// restores the wrapped allocator.
struct Installation {
  std::mutex mutex;
  // Made once and never freed: torch code may keep the allocator pointer it read.
  LendingAllocator* lender = nullptr;
  int lenders = 0;
};

Installation& TheInstallation() {
  static Installation* installation = new Installation;
  return *installation;
}

void Install() {
  Installation& installation = TheInstallation();
  std::lock_guard<std::mutex> lock(installation.mutex);
  cca::CUDAAllocator* current = cca::allocator.load();
  if (installation.lender == nullptr) installation.lender = new LendingAllocator(current);
  TORCH_CHECK(current == installation.lender || current == installation.lender->wrapped(),
              "torch's CUDA allocator was replaced (by ", current->name(),
              ") after jax_flashmla first wrapped it; jax_flashmla cannot then keep FlashMLA's "
              "ops from allocating memory of their own");
  if (installation.lenders++ == 0) cca::allocator.store(installation.lender);
}

void Uninstall() {
  Installation& installation = TheInstallation();
  std::lock_guard<std::mutex> lock(installation.mutex);
  if (--installation.lenders == 0) cca::allocator.store(installation.lender->wrapped());
}

}  // namespace

LendBuffers::LendBuffers(const std::vector<at::Tensor>& buffers, std::string_view op) {
  Install();
  loans_.op = std::string(op);
  loans_.buffers.reserve(buffers.size());
  for (const at::Tensor& buffer : buffers)
    loans_.buffers.push_back(
        BufferLoan{buffer.data_ptr(), buffer.nbytes(), buffer.device().index(), false});
  previous_loans_ = thread_loans;
  thread_loans = &loans_;
}

LendBuffers::~LendBuffers() {
  thread_loans = previous_loans_;
  Uninstall();
}

std::string LendBuffers::Refusal() const {
  if (loans_.refused.empty()) return "";
  std::string asked;
  for (size_t bytes : loans_.refused) asked += (asked.empty() ? "" : ", ") + std::to_string(bytes);
  return loans_.op + " asked torch's CUDA allocator for " + asked +
         " bytes, which is none of the buffers XLA gave it (bytes: " + LentSizes(loans_) +
         "). jax_flashmla lets FlashMLA's ops allocate nothing of their own, so that XLA can "
         "capture them into a CUDA graph; this kernel release allocates what jax_flashmla does "
         "not know of.";
}

bool IsBuffer(const at::Tensor& result, const at::Tensor& buffer) {
  if (result.numel() == 0)  // nothing of it lives anywhere
    return result.sizes() == buffer.sizes() && result.scalar_type() == buffer.scalar_type();
  if (result.const_data_ptr() != buffer.const_data_ptr() || result.sizes() != buffer.sizes() ||
      result.scalar_type() != buffer.scalar_type())
    return false;
  for (int64_t d = 0; d < buffer.dim(); ++d)  // a dimension of size 1 has no layout to match
    if (buffer.size(d) > 1 && result.stride(d) != buffer.stride(d)) return false;
  return true;
}

}  // namespace jax_flashmla
