#include "reference_mla.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace jax_flashmla {
namespace {

// Cost, in blocks, of one (part, request) piece beyond its blocks: loading q, writing a
// partial result and combining it. Keeps the scheduler from cutting requests too finely.
constexpr int64_t kPieceOverheadBlocks = 5;

int64_t NumBlocks(int32_t seq_len) {
  return (std::max<int32_t>(seq_len, 0) + kPageTokens - 1) / kPageTokens;
}

float HalfToFloat(uint16_t bits, ElementType type) {
  if (type == ElementType::kBFloat16) {
    uint32_t word = static_cast<uint32_t>(bits) << 16;
    float value;
    std::memcpy(&value, &word, sizeof(value));
    return value;
  }
  _Float16 half;
  std::memcpy(&half, &bits, sizeof(bits));
  return static_cast<float>(half);
}

uint16_t FloatToHalf(float value, ElementType type) {
  if (type == ElementType::kBFloat16) {
    uint32_t word;
    std::memcpy(&word, &value, sizeof(word));
    if (std::isnan(value)) return 0x7fc0;
    word += 0x7fff + ((word >> 16) & 1);  // round to nearest even
    return static_cast<uint16_t>(word >> 16);
  }
  _Float16 half = static_cast<_Float16>(value);
  uint16_t bits;
  std::memcpy(&bits, &half, sizeof(bits));
  return bits;
}

// Element i of a buffer of q's or the cache's type, as a float (before any scale).
float LoadElement(const void* base, int64_t i, ElementType type) {
  if (type == ElementType::kFloat8E4M3FN)
    return Float8E4M3FNToFloat(static_cast<const uint8_t*>(base)[i]);
  return HalfToFloat(static_cast<const uint16_t*>(base)[i], type);
}

// Online-softmax state of one (query token, head) over the keys seen so far.
struct RowState {
  float max = -std::numeric_limits<float>::infinity();
  float sum = 0.f;
};

}  // namespace

float Float8E4M3FNToFloat(uint8_t bits) {
  const float sign = (bits & 0x80) ? -1.f : 1.f;
  const int exponent = (bits >> 3) & 0xf;
  const int mantissa = bits & 0x7;
  if (exponent == 0xf && mantissa == 0x7) return std::numeric_limits<float>::quiet_NaN();
  if (exponent == 0) return sign * std::ldexp(static_cast<float>(mantissa), -9);  // m/8 * 2^-6
  return sign * std::ldexp(static_cast<float>(8 + mantissa), exponent - 10);   // (1 + m/8) * 2^(e-7)
}

void ScheduleDecode(const int32_t* seq_lens, int64_t batch, int64_t num_parts,
                    SchedulerRow* rows, int32_t* num_splits) {
  int64_t total_cost = 0;
  for (int64_t r = 0; r < batch; ++r) {
    int64_t blocks = NumBlocks(seq_lens[r]);
    if (blocks > 0) total_cost += blocks + kPieceOverheadBlocks;
  }
  const int64_t payload = (total_cost + num_parts - 1) / num_parts + kPieceOverheadBlocks;

  std::vector<int32_t> splits_of(batch, 0);
  int64_t req = 0, block = 0, split = 0;
  for (int64_t part = 0; part < num_parts; ++part) {
    SchedulerRow row{};
    row.begin_req = static_cast<int32_t>(req);
    row.begin_block = static_cast<int32_t>(block);
    row.begin_split = static_cast<int32_t>(split);
    row.first_req_is_split = block > 0;
    row.end_req = row.begin_req - 1;  // empty until a piece is taken
    // The last part takes whatever is left, so no work can fall off the end.
    int64_t budget = part + 1 == num_parts ? std::numeric_limits<int64_t>::max() : payload;
    while (req < batch) {
      const int64_t blocks = NumBlocks(seq_lens[req]);
      if (blocks == 0) {
        ++req;
        continue;
      }
      const int64_t cost = blocks - block + kPieceOverheadBlocks;
      if (cost <= budget) {
        budget -= cost;
        splits_of[req] = static_cast<int32_t>(split + 1);
        row.end_req = static_cast<int32_t>(req);
        row.end_block = static_cast<int32_t>(blocks);
        row.last_req_is_split = 0;
        ++req;
        block = 0;
        split = 0;
        continue;
      }
      const int64_t take = budget - kPieceOverheadBlocks;
      if (take > 0) {
        block += take;
        row.end_req = static_cast<int32_t>(req);
        row.end_block = static_cast<int32_t>(block);
        row.last_req_is_split = 1;
        ++split;
      }
      break;
    }
    if (row.end_req < row.begin_req) row.begin_block = row.begin_split = row.first_req_is_split = 0;
    rows[part] = row;
  }
  num_splits[0] = 0;
  for (int64_t r = 0; r < batch; ++r) num_splits[r + 1] = num_splits[r] + splits_of[r];
}

