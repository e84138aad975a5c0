// The kernels of index_topk.h.
#include "index_topk.h"

#include <cooperative_groups.h>
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include <cstdint>

namespace jax_flashmla {
namespace {

constexpr int kPageTokens = 64;
constexpr int kDim = 128;                                 // an index key's e4m3 values
constexpr int kPageBytes = kPageTokens * (kDim + 4);      // 8448: values, then scales
// Shared rows padded from 128 to 144 bytes: the 8 rows of one mma fragment then start in 8
// different banks, so that its 32 four-byte loads hit 32 banks.
constexpr int kRowStride = kDim + 16;
constexpr int kScoreWarps = 4;  // 16 of a page's 64 tokens each
constexpr int kPagesPerBlock = 8;
constexpr int kStages = 4;  // pages a block has in shared memory: one scored, three in flight
constexpr int kChunkTiles = 8;  // tiles of 8 heads whose q a lane holds at once
constexpr float kNegInf = -__builtin_huge_valf();

__host__ __device__ inline int64_t Min(int64_t a, int64_t b) { return a < b ? a : b; }
__host__ __device__ inline int64_t Max(int64_t a, int64_t b) { return a > b ? a : b; }

// A 16 x 8 tile of q . k over 32 columns: a (16 heads x 32) and b (32 x 8 tokens) as e4m3,
// accumulated in float32 by the tensor cores.
__device__ __forceinline__ void MmaE4m3(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                        uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// relu that keeps NaN, as jax.nn.relu does (fmaxf(NaN, 0) would give 0).
__device__ __forceinline__ float Relu(float x) { return x < 0.f ? 0.f : x; }

__device__ __forceinline__ uint32_t Load32(const uint8_t* p) {
  return *reinterpret_cast<const uint32_t*>(p);
}

// Copies 16 bytes from global to shared memory without holding registers (completed by
// cp.async.wait_group).
__device__ __forceinline__ void CopyAsync16(void* shared_dst, const void* global_src) {
  const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(shared_dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(global_src));
}

// The shared memory of IndexScoresKernel: the row's q rows, kStages buffers of a page's key
// rows (one read while the next pages' copies are in flight), the head weights, the buffers'
// key scales.
struct ScoreLayout {
  uint8_t* base;
  int heads_padded;
  __device__ uint8_t* q_rows() const { return base; }
  __device__ uint8_t* keys(int stage) const {
    return base + (heads_padded + stage * kPageTokens) * kRowStride;
  }
  __device__ float* w() const {
    return reinterpret_cast<float*>(base + (heads_padded + kStages * kPageTokens) * kRowStride);
  }
  __device__ float* scales(int stage) const { return w() + heads_padded + stage * kPageTokens; }
  static size_t Bytes(int heads_padded) {
    return (heads_padded + kStages * kPageTokens) * (kRowStride + sizeof(float));
  }
};

// One block per (row, kPagesPerBlock pages): the row's q in shared memory, then in each lane's
// registers as mma operands; page by page (the next ones copied while one is scored) each warp
// a quarter of the page's 64 tokens x heads logits, their relu-weighted sum over heads kept in
// the lanes.
__global__ void __launch_bounds__(kScoreWarps * 32, 3)
    IndexScoresKernel(const uint8_t* q, const float* weights, int heads, int heads_padded,
                      const uint8_t* cache, int64_t num_pages, const int32_t* block_table,
                      int64_t max_pages, const int32_t* visible, float* scores,
                      int64_t score_width) {
  extern __shared__ __align__(16) uint8_t shared[];
  const ScoreLayout smem{shared, heads_padded};
  const int64_t row = blockIdx.x;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int group = lane / 4, in_group = lane % 4;  // an mma fragment's row and column pair
  float* row_scores = scores + row * score_width;
  const int64_t row_visible = visible[row];
  const int32_t* row_pages = block_table + row * max_pages;
  // Tokens of page j the row sees (0 where its table entry names no page of the cache).
  auto seen = [&](int64_t j) -> int64_t {
    const int64_t page = row_pages[j];
    if (page < 0 || page >= num_pages) return 0;
    return Min(Max(row_visible - j * kPageTokens, 0), kPageTokens);
  };
  auto copy_page = [&](int64_t j, int buffer) {
    const uint8_t* bytes = cache + static_cast<int64_t>(row_pages[j]) * kPageBytes;
    for (int i = tid; i < kPageTokens * (kDim / 16); i += blockDim.x)
      CopyAsync16(smem.keys(buffer) + (i / (kDim / 16)) * kRowStride + (i % (kDim / 16)) * 16,
                  bytes + i * 16);
    if (tid < kPageTokens * 4 / 16)
      CopyAsync16(smem.scales(buffer) + tid * 4, bytes + kPageTokens * kDim + tid * 16);
  };

  // The pages of this block the row sees, their copies issued kStages - 1 ahead; the others
  // are -inf.
  const int64_t first = static_cast<int64_t>(blockIdx.y) * kPagesPerBlock;
  const int64_t last = Min(first + kPagesPerBlock, max_pages);
  int64_t ready[kPagesPerBlock];
  int count = 0;
  for (int64_t j = first; j < last; ++j) {
    if (seen(j) > 0) {
      ready[count++] = j;
    } else if (tid < kPageTokens) {
      row_scores[j * kPageTokens + tid] = kNegInf;
    }
  }
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < count) copy_page(ready[s], s);
    asm volatile("cp.async.commit_group;");
  }

