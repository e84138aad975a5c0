// The kernels of index_topk.h.
#include "index_topk.h"

#include <cooperative_groups.h>
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include <cstdint>
#include <map>
#include <mutex>
#include <utility>

#include "layouts.h"

namespace jax_flashmla {
namespace {

// The index-key cache's page (layouts.h) as int: the kernels index in 32-bit arithmetic.
constexpr int kTokens = static_cast<int>(kPageTokens);
constexpr int kDim = static_cast<int>(kIndexKeyDim);  // an index key's e4m3 values, bytes
constexpr int kKeyBytes = static_cast<int>(kIndexPageValuesBytes);  // a page's values, then
constexpr int kPageBytes = static_cast<int>(kIndexPageBytes);       // their float32 scales
constexpr int kHeadChunk = 64;  // heads per wgmma (its N); q is padded with zero heads
static_assert(kIndexMaxHeads % kHeadChunk == 0, "the most heads fill whole chunks");
constexpr int kScoreThreads = 128;  // one warpgroup: each warp 16 of a page's 64 tokens
constexpr int kStages = 4;  // pages a block has in shared memory: one scored, three in flight
constexpr float kNegInf = -__builtin_huge_valf();

__host__ __device__ inline int64_t Min(int64_t a, int64_t b) { return a < b ? a : b; }
__host__ __device__ inline int64_t Max(int64_t a, int64_t b) { return a > b ? a : b; }

// relu that keeps NaN, as jax.nn.relu does (fmaxf(NaN, 0) would give 0), in one instruction
// (a compare and a select take two).
__device__ __forceinline__ float Relu(float x) {
  float y;
  asm("max.NaN.f32 %0, %1, 0f00000000;" : "=f"(y) : "f"(x));
  return y;
}

// The byte offset of 16-byte chunk `chunk` of 128-byte row `row` in a tile of rows stored with
// the 128-byte swizzle the wgmma descriptors below name: chunk c of row r sits at c ^ (r % 8),
// so that the 8 rows of a core matrix lie in 8 different bank groups.
__device__ __forceinline__ int Swizzled(int row, int chunk) {
  return row * kDim + ((chunk ^ (row % 8)) << 4);
}

// Copies 16 bytes from global to shared memory without holding registers (completed by
// cp.async.wait_group).
__device__ __forceinline__ void CopyAsync16(void* shared_dst, const void* global_src) {
  const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(shared_dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(global_src));
}

// A wgmma shared-memory descriptor of a K-major tile of 128-byte rows in the 128-byte swizzle
// (a 1024-byte aligned tile; 8 rows, 1024 bytes, between core matrices). Adding 2 moves it 32
// bytes (one k step of e4m3) along the rows.
__device__ __forceinline__ uint64_t TileDescriptor(const uint8_t* tile) {
  const uint64_t address = static_cast<uint32_t>(__cvta_generic_to_shared(tile));
  return ((address & 0x3FFFF) >> 4) | (uint64_t{1024 >> 4} << 32) | (uint64_t{1} << 62);
}

// d (64 keys x 64 heads, float32) = a (64 keys x 32) . b (64 heads x 32)^T + (accumulate ? d :
// 0), e4m3 from shared memory, issued by the whole warpgroup; with accumulate 0 it reads no d.
// Thread t of the warpgroup holds rows 16 (t / 32) + (t % 32) / 4 (+ 8 in d[4 j + 2..3]),
// columns 8 j + 2 (t % 4) (+ 1 in d[4 j + 1], d[4 j + 3]), j < 8.
__device__ __forceinline__ void WgmmaE4m3(float (&d)[32], uint64_t a, uint64_t b,
                                          int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, "
      "%19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]),
        "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]),
        "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "l"(a), "l"(b), "r"(accumulate));
}

// The shared memory of IndexScoresKernel, 1024-byte aligned: kStages buffers of a page's keys
// (swizzled), the row's q in chunks of kHeadChunk heads (swizzled), the buffers' key scales,
// the head weights.
struct ScoreLayout {
  uint8_t* base;
  int chunks;
  __device__ ScoreLayout(uint8_t* raw, int chunks_)
      : base(reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(raw) + 1023) &
                                        ~uintptr_t{1023})),
        chunks(chunks_) {}
  __device__ uint8_t* keys(int stage) const { return base + stage * kKeyBytes; }
  __device__ uint8_t* q(int chunk) const {
    return base + (kStages + chunk) * kKeyBytes;  // kHeadChunk * kDim == kKeyBytes
  }
  __device__ float* scales(int stage) const {
    return reinterpret_cast<float*>(q(chunks)) + stage * kTokens;
  }
  __device__ float* w() const { return scales(kStages); }
  static size_t Bytes(int chunks) {
    return 1024 + (kStages + chunks) * kKeyBytes + (kStages * kTokens +
                                                    chunks * kHeadChunk) * sizeof(float);
  }
};

