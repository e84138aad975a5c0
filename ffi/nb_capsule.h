// Shared by the extension modules: their registrations(), XLA FFI handlers handed to Python
// for jax.ffi.register_ffi_target.
#ifndef JAX_FLASHMLA_FFI_NB_CAPSULE_H_
#define JAX_FLASHMLA_FFI_NB_CAPSULE_H_

#include <nanobind/nanobind.h>

#include <cstddef>

#include "targets.h"

namespace jax_flashmla {

// A module's registrations(): {target name: handler capsule}.
template <size_t N>
nanobind::dict Registrations(const Target (&targets)[N]) {
  nanobind::dict dict;
  for (const Target& target : targets)
    dict[target.name] = nanobind::capsule(reinterpret_cast<void*>(target.handler));
  return dict;
}

}  // namespace jax_flashmla

#endif  // JAX_FLASHMLA_FFI_NB_CAPSULE_H_
