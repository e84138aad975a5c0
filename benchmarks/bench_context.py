"""Per-layer decode time and cache bytes per token against the context: the dense MLA layer
(DeepSeek-V3), V3.2's sparse layer and DeepSeek-V4's three layer types, at contexts of 8k, 128k
and 1M tokens, b = 1 and 16.

What is timed: one layer's attention for one new token a request, over caches already holding
`context` tokens a request (the new token's included), as one jitted call; the ops alone, not the
Flax layers' projections or cache writes (which do not grow with the context), so that what
grows with the context is all that differs between the families. A family's call holds what its
layer computes between its projections and its output projection:
  dense_bf16  jax_flashmla.mla_decode over a bf16 PagedKVCache, 128 heads, its metadata made once
              outside the call (a serving step makes one for all its layers);
  dense_fp8   the same over the FP8 cache (576 bytes a token, one scale per tensor);
  v32         V3.2: indexer_decode (64 heads, the top 2048 over every token's index key) then
              sparse_mla_decode over those 2048 on the 656-byte cache, 128 heads;
  v4_hca      V4's HCA layer: sparse_mla_decode over all context / 128 compressed entries and the
              128-token window, 64 heads, a sink per head (entry and window slots computed in the
              call from the tables, as V4Attention.decode computes them);
  v4_csa      V4's CSA layer: v4_indexer_select (64 heads over the context / 4 entries' index
              keys, the top 512) then the sparse decode over those 512 entries and the window;
  v4_sliding  V4's sliding layer: the sparse decode over the window alone.
The caches are synthesised, never prefilled: pages of random rows quantized to each layout (the
first base_pages (1024) pages, repeated: what a page holds does not change what reading it
costs), each request's pages in a random order. A served model's layer finds little of its
cache in the L2 (the other layers ran since its last call), so a layer's caches under
evict_bytes (128 MiB, over twice the 50 MB L2 of an H100 or H200) are copied until the copies
pass it, and the calls take the copies in turn.

Timing (benchmarks/timing.py time_in_turns): batches of calls back to back, then one sync; µs
per call the median batch's: the host's dispatch wherever the GPU runs a call faster than the
host launches one. On a GPU also the device time (benchmarks/device_time.py): calls queued
behind a spinning kernel, from its end to the last call's end, the GPU's time per call without
the host's. Points run one at a time, the family's caches freed before the next; a point whose
caches would not fit in the device's free memory is skipped with the reason recorded.

Bytes per token (per request, per layer) from the layouts: the pages the layer's caches take
for `context` tokens (dense 1152 or 576 a token; V3.2 656 and a 132-byte index key; V4 a
37,440-byte page of 64 entries, 585 an entry: the kernel's 584-byte token (576 bytes of row, 8
of scales) and a byte of the scale row's padding, plus in CSA a 132-byte index key an entry;
V4's window ring of 2 pages a request, whatever the context), beside the arrays built, divided
by their tokens, as a check; and V4's compressor states (bf16 projections, float32 biased
gates, as initial_state makes them for HF's weights), a fixed cost per request that the decode
does not read.

The report (context_report.py) says how each grows: the slope of log time (the device's where
measured) and of log bytes a token over log context between the two longest contexts (128k and
1M), in words (flat, sublinear, ~linear; bytes falling ~1/context where a fixed cost dominates).

Indexer points: the indexer call alone, 64 index heads, one new token a request, over `entries`
index keys a request (65,536 to 1,048,576; b = 16 and 64), against its HBM floor (the b *
entries * 132 bytes of index keys it must read, over the device's peak bandwidth; the report
holds the table and the bar):
  v32_indexer  indexer_decode, the top 2048 over an IndexKeyCache of `entries` tokens a request;
  v4_indexer   v4_indexer_select, the top 512 of `entries` compressed entries (ratio 4: start =
               4 * entries sees them all, seq_len 1).
Each is timed as a layer is, and on a GPU its device time is split by a trace of its own into
the custom call's two kernels (ffi/index_topk.cu): the scoring (IndexScoresKernel) and the
top-k (TopkPositionsKernel) after it (its time beside the scoring's, where its launch overlaps
it, not counted); the rest is XLA's own kernels and the gaps between them.

  python benchmarks/bench_context.py --out benchmarks/results/context_h200
  python benchmarks/bench_context.py --families v32_indexer v4_indexer --out ...  # indexers
  python benchmarks/bench_context.py --tiny       # CPU: the references, small
"""
import argparse
import datetime
import functools
import itertools
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_step  # noqa: E402,F401  (first: it sets XLA's flags before JAX starts)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jax_flashmla as jf  # noqa: E402
from jax_flashmla.caches import fp8  # noqa: E402
from jax_flashmla.caches.compressor_state import CompressorState  # noqa: E402
from jax_flashmla.caches.index_keys import INDEX_HEAD_DIM, quantize_index_keys  # noqa: E402
from jax_flashmla.caches.index_keys import PAGE_BYTES as INDEX_PAGE_BYTES  # noqa: E402
from jax_flashmla.caches.sparse import TOKEN_BYTES as SPARSE_TOKEN_BYTES  # noqa: E402
from jax_flashmla.caches.v4 import PAGE_ROWS, ROW_BYTES, ROW_DIM, V4KVCache  # noqa: E402
from jax_flashmla.caches.v4_layer import V4LayerCache  # noqa: E402
from jax_flashmla.kernels import library as kernels  # noqa: E402
from jax_flashmla.ops.compressor import visible_entries  # noqa: E402
from jax_flashmla.ops.indexer import IndexQuery  # noqa: E402
from jax_flashmla.ops.v4_indexer import v4_indexer_select  # noqa: E402
from jax_flashmla.sparse import IndexKeyCache, indexer_decode, sparse_mla_decode  # noqa: E402

