// The registry of host_queue.h and the host's wait.
#include "host_queue.h"

#include <chrono>
#include <map>
#include <mutex>
#include <string>

#include "targets.h"

namespace jax_flashmla {
namespace {

std::mutex registry_mutex;
std::map<uint64_t, HostQueue>& Registry() {
  static auto* queues = new std::map<uint64_t, HostQueue>;  // never freed, as the queues
  return *queues;
}

inline void Pause() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

}  // namespace

const HostQueue* FindHostQueue(uint64_t id) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  auto it = Registry().find(id);
  return it == Registry().end() ? nullptr : &it->second;
}

void AddHostQueue(uint64_t id, const HostQueue& queue) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  Registry()[id] = queue;
}

const HostQueue* QueueForPush(uint64_t id, int32_t device, int64_t bytes, std::string& error) {
  const std::string where = std::string(kHostQueuePushTarget) + ": ";
  const HostQueue* queue = FindHostQueue(id);
  if (queue == nullptr || queue->device != device) {
    error = where + "no HostQueue " + std::to_string(id) + " of " +
            (device < 0 ? std::string("the CPU") : "CUDA device " + std::to_string(device)) +
            " in this process";
    return nullptr;
  }
  if (bytes > queue->slot_bytes - kHostQueueHeaderBytes) {
    error = where + "the array has " + std::to_string(bytes) + " bytes, the queue's slots " +
            std::to_string(queue->slot_bytes - kHostQueueHeaderBytes);
    return nullptr;
  }
  return queue;
}

uint64_t HostQueueWait(const uint64_t* sequence, uint64_t expected, double timeout_s) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  for (int64_t spins = 0;; ++spins) {
    const uint64_t seen = __atomic_load_n(sequence, __ATOMIC_ACQUIRE);
    if (seen == expected || (seen & ~kHostQueueWriting) > expected) return seen;
    if (spins % 1024 == 1023 && std::chrono::steady_clock::now() > deadline) return 0;
    Pause();
  }
}

}  // namespace jax_flashmla