// One block (a warpgroup) per row and run of pages_per_block pages: the row's q in shared
// memory, then page by page (the next ones copied while one is scored) the page's 64 tokens x
// heads logits by wgmma, each thread the relu-weighted sum over its heads of two tokens, the 4
// threads sharing a token summed by shuffles.
__global__ void __launch_bounds__(kScoreThreads)
    IndexScoresKernel(const uint8_t* q, const float* weights, int heads, int chunks,
                      const uint8_t* cache, int64_t num_pages, const int32_t* block_table,
                      int64_t max_pages, const int32_t* visible, float* scores,
                      int64_t score_width, int64_t pages_per_block) {
  extern __shared__ uint8_t shared[];
  // The top-k after it may be launched now: its blocks wait (griddepcontrol.wait) for every
  // score, and take multiprocessors only as this wave's blocks leave them.
  asm volatile("griddepcontrol.launch_dependents;");
  const ScoreLayout smem(shared, chunks);
  const int64_t row = blockIdx.x;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int group = lane / 4, in_group = lane % 4;  // a fragment's row and column pair
  float* row_scores = scores + row * score_width;
  const int64_t row_visible = Max(visible[row], 0);
  const int32_t* row_pages = block_table + row * max_pages;

  // Pages [first, scored) the row sees tokens of; the rest of the block's are -inf, as are the
  // positions past the table's pages (score_width > max_pages * 64 where k is larger).
  const int64_t first = static_cast<int64_t>(blockIdx.y) * pages_per_block;
  const int64_t last = Min(first + pages_per_block, max_pages);
  const int64_t scored = Max(first, Min(last, (row_visible + kTokens - 1) / kTokens));
  for (int64_t p = scored * kTokens + tid; p < last * kTokens; p += blockDim.x)
    row_scores[p] = kNegInf;
  if (blockIdx.y == 0)
    for (int64_t p = max_pages * kTokens + tid; p < score_width; p += blockDim.x)
      row_scores[p] = kNegInf;
  const int count = static_cast<int>(scored - first);
  if (count <= 0) return;  // uniform across the block, before any barrier

  auto in_cache = [&](int64_t j) { return row_pages[j] >= 0 && row_pages[j] < num_pages; };
  // A thread copies a page's 16-byte chunks tid + kScoreThreads n: chunk i is row i / 8's chunk
  // i % 8, and rows kScoreThreads / 8 apart (a multiple of 8) share their swizzle, so that its
  // chunks lie kCopyStride apart in the page and in the buffer alike, from one offset computed
  // once (the copies are most of a page's instructions otherwise).
  constexpr int kCopyStride = 16 * kScoreThreads;
  static_assert(kScoreThreads % 64 == 0 && kKeyBytes % kCopyStride == 0,
                "a thread's chunks share their swizzle");
  const int copy_offset = Swizzled(tid / 8, tid % 8);
  // A page outside the cache is not copied: its buffer's stale bytes give scores that are
  // replaced by -inf.
  auto copy_page = [&](int64_t j, int stage) {
    if (!in_cache(j)) return;
    const uint8_t* bytes = cache + static_cast<int64_t>(row_pages[j]) * kPageBytes;
#pragma unroll
    for (int n = 0; n < kKeyBytes / kCopyStride; ++n)
      CopyAsync16(smem.keys(stage) + copy_offset + n * kCopyStride,
                  bytes + tid * 16 + n * kCopyStride);
    if (tid < kTokens * 4 / 16)
      CopyAsync16(smem.scales(stage) + tid * 4, bytes + kKeyBytes + tid * 16);
  };
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < count) copy_page(first + s, s);
    asm volatile("cp.async.commit_group;");
  }
  const uint8_t* row_q = q + row * heads * kDim;
  for (int i = tid; i < chunks * kHeadChunk * (kDim / 16); i += blockDim.x) {
    const int h = i / (kDim / 16), c = i % (kDim / 16);
    const uint4 v = h < heads ? reinterpret_cast<const uint4*>(row_q + h * kDim)[c]
                              : make_uint4(0, 0, 0, 0);
    *reinterpret_cast<uint4*>(smem.q(h / kHeadChunk) + Swizzled(h % kHeadChunk, c)) = v;
  }
  for (int h = tid; h < chunks * kHeadChunk; h += blockDim.x)
    smem.w()[h] = h < heads ? weights[row * heads + h] : 0.f;
  __syncthreads();
  // The first chunk's weights of this thread's heads (8 j + 2 in_group and the next), held.
  float2 first_weights[kHeadChunk / 8];
