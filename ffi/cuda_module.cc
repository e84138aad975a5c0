// The CUDA extension module of our own kernel (the host queue's push): it links the
// CUDA runtime alone, no torch.
#include <cuda_runtime_api.h>
#include <nanobind/nanobind.h>

#include <cstring>
#include <stdexcept>
#include <string>

#include "cuda_error.h"
#include "cuda_handlers.h"
#include "host_queue.h"
#include "nb_capsule.h"

namespace jax_flashmla {
namespace {

// For nanobind, which raises a thrown error in Python.
void Check(cudaError_t status, const char* what) {
  if (xla::ffi::Error error = CudaError(std::string("HostQueue: ") + what, status);
      error.failure())
    throw std::runtime_error(error.message());
}

// A host queue (host_queue.h) of CUDA device `device`, registered as `id`: its slots pinned
// host memory mapped into the device's address space, its push count on the device. Made
// before any capture, as the allocations are synchronous; returns the slots' address.
uintptr_t CreateHostQueue(uint64_t id, int64_t slot_bytes, int64_t depth, int32_t device) {
  int previous = 0;
  Check(cudaGetDevice(&previous), "cudaGetDevice");
  Check(cudaSetDevice(device), "cudaSetDevice");
  void* slots = nullptr;
  void* pushes = nullptr;
  void* mapped = nullptr;
  const size_t bytes = static_cast<size_t>(slot_bytes * depth);
  Check(cudaHostAlloc(&slots, bytes, cudaHostAllocMapped | cudaHostAllocPortable),
        "cudaHostAlloc");
  std::memset(slots, 0, bytes);
  Check(cudaHostGetDevicePointer(&mapped, slots, 0), "cudaHostGetDevicePointer");
  Check(cudaMalloc(&pushes, sizeof(unsigned long long)), "cudaMalloc");
  Check(cudaMemset(pushes, 0, sizeof(unsigned long long)), "cudaMemset");
  Check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  Check(cudaSetDevice(previous), "cudaSetDevice");
  AddHostQueue(id, HostQueue{static_cast<uint8_t*>(mapped),
                             static_cast<unsigned long long*>(pushes), slot_bytes, depth, device});
  return reinterpret_cast<uintptr_t>(slots);
}

NB_MODULE(_cuda, m) {
  m.def("registrations", []() { return Registrations(kCudaTargets); });
  m.def("host_queue_create", &CreateHostQueue);
}

}  // namespace
}  // namespace jax_flashmla
