// The CPU extension module: the custom-call targets every JAX install can use.
#include <nanobind/nanobind.h>

#include <cstdlib>
#include <cstring>
#include <new>

#include "cpu_handlers.h"
#include "host_queue.h"
#include "layouts.h"
#include "nb_capsule.h"

namespace nb = nanobind;

namespace jax_flashmla {
namespace {

NB_MODULE(_cpu, m) {
  m.def("registrations", []() { return Registrations(kCpuTargets); });
  // layouts.h's sizes and host_queue.h's slot header, which the CUDA modules are compiled
  // with too, for tests/test_layouts.py to compare with the Python package's.
  m.def("layouts", []() {
    nb::dict sizes;
    sizes["page_tokens"] = kPageTokens;
    sizes["metadata_fields"] = kMetadataFields;
    sizes["index_key_dim"] = kIndexKeyDim;
    sizes["index_key_scale_bytes"] = kIndexKeyScaleBytes;
    sizes["index_page_values_bytes"] = kIndexPageValuesBytes;
    sizes["index_page_bytes"] = kIndexPageBytes;
    sizes["v4_row_bytes"] = kV4RowBytes;
    sizes["v4_scale_bytes"] = kV4ScaleBytes;
    sizes["v4_page_rows"] = kV4PageRows;
    sizes["v4_kernel_token_bytes"] = kV4KernelTokenBytes;
    sizes["host_queue_header_bytes"] = kHostQueueHeaderBytes;
    sizes["host_queue_writing"] = kHostQueueWriting;
    return sizes;
  });
  // A CPU host queue (host_queue.h) registered as `id`; returns the address of its slots.
  m.def("host_queue_create", [](uint64_t id, int64_t slot_bytes, int64_t depth) {
    const size_t bytes = static_cast<size_t>(slot_bytes * depth);
    void* slots = std::aligned_alloc(kHostQueueHeaderBytes, bytes);
    if (slots == nullptr) throw std::bad_alloc();
    std::memset(slots, 0, bytes);
    AddHostQueue(id, HostQueue{static_cast<uint8_t*>(slots), new unsigned long long(0),
                               slot_bytes, depth, -1});
    return reinterpret_cast<uintptr_t>(slots);
  });
  m.def("host_queue_wait", [](uintptr_t sequence, uint64_t expected, double timeout_s) {
    nb::gil_scoped_release release;
    return HostQueueWait(reinterpret_cast<const uint64_t*>(sequence), expected, timeout_s);
  });
}

}  // namespace
}  // namespace jax_flashmla