#pragma unroll
  for (int j = 0; j < kHeadChunk / 8; ++j)
    first_weights[j] = reinterpret_cast<const float2*>(smem.w())[4 * j + in_group];

  for (int i = 0; i < count; ++i) {
    const int stage = i % kStages;
    // This page's copies are done (all but the kStages - 2 issued after it), then made visible
    // to the wgmma's reads (the async proxy) and to every thread; every thread is past the
    // previous page, so that its buffer can be refilled.
    asm volatile("cp.async.wait_group %0;" ::"n"(kStages - 2) : "memory");
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    __syncthreads();
    if (i + kStages - 1 < count) copy_page(first + i + kStages - 1, (i + kStages - 1) % kStages);
    asm volatile("cp.async.commit_group;");

    float sum0 = 0.f, sum8 = 0.f;  // tokens 16 warp + group and + 8
    for (int chunk = 0; chunk < chunks; ++chunk) {
      float d[32];  // the first wgmma (ks 0) writes it without reading it
      const uint64_t a = TileDescriptor(smem.keys(stage)), b = TileDescriptor(smem.q(chunk));
      asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
      for (int ks = 0; ks < kDim / 32; ++ks) WgmmaE4m3(d, a + 2 * ks, b + 2 * ks, ks);
      asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
      asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
      const float2* w = reinterpret_cast<const float2*>(smem.w() + chunk * kHeadChunk) + in_group;
#pragma unroll
      for (int j = 0; j < kHeadChunk / 8; ++j) {
        const float2 wj = chunk == 0 ? first_weights[j] : w[4 * j];
        sum0 = fmaf(Relu(d[4 * j]), wj.x, sum0);
        sum0 = fmaf(Relu(d[4 * j + 1]), wj.y, sum0);
        sum8 = fmaf(Relu(d[4 * j + 2]), wj.x, sum8);
        sum8 = fmaf(Relu(d[4 * j + 3]), wj.y, sum8);
      }
    }
#pragma unroll
    for (int offset = 1; offset < 4; offset *= 2) {  // over the threads sharing the tokens
      sum0 += __shfl_xor_sync(0xffffffff, sum0, offset);
      sum8 += __shfl_xor_sync(0xffffffff, sum8, offset);
    }
    if (in_group == 0) {
      const int64_t j = first + i, base = j * kTokens;
      const int64_t seen = in_cache(j) ? Min(row_visible - base, kTokens) : 0;
      const int t = warp * 16 + group;
      const float* key_scales = smem.scales(stage);
      row_scores[base + t] = t < seen ? sum0 * key_scales[t] : kNegInf;
      row_scores[base + t + 8] = t + 8 < seen ? sum8 * key_scales[t + 8] : kNegInf;
    }
  }
}

constexpr int kTopkThreads = 512;
constexpr int kTopkWarps = kTopkThreads / 32;
constexpr int kMaxCluster = 8;  // blocks per row at most (the portable cluster size)
constexpr int kPerLane = 4;     // consecutive scores a lane reads at once
constexpr int kStep = 32 * kPerLane;  // consecutive scores a warp reads at once
constexpr int kRadixBits = 11;  // three passes over a 32-bit key: 11, 11, 10 bits
constexpr int kBins = 1 << kRadixBits;
constexpr int kBinsPerThread = kBins / kTopkThreads;
constexpr int kHeldSteps = 8;  // a block's slice of up to 16384 scores held in registers
constexpr int kCompactKeys = 4096;  // a held slice's keys still in the running, kept in shared
static_assert(kHeldSteps * kPerLane <= 32, "a lane's held keys are bits of one word");
// The scores a block holds, and so the pieces a wide row may be cut into.
constexpr int64_t kTopkPiece = int64_t{kHeldSteps} * kStep * kTopkWarps;

// A row of `width` scores may be cut into pieces where that leaves at most an eighth of it and
// the rest would need a cluster of more than 2 blocks.
__host__ __device__ inline bool ReducesTopk(int64_t width, int64_t k) {
  return width > 2 * kTopkPiece && 8 * k <= kTopkPiece;
}

// The candidates of a row of `width` scores cut into pieces: each piece's k best, the last
// piece's all where it has fewer.
__host__ __device__ inline int64_t TopkCandidates(int64_t width, int64_t k) {
  const int64_t pieces = (width + kTopkPiece - 1) / kTopkPiece;
  return (pieces - 1) * k + Min(width - (pieces - 1) * kTopkPiece, k);
}

// A score as an unsigned key of the same order (totalOrder, a NaN's sign dropped first, so that
// every NaN ranks above +inf): flip the sign bit of positives, every bit of negatives.
__device__ __forceinline__ uint32_t OrderedKey(float x) {
  uint32_t bits = __float_as_uint(x);
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) bits &= 0x7FFFFFFFu;
  return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}

constexpr uint32_t kNegInfKey = 0x007FFFFFu;  // OrderedKey(-inf)

static_assert(kBinsPerThread == 4, "a thread reads its bins of each block as one uint4");

