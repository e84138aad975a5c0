// Shared by the extension modules: hands an XLA FFI handler to Python for
// jax.ffi.register_ffi_target.
#ifndef JAX_FLASHMLA_FFI_NB_CAPSULE_H_
#define JAX_FLASHMLA_FFI_NB_CAPSULE_H_

#include <nanobind/nanobind.h>

namespace jax_flashmla {

template <typename T>
nanobind::capsule EncapsulateFfiHandler(T* fn) {
  return nanobind::capsule(reinterpret_cast<void*>(fn));
}

}  // namespace jax_flashmla

#endif  // JAX_FLASHMLA_FFI_NB_CAPSULE_H_
