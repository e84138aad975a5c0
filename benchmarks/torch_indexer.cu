// jax_flashmla's indexer kernels (ffi/index_topk.h) behind a C ABI, for ctypes: the torch side
// of bench_v4.py calls the same kernels as the JAX step, on torch's stream, so that a CUDA
// graph captures them. Arguments and contracts are index_topk.h's; returns its cudaError_t.
#include <cstdint>

#include "index_topk.h"

extern "C" {

int jax_flashmla_index_scores(const uint8_t* q, const float* weights, int64_t rows,
                              int64_t heads, const uint8_t* cache, int64_t num_pages,
                              const int32_t* block_table, int64_t max_pages,
                              const int32_t* visible, float* scores, int64_t score_width,
                              void* stream) {
  return static_cast<int>(jax_flashmla::LaunchIndexScores(
      q, weights, rows, heads, cache, num_pages, block_table, max_pages, visible, scores,
      score_width, static_cast<cudaStream_t>(stream)));
}

int jax_flashmla_topk_positions(const float* scores, int64_t rows, int64_t score_width,
                                int64_t k, int32_t* positions, int32_t* scratch, void* stream) {
  return static_cast<int>(jax_flashmla::LaunchTopkPositions(
      scores, rows, score_width, k, positions, scratch, static_cast<cudaStream_t>(stream)));
}

int64_t jax_flashmla_topk_scratch_width(int64_t score_width, int64_t k) {
  return jax_flashmla::TopkScratchWidth(score_width, k);
}

// cudaGetErrorString, for the message of a failed launch.
const char* jax_flashmla_error_string(int error) {
  return cudaGetErrorString(static_cast<cudaError_t>(error));
}

}  // extern "C"