  const uint8_t* row_q = q + row * heads * kDim;
  for (int i = tid; i < heads_padded * (kDim / 16); i += blockDim.x) {
    const int h = i / (kDim / 16), chunk = i % (kDim / 16);
    const uint4 v = h < heads ? reinterpret_cast<const uint4*>(row_q + h * kDim)[chunk]
                              : make_uint4(0, 0, 0, 0);
    *reinterpret_cast<uint4*>(smem.q_rows() + h * kRowStride + chunk * 16) = v;
  }
  for (int h = tid; h < heads_padded; h += blockDim.x)
    smem.w()[h] = h < heads ? weights[row * heads + h] : 0.f;
  // The positions past the table's pages (score_width > max_pages * 64 where k is larger).
  if (blockIdx.y == 0)
    for (int64_t p = max_pages * kPageTokens + tid; p < score_width; p += blockDim.x)
      row_scores[p] = kNegInf;
  __syncthreads();

  // This lane's mma operands of q (b: 8 heads x 32 columns a tile) and its heads' weights,
  // kChunkTiles tiles of 8 heads at a time: kept in registers over every page where the heads
  // fit in one chunk.
  const int head_tiles = heads_padded / 8, chunks = (head_tiles + kChunkTiles - 1) / kChunkTiles;
  uint32_t b[kChunkTiles][kDim / 32][2];
  float w[kChunkTiles][2];
  auto load_heads = [&](int chunk) {
#pragma unroll
    for (int n = 0; n < kChunkTiles; ++n) {
      const int tile = min(chunk * kChunkTiles + n, head_tiles - 1);
      const uint8_t* q_row = smem.q_rows() + (tile * 8 + group) * kRowStride + in_group * 4;
#pragma unroll
      for (int ks = 0; ks < kDim / 32; ++ks) {
        b[n][ks][0] = Load32(q_row + ks * 32);
        b[n][ks][1] = Load32(q_row + ks * 32 + 16);
      }
      w[n][0] = smem.w()[tile * 8 + 2 * in_group];
      w[n][1] = smem.w()[tile * 8 + 2 * in_group + 1];
    }
  };
  if (chunks == 1) load_heads(0);

