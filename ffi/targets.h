// The custom-call targets' names, for every module that registers a handler under them
// (jax_flashmla/custom_calls.py names each once and checks it against registrations()).
#ifndef JAX_FLASHMLA_FFI_TARGETS_H_
#define JAX_FLASHMLA_FFI_TARGETS_H_

#include "xla/ffi/api/c_api.h"

namespace jax_flashmla {

// A handler and the target it is registered under.
struct Target {
  const char* name;
  XLA_FFI_Handler* handler;
};

inline constexpr char kMlaDecodeTarget[] = "jax_flashmla_mla_decode";
inline constexpr char kMlaDecodeFp8Target[] = "jax_flashmla_mla_decode_fp8";
inline constexpr char kMlaMetadataTarget[] = "jax_flashmla_mla_metadata";
inline constexpr char kMlaSparseDecodeTarget[] = "jax_flashmla_mla_sparse_decode";
inline constexpr char kMlaSparseDecodeV4Target[] = "jax_flashmla_mla_sparse_decode_v4";
inline constexpr char kMlaSparsePrefillTarget[] = "jax_flashmla_mla_sparse_prefill";
inline constexpr char kHostQueuePushTarget[] = "jax_flashmla_host_queue_push";
inline constexpr char kIndexTopkTarget[] = "jax_flashmla_index_topk";

}  // namespace jax_flashmla

#endif  // JAX_FLASHMLA_FFI_TARGETS_H_
