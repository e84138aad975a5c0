// The CPU extension module: the custom-call targets every JAX install can use.
#include <nanobind/nanobind.h>

#include "nb_capsule.h"
#include "cpu_handlers.h"

namespace nb = nanobind;

namespace jax_flashmla {
namespace {

NB_MODULE(_cpu, m) {
  m.def("registrations", []() {
    nb::dict targets;
    targets["jax_flashmla_mla_decode"] = EncapsulateFfiHandler(kMlaDecodeCpu);
    targets["jax_flashmla_mla_decode_fp8"] = EncapsulateFfiHandler(kMlaDecodeFp8Cpu);
    targets["jax_flashmla_mla_metadata"] = EncapsulateFfiHandler(kMlaMetadataCpu);
    targets["jax_flashmla_fp8_guard"] = EncapsulateFfiHandler(kFp8GuardCpu);
    return targets;
  });
}

}  // namespace
}  // namespace jax_flashmla