import bench_sparse  # noqa: E402
import bench_v32_decode  # noqa: E402
import bench_v4  # noqa: E402
import context_report  # noqa: E402
from bench_sparse import SOFTMAX_SCALE, random_rows  # noqa: E402
from device_time import QUEUED_CALLS, device_time_in_turns, spin_blockers, traced_calls  # noqa
from results_io import run_points  # noqa: E402
from timing import time_in_turns  # noqa: E402
from workload import D_QK, PAGE  # noqa: E402

FAMILIES = ("dense_bf16", "dense_fp8", "v32", "v4_hca", "v4_csa", "v4_sliding")
INDEXERS = tuple(context_report.INDEXER_CALLS)  # v32_indexer, v4_indexer
# The indexer's custom call launches a scoring kernel then a top-k kernel (ffi/index_topk.cu):
# a record's key -> a part of the kernel's name as the profiler gives it.
INDEXER_KERNELS = dict(scoring_us="IndexScoresKernel", topk_us="TopkPositionsKernel")
V4_PAGE_BYTES = PAGE_ROWS * ROW_BYTES  # 37,440: 64 tokens and their scale row
WINDOW = bench_v4.WINDOW
RATIO = dict(v4_hca=128, v4_csa=4)
GPU = dict(contexts=(8192, 131072, 1048576), batches=(1, 16), heads=128, v4_heads=64,
           index_heads=64, v32_topk=2048, csa_topk=bench_v4.CSA_TOPK, target_ms=20.0,
           repeats=5, device_repeats=3, evict_bytes=128 * 2**20, max_copies=2048,
           base_pages=bench_sparse.BASE_PAGES, indexer_entries=(65536, 131072, 262144, 1048576),
           indexer_batches=(16, 64))
# Small enough for CPU's references: a run is mostly its points' compiles.
TINY = dict(contexts=(256, 1024), batches=(1, 2), heads=16, v4_heads=16, index_heads=16,
            v32_topk=64, csa_topk=32, target_ms=2.0, repeats=2, device_repeats=0,
            evict_bytes=2**20, max_copies=4, base_pages=4, indexer_entries=(256, 1024),
            indexer_batches=(2,))