  for (int i = 0; i < count; ++i) {
    const int buffer = i % kStages;
    if (i + kStages - 1 < count) copy_page(ready[i + kStages - 1], (i + kStages - 1) % kStages);
    asm volatile("cp.async.commit_group;");
    // All but the kStages - 1 copies issued after this page's.
    asm volatile("cp.async.wait_group %0;" ::"n"(kStages - 1) : "memory");
    __syncthreads();
    const int64_t base = ready[i] * kPageTokens, page_seen = seen(ready[i]);

    // Warp w scores tokens [16 w, 16 w + 16): the keys are the mma's rows, the heads its
    // columns, so that the sum over heads stays in each lane but for the 4 lanes sharing a
    // token.
    const uint8_t* k0 = smem.keys(buffer) + (warp * 16 + group) * kRowStride + in_group * 4;
    const uint8_t* k8 = k0 + 8 * kRowStride;
    uint32_t a[kDim / 32][4];
#pragma unroll
    for (int ks = 0; ks < kDim / 32; ++ks) {
      a[ks][0] = Load32(k0 + ks * 32);
      a[ks][1] = Load32(k8 + ks * 32);
      a[ks][2] = Load32(k0 + ks * 32 + 16);
      a[ks][3] = Load32(k8 + ks * 32 + 16);
    }
    float sum0 = 0.f, sum8 = 0.f;  // tokens group and group + 8
    for (int chunk = 0; chunk < chunks; ++chunk) {
      if (chunks > 1) load_heads(chunk);
#pragma unroll
      for (int n = 0; n < kChunkTiles; ++n) {
        if (chunk * kChunkTiles + n >= head_tiles) break;
        // Each 32 columns' products summed by the tensor cores, which keep fewer bits than
        // float32 between additions; the four partial sums added here in float32.
        float dot[4] = {};
#pragma unroll
        for (int ks = 0; ks < kDim / 32; ++ks) {
          float part[4] = {};
          MmaE4m3(part, a[ks], b[n][ks][0], b[n][ks][1]);
#pragma unroll
          for (int c = 0; c < 4; ++c) dot[c] += part[c];
        }
        // dot: tokens group and group + 8, heads 8 n + 2 in_group + {0, 1}.
        sum0 += Relu(dot[0]) * w[n][0] + Relu(dot[1]) * w[n][1];
        sum8 += Relu(dot[2]) * w[n][0] + Relu(dot[3]) * w[n][1];
      }
    }
#pragma unroll
    for (int offset = 1; offset < 4; offset *= 2) {  // over the lanes sharing the tokens
      sum0 += __shfl_xor_sync(0xffffffff, sum0, offset);
      sum8 += __shfl_xor_sync(0xffffffff, sum8, offset);
    }
    if (in_group == 0) {
      const int t = warp * 16 + group;
      const float* scales = smem.scales(buffer);
      row_scores[base + t] = t < page_seen ? sum0 * scales[t] : kNegInf;
      row_scores[base + t + 8] = t + 8 < page_seen ? sum8 * scales[t + 8] : kNegInf;
    }
    __syncthreads();  // this buffer is read before it is refilled
  }
}

constexpr int kTopkThreads = 512;
constexpr int kCluster = 8;     // blocks per row, one slice of it each
constexpr int kPerThread = 4;   // consecutive scores a thread reads at once
constexpr int kTile = kTopkThreads * kPerThread;
constexpr int kRadixBits = 11;  // three passes over a 32-bit key: 11, 11, 10 bits
constexpr int kBins = 1 << kRadixBits;
constexpr int kBinsPerThread = kBins / kTopkThreads;
constexpr int kHeldTiles = 8;  // a slice of up to 16384 scores (a 131072-token row) in registers

// A score as an unsigned key of the same order (totalOrder): flip the sign bit of positives,
// every bit of negatives.
__device__ __forceinline__ uint32_t OrderedKey(float x) {
  const uint32_t bits = __float_as_uint(x);
  return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}

struct TopkShared {
  unsigned int bins[kBins];  // this block's histogram of its slice, read by the whole cluster
  int chosen_bin, above;     // the bin holding the k-th key; keys of the row in bins above it
  int greater, equal;        // keys of this slice above the k-th key, and equal to it
  union {
    typename cub::BlockScan<int, kTopkThreads>::TempStorage scan;
    typename cub::BlockReduce<int, kTopkThreads>::TempStorage reduce;
  };
};

// The first of this thread's kPerThread positions in tile `tile` of a slice from `begin`.
__device__ __forceinline__ int64_t TileStart(int64_t begin, int64_t tile) {
  return begin + tile * kTile + static_cast<int64_t>(threadIdx.x) * kPerThread;
}

// This thread's kPerThread keys of tile `tile` of [begin, end) (0 past end).
__device__ __forceinline__ void LoadTile(const float* row, int64_t begin, int64_t end,
                                         int64_t tile, uint32_t (&keys)[kPerThread]) {
  const int64_t start = TileStart(begin, tile);
  if (start + kPerThread <= end && reinterpret_cast<uintptr_t>(row + start) % 16 == 0) {
    const float4 v = *reinterpret_cast<const float4*>(row + start);
    keys[0] = OrderedKey(v.x);
    keys[1] = OrderedKey(v.y);
    keys[2] = OrderedKey(v.z);
    keys[3] = OrderedKey(v.w);
    return;
  }
#pragma unroll
  for (int e = 0; e < kPerThread; ++e) keys[e] = start + e < end ? OrderedKey(row[start + e]) : 0;
}

// A cluster of kCluster blocks per row, each over one slice of it. A radix select finds the
// k-th largest key, most significant bits first: per pass each block counts the keys of its
// slice that share the bits fixed so far, and every block sums the cluster's counts (read from
// the others' shared memory) to fix the next bits. Then each block writes its slice's keys
// above the k-th and, of those equal to it, the first ones, in position order, after the
// earlier slices'.
__global__ void __cluster_dims__(kCluster, 1, 1) __launch_bounds__(kTopkThreads)
    TopkPositionsKernel(const float* scores, int64_t width, int64_t k, int32_t* positions) {
  namespace cg = cooperative_groups;
  __shared__ TopkShared shared;
  cg::cluster_group cluster = cg::this_cluster();
  const int rank = static_cast<int>(cluster.block_rank());
  const int64_t row = blockIdx.x / kCluster;
  const float* row_scores = scores + row * width;
  int32_t* out = positions + row * k;
  const int tid = threadIdx.x;

  if (width <= k) {  // uniform across the cluster: no block waits on another
    if (rank == 0)
      for (int64_t i = tid; i < k; i += blockDim.x)
        out[i] = i < width ? static_cast<int32_t>(i) : -1;
    return;
  }
  const int64_t slice =
      (width + kCluster * kPerThread - 1) / (kCluster * kPerThread) * kPerThread;
  const int64_t begin = Min(rank * slice, width), end = Min(begin + slice, width);
  const int64_t tiles = (end - begin + kTile - 1) / kTile;
  if (tid == 0) shared.greater = 0;

  // A slice of up to kHeldTiles tiles is read once and kept in registers for every pass.
  uint32_t held[kHeldTiles][kPerThread];
  const bool holds = tiles <= kHeldTiles;
  if (holds) {
#pragma unroll
    for (int t = 0; t < kHeldTiles; ++t)
      if (t < tiles) LoadTile(row_scores, begin, end, t, held[t]);
  }
  auto for_each_tile = [&](auto&& body) {
    if (holds) {
#pragma unroll
      for (int t = 0; t < kHeldTiles; ++t)
        if (t < tiles) body(t, held[t]);
    } else {
      for (int64_t t = 0; t < tiles; ++t) {
        uint32_t keys[kPerThread];
        LoadTile(row_scores, begin, end, t, keys);
        body(t, keys);
      }
    }
  };

  uint32_t prefix = 0, mask = 0;  // the bits of the k-th key fixed so far
  int64_t remaining = k;          // of the k, those among the keys matching prefix
  for (int shift = 32 - kRadixBits; mask != 0xffffffffu;
       shift = static_cast<int>(Max(shift - kRadixBits, 0))) {
    const int bits = static_cast<int>(Min(kRadixBits, 32 - __popc(mask)));
    const uint32_t digit_mask = (1u << bits) - 1;
    for (int i = tid; i < kBins; i += blockDim.x) shared.bins[i] = 0;
    __syncthreads();
    // Plain shared atomics: aggregating equal digits first (__match_any_sync) cost more.
    for_each_tile([&](int64_t tile, const uint32_t (&keys)[kPerThread]) {
      const int64_t start = TileStart(begin, tile);
#pragma unroll
      for (int e = 0; e < kPerThread; ++e)
        if (start + e < end && (keys[e] & mask) == prefix)
          atomicAdd(&shared.bins[(keys[e] >> shift) & digit_mask], 1u);
    });
    cluster.sync();  // every block's histogram is complete
    // Thread t owns bins kBins - 1 - kBinsPerThread t downwards; the row's count of each is
    // the sum over the cluster's blocks; a scan gives the count above them.
    const int high = kBins - 1 - kBinsPerThread * tid;
    int counts[kBinsPerThread], total = 0;
#pragma unroll
    for (int i = 0; i < kBinsPerThread; ++i) {
      counts[i] = 0;
      for (int r = 0; r < kCluster; ++r)
        counts[i] += cluster.map_shared_rank(shared.bins, r)[high - i];
      total += counts[i];
    }
    int above = 0;
    cub::BlockScan<int, kTopkThreads>(shared.scan).ExclusiveSum(total, above);
#pragma unroll
    for (int i = 0; i < kBinsPerThread; ++i) {
      if (above < remaining && above + counts[i] >= remaining) {
        shared.chosen_bin = high - i;
        shared.above = above;
      }
      above += counts[i];
    }
    __syncthreads();
    const int chosen = shared.chosen_bin;
    // This slice's keys that pass the k-th here: those counted in bins above the chosen one.
    int mine_above = 0;
#pragma unroll
    for (int i = 0; i < kBinsPerThread; ++i)
      mine_above += high - i > chosen ? shared.bins[high - i] : 0;
    __syncthreads();  // the scan's storage is the reduction's
    mine_above = cub::BlockReduce<int, kTopkThreads>(shared.reduce).Sum(mine_above);
    if (tid == 0) {
      shared.greater += mine_above;
      shared.equal = shared.bins[chosen];
    }
    prefix |= static_cast<uint32_t>(chosen) << shift;
    mask |= digit_mask << shift;
    remaining -= shared.above;
    cluster.sync();  // the cluster has read every histogram before the next pass clears them
  }

  // This slice's place in the row's selection: after the earlier slices' keys above the k-th
  // and their share of the `remaining` equal ones.
  int64_t greater_before = 0, equal_before = 0;
  for (int r = 0; r < rank; ++r) {
    greater_before += cluster.map_shared_rank(&shared.greater, r)[0];
    equal_before += cluster.map_shared_rank(&shared.equal, r)[0];
  }
  cluster.sync();  // no block leaves while another reads its counts
  const int64_t equal_left = Max(remaining - equal_before, 0);
  int64_t written = greater_before + Min(equal_before, remaining), equal_seen = 0;
  for_each_tile([&](int64_t tile, const uint32_t (&keys)[kPerThread]) {
    const int64_t start = TileStart(begin, tile);
    int greater = 0, equal = 0;
#pragma unroll
    for (int e = 0; e < kPerThread; ++e) {
      greater += start + e < end && keys[e] > prefix;
      equal += start + e < end && keys[e] == prefix;
    }
    // Packed: counts of a tile fit in 16 bits (kTile <= 4096).
    int before = 0, total = 0;
    cub::BlockScan<int, kTopkThreads>(shared.scan).ExclusiveSum(greater | (equal << 16), before,
                                                                total);
    __syncthreads();  // the scan's storage is reused by the next tile's
    const int64_t left = Max(equal_left - equal_seen, 0);
    int64_t greater_here = before & 0xffff, equal_here = before >> 16;
#pragma unroll
    for (int e = 0; e < kPerThread; ++e) {
      if (start + e >= end) continue;
      const bool is_greater = keys[e] > prefix, is_equal = keys[e] == prefix;
      if (is_greater || (is_equal && equal_here < left))
        out[written + greater_here + Min(equal_here, left)] = static_cast<int32_t>(start + e);
      greater_here += is_greater;
      equal_here += is_equal;
    }
    written += (total & 0xffff) + Min(total >> 16, left);
    equal_seen += total >> 16;
  });
}

}  // namespace