struct TopkShared {
  alignas(16) unsigned int bins[kBins];  // this block's histogram, read by the whole cluster
  int chosen_bin, above;     // the bin holding the k-th key; keys of the row in bins above it
  // Keys of this slice above the bits of the k-th key fixed so far, and matching them: in the
  // end, above the k-th key and equal to it.
  int greater, equal;
  int warp_greater[kTopkWarps], warp_equal[kTopkWarps];  // the same per warp's segment
  // A held slice's keys at or above the bits fixed after a pass, and their positions, in
  // position order, where they fit (TopkPositionsKernel); count of them, or -1 where the
  // slice's own are walked.
  uint32_t compact_keys[kCompactKeys];
  int32_t compact_positions[kCompactKeys];
  int compact_count;
  int warp_reached[kTopkWarps];  // of those keys, each warp's
  union {
    typename cub::BlockScan<int, kTopkThreads>::TempStorage scan;
    typename cub::BlockReduce<int, kTopkThreads>::TempStorage reduce;
  };
};

// This lane's kPerLane keys of the scores from `start` that lie before `end` (0 past it).
__device__ __forceinline__ void LoadKeys(const float* row, int64_t start, int64_t end,
                                         uint32_t (&keys)[kPerLane]) {
  if (start + kPerLane <= end && reinterpret_cast<uintptr_t>(row + start) % 16 == 0) {
    const float4 v = *reinterpret_cast<const float4*>(row + start);
    keys[0] = OrderedKey(v.x);
    keys[1] = OrderedKey(v.y);
    keys[2] = OrderedKey(v.z);
    keys[3] = OrderedKey(v.w);
    return;
  }
#pragma unroll
  for (int e = 0; e < kPerLane; ++e) keys[e] = start + e < end ? OrderedKey(row[start + e]) : 0;
}

// out[i] = -1 for i in [from, to), by the block's threads. Not inlined: inlined in
// TopkPositionsKernel, at its 128 registers a thread, ptxas (CUDA 13.0) spilled.
__device__ __noinline__ void FillUnpicked(int32_t* out, int64_t from, int64_t to) {
  for (int64_t i = from + threadIdx.x; i < to; i += blockDim.x) out[i] = -1;
}