def _pages(tokens):
    return -(-tokens // PAGE)


def _state_bytes(*states):
    """Bytes a request of compressor states (ratio, head_dim, overlap), as initial_state makes
    them for bf16 hidden states and HF's float32 position bias."""
    shapes = [jax.eval_shape(lambda s=s: CompressorState.create(1, *s, jnp.bfloat16))
              for s in states]
    return sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(shapes))


def layout(family, context):
    """dict(cache: bytes a request of the layer's pages for `context` tokens (what the decode
    reads, with the index keys), window: of them the fixed ring, state: the compressor states'
    bytes a request, not in the pages)."""
    if family.startswith("dense"):
        token = D_QK * (2 if family == "dense_bf16" else 1)
        return dict(cache=_pages(context) * PAGE * token, window=0, state=0)
    if family == "v32":
        return dict(cache=_pages(context) * (PAGE * SPARSE_TOKEN_BYTES + INDEX_PAGE_BYTES),
                    window=0, state=0)
    ring = _pages(WINDOW) * V4_PAGE_BYTES
    if family == "v4_sliding":
        return dict(cache=ring, window=ring, state=0)
    entry_pages = max(1, _pages(context // RATIO[family]))
    if family == "v4_hca":
        return dict(cache=entry_pages * V4_PAGE_BYTES + ring, window=ring,
                    state=_state_bytes((RATIO[family], ROW_DIM, False)))
    return dict(cache=entry_pages * (V4_PAGE_BYTES + INDEX_PAGE_BYTES) + ring, window=ring,
                state=_state_bytes((RATIO[family], ROW_DIM, True),
                                   (RATIO[family], INDEX_HEAD_DIM, True)))


def _tables(rng, b, pages, copies):
    """Per copy a (b, pages) block table: the b * pages pages of a copy in one random order,
    copy c's pages after the c copies before it."""
    order = rng.permutation(b * pages).astype(np.int32).reshape(b, pages)
    return [jnp.asarray(order + c * b * pages) for c in range(copies)]


# The dense FP8 cache's one scale: its rows (random_rows') lie in [-1, 1], none saturates.
FP8_SCALE = 1 / fp8.FP8_MAX
# Makers of a cache of n pages of random rows, each compiled once (for the base's n).
BASES = dict(
    bf16=jax.jit(bench_v32_decode.dense_cache, static_argnums=0),
    fp8=jax.jit(lambda n, key: fp8.quantize(bench_v32_decode.dense_cache(n, key),
                                            jnp.float32(FP8_SCALE)), static_argnums=0),
    sparse=bench_sparse.sparse_cache,
    index=jax.jit(bench_v32_decode.index_cache, static_argnums=0),
    v4=jax.jit(lambda n, key: bench_v4.filled_cache(n, key).data, static_argnums=0))


@functools.lru_cache(maxsize=None)
def _base(kind, pages):
    return jax.block_until_ready(BASES[kind](pages, jax.random.key(list(BASES).index(kind))))


def filled(kind, pages, grid):
    """A cache array of `pages` pages of `kind`: the first base_pages (made once a run), then
    the same again; what a page holds does not change what reading it costs. One gather writes
    the cache once."""
    base = _base(kind, grid["base_pages"])
    return base[np.arange(pages) % base.shape[0]]


def _index_query(key, b, heads):
    """A decode's IndexQuery: random rows quantized as index_query quantizes them, random head
    weights times their scales."""
    rows, weights = jax.random.split(key)
    values, scales = quantize_index_keys(jax.random.normal(rows, (b, 1, heads, INDEX_HEAD_DIM)))
    return IndexQuery(values, random_rows(weights, (b, 1, heads), jnp.float32) * scales)


# The decodes' implementation: FlashMLA's kernels on a GPU (never a reference there by
# accident), else the references.
implementation = bench_sparse.sparse_implementation


def dense_inputs(family, context, b, copies, grid, keys, rng):
    pages = _pages(context)
    cache = filled(family.removeprefix("dense_"), copies * b * pages, grid)
    scale = jnp.float32(FP8_SCALE) if family == "dense_fp8" else None
    q = random_rows(next(keys), (b, 1, grid["heads"], D_QK), jnp.bfloat16)
    seq_lens = jnp.full((b,), context, jnp.int32)

    def layer(q, cache, table, seq_lens, metadata, scale):
        return jf.mla_decode(q, cache, table, seq_lens, metadata=metadata, k_scale=scale,
                             softmax_scale=SOFTMAX_SCALE, implementation=implementation())[0]
    metadata = lambda table: jf.get_mla_metadata(
        seq_lens, block_table=table, num_pages=cache.shape[0], num_heads_q=grid["heads"],
        implementation=implementation(), fp8=scale is not None)
    return layer, [(q, cache, t, seq_lens, metadata(t), scale)
                   for t in _tables(rng, b, pages, copies)], [cache]


def v32_inputs(context, b, copies, grid, keys, rng):
    pages = copies * b * _pages(context)
    sparse, index = filled("sparse", pages, grid), filled("index", pages, grid)
    q = random_rows(next(keys), (b, 1, grid["heads"], D_QK), jnp.bfloat16)
    query = _index_query(next(keys), b, grid["index_heads"])
    seq_lens = jnp.full((b,), context, jnp.int32)

    def layer(q, query, index, sparse, table, seq_lens):
        indices = indexer_decode(query, index, table, seq_lens, topk=grid["v32_topk"])
        return sparse_mla_decode(q, sparse, indices, softmax_scale=SOFTMAX_SCALE,
                                 implementation=implementation())[0]
    return layer, [(q, query, index, sparse, t, seq_lens)
                   for t in _tables(rng, b, _pages(context), copies)], [sparse, index]


def v4_inputs(family, context, b, copies, grid, keys, rng):
    """V4LayerCaches (a copy each) of b requests whose next token is at position context - 1:
    the window ring full, context // ratio entries; the call as V4Attention.decode attends."""
    window = V4KVCache(filled("v4", copies * b * _pages(WINDOW), grid))
    num_tokens = jnp.full((b,), context - 1, jnp.int32)
    fields = [dict(window=window, window_table=t, num_tokens=num_tokens)
              for t in _tables(rng, b, _pages(WINDOW), copies)]
    arrays = [window.data]
    if family != "v4_sliding":
        pages = _pages(context // RATIO[family])
        compressed = V4KVCache(filled("v4", copies * b * pages, grid))
        index = (IndexKeyCache(filled("index", copies * b * pages, grid))
                 if family == "v4_csa" else None)
        arrays += [compressed.data] + ([index.data] if index else [])
        for f, t in zip(fields, _tables(rng, b, pages, copies)):
            f.update(compressed=compressed, compressed_table=t, index_keys=index)
    q = jax.random.normal(next(keys), (b, 1, grid["v4_heads"], ROW_DIM), jnp.bfloat16)
    sink = jax.random.normal(next(keys), (grid["v4_heads"],), jnp.float32)
    query = _index_query(next(keys), b, grid["index_heads"]) if family == "v4_csa" else None

    def layer(q, sink, cache, query):
        position = cache.num_tokens
        window_indices = cache.window_slots(position[:, None] - jnp.arange(WINDOW))[:, None]
        window_length = jnp.minimum(position + 1, WINDOW)
        common = dict(attn_sink=sink, softmax_scale=bench_v4.SCALE,
                      implementation=implementation())
        if family == "v4_sliding":
            return sparse_mla_decode(q, cache.window, window_indices, topk_length=window_length,
                                     **common)[0]
        if family == "v4_hca":  # every entry seen
            ids = jnp.broadcast_to(jnp.arange(cache.entry_capacity, dtype=jnp.int32),
                                   (q.shape[0], cache.entry_capacity))
            indices = cache.entry_slots(ids)[:, None]
            length = visible_entries(position, RATIO[family])
        else:
            selection = v4_indexer_select(query, cache.index_keys, cache.compressed_table,
                                          position, jnp.ones_like(position),
                                          ratio=RATIO[family], topk=grid["csa_topk"])
            indices = selection.slots
            length = jnp.sum(selection.entries[:, 0] >= 0, axis=-1, dtype=jnp.int32)
        return sparse_mla_decode(q, cache.compressed, indices, topk_length=length,
                                 extra_kv_cache=cache.window, extra_indices=window_indices,
                                 extra_topk_length=window_length, **common)[0]
    return layer, [(q, sink, V4LayerCache(**f), query) for f in fields], arrays


def inputs(family, context, b, copies, grid, seed):
    """(layer(*args) -> out, args of each copy, the cache arrays built)."""
    keys, rng = iter(jax.random.split(jax.random.key(seed), 8)), np.random.default_rng(seed)
    if family.startswith("dense"):
        return dense_inputs(family, context, b, copies, grid, keys, rng)
    if family == "v32":
        return v32_inputs(context, b, copies, grid, keys, rng)
    return v4_inputs(family, context, b, copies, grid, keys, rng)


def needed_bytes(family, context, b, copies):
    """A bound on a point's device memory: its caches, the indexers' float32 scores four times
    over (top-k's temporaries), and 1 GiB (the bases, q, the allocator's slack)."""
    scored = dict(v32=context, v4_csa=context // RATIO["v4_csa"]).get(family, 0)
    return copies * b * layout(family, context)["cache"] + 4 * b * scored * 4 + 2**30


def free_bytes():
    """The default device's free memory, or None where it does not say (CPU)."""
    stats = jax.devices()[0].memory_stats()
    return None if not stats else stats["bytes_limit"] - stats["bytes_in_use"]


def too_big(need):
    """Why a point needing `need` bytes of device memory is skipped, or None where it fits."""
    free = free_bytes()
    if free is not None and need > free:
        return f"needs ~{need / 1e9:.1f} GB of device memory, {free / 1e9:.1f} free"
    return None


def out_finite(out):
    return dict(out_finite=bool(np.isfinite(np.asarray(out, np.float32)).all()))


def kernel_us(gpu, calls, kernels):
    """{key: µs a call} of each kernel in kernels (key -> a part of its name) among a trace's
    GPU activities over `calls` calls: the sum of its activities' durations over calls, less
    where they overlap an activity of a kernel named before it. The top-k is launched as the
    scoring's programmatic dependent: it starts, and waits, while the scoring runs."""
    split, earlier = {}, []  # earlier: (start, end) of the kernels named before
    for key, name in kernels.items():
        spans = [(e.start, e.end) for e in gpu if name in e.name]
        if not spans:
            raise RuntimeError(f"no kernel named like {name} in the trace")
        own = sum(end - start - sum(max(0, min(end, e) - max(start, s)) for s, e in earlier)
                  for start, end in spans)
        split[key] = round(own / calls / 1e3, 2)
        earlier += spans
    return split


def traced_kernel_us(call, kernels, calls=QUEUED_CALLS):
    """kernel_us of `calls` calls back to back, under a trace of their own."""
    return kernel_us(traced_calls(call, jax.block_until_ready, calls), calls, kernels)


def timed(compiled, args, family, grid, blocker, check=out_finite, kernels=None):
    """us (µs a call by wall clock, the median batch's), check(the first call's out) and, given
    a blocker, device_us (the GPU's µs a call) and, given kernels, kernel_us of those kernels,
    of compiled(*args[k]), k the next copy each call."""
    turn = itertools.count()  # every call the next copy, across batches and repeats
    call = lambda _=None: compiled(*args[next(turn) % len(args)])
    results, failed = time_in_turns({family: (call, jax.block_until_ready)},
                                    target_ms=grid["target_ms"], repeats=grid["repeats"],
                                    max_calls=4000, fitted=())
    if family in failed:
        raise failed[family]
    record = dict(us=round(statistics.median(results[family]["samples"]) * 1e6, 2),
                  **check(results[family]["first"]))
    if blocker is None:
        return record
    try:
        per_call = device_time_in_turns({family: (call, jax.block_until_ready, blocker)},
                                        grid["device_repeats"])[family]["per_call"]
        record["device_us"] = round(statistics.median(per_call) * 1e6, 2)
    except Exception as e:  # the wall clock stands without it
        record["device_time_failed"] = f"{type(e).__name__}: {str(e)[:300]}"
    if kernels:
        try:
            record.update(traced_kernel_us(call, kernels))
        except Exception as e:  # the call's time stands without its split
            record["kernel_split_failed"] = f"{type(e).__name__}: {str(e)[:300]}"
    return record


def run_point(family, context, b, grid, blocker, seed=0):
    started = time.perf_counter()
    shape = layout(family, context)
    copies = min(grid["max_copies"], max(1, -(-grid["evict_bytes"] // (b * shape["cache"]))))
    record = dict(family=family, b=b, context=context, copies=copies,
                  heads=grid["v4_heads"] if family.startswith("v4") else grid["heads"],
                  bytes_per_token=round((shape["cache"] + shape["state"]) / context, 4),
                  pages_bytes_per_token=round(shape["cache"] / context, 4),
                  window_bytes=shape["window"], state_bytes=shape["state"])
    skipped = too_big(needed_bytes(family, context, b, copies))
    if skipped:
        return dict(record, skipped=skipped)
    layer, args, arrays = inputs(family, context, b, copies, grid, seed)
    try:
        built = sum(a.nbytes for a in arrays)
        record["measured_bytes_per_token"] = round(built / (copies * b * context), 4)
        record.update(timed(jax.jit(layer), args, family, grid, blocker))
    finally:  # freed before the next point builds its caches, whatever this one met
        for a in arrays:
            a.delete()
    record["point_s"] = round(time.perf_counter() - started, 1)
    return record


def indexer_call(family, entries, b, grid):
    """(call(query, index keys, table, n) -> (b, 1, topk) slots, n (b,) int32, topk): V3.2's
    indexer_decode over `entries` tokens a request (n their count), or V4's v4_indexer_select
    over `entries` compressed entries (n = ratio * entries tokens before the new one)."""
    if family == "v32_indexer":
        topk = grid["v32_topk"]
        return (lambda query, index, table, n: indexer_decode(query, index, table, n, topk=topk),
                jnp.full((b,), entries, jnp.int32), topk)
    topk, ratio = grid["csa_topk"], RATIO["v4_csa"]
    select = lambda query, index, table, start: v4_indexer_select(
        query, index, table, start, jnp.ones_like(start), ratio=ratio, topk=topk).slots
    return select, jnp.full((b,), ratio * entries, jnp.int32), topk


def run_indexer_point(family, entries, b, grid, blocker, seed=0):
    """The indexer call alone over `entries` index keys a request: timed as a layer's call,
    its device time split into its kernels (INDEXER_KERNELS); index_bytes the keys it reads."""
    started = time.perf_counter()
    pages, index_bytes = _pages(entries), b * entries * INDEX_PAGE_BYTES // PAGE
    copies = min(grid["max_copies"], max(1, -(-grid["evict_bytes"] // index_bytes)))
    call, n, topk = indexer_call(family, entries, b, grid)
    record = dict(family=family, b=b, entries=entries, copies=copies, index_bytes=index_bytes)
    # The keys, the float32 scores four times over (top-k's temporaries) and 1 GiB of slack.
    skipped = too_big(copies * index_bytes + 4 * b * pages * PAGE * 4 + 2**30)
    if skipped:
        return dict(record, skipped=skipped)
    index = IndexKeyCache(filled("index", copies * b * pages, grid))
    query = _index_query(jax.random.key(seed), b, grid["index_heads"])
    args = [(query, index, t, n) for t in _tables(np.random.default_rng(seed), b, pages, copies)]
    # Every key is valid and none scores NaN: each row selects min(topk, entries) of them.
    check = lambda slots: dict(selected_all=bool(
        (np.sum(np.asarray(slots) >= 0, axis=-1) == min(topk, entries)).all()))
    try:
        record.update(timed(jax.jit(call), args, family, grid, blocker, check,
                            kernels=INDEXER_KERNELS))
    finally:
        index.data.delete()
    record["point_s"] = round(time.perf_counter() - started, 1)
    return record


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", nargs="+", default=FAMILIES + INDEXERS,
                        choices=FAMILIES + INDEXERS,
                        help="the layers and indexer calls measured (default all)")
    parser.add_argument("--contexts", type=int, nargs="+", default=None,
                        help="the layers' tokens a request (default 8192 131072 1048576)")
    parser.add_argument("--entries", type=int, nargs="+", default=None,
                        help="the indexers' keys a request (default 65536 131072 262144 "
                             "1048576)")
    parser.add_argument("--batches", type=int, nargs="+", default=None,
                        help="requests (default 1 16 for the layers, 16 64 for the indexers)")
    parser.add_argument("--deadline-s", type=float, default=None,
                        help="start no point after this many seconds; the report is still "
                             "written")
    parser.add_argument("--tiny", action="store_true",
                        help="a small configuration on the default device (CPU: the references)")
    parser.add_argument("--out", default=None, help="path prefix of the .json/.md/.png results")
    args = parser.parse_args(argv)
    grid = dict(TINY if args.tiny else GPU)
    grid["contexts"] = tuple(args.contexts or grid["contexts"])
    grid["batches"] = tuple(args.batches or grid["batches"])
    grid["indexer_entries"] = tuple(args.entries or grid["indexer_entries"])
    grid["indexer_batches"] = tuple(args.batches or grid["indexer_batches"])
    result = dict(meta=dict(
        device=jax.devices()[0].device_kind, jax=jax.__version__, host=platform.node(),
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        implementation=implementation(),
        indexer_implementation="custom_call" if kernels.own_kernels_available() else "reference",
        **grid), points=[], not_run=[], failed={})
    gpu = jax.default_backend() == "gpu"
    blocker = spin_blockers()["jax"] if gpu and grid["device_repeats"] else None
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    # The longest contexts first, while the device's memory is all free; a deadline then leaves
    # out the shortest, of every family alike (growth's slope is the longest two's). The
    # indexers' points after the layers', the most entries first likewise.
    layers = [f for f in args.families if f in FAMILIES]
    indexers = [f for f in args.families if f in INDEXERS]
    points = [(context_report.label(family, b, context),
               functools.partial(run_point, family, context, b, grid, blocker))
              for context, b, family in itertools.product(
                  sorted(grid["contexts"], reverse=True), grid["batches"], layers)]
    points += [(context_report.indexer_label(family, b, entries),
                functools.partial(run_indexer_point, family, entries, b, grid, blocker))
               for entries, b, family in itertools.product(
                   sorted(grid["indexer_entries"], reverse=True), grid["indexer_batches"],
                   indexers)]
    run_points(points, result, result["points"], deadline_s=args.deadline_s,
               line=context_report.point_line,
               save=lambda: args.out and context_report.write_report(result, args.out, png=False))
    if args.out:
        context_report.write_report(result, args.out)
    print("\n".join(context_report.growth_lines(result) + context_report.bar_lines(result)))
    return result


if __name__ == "__main__":
    main()
