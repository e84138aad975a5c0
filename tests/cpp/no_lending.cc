// buffer_lending.h for torch_bridge_test.cc, which links torch's CPU libraries only
// (buffer_lending.cc needs torch's CUDA allocator). The test's calls fail before the bridge
// lends anything: reaching this is an error the test reports.
#include <stdexcept>

#include "buffer_lending.h"

namespace jax_flashmla {

LendBuffers::LendBuffers(const std::vector<at::Tensor>&, std::string_view op) {
  throw std::logic_error("the host-side test reached LendBuffers for " + std::string(op));
}

LendBuffers::~LendBuffers() = default;

std::string LendBuffers::Refusal() const { return ""; }

bool IsBuffer(const at::Tensor&, const at::Tensor&) { return false; }

}  // namespace jax_flashmla