// Per cluster of blocks, one piece of a row: scores [part * piece, part * piece + piece) of
// row `row` of scores (rows, width), cluster blockIdx.x / blocks being piece `part` of row
// `row`. Its k best go to positions[row, part * k + i] (positions (rows, out_width)), i < k:
// their positions in the row, or index[row, position] where index (rows, width) is given, and
// with kept (rows, out_width) given their scores too. A piece of no more than k scores keeps
// every one, then -1 up to out_width. Without kept (the last pass) a -inf score, which marks
// a position the row does not see, is never taken: the row's picks above -inf, then -1.
//
// The blocks of a cluster (those that hold the piece's scores in registers, as many as fit
// the clusters in one wave, up to kMaxCluster) each take one slice of the piece, each of their
// warps one segment of the slice. A radix select finds the k-th largest key, most significant
// bits first: per pass each block counts the keys of its slice that share the bits fixed so
// far, and every block sums the cluster's counts (read from the others' shared memory) to fix
// the next bits. Then each warp writes its segment's keys above the k-th and, of those equal
// to it, the first ones, in position order, after the earlier segments' and slices'.
__global__ void __launch_bounds__(kTopkThreads)
    TopkPositionsKernel(const float* scores, const int32_t* index, int64_t width, int64_t piece,
                        int64_t k, int32_t* positions, float* kept, int64_t out_width) {
  namespace cg = cooperative_groups;
  // Launched as the scoring's programmatic dependent: every score written and visible first.
  asm volatile("griddepcontrol.wait;" ::: "memory");
  __shared__ TopkShared shared;
  cg::cluster_group cluster = cg::this_cluster();
  const int blocks = static_cast<int>(cluster.num_blocks());
  const int rank = static_cast<int>(cluster.block_rank());
  const int64_t pieces = (width + piece - 1) / piece, cluster_id = blockIdx.x / blocks;
  const int64_t row = cluster_id / pieces, part = cluster_id % pieces;
  const int64_t lo = part * piece, hi = Min(lo + piece, width), length = hi - lo;
  const float* row_scores = scores + row * width;
  const int64_t out_start = row * out_width + part * k, take = Min(k, out_width - part * k);
  // Output i holds position p (of this row).
  auto emit = [&](int64_t i, int64_t p) {
    positions[out_start + i] = index != nullptr ? index[row * width + p] : static_cast<int32_t>(p);
    if (kept != nullptr) kept[out_start + i] = row_scores[p];
  };
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  // A cluster of one block (the pieces' launch) syncs as a block: the cluster barrier costs
  // more.
  auto sync_cluster = [&] {
    if (blocks == 1) __syncthreads();
    else cluster.sync();
  };

  if (length <= k) {  // uniform across the cluster: no block waits on another
    if (rank != 0) return;
    int64_t placed = 0;  // of the scores before i, those taken
    for (int64_t first = 0; first < length; first += blockDim.x) {
      const int64_t i = first + tid;
      const int keep =
          i < length && (kept != nullptr || OrderedKey(row_scores[lo + i]) > kNegInfKey);
      int before = 0, total = 0;
      cub::BlockScan<int, kTopkThreads>(shared.scan).ExclusiveSum(keep, before, total);
      if (keep) emit(placed + before, lo + i);
      placed += total;
      __syncthreads();  // the scan's storage is reused
    }
    for (int64_t i = placed + tid; i < take; i += blockDim.x) positions[out_start + i] = -1;
    return;
  }
  constexpr int64_t kSliceUnit = kTopkWarps * kStep;
  const int64_t slice = (length + blocks * kSliceUnit - 1) / (blocks * kSliceUnit) * kSliceUnit;
  const int64_t segment = slice / kTopkWarps, steps = segment / kStep;
  const int64_t slice_start = lo + Min(rank * slice, length);
  const int64_t end = Min(slice_start + slice, hi);
  const int64_t begin = Min(slice_start + warp * segment, end);  // this warp's
  const int64_t warp_end = Min(begin + segment, end);
  if (tid == 0) shared.greater = 0;

  // A slice of up to kHeldSteps steps a warp is read once and kept in registers for every
  // pass; a longer one is read again each pass.
  uint32_t held[kHeldSteps][kPerLane];
  const bool holds = steps <= kHeldSteps;
  // Positions in a row fit int32 (the callers': indexer._check_rows), and 32-bit arithmetic
  // is most of the walks' instructions.
  const int first_position = static_cast<int>(begin), last_position = static_cast<int>(warp_end);
  auto lane_start = [&](int64_t step) {
    return first_position + static_cast<int>(step) * kStep + lane * kPerLane;
  };
  if (holds) {
#pragma unroll
    for (int s = 0; s < kHeldSteps; ++s)
      if (s < steps) LoadKeys(row_scores, lane_start(s), warp_end, held[s]);
  }
  // body(start, keys): this lane's keys from position start, in position order.
  auto for_each_step = [&](auto&& body) {
    if (holds) {
#pragma unroll
      for (int s = 0; s < kHeldSteps; ++s)
        if (s < steps) body(lane_start(s), held[s]);
    } else {
      for (int64_t s = 0; s < steps; ++s) {
        uint32_t keys[kPerLane];
        LoadKeys(row_scores, lane_start(s), warp_end, keys);
        body(lane_start(s), keys);
      }
    }
  };

  // A held slice's keys that may still be among the k best (at or above the bits of the k-th
  // fixed so far) go, where they fit, into shared memory in position order after a pass: the
  // later passes and the writes walk them alone. Bit kPerLane s + e of a lane's `reach`: its key
  // e of step s is at or above `floor`.
  if (tid == 0) shared.compact_count = -1;
  auto compact = [&](uint32_t floor) {
    uint32_t reach = 0;
    int s = 0;  // the step
    for_each_step([&](int start, const uint32_t (&keys)[kPerLane]) {
#pragma unroll
      for (int e = 0; e < kPerLane; ++e)
        reach |= static_cast<uint32_t>(start + e < last_position && keys[e] >= floor)
                 << (kPerLane * s + e);
      ++s;
    });
    const int reached = __reduce_add_sync(0xffffffff, __popc(reach));
    if (lane == 0) shared.warp_reached[warp] = reached;
    __syncthreads();
    int offset = 0;  // this warp's first place
    for (int w = 0; w < warp; ++w) offset += shared.warp_reached[w];
    s = 0;
    for_each_step([&](int start, const uint32_t (&keys)[kPerLane]) {
      const uint32_t mine = (reach >> (kPerLane * s)) & ((1u << kPerLane) - 1);
      int scan = __popc(mine);  // inclusive over the warp's lanes
#pragma unroll
      for (int d = 1; d < 32; d *= 2) {
        const int other = __shfl_up_sync(0xffffffff, scan, d);
        if (lane >= d) scan += other;
      }
      int place = offset + scan - __popc(mine);
#pragma unroll
      for (int e = 0; e < kPerLane; ++e)
        if (mine & (1u << e)) {
          shared.compact_keys[place] = keys[e];
          shared.compact_positions[place++] = static_cast<int32_t>(start + e);
        }
      offset += __shfl_sync(0xffffffff, scan, 31);
      ++s;
    });
    if (warp == kTopkWarps - 1 && lane == 31) shared.compact_count = offset;
  };

  uint32_t prefix = 0, mask = 0;  // the bits of the k-th key fixed so far
  int64_t remaining = k;          // of the k, those among the keys matching prefix
  for (int shift = 32 - kRadixBits; mask != 0xffffffffu;
       shift = static_cast<int>(Max(shift - kRadixBits, 0))) {
    const int bits = static_cast<int>(Min(kRadixBits, 32 - __popc(mask)));
    const uint32_t digit_mask = (1u << bits) - 1;
    for (int i = tid; i < kBins; i += blockDim.x) shared.bins[i] = 0;
    __syncthreads();
    const int compacted = shared.compact_count;  // -1: the slice's own keys are walked
    // Plain shared atomics: aggregating equal digits first (__match_any_sync) cost more.
    if (compacted >= 0) {
      for (int i = tid; i < compacted; i += blockDim.x) {
        const uint32_t key = shared.compact_keys[i];
        if ((key & mask) == prefix) atomicAdd(&shared.bins[(key >> shift) & digit_mask], 1u);
      }
    } else {
      for_each_step([&](int start, const uint32_t (&keys)[kPerLane]) {
#pragma unroll
        for (int e = 0; e < kPerLane; ++e)
          if (start + e < last_position && (keys[e] & mask) == prefix)
            atomicAdd(&shared.bins[(keys[e] >> shift) & digit_mask], 1u);
      });
    }
    sync_cluster();  // every block's histogram is complete
    // Thread t owns bins kBins - 1 - kBinsPerThread t downwards; the row's count of each is
    // the sum over the cluster's blocks (16 bytes read from each: one request per block, where
    // 4-byte reads of the others' shared memory made the top-k wait on them); a scan gives the
    // count above them.
    const int high = kBins - 1 - kBinsPerThread * tid;
    uint4 sum = make_uint4(0, 0, 0, 0);
    for (int r = 0; r < blocks; ++r) {
      const unsigned int* bins =
          blocks == 1 ? shared.bins : cluster.map_shared_rank(shared.bins, r);
      const uint4 c = *reinterpret_cast<const uint4*>(bins + high - (kBinsPerThread - 1));
      sum = make_uint4(sum.x + c.x, sum.y + c.y, sum.z + c.z, sum.w + c.w);
    }
    const int counts[kBinsPerThread] = {static_cast<int>(sum.w), static_cast<int>(sum.z),
                                        static_cast<int>(sum.y), static_cast<int>(sum.x)};
    const int total = counts[0] + counts[1] + counts[2] + counts[3];
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
    sync_cluster();  // the cluster has read every histogram before the next pass clears them
    // This slice's keys at or above prefix: those above the k-th so far and those matching
    // the bits fixed so far (uniform across the block).
    if (holds && compacted < 0 && mask != 0xffffffffu &&
        shared.greater + shared.equal <= kCompactKeys)
      compact(prefix);
  }
  const int compacted = shared.compact_count;
  // The last pass where the k-th key is -inf: the row has fewer than k keys above -inf, which
  // are taken (each slice's are the shared.greater its passes counted); the rest of the k are
  // -1, written by the last block (uniform across the cluster; no pick lies past them).
  if (kept == nullptr && prefix == kNegInfKey) {
    remaining = 0;  // of the keys equal to the k-th (-inf), none
    if (rank == blocks - 1) {
      int64_t picked = 0;
      for (int r = 0; r < blocks; ++r)
        picked += blocks == 1 ? shared.greater : cluster.map_shared_rank(&shared.greater, r)[0];
      FillUnpicked(positions + out_start, picked, take);
    }
  }

  // Of the row, the keys above the k-th and equal to it before this slice: the earlier
  // slices' (their blocks' totals).
  int64_t greater_before = 0, equal_before = 0;
  for (int r = 0; r < rank; ++r) {
    greater_before += cluster.map_shared_rank(&shared.greater, r)[0];
    equal_before += cluster.map_shared_rank(&shared.equal, r)[0];
  }
  // Position p is taken where its key is above the k-th, or equal to it with fewer than
  // `remaining` equal ones before it; it goes to out[greater before p + min(equal before p,
  // remaining)].
  auto take_key = [&](uint32_t key, int64_t p, int64_t& g, int64_t& q) {
    if (key > prefix) {
      emit(g + Min(q, remaining), p);
      ++g;
    } else if (key == prefix) {
      if (q < remaining) emit(g + q, p);
      ++q;
    }
  };
  if (compacted >= 0) {
    // Each thread a run of the kept keys, after the earlier runs' (a block scan of greater |
    // equal << 16: the kept keys fit 16 bits).
    const int run = (compacted + kTopkThreads - 1) / kTopkThreads;
    const int first = Min(tid * run, compacted), last = Min(first + run, compacted);
    int mine = 0;
    for (int i = first; i < last; ++i) {
      const uint32_t key = shared.compact_keys[i];
      mine += (key > prefix) | ((key == prefix) << 16);
    }
    int before = 0;
    cub::BlockScan<int, kTopkThreads>(shared.scan).ExclusiveSum(mine, before);
    sync_cluster();  // no block leaves while another reads its counts
    int64_t g = greater_before + (before & 0xffff), q = equal_before + (before >> 16);
    for (int i = first; i < last; ++i)
      take_key(shared.compact_keys[i], shared.compact_positions[i], g, q);
    return;
  }
  // Each warp's counts of keys above the k-th and equal to it, in its segment; its keys go
  // after this slice's earlier warps'.
  int greater = 0, equal = 0;
  for_each_step([&](int start, const uint32_t (&keys)[kPerLane]) {
#pragma unroll
    for (int e = 0; e < kPerLane; ++e) {
      greater += start + e < last_position && keys[e] > prefix;
      equal += start + e < last_position && keys[e] == prefix;
    }
  });
  greater = __reduce_add_sync(0xffffffff, greater);
  equal = __reduce_add_sync(0xffffffff, equal);
  if (lane == 0) {
    shared.warp_greater[warp] = greater;
    shared.warp_equal[warp] = equal;
  }
  sync_cluster();  // no block leaves while another reads its counts; the warps' are written
  for (int w = 0; w < warp; ++w) {
    greater_before += shared.warp_greater[w];
    equal_before += shared.warp_equal[w];
  }
  for_each_step([&](int start, const uint32_t (&keys)[kPerLane]) {
    int mine = 0;  // this lane's greater | equal << 16 (a warp's step counts fit 16 bits)
#pragma unroll
    for (int e = 0; e < kPerLane; ++e)
      mine += start + e < last_position ? (keys[e] > prefix) | ((keys[e] == prefix) << 16) : 0;
    int scan = mine;  // inclusive over the warp's lanes
#pragma unroll
    for (int offset = 1; offset < 32; offset *= 2) {
      const int other = __shfl_up_sync(0xffffffff, scan, offset);
      if (lane >= offset) scan += other;
    }
    const int step_total = __shfl_sync(0xffffffff, scan, 31), before = scan - mine;
    int64_t g = greater_before + (before & 0xffff), q = equal_before + (before >> 16);
#pragma unroll
    for (int e = 0; e < kPerLane; ++e)
      if (start + e < last_position) take_key(keys[e], start + e, g, q);
    greater_before += step_total & 0xffff;
    equal_before += step_total >> 16;
  });
}

