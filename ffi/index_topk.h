// DeepSeek-V3.2's lightning indexer on the GPU: each query row's scores over its request's
// tokens in the paged index-key cache, then the positions of its top k scores.
//
// The arithmetic is jax_flashmla/sparse/indexer.py's (its module doc):
//   score(row, p) = k_scale(p) * sum_h relu(q_h(row) . k(p)) * w_h(row)
// over the e4m3 values of q and k, the 128 products of q_h . k summed by the tensor cores (wgmma,
// whose float32 accumulator keeps fewer bits between additions), the rest in float32. The
// cache's pages are layouts.h's index-key pages. Built for sm_90a (wgmma).
#ifndef JAX_FLASHMLA_FFI_INDEX_TOPK_H_
#define JAX_FLASHMLA_FFI_INDEX_TOPK_H_

#include <cuda_runtime_api.h>

#include <cstdint>

namespace jax_flashmla {

// The most query heads the scoring kernel keeps in shared memory at once.
inline constexpr int64_t kIndexMaxHeads = 256;

// scores (rows, score_width) float32: position p < max_pages * 64 of row r its score where
// p < visible[r] and its page block_table[r, p / 64] lies in [0, num_pages); -inf elsewhere,
// including every p >= max_pages * 64 (score_width may exceed max_pages * 64).
//   q (rows, heads, 128) e4m3 bytes; weights (rows, heads) float32; cache (num_pages,
//   kIndexPageBytes) bytes; block_table (rows, max_pages) and visible (rows,) int32.
//   heads <= kIndexMaxHeads.
cudaError_t LaunchIndexScores(const uint8_t* q, const float* weights, int64_t rows,
                              int64_t heads, const uint8_t* cache, int64_t num_pages,
                              const int32_t* block_table, int64_t max_pages,
                              const int32_t* visible, float* scores, int64_t score_width,
                              cudaStream_t stream);

// positions (rows, k) int32: the positions of each row's k largest scores (of score_width)
// above -inf, in ascending order, then -1 where fewer than k are. Scores are ordered as IEEE
// totalOrder orders them with every NaN's sign dropped (every NaN above +inf); of equal scores
// the lower position is taken first, as lax.top_k takes them. A -inf score (a position the
// row does not see) is never taken, so that the picks need no reordering after. scratch:
// rows * TopkScratchWidth(score_width, k) int32 the launch's kernels use between them (none
// where that is 0). They are launched as programmatic dependents of the kernel before them on
// the stream (its tail overlaps their launch) and wait for it to complete before they read.
cudaError_t LaunchTopkPositions(const float* scores, int64_t rows, int64_t score_width,
                                int64_t k, int32_t* positions, int32_t* scratch,
                                cudaStream_t stream);

// The int32 scratch LaunchTopkPositions takes per row: room for a wide row's candidates (a
// float32 score and an int32 position each) in two halves, which its passes fill in turn.
int64_t TopkScratchWidth(int64_t score_width, int64_t k);

}  // namespace jax_flashmla

#endif  // JAX_FLASHMLA_FFI_INDEX_TOPK_H_
