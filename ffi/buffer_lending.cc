#include "buffer_lending.h"

#include <cuda_runtime_api.h>

#include <cstddef>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_set>
#include <utility>
#include <vector>

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/util/Exception.h>
#include <torch/csrc/cuda/CUDAPluggableAllocator.h>
#include <torch/version.h>

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
// on a lending thread; everything else is the wrapped allocator's, for torch code on any other
// thread (its statistics, caches, pools, graphs, IPC). CUDAPluggableAllocator is the base only
// because it implements the whole allocator interface, whose virtual methods change between
// torch releases: each method of the releases named below is forwarded, and
// tests/test_bridge_compile.py fails where the installed torch's allocator has a virtual
// method this class leaves to its bases (most of the plugin's raise).
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
  void* raw_alloc(size_t bytes) override {
    if (thread_loans != nullptr) thread_loans->refused.push_back(bytes);
    return wrapped_->raw_alloc(bytes);
  }
  void* raw_alloc_with_stream(size_t bytes, cudaStream_t stream) override {
    if (thread_loans != nullptr) thread_loans->refused.push_back(bytes);
    return wrapped_->raw_alloc_with_stream(bytes, stream);
  }
  void recordStream(const c10::DataPtr& data, c10::cuda::CUDAStream stream) override {
    if (data.get_deleter() != &KeepXlaBuffer && data.get() != nullptr)
      wrapped_->recordStream(data, stream);
  }

  // The rest of the interface of torch 2.11 to 2.13, forwarded.
  c10::DeleterFnPtr raw_deleter() const override { return wrapped_->raw_deleter(); }
  bool is_simple_data_ptr(const c10::DataPtr& data) const override {
    return wrapped_->is_simple_data_ptr(data);
  }
  bool initialized() override { return wrapped_->initialized(); }
  void emptyCache(c10::MempoolId_t pool) override { wrapped_->emptyCache(pool); }
  c10::CachingDeviceAllocator::DeviceStats getDeviceStats(c10::DeviceIndex device) override {
    return wrapped_->getDeviceStats(device);
  }
  void resetAccumulatedStats(c10::DeviceIndex device) override {
    wrapped_->resetAccumulatedStats(device);
  }
  void resetPeakStats(c10::DeviceIndex device) override { wrapped_->resetPeakStats(device); }
  std::pair<size_t, size_t> getMemoryInfo(c10::DeviceIndex device) override {
    return wrapped_->getMemoryInfo(device);
  }
  void raw_delete(void* data) override { wrapped_->raw_delete(data); }
  void init(int device_count) override { wrapped_->init(device_count); }
  double getMemoryFraction(c10::DeviceIndex device) override {
    return wrapped_->getMemoryFraction(device);
  }
  void setMemoryFraction(double fraction, c10::DeviceIndex device) override {
    wrapped_->setMemoryFraction(fraction, device);
  }
  std::vector<cca::StreamSegmentSize> getExpandableSegmentSizes(
      c10::DeviceIndex device) override {
    return wrapped_->getExpandableSegmentSizes(device);
  }
  void enable(bool value) override { wrapped_->enable(value); }
  bool isEnabled() const override { return wrapped_->isEnabled(); }
  void cacheInfo(c10::DeviceIndex device, size_t* largest_block) override {
    wrapped_->cacheInfo(device, largest_block);
  }
  void* getBaseAllocation(void* data, size_t* size) override {
    return wrapped_->getBaseAllocation(data, size);
  }
  cca::SnapshotInfo snapshot(c10::MempoolId_t pool, bool include_traces) override {
    return wrapped_->snapshot(pool, include_traces);
  }
  void beginAllocateToPool(c10::DeviceIndex device, c10::MempoolId_t pool,
                           std::function<bool(cudaStream_t)> filter) override {
    wrapped_->beginAllocateToPool(device, pool, std::move(filter));
  }
  void endAllocateToPool(c10::DeviceIndex device, c10::MempoolId_t pool) override {
    wrapped_->endAllocateToPool(device, pool);
  }
  void releasePool(c10::DeviceIndex device, c10::MempoolId_t pool) override {
    wrapped_->releasePool(device, pool);
  }
  int getPoolUseCount(c10::DeviceIndex device, c10::MempoolId_t pool) override {
    return wrapped_->getPoolUseCount(device, pool);
  }
  void createOrIncrefPool(c10::DeviceIndex device, c10::MempoolId_t pool,
                          std::shared_ptr<cca::CUDAAllocator> allocator) override {
    wrapped_->createOrIncrefPool(device, pool, std::move(allocator));
  }
  void setUseOnOOM(c10::DeviceIndex device, c10::MempoolId_t pool, bool use_on_oom) override {
    wrapped_->setUseOnOOM(device, pool, use_on_oom);
  }
  void setNoSplit(c10::DeviceIndex device, c10::MempoolId_t pool) override {
    wrapped_->setNoSplit(device, pool);
  }
  bool checkPoolLiveAllocations(c10::DeviceIndex device, c10::MempoolId_t pool,
                                const std::unordered_set<void*>& live) override {
    return wrapped_->checkPoolLiveAllocations(device, pool, live);
  }
  cca::ShareableHandle shareIpcHandle(void* data) override {
    return wrapped_->shareIpcHandle(data);
  }
  std::shared_ptr<void> getIpcDevPtr(std::string handle) override {
    return wrapped_->getIpcDevPtr(std::move(handle));
  }
  bool isHistoryEnabled() override { return wrapped_->isHistoryEnabled(); }
  void recordHistory(bool enabled, cca::CreateContextFn context_recorder,
                     size_t alloc_trace_max_entries, cca::RecordContext when, bool clear_history,
                     const std::vector<std::string>& skip_actions) override {
    wrapped_->recordHistory(enabled, context_recorder, alloc_trace_max_entries, when,
                            clear_history, skip_actions);
  }
  void recordAnnotation(const std::vector<std::pair<std::string, std::string>>& md) override {
    wrapped_->recordAnnotation(md);
  }
  void pushCompileContext(std::string& md) override { wrapped_->pushCompileContext(md); }
  void popCompileContext() override { wrapped_->popCompileContext(); }
  void setUserMetadata(const std::string& metadata) override {
    wrapped_->setUserMetadata(metadata);
  }
  std::string getUserMetadata() override { return wrapped_->getUserMetadata(); }
  void attachOutOfMemoryObserver(cca::OutOfMemoryObserver observer) override {
    wrapped_->attachOutOfMemoryObserver(std::move(observer));
  }
  void attachAllocatorTraceTracker(cca::AllocatorTraceTracker tracker) override {
    wrapped_->attachAllocatorTraceTracker(std::move(tracker));
  }
  void enablePeerAccess(c10::DeviceIndex device, c10::DeviceIndex device_to_access) override {
    wrapped_->enablePeerAccess(device, device_to_access);
  }
  cudaError_t memcpyAsync(void* dst, int dst_device, const void* src, int src_device,
                          size_t count, cudaStream_t stream, bool p2p_enabled) override {
    return wrapped_->memcpyAsync(dst, dst_device, src, src_device, count, stream, p2p_enabled);
  }
  std::shared_ptr<cca::AllocatorState> getCheckpointState(c10::DeviceIndex device,
                                                          c10::MempoolId_t id) override {
    return wrapped_->getCheckpointState(device, id);
  }
  cca::CheckpointDelta setCheckpointPoolState(
      c10::DeviceIndex device, std::shared_ptr<cca::AllocatorState> state) override {
    return wrapped_->setCheckpointPoolState(device, std::move(state));
  }
  std::string name() override { return wrapped_->name(); }
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 13)
  void markCaptureBegin(c10::DeviceIndex device) override { wrapped_->markCaptureBegin(device); }
  void markCaptureEnd(c10::DeviceIndex device) override { wrapped_->markCaptureEnd(device); }
  std::shared_ptr<c10::GatheredContext> getContextForPointer(const void* data) override {
    return wrapped_->getContextForPointer(data);
  }
  void attachOomRejectionObserver(cca::OomRejectionObserver observer) override {
    wrapped_->attachOomRejectionObserver(std::move(observer));
  }
  c10::DataPtr allocateWithAddress(size_t size, void* address) override {
    return wrapped_->allocateWithAddress(size, address);
  }
#endif

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
