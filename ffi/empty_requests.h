// The FP8 decode's results for requests of length 0.
//
// FlashMLA's FP8 decode faults on a request of length 0 (it reads block_table[i, -1]), so
// mla_decode hands its kernel such a request as length 1 over page 0 (fp8.py's
// guard_empty_requests); after the kernel, the decode's handler sets that request's results to
// FlashMLA's convention, out 0 and lse +inf, with this kernel.
#ifndef JAX_FLASHMLA_FFI_EMPTY_REQUESTS_H_
#define JAX_FLASHMLA_FFI_EMPTY_REQUESTS_H_

#include <cuda_runtime_api.h>

#include <cstdint>

namespace jax_flashmla {

// For each request i with seq_lens[i] == 0: its out_per_request bfloat16 values of out (zeros)
// and lse_per_request float values of lse (+inf), both contiguous per request. One block per
// request; the others return at once.
cudaError_t LaunchClearEmptyRequests(const int32_t* seq_lens, int64_t batch, void* out,
                                     int64_t out_per_request, float* lse,
                                     int64_t lse_per_request, cudaStream_t stream);

}  // namespace jax_flashmla

#endif  // JAX_FLASHMLA_FFI_EMPTY_REQUESTS_H_
