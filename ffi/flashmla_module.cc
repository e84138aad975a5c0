// The extension module of FlashMLA's targets. It links torch, so jax_flashmla imports it only
// after torch and the FlashMLA kernel library are loaded, when the GPU path is first lowered.
#include <nanobind/nanobind.h>

#include "flashmla_handlers.h"
#include "nb_capsule.h"
#include "targets.h"

namespace nb = nanobind;

namespace jax_flashmla {
namespace {

NB_MODULE(_flashmla, m) {
  m.def("registrations", []() {
    nb::dict targets;
    targets[kMlaDecodeTarget] = EncapsulateFfiHandler(kMlaDecodeCuda);
    targets[kMlaDecodeFp8Target] = EncapsulateFfiHandler(kMlaDecodeFp8Cuda);
    targets[kMlaMetadataTarget] = EncapsulateFfiHandler(kMlaMetadataCuda);
    return targets;
  });
}

}  // namespace
}  // namespace jax_flashmla
