// Shared by the extension modules: their registrations(), XLA FFI handlers handed to Python
// for jax.ffi.register_ffi_target.
#ifndef JAX_FLASHMLA_FFI_NB_CAPSULE_H_
#define JAX_FLASHMLA_FFI_NB_CAPSULE_H_

#include <nanobind/nanobind.h>

#include <initializer_list>
#include <utility>

#include "xla/ffi/api/c_api.h"

namespace jax_flashmla {

// {target name: handler capsule}.
inline nanobind::dict Registrations(
    std::initializer_list<std::pair<const char*, XLA_FFI_Handler*>> targets) {
  nanobind::dict dict;
  for (const auto& [name, handler] : targets)
    dict[name] = nanobind::capsule(reinterpret_cast<void*>(handler));
  return dict;
}

}  // namespace jax_flashmla

#endif  // JAX_FLASHMLA_FFI_NB_CAPSULE_H_