cudaError_t LaunchIndexScores(const uint8_t* q, const float* weights, int64_t rows,
                              int64_t heads, const uint8_t* cache, int64_t num_pages,
                              const int32_t* block_table, int64_t max_pages,
                              const int32_t* visible, float* scores, int64_t score_width,
                              cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  const int heads_padded = static_cast<int>((heads + 7) / 8 * 8);
  const size_t shared_bytes = ScoreLayout::Bytes(heads_padded);
  if (shared_bytes > 48 * 1024) {
    if (cudaError_t status = cudaFuncSetAttribute(
            IndexScoresKernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
            static_cast<int>(shared_bytes));
        status != cudaSuccess)
      return status;
  }
  // Rows in x (up to 2**31 - 1 blocks), pages in y (65535 blocks: 33M tokens a row).
  const dim3 grid(static_cast<unsigned>(rows),
                  static_cast<unsigned>(Max((max_pages + kPagesPerBlock - 1) /
                                                     kPagesPerBlock, 1)));
  IndexScoresKernel<<<grid, kScoreWarps * 32, shared_bytes, stream>>>(
      q, weights, static_cast<int>(heads), heads_padded, cache, num_pages, block_table,
      max_pages, visible, scores, score_width);
  return cudaGetLastError();
}

cudaError_t LaunchTopkPositions(const float* scores, int64_t rows, int64_t score_width,
                                int64_t k, int32_t* positions, cudaStream_t stream) {
  if (rows == 0 || k == 0) return cudaSuccess;
  TopkPositionsKernel<<<static_cast<unsigned>(rows * kCluster), kTopkThreads, 0, stream>>>(
      scores, score_width, k, positions);
  return cudaGetLastError();
}

}  // namespace jax_flashmla
