#include "result_lending.h"

#include <cuda_runtime_api.h>

#include <cstddef>
#include <mutex>
#include <string>
#include <vector>

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <torch/csrc/cuda/CUDAPluggableAllocator.h>

namespace jax_flashmla {
namespace {

namespace cca = c10::cuda::CUDACachingAllocator;
using torch::cuda::CUDAPluggableAllocator::CUDAPluggableAllocator;

// The buffers a LendResultBuffers of this thread lends; null when it lends none.
thread_local std::vector<BufferLoan>* thread_loans = nullptr;

// XLA owns a lent buffer: dropping the tensor over it frees nothing.
void KeepXlaBuffer(void*) {}

// torch's CUDA allocator, wrapped: allocate() may hand out a lent buffer, everything else is
// the wrapped allocator's. CUDAPluggableAllocator is the base only because it implements the
// whole allocator interface, whose pure virtual methods change between torch releases; the
// methods a decode calls (allocating, freeing, recordStream, initialisation) are forwarded
// here. The rest are the plugin's, and only for as long as an op runs under the wrapper.
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
    if (thread_loans != nullptr) {
      const c10::DeviceIndex device = c10::cuda::current_device();
      for (BufferLoan& loan : *thread_loans) {
        if (!loan.taken && loan.bytes == bytes && loan.device == device) {
          loan.taken = true;
          return c10::DataPtr(loan.data, loan.data, &KeepXlaBuffer,
                              c10::Device(c10::DeviceType::CUDA, device));
        }
      }
    }
    return wrapped_->allocate(bytes);
  }
  c10::DeleterFnPtr raw_deleter() const override { return wrapped_->raw_deleter(); }
  void* raw_alloc(size_t bytes) override { return wrapped_->raw_alloc(bytes); }
  void* raw_alloc_with_stream(size_t bytes, cudaStream_t stream) override {
    return wrapped_->raw_alloc_with_stream(bytes, stream);
  }
  void raw_delete(void* data) override { wrapped_->raw_delete(data); }
  void init(int device_count) override { wrapped_->init(device_count); }
  bool initialized() override { return wrapped_->initialized(); }
  void recordStream(const c10::DataPtr& data, c10::cuda::CUDAStream stream) override {
    if (data.get_deleter() != &KeepXlaBuffer) wrapped_->recordStream(data, stream);
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

bool Install() {
  Installation& installation = TheInstallation();
  std::lock_guard<std::mutex> lock(installation.mutex);
  cca::CUDAAllocator* current = cca::allocator.load();
  if (installation.lender == nullptr) installation.lender = new LendingAllocator(current);
  // Someone replaced torch's allocator after we first wrapped it: leave theirs alone.
  if (current != installation.lender && current != installation.lender->wrapped()) return false;
  if (installation.lenders++ == 0) cca::allocator.store(installation.lender);
  return true;
}

void Uninstall() {
  Installation& installation = TheInstallation();
  std::lock_guard<std::mutex> lock(installation.mutex);
  if (--installation.lenders == 0) cca::allocator.store(installation.lender->wrapped());
}

}  // namespace

LendResultBuffers::LendResultBuffers(const std::vector<at::Tensor>& buffers)
    : lending_(Install()) {
  if (!lending_) return;
  loans_.reserve(buffers.size());
  for (const at::Tensor& buffer : buffers)
    loans_.push_back(
        BufferLoan{buffer.data_ptr(), buffer.nbytes(), buffer.device().index(), false});
  previous_loans_ = thread_loans;
  thread_loans = &loans_;
}

LendResultBuffers::~LendResultBuffers() {
  if (!lending_) return;
  thread_loans = previous_loans_;
  Uninstall();
}

bool IsResultBuffer(const at::Tensor& result, const at::Tensor& dst) {
  if (result.const_data_ptr() != dst.const_data_ptr() || result.sizes() != dst.sizes() ||
      result.scalar_type() != dst.scalar_type())
    return false;
  for (int64_t d = 0; d < dst.dim(); ++d)  // a dimension of size 1 has no layout to match
    if (dst.size(d) > 1 && result.stride(d) != dst.stride(d)) return false;
  return true;
}

bool LivesIn(const at::Tensor& result, const at::Tensor& buffer) {
  return result.storage().data() == buffer.const_data_ptr();
}

}  // namespace jax_flashmla
