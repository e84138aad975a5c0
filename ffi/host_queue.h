// A queue of small arrays from a running step to the host: the step's custom call
// jax_flashmla_host_queue_push writes its operand into a slot of host memory that the device
// can write (CUDA: pinned and mapped), then the slot's sequence number; the host spins on
// that number (HostQueueWait) instead of waiting for XLA to mark the step's buffers ready.
//
// The memory: `depth` slots of `slot_bytes`, each a 64-byte header (the sequence number, a
// uint64) then the payload. Push number s (1, 2, ...) goes to slot (s - 1) % depth: it sets
// the slot's sequence to s | kWriting, writes the payload, then sets it to s. The queue's
// memory lives until the process exits: a CUDA graph replays the push with the addresses it
// was captured with, however long its executable lives.
#ifndef JAX_FLASHMLA_FFI_HOST_QUEUE_H_
#define JAX_FLASHMLA_FFI_HOST_QUEUE_H_

#include <cstdint>
#include <string>

namespace jax_flashmla {

inline constexpr int64_t kHostQueueHeaderBytes = 64;
inline constexpr uint64_t kHostQueueWriting = uint64_t{1} << 63;

struct HostQueue {
  uint8_t* slots;              // depth * slot_bytes bytes, host memory the device can write
  unsigned long long* pushes;  // how many pushes have started; device memory on CUDA
  int64_t slot_bytes;
  int64_t depth;
  int32_t device;              // the CUDA device, -1 on the CPU
};

// The queue named `id` in this module's registry, or nullptr.
const HostQueue* FindHostQueue(uint64_t id);
void AddHostQueue(uint64_t id, const HostQueue& queue);

// The queue `id` of `device` (-1: the CPU) that a push of `bytes` may write, or nullptr with
// `error` saying why not.
const HostQueue* QueueForPush(uint64_t id, int32_t device, int64_t bytes, std::string& error);

// Spins until the sequence number at `sequence` is `expected` (returns it) or beyond
// expected's push (returns what it saw: the reader fell behind), or until timeout_s has passed
// (returns 0).
uint64_t HostQueueWait(const uint64_t* sequence, uint64_t expected, double timeout_s);

}  // namespace jax_flashmla

#endif  // JAX_FLASHMLA_FFI_HOST_QUEUE_H_
