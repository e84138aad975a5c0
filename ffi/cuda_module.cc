// The CUDA extension module. It links torch, so jax_flashmla imports it only after torch
// and the FlashMLA kernel library are loaded, when the GPU path is first lowered.
#include <nanobind/nanobind.h>

#include "cuda_handlers.h"
#include "nb_capsule.h"

namespace nb = nanobind;

namespace jax_flashmla {
namespace {

NB_MODULE(_cuda, m) {
  m.def("registrations", []() {
    nb::dict targets;
    targets["jax_flashmla_mla_decode"] = EncapsulateFfiHandler(kMlaDecodeCuda);
    targets["jax_flashmla_mla_decode_fp8"] = EncapsulateFfiHandler(kMlaDecodeFp8Cuda);
    targets["jax_flashmla_mla_metadata"] = EncapsulateFfiHandler(kMlaMetadataCuda);
    targets["jax_flashmla_fp8_guard"] = EncapsulateFfiHandler(kFp8GuardCuda);
    return targets;
  });
}

}  // namespace
}  // namespace jax_flashmla
