// The extension module of FlashMLA's targets. It links torch, so jax_flashmla imports it only
// after torch and the FlashMLA kernel library are loaded, when the GPU path is first lowered.
#include <nanobind/nanobind.h>

#include "flashmla_handlers.h"
#include "nb_capsule.h"
#include "targets.h"

namespace jax_flashmla {
namespace {

NB_MODULE(_flashmla, m) {
  m.def("registrations", []() {
    return Registrations({{kMlaDecodeTarget, kMlaDecodeCuda},
                          {kMlaDecodeFp8Target, kMlaDecodeFp8Cuda},
                          {kMlaMetadataTarget, kMlaMetadataCuda}});
  });
}

}  // namespace
}  // namespace jax_flashmla