std::string DecodeReference(const DecodeProblem& p, const void* q, const void* kv_cache,
                            const int32_t* block_table, const int32_t* seq_lens,
                            const SchedulerRow* rows, const int32_t* num_splits, void* out,
                            float* lse, const SplitAccumulators& accum) {
  const int64_t rows_per_req = p.seqlen_q * p.heads_q;  // (query token, head) pairs
  const int64_t total_splits = num_splits[p.batch];
  for (int64_t r = 0; r < p.batch; ++r) {
    if (seq_lens[r] < 0 || seq_lens[r] > p.max_pages * kPageTokens)
      return "seq_lens[" + std::to_string(r) + "] = " + std::to_string(seq_lens[r]) +
             " is outside [0, max_pages * 64 = " + std::to_string(p.max_pages * kPageTokens) +
             "]";
    if (num_splits[r + 1] < num_splits[r])
      return "num_splits is not a non-decreasing prefix sum; was it computed for these seq_lens?";
  }
  if (num_splits[0] != 0 || total_splits > accum.splits)
    return "num_splits schedules " + std::to_string(total_splits) + " splits from " +
           std::to_string(num_splits[0]) + "; at most batch + num_sm_parts = " +
           std::to_string(accum.splits) + " from 0 fit; was it computed for these seq_lens?";
  // Partial results of every split: normalised output and LSE per (query token, head).
  float* part_out = accum.out;
  float* part_lse = accum.lse;
  std::fill(part_out, part_out + total_splits * rows_per_req * p.head_dim_v, 0.f);
  std::fill(part_lse, part_lse + total_splits * rows_per_req,
            -std::numeric_limits<float>::infinity());
  std::vector<float> q_row(p.head_dim), key(kPageTokens * p.head_dim);
  std::vector<float> q_req(rows_per_req * p.head_dim);
  std::vector<RowState> state(rows_per_req);
  std::vector<float> acc(rows_per_req * p.head_dim_v);

  // Each request's pieces must cover its blocks in order, each split computed once: else the
  // metadata was made for other lengths, and some keys would be left out.
  std::vector<int64_t> covered(p.batch, 0);
  std::vector<char> computed(total_splits, 0);
  for (int64_t part = 0; part < p.num_parts; ++part) {
    const SchedulerRow& row = rows[part];
    if (row.begin_req < 0 || row.begin_req > p.batch || row.end_req >= p.batch ||
        row.end_req < row.begin_req - 1)
      return "tile_scheduler_metadata row " + std::to_string(part) +
             " names requests outside the batch (" + std::to_string(row.begin_req) + " to " +
             std::to_string(row.end_req) + ")";
    for (int64_t r = row.begin_req; r <= row.end_req; ++r) {
      const int64_t blocks = NumBlocks(seq_lens[r]);
      const int64_t first = r == row.begin_req ? row.begin_block : 0;
      const int64_t last = std::min<int64_t>(r == row.end_req ? row.end_block : blocks, blocks);
      if (first >= last) continue;
      const int64_t split = num_splits[r] + (r == row.begin_req ? row.begin_split : 0);
      if (first != covered[r] || split < num_splits[r] || split >= num_splits[r + 1] ||
          computed[split])
        return "tile_scheduler_metadata does not match num_splits and seq_lens (request " +
               std::to_string(r) + ", blocks " + std::to_string(first) + " to " +
               std::to_string(last) + "); was it computed for these seq_lens?";
      covered[r] = last;
      computed[split] = 1;

      for (int64_t i = 0; i < rows_per_req * p.head_dim; ++i)
        q_req[i] = LoadElement(q, r * rows_per_req * p.head_dim + i, p.in_type) * p.q_scale;
      std::fill(state.begin(), state.end(), RowState{});
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t b = first; b < last; ++b) {
        const int32_t page = block_table[r * p.max_pages + b];
        if (page < 0 || page >= p.num_pages)
          return "block_table[" + std::to_string(r) + ", " + std::to_string(b) + "] = " +
                 std::to_string(page) + " is not a page of the cache (num_pages = " +
                 std::to_string(p.num_pages) + ")";
        const int64_t tokens = std::min<int64_t>(kPageTokens, seq_lens[r] - b * kPageTokens);
        for (int64_t t = 0; t < tokens * p.head_dim; ++t)
          key[t] =
              LoadElement(kv_cache, page * kPageTokens * p.head_dim + t, p.in_type) * p.k_scale;
        for (int64_t qi = 0; qi < p.seqlen_q; ++qi) {
          const int64_t visible = p.causal ? seq_lens[r] - p.seqlen_q + qi + 1 : seq_lens[r];
          const int64_t n = std::min<int64_t>(tokens, visible - b * kPageTokens);
          for (int64_t h = 0; h < p.heads_q; ++h) {
            const int64_t idx = qi * p.heads_q + h;
            const float* qv = &q_req[idx * p.head_dim];
            float* a = &acc[idx * p.head_dim_v];
            for (int64_t t = 0; t < n; ++t) {
              const float* k = &key[t * p.head_dim];
              float s = 0.f;
              for (int64_t d = 0; d < p.head_dim; ++d) s += qv[d] * k[d];
              s *= p.softmax_scale;
              RowState& st = state[idx];
              const float new_max = std::max(st.max, s);
              const float rescale = std::exp(st.max - new_max);
              const float w = std::exp(s - new_max);
              st.sum = st.sum * rescale + w;
              for (int64_t d = 0; d < p.head_dim_v; ++d) a[d] = a[d] * rescale + w * k[d];
              st.max = new_max;
            }
            // FlashMLA multiplies the keys the causal mask hides from this query by a weight
            // of 0, so a NaN in their V columns reaches this query's out (0 * NaN).
            for (int64_t t = std::max<int64_t>(n, 0); t < tokens; ++t)
              for (int64_t d = 0; d < p.head_dim_v; ++d) a[d] += 0.f * key[t * p.head_dim + d];
          }
        }
      }
      for (int64_t idx = 0; idx < rows_per_req; ++idx) {
        const RowState& st = state[idx];
        // As FlashMLA: a piece that saw no key of this query, or whose sum is NaN (a NaN
        // score), keeps lse -inf and its unnormalised out (0, or NaN).
        const bool no_weight = st.sum == 0.f || std::isnan(st.sum);
        float* o = &part_out[(split * rows_per_req + idx) * p.head_dim_v];
        const float inv_sum = no_weight ? 1.f : 1.f / st.sum;
        for (int64_t d = 0; d < p.head_dim_v; ++d) o[d] = acc[idx * p.head_dim_v + d] * inv_sum;
        if (!no_weight) part_lse[split * rows_per_req + idx] = st.max + std::log(st.sum);
      }
    }
  }

  for (int64_t r = 0; r < p.batch; ++r)
    if (covered[r] != NumBlocks(seq_lens[r]))
      return "tile_scheduler_metadata covers " + std::to_string(covered[r]) + " of the " +
             std::to_string(NumBlocks(seq_lens[r])) + " blocks of request " + std::to_string(r) +
             " (seq_lens[" + std::to_string(r) + "] = " + std::to_string(seq_lens[r]) +
             "); was it computed for these seq_lens?";

  // Combine the splits of each request through their LSEs.
  std::vector<float> combined(p.head_dim_v);
  for (int64_t r = 0; r < p.batch; ++r) {
    for (int64_t qi = 0; qi < p.seqlen_q; ++qi) {
      for (int64_t h = 0; h < p.heads_q; ++h) {
        const int64_t idx = qi * p.heads_q + h;
        float max_lse = -std::numeric_limits<float>::infinity();
        for (int64_t s = num_splits[r]; s < num_splits[r + 1]; ++s)
          max_lse = std::max(max_lse, part_lse[s * rows_per_req + idx]);
        std::fill(combined.begin(), combined.end(), 0.f);
        float row_lse = std::numeric_limits<float>::infinity();  // FlashMLA: no key seen
        const bool seen = max_lse != -std::numeric_limits<float>::infinity();
        float weight_sum = 0.f;
        // Splits of weight 0 still add 0 * out: a NaN out stays NaN, as in FlashMLA.
        for (int64_t s = num_splits[r]; s < num_splits[r + 1]; ++s) {
          const float w = seen ? std::exp(part_lse[s * rows_per_req + idx] - max_lse) : 0.f;
          weight_sum += w;
          const float* o = &part_out[(s * rows_per_req + idx) * p.head_dim_v];
          for (int64_t d = 0; d < p.head_dim_v; ++d) combined[d] += w * o[d];
        }
        if (seen) {
          for (float& c : combined) c /= weight_sum;
          row_lse = max_lse + std::log(weight_sum);
        }
        uint16_t* dst = static_cast<uint16_t*>(out) + (r * rows_per_req + idx) * p.head_dim_v;
        for (int64_t d = 0; d < p.head_dim_v; ++d) dst[d] = FloatToHalf(combined[d], p.out_type);
        lse[(r * p.seqlen_q + qi) * p.heads_q + h] = row_lse;  // FlashMLA's layout
      }
    }
  }
  return "";
}

}  // namespace jax_flashmla
