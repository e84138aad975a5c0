// A plain C++ model of FlashMLA's paged MLA decode: its tile scheduler and its split-KV
// attention, for the CPU custom-call targets. It follows FlashMLA's documented semantics
// (page size 64, V = first head_dim_v columns of each cache row, bottom-right causal mask,
// natural-log LSE, +inf LSE for a query that sees no key) so that the CPU path of the very
// same custom call can stand in for the GPU one in tests.
#ifndef JAX_FLASHMLA_FFI_REFERENCE_MLA_H_
#define JAX_FLASHMLA_FFI_REFERENCE_MLA_H_

#include <cstdint>
#include <string>

#include "layouts.h"

namespace jax_flashmla {

// One metadata row: the span of work one SM part does, in units of 64-token blocks.
// end_req is inclusive; end_block is exclusive and counts blocks of end_req.
struct SchedulerRow {
  int32_t begin_req;
  int32_t end_req;
  int32_t begin_block;
  int32_t end_block;
  int32_t begin_split;        // split index of begin_req that this part produces
  int32_t first_req_is_split;  // begin_req is shared with an earlier part
  int32_t last_req_is_split;   // end_req continues in a later part
  int32_t unused;
};
static_assert(sizeof(SchedulerRow) == kMetadataFields * sizeof(int32_t));

// Splits the batch's KV blocks over num_parts SM parts, balancing blocks plus a fixed cost
// per (part, request) piece. Fills num_parts rows and num_splits (batch + 1 prefix sums of
// the number of splits of each request).
void ScheduleDecode(const int32_t* seq_lens, int64_t batch, int64_t num_parts,
                    SchedulerRow* rows, int32_t* num_splits);

// Element types of q, the cache and out. kFloat8E4M3FN is FlashMLA's FP8 decode: q and the
// cache in e4m3fn (1 sign, 4 exponent bits of bias 7, 3 mantissa bits, no infinity), each
// with a per-tensor scale, and out in bfloat16.
enum class ElementType { kBFloat16, kFloat16, kFloat8E4M3FN };

struct DecodeProblem {
  ElementType in_type;  // of q and kv_cache
  ElementType out_type;
  int64_t batch, seqlen_q, heads_q, head_dim, head_dim_v;
  int64_t num_pages, max_pages;
  int64_t num_parts;
  float softmax_scale;
  bool causal;
  // An element of q (of the cache) stands for its stored value times q_scale (k_scale): the
  // FP8 kernel's descale_q and descale_k; 1 for bfloat16 and float16.
  float q_scale = 1.f;
  float k_scale = 1.f;
};

// The value of an e4m3fn byte (NaN for 0x7f and 0xff).
float Float8E4M3FNToFloat(uint8_t bits);

// The split-KV accumulators, one row per split, as FlashMLA's: out_accum (splits, seqlen_q *
// heads_q, head_dim_v) and lse_accum (splits, seqlen_q * heads_q) float32, splits = batch +
// num_parts (at most that many splits are scheduled).
struct SplitAccumulators {
  float* out;
  float* lse;
  int64_t splits;
};

// Runs the decode. Inputs are row-major: q (batch, seqlen_q, heads_q, head_dim),
// kv_cache (num_pages, 64, 1, head_dim), block_table (batch, max_pages),
// seq_lens (batch), rows (num_parts), num_splits (batch + 1). Outputs: out
// (batch, seqlen_q, heads_q, head_dim_v) row-major, lse (batch, heads_q, seqlen_q) laid out
// as FlashMLA lays it out, seqlen_q outside heads_q (row-major (batch, seqlen_q, heads_q); the
// custom call declares that layout, custom_calls.py); the splits' partial results in `accum`.
// Returns an empty string on success, otherwise what was wrong with the inputs.
std::string DecodeReference(const DecodeProblem& p, const void* q, const void* kv_cache,
                            const int32_t* block_table, const int32_t* seq_lens,
                            const SchedulerRow* rows, const int32_t* num_splits, void* out,
                            float* lse, const SplitAccumulators& accum);

}  // namespace jax_flashmla

#endif  // JAX_FLASHMLA_FFI_REFERENCE_MLA_H_