// *value = what ask(value) gives for (device, key), asked once per process: device attributes,
// occupancy and kernel attributes are fixed per device and launch shape, and each query costs
// the host microseconds, at every launch outside a command buffer. Each call site (each Ask
// type) keeps its own answers.
template <typename Ask>
cudaError_t AskedOnce(int device, int key, int* value, Ask ask) {
  static std::mutex mutex;
  static std::map<std::pair<int, int>, int> answers;
  {
    std::lock_guard<std::mutex> lock(mutex);
    if (auto it = answers.find({device, key}); it != answers.end()) {
      *value = it->second;
      return cudaSuccess;
    }
  }
  if (cudaError_t status = ask(value); status != cudaSuccess) return status;
  std::lock_guard<std::mutex> lock(mutex);
  answers[{device, key}] = *value;
  return cudaSuccess;
}

}  // namespace

cudaError_t LaunchIndexScores(const uint8_t* q, const float* weights, int64_t rows,
                              int64_t heads, const uint8_t* cache, int64_t num_pages,
                              const int32_t* block_table, int64_t max_pages,
                              const int32_t* visible, float* scores, int64_t score_width,
                              cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  const int chunks = static_cast<int>(Max((heads + kHeadChunk - 1) / kHeadChunk, 1));
  const size_t shared_bytes = ScoreLayout::Bytes(chunks);
  int device = 0, attribute_set = 0, sms = 0, per_sm = 0;
  if (cudaError_t status = cudaGetDevice(&device); status != cudaSuccess) return status;
  // The kernel may use the shared memory of the most heads it takes, set once per device.
  if (cudaError_t status = AskedOnce(device, 0, &attribute_set, [](int* done) {
        *done = 1;
        return cudaFuncSetAttribute(
            IndexScoresKernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
            static_cast<int>(ScoreLayout::Bytes(kIndexMaxHeads / kHeadChunk)));
      });
      status != cudaSuccess)
    return status;
  // One wave of blocks: each row split into as many runs of pages as fill the GPU once with
  // the rows' blocks, so that a block's start (its q, its first copies) is paid a few times
  // per multiprocessor, not per 8 pages.
  if (cudaError_t status = AskedOnce(device, 0, &sms, [device](int* value) {
        return cudaDeviceGetAttribute(value, cudaDevAttrMultiProcessorCount, device);
      });
      status != cudaSuccess)
    return status;
  if (cudaError_t status = AskedOnce(device, chunks, &per_sm, [shared_bytes](int* value) {
        return cudaOccupancyMaxActiveBlocksPerMultiprocessor(value, IndexScoresKernel,
                                                             kScoreThreads, shared_bytes);
      });
      status != cudaSuccess)
    return status;
  const int64_t runs_per_row = Max(static_cast<int64_t>(sms) * Max(per_sm, 1) / rows, 1);
  // Pages in y: at most 65535 runs a row.
  const int64_t pages_per_block =
      Max(Max((max_pages + runs_per_row - 1) / runs_per_row, (max_pages + 65534) / 65535), 1);
  const dim3 grid(static_cast<unsigned>(rows),
                  static_cast<unsigned>(Max((max_pages + pages_per_block - 1) /
                                                pages_per_block, 1)));
  IndexScoresKernel<<<grid, kScoreThreads, shared_bytes, stream>>>(
      q, weights, static_cast<int>(heads), chunks, cache, num_pages, block_table, max_pages,
      visible, scores, score_width, pages_per_block);
  return cudaGetLastError();
}

