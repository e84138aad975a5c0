// The FP8 decode's guard for requests of length 0: two small kernels.
//
// FlashMLA's FP8 decode reads block_table[i, -1] for a request of length 0 (its last block
// index is then -1): the previous row's last slot, or memory before the table, which faults
// when it holds no page (seen on the H200; vLLM #35969 clamps the same way). The kernel is
// given such a request as length 1 over page 0 instead, from copies of seq_lens and
// block_table that the custom call jax_flashmla_fp8_guard makes (XLA's operands are
// read-only); the decode's handler then sets its results to FlashMLA's convention: out 0,
// lse +inf. The guard is a custom call of its own so that XLA computes it once for all the
// layers of a step that share a block table (its common-subexpression pass merges identical
// calls); the clear follows every decode.
#ifndef JAX_FLASHMLA_FFI_FP8_GUARD_H_
#define JAX_FLASHMLA_FFI_FP8_GUARD_H_

#include <cuda_runtime_api.h>

#include <cstdint>

namespace jax_flashmla {

// guarded_seq_lens[i] = max(seq_lens[i], 1); guarded_block_table = block_table (batch rows of
// max_pages >= 1 entries) but for slot 0 of requests of length 0, which becomes page 0.
cudaError_t LaunchGuardEmptyRequests(const int32_t* seq_lens, const int32_t* block_table,
                                     int64_t batch, int64_t max_pages, int32_t* guarded_seq_lens,
                                     int32_t* guarded_block_table, cudaStream_t stream);

// For each request i with seq_lens[i] == 0: its out_per_request bfloat16 values of out (zeros)
// and lse_per_request float values of lse (+inf), both contiguous per request. One block per
// request; the others return at once.
cudaError_t LaunchClearEmptyRequests(const int32_t* seq_lens, int64_t batch, void* out,
                                     int64_t out_per_request, float* lse,
                                     int64_t lse_per_request, cudaStream_t stream);

}  // namespace jax_flashmla

#endif  // JAX_FLASHMLA_FFI_FP8_GUARD_H_
