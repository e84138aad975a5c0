// The extension module of FlashMLA's targets. It links torch, so jax_flashmla imports it only
// after torch and the FlashMLA kernel library are loaded, when the GPU path is first lowered.
#include <nanobind/nanobind.h>

#include "flashmla_handlers.h"
#include "nb_capsule.h"

namespace jax_flashmla {
namespace {

NB_MODULE(_flashmla, m) {
  m.def("registrations", []() { return Registrations(kFlashMlaTargets); });
}

}  // namespace
}  // namespace jax_flashmla