int64_t TopkScratchWidth(int64_t score_width, int64_t k) {
  const int64_t first = ReducesTopk(score_width, k) ? TopkCandidates(score_width, k) : 0;
  const int64_t second = ReducesTopk(first, k) ? TopkCandidates(first, k) : 0;
  return 2 * (first + second);
}

cudaError_t LaunchTopkPositions(const float* scores, int64_t rows, int64_t score_width,
                                int64_t k, int32_t* positions, int32_t* scratch,
                                cudaStream_t stream) {
  if (rows == 0 || k == 0) return cudaSuccess;
  int device = 0;
  if (cudaError_t status = cudaGetDevice(&device); status != cudaSuccess) return status;
  cudaLaunchAttribute attributes[2];
  attributes[0].id = cudaLaunchAttributeClusterDimension;
  attributes[0].val.clusterDim.x = attributes[0].val.clusterDim.y =
      attributes[0].val.clusterDim.z = 1;
  // Launched before the kernel ahead of it ends (programmatic dependent launch: the scoring's
  // blocks allow it as they start): the launch's latency overlaps that kernel's tail.
  attributes[1].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attributes[1].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config = {};
  config.blockDim = dim3(kTopkThreads);
  config.stream = stream;
  config.attrs = attributes;
  config.numAttrs = 2;

  // Blocks a row's cluster takes over `width` scores: enough to hold them in registers (a
  // cluster's barriers and reads of the others' histograms cost more than a block's own passes
  // over kTopkPiece scores), fewer where every row's cluster would not run at once: at 16
  // rows, 8 blocks a row would leave one cluster to a second wave (15 clusters of 8 fit an
  // H200).
  auto cluster_blocks = [&](int64_t width, int* blocks) -> cudaError_t {
    *blocks = 1;
    while (*blocks < kMaxCluster && *blocks * kTopkPiece < width) *blocks *= 2;
    for (; *blocks > 1; *blocks /= 2) {
      attributes[0].val.clusterDim.x = *blocks;
      config.gridDim = dim3(static_cast<unsigned>(rows * *blocks));
      int active = 0;
      if (cudaError_t status = AskedOnce(device, *blocks, &active, [&config](int* value) {
            cudaLaunchConfig_t clusters_only = config;  // the query takes the cluster alone
            clusters_only.numAttrs = 1;
            return cudaOccupancyMaxActiveClusters(value, TopkPositionsKernel, &clusters_only);
          });
          status != cudaSuccess)
        return status;
      if (rows <= active) break;
    }
    attributes[0].val.clusterDim.x = *blocks;
    config.gridDim = dim3(static_cast<unsigned>(rows * *blocks));
    return cudaSuccess;
  };
  int blocks = 1;
  // Where the rows' clusters would not hold their scores, each pass of theirs would read the
  // rows again, and their slices could not be set aside in shared memory: the rows are first
  // cut into pieces of kTopkPiece scores, a block each (held), whose k best are the candidates
  // (their scores and positions, in position order, into the scratch's two halves in turn).
  // Every one of a row's k best is among its piece's, and candidates keep position order, so
  // that ties resolve as in the row.
  const float* in = scores;
  const int32_t* index = nullptr;
  int64_t width = score_width;
  const int64_t first = ReducesTopk(score_width, k) ? TopkCandidates(score_width, k) : 0;
  int32_t* halves[2] = {scratch, scratch + 2 * rows * first};
  for (int pass = 0;; ++pass) {
    if (cudaError_t status = cluster_blocks(width, &blocks); status != cudaSuccess) return status;
    if (!ReducesTopk(width, k) || blocks * kTopkPiece >= width) break;
    const int64_t candidates = TopkCandidates(width, k);
    float* kept = reinterpret_cast<float*>(halves[pass % 2]);
    int32_t* kept_positions = halves[pass % 2] + rows * candidates;
    attributes[0].val.clusterDim.x = 1;
    config.gridDim = dim3(static_cast<unsigned>(rows * ((width + kTopkPiece - 1) / kTopkPiece)));
    if (cudaError_t status = cudaLaunchKernelEx(&config, TopkPositionsKernel, in, index, width,
                                                kTopkPiece, k, kept_positions, kept, candidates);
        status != cudaSuccess)
      return status;
    in = kept;
    index = kept_positions;
    width = candidates;
  }
  return cudaLaunchKernelEx(&config, TopkPositionsKernel, in, index, width, Max(width, 1), k,
                            positions, static_cast<float*>(nullptr), k);
}

}  // namespace jax_flashmla
