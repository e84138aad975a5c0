"""DeepSeek-V3.2's decode step (per layer the lightning indexer, then the sparse MLA decode over
the tokens it picks) against the dense MLA decode step over the same contexts.

Per point (b requests of `context` tokens, h_q 128, s_q 1), three steps of L layers (61), each
jitted under lax.scan (bench_step.py's SCAN_UNROLL layers an iteration, with
jax_flashmla.serving.AlternatingStep.LOOP_COMPILER_OPTIONS), called through AlternatingStep and
synced by popping what it pushed to a HostQueue, as bench_step.py's and bench_sparse.py's steps:
  v32           per layer: jax_flashmla.sparse.indexer_decode (pure JAX) over the paged
                index-key cache (132-byte FP8 keys), picking topk (2048) of each request's
                tokens, then sparse_mla_decode over those on the 656-byte sparse cache (its
                schedule a constant of the program);
  dense         per layer: jax_flashmla.mla_decode over the whole context in bf16 (1152 bytes
                a token); one get_mla_metadata per step;
  indexer_only  v32 with a fusion in place of each sparse decode (one that reads every index,
                so that the next layer still waits for the indexer): the indexer's share of the
                v32 step is indexer_only's time over v32's.
Each layer's q is made from the out of the layer before (its 512 latent columns and the layer's
own 64 rope columns, as bench_step.py chains them), and so is its index query: the layer's own
random rows of 64 heads x 128 plus head 0's first 128 columns of that out, quantized to e4m3
with a power-of-two scale per head as index_query quantizes, its head weights random times
those scales; so every layer is live and follows the one before. Neither step holds the
projections (index_query's wq_b and weights_proj, MLA's own) nor the cache writes.

The caches: each request's pages in one random order (one block table for every cache); the
pages are copies of 1024 pages of random rows (keys), as bench_sparse.py makes its sparse cache,
since what a page holds does not change what reading it costs. One layer of b=64 x 128k tokens
is 9.7 GB of dense cache, 1.1 GB of index keys and 5.5 GB of sparse cache, so each kind's caches
are one stacked array of as many layer caches as fit in --cache-gb (32 GiB for the dense step's,
32 GiB for the index and sparse caches, which the indexer-only step shares), layer l reading
cache l mod that many (`caches` in the report). Layers share caches only where one layer's is
over 560 MB (32 GiB / 61); its index keys alone are then over 90 MB, more than the L2 holds, so
a layer finds little of what an earlier one read. A point's memory is those caches (at most
69 GB), the per-layer inputs (0.2 GB at b=64) and the indexer's temporaries (its scores of 16
rows at a time: 64 heads' float32 logits of 16 x 128k tokens are 0.5 GB).

Timing: the three steps in turns (timing.in_turns: per turn one synced step of each, the order
reversed every other turn), µs per layer the median step's wall clock / L, ratios the medians
of per-turn ratios; on a GPU also the GPU's span per layer (a step's first kernel's start to
its last's end, from a profile: bench_step.gpu_span_us). Reported: the three times, v32 /
dense, the indexer's share, and the bar (computed, not asserted): at 128k tokens and b=16 the
v32 step per layer at most 0.4x the dense one (v32_report.py).

On CPU, --tiny runs a small configuration end to end: the pure-JAX indexer, the sparse
reference and the C++ model of the dense decode.

  python benchmarks/bench_v32_decode.py --out benchmarks/results/v32_decode_h200
  python benchmarks/bench_v32_decode.py --points 'step/*/ctx131072/*' --out /tmp/v32_128k
"""
import argparse
import concurrent.futures
import datetime
import functools
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# First: bench_step's import sets the XLA flag that keeps command buffers on under the profiler,
# before JAX starts its backend.
import bench_step  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jax_flashmla as jf  # noqa: E402
from jax_flashmla import serving  # noqa: E402
from jax_flashmla.kernels import library as kernels  # noqa: E402
from jax_flashmla.sparse import (indexer_decode, IndexKeyCache, sparse_mla_decode,  # noqa: E402
                                 write_sparse_kv)
from jax_flashmla.caches.index_keys import quantize_index_keys  # noqa: E402
from jax_flashmla.ops.indexer import IndexQuery  # noqa: E402
from jax_flashmla.caches.sparse import TOKEN_BYTES as SPARSE_TOKEN_BYTES  # noqa: E402
from jax_flashmla.caches.index_keys import INDEX_HEAD_DIM  # noqa: E402
from jax_flashmla.caches.index_keys import TOKEN_BYTES as INDEX_TOKEN_BYTES  # noqa: E402
from jax_flashmla.ops.indexer import INDEX_TOPK  # noqa: E402

import bench_sparse  # noqa: E402
import v32_report  # noqa: E402
from bench_sparse import BASE_PAGES, SOFTMAX_SCALE, random_rows  # noqa: E402
from results_io import run_points  # noqa: E402
from timing import in_turns  # noqa: E402
from workload import D_QK, D_V, PAGE  # noqa: E402

DENSE_TOKEN_BYTES = D_QK * 2  # bf16
GPU = dict(contexts=(8192, 32768, 131072), batches=(1, 16, 64), h_q=128, s_q=1,
           topk=INDEX_TOPK, index_heads=64, layers=61, steps=20)
# 16 heads: on CPU the C++ model of the dense decode takes ~0.1 ms a head.
TINY = dict(contexts=(256,), batches=(2,), h_q=16, s_q=1, topk=64, index_heads=64, layers=3,
            steps=3)
WARMUP_STEPS = 3


def dense_cache(num_pages, key):
    """A (num_pages, 64, 1, 576) bf16 cache: BASE_PAGES pages of random rows, repeated by a
    gather (as bench_sparse.sparse_cache)."""
    base = random_rows(key, (min(num_pages, BASE_PAGES), PAGE, 1, D_QK), jnp.bfloat16)
    return base[jnp.arange(num_pages) % base.shape[0]]


def index_cache(num_pages, key):
    """A (num_pages, 8448) index-key cache: BASE_PAGES pages of random keys quantized by
    write_sparse_kv, repeated by a gather."""
    base_pages = min(num_pages, BASE_PAGES)
    slots = jnp.arange(base_pages * PAGE, dtype=jnp.int32)
    base = write_sparse_kv(IndexKeyCache.create(base_pages), slots,
                            jax.random.normal(key, (base_pages * PAGE, INDEX_HEAD_DIM))).data
    return base[jnp.arange(num_pages) % base_pages]


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def random_arrays(dense_pages, v32_pages, shapes, key):
    """(dense cache, sparse cache, index cache, random_rows of each (shape, dtype) in shapes),
    made by one program: on CPU each of them alone compiles for a second or two."""
    keys = jax.random.split(key, 3 + len(shapes))
    return (dense_cache(dense_pages, keys[0]), bench_sparse.sparse_cache(v32_pages, keys[1]),
            index_cache(v32_pages, keys[2]),
            *(random_rows(k, shape, dtype) for k, (shape, dtype) in zip(keys[3:], shapes)))


class Inputs:
    """One point's inputs: the stacked dense cache, the stacked index-key and sparse caches
    (each as many layer caches as fit in cache_gb; layer l's pages at (l mod that many) * pages),
    the block table (each request's pages in one random order) and lengths, the first q, and
    per layer its rope columns, its index-query rows and its head weights."""

    def __init__(self, b, context, grid, cache_gb, seed=0):
        self.b, self.context = b, context
        self.h_q, self.s_q, self.topk = grid["h_q"], grid["s_q"], grid["topk"]
        self.index_heads, self.layers = grid["index_heads"], grid["layers"]
        self.pages = b * context // PAGE
        fit = lambda token_bytes: max(1, min(self.layers, int(
            cache_gb * 2**30 // (self.pages * PAGE * token_bytes))))
        self.dense_caches = fit(DENSE_TOKEN_BYTES)
        self.v32_caches = fit(SPARSE_TOKEN_BYTES + INDEX_TOKEN_BYTES)
        layers, s_q, h_q = self.layers, self.s_q, self.h_q
        shapes = (((b, s_q, h_q, D_QK), jnp.bfloat16),
                  ((layers, b, s_q, h_q, D_QK - D_V), jnp.bfloat16),
                  ((layers, b, s_q, self.index_heads, INDEX_HEAD_DIM), jnp.float32),
                  ((layers, b, s_q, self.index_heads), jnp.float32))
        (self.dense, self.sparse, self.index, self.q0, self.rope, self.index_rows,
         self.index_weights) = jax.block_until_ready(random_arrays(
             self.dense_caches * self.pages, self.v32_caches * self.pages, shapes,
             jax.random.key(seed, impl="rbg")))
        order = np.random.default_rng(seed).permutation(self.pages).astype(np.int32)
        self.block_table = jnp.asarray(order.reshape(b, -1))
        self.seq_lens = jnp.full((b,), context, jnp.int32)

    def label(self):
        return bench_sparse.step_label(self.b, self.context, self.h_q, self.s_q)


def steps(inp):
    """{name: (step, its arguments)}: each step returns its last out (q[..., :512] after the
    last layer), its layers a lax.scan over (layer index, per-layer inputs)."""
    def scanned(layer, q, per_layer):
        body = lambda q, xs: (layer(q, *xs), None)
        q, _ = jax.lax.scan(body, q, (jnp.arange(inp.layers, dtype=jnp.int32), *per_layer),
                            unroll=bench_step.SCAN_UNROLL)
        return q[..., :D_V]

    def selected(q, layer, rows, weights, index, table, seq_lens):
        """The layer's top-k slots over its index cache: its query made from the out before."""
        values, scales = quantize_index_keys(
            rows + q[:, :, :1, :INDEX_HEAD_DIM].astype(jnp.float32))
        offset = layer % inp.v32_caches * inp.pages
        return indexer_decode(IndexQuery(values, weights * scales), index, table + offset,
                              seq_lens, topk=inp.topk)

    def v32(index, sparse, q, rope, rows, weights, table, seq_lens):
        def layer(q, l, rope, rows, weights):
            indices = selected(q, l, rows, weights, index, table, seq_lens)
            out, _ = sparse_mla_decode(q, sparse, indices, softmax_scale=SOFTMAX_SCALE,
                                       implementation=bench_sparse.sparse_implementation())
            return bench_step._next(out, rope)[0]
        return scanned(layer, q, (rope, rows, weights))

    def indexer_only(index, q, rope, rows, weights, table, seq_lens):
        def layer(q, l, rope, rows, weights):
            # Every index read: no part of the selection is left for XLA to drop.
            picked = jnp.min(selected(q, l, rows, weights, index, table, seq_lens), axis=-1)
            return bench_step._next(q[..., :D_V] * (picked >= 0)[:, :, None, None], rope)[0]
        return scanned(layer, q, (rope, rows, weights))

    def dense(cache, q, rope, table, seq_lens):
        md = jf.get_mla_metadata(seq_lens, block_table=table, num_pages=inp.pages,
                                 num_heads_q=inp.h_q, num_q_tokens=inp.s_q,
                                 implementation="custom_call")

        def layer(q, l, rope):
            offset = l % inp.dense_caches * inp.pages
            out, _ = jf.mla_decode(q, cache, table + offset, seq_lens, metadata=md,
                                   softmax_scale=SOFTMAX_SCALE, implementation="custom_call")
            return bench_step._next(out, rope)[0]
        return scanned(layer, q, (rope,))

    after_q = (inp.rope, inp.index_rows, inp.index_weights, inp.block_table, inp.seq_lens)
    return {"v32": (v32, (inp.index, inp.sparse, inp.q0, *after_q)),
            "indexer_only": (indexer_only, (inp.index, inp.q0, *after_q)),
            "dense": (dense, (inp.dense, inp.q0, inp.rope, inp.block_table, inp.seq_lens))}


class SyncedStep:
    """A compiled step through AlternatingStep: launch() runs it on its arguments, wait() pops
    what every launch since the last wait pushed to its HostQueue (a serving loop's sync)."""

    def __init__(self, inp, step, arguments):
        self.queue = bench_step.result_queue(inp)
        pushing = bench_step.pushing_step(lambda *a: (None, step(*a)), self.queue,
                                          lambda out: out)
        compiled = jax.jit(pushing, compiler_options=serving.AlternatingStep.LOOP_COMPILER_OPTIONS)
        self.step = serving.AlternatingStep(compiled.lower(*arguments).compile())
        self.arguments, self.unpopped, self.out = arguments, 0, None

    def launch(self):
        self.out = self.step(*self.arguments)[1]
        self.unpopped += 1

    def wait(self, _=None):
        for _ in range(self.unpopped):
            self.queue.pop()
        self.unpopped = 0


def run_point(inp, repeats):
    """The point's record: µs per layer of each step (and the GPU's span per layer on a GPU),
    the ratios, whether every step's last out is finite."""
    started = time.perf_counter()
    record = dict(label=inp.label(), b=inp.b, context=inp.context, h_q=inp.h_q, s_q=inp.s_q,
                  topk=inp.topk, index_heads=inp.index_heads, layers=inp.layers,
                  dense_caches=inp.dense_caches, v32_caches=inp.v32_caches)
    variants = steps(inp)
    # Compiled at once: XLA compiles off Python's thread.
    with concurrent.futures.ThreadPoolExecutor(len(variants)) as pool:
        start = time.perf_counter()
        made = dict(zip(variants, pool.map(lambda item: SyncedStep(inp, *item),
                                           variants.values())))
        record["compile_s"] = round(time.perf_counter() - start, 1)
    samples = in_turns({name: (step.launch, step.wait, 1, inp.layers)
                        for name, step in made.items()}, repeats=repeats, warmup=WARMUP_STEPS)
    for name, per_layer in samples.items():
        turns = record[f"{name}_us_repeats"] = [s * 1e6 for s in per_layer]
        record[f"{name}_us"] = round(statistics.median(turns), 2)
    if jax.default_backend() == "gpu":
        runs = {name: (lambda step=step: (step.launch(), step.wait()))
                for name, step in made.items()}
        for name, span in bench_step.gpu_span_us(runs).items():
            record[f"{name}_gpu_us"] = None if span is None else round(span / inp.layers, 2)
    record["outs_finite"] = all(bool(np.isfinite(np.asarray(step.out, np.float32)).all())
                                for step in made.values())
    record.update(v32_report.ratios(record))
    record["point_s"] = round(time.perf_counter() - started, 1)
    return record


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--points", nargs="+", default=["*"], metavar="GLOB",
                        help="the points whose label matches, e.g. 'step/*/ctx131072/*', "
                             "'step/b16/*' (default: all)")
    parser.add_argument("--layers", type=int, default=GPU["layers"],
                        help="layers per step (default 61)")
    parser.add_argument("--cache-gb", type=float, default=32,
                        help="GiB for each kind's stacked caches (dense; index and sparse): "
                             "layers beyond the caches that fit share them (default 32)")
    parser.add_argument("--steps", type=int, default=GPU["steps"],
                        help="turns timed (a step of each kind per turn; default 20)")
    parser.add_argument("--deadline-s", type=float, default=None,
                        help="start no point after this many seconds; the report is still "
                             "written (default: none)")
    parser.add_argument("--tiny", action="store_true",
                        help="a small configuration on the default device (CPU: the references "
                             "and the C++ model of the dense decode)")
    parser.add_argument("--out", default=None, help="path prefix of the .json/.md/.png results")
    args = parser.parse_args(argv)
    grid = TINY if args.tiny else dict(GPU, layers=args.layers, steps=args.steps)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    result = dict(meta=dict(
        device=jax.devices()[0].device_kind, jax=jax.__version__, host=platform.node(),
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        sparse_implementation=bench_sparse.sparse_implementation(),
        indexer_implementation="custom_call" if kernels.own_kernels_available() else "reference",
        topk=grid["topk"],
        index_heads=grid["index_heads"], layers=grid["layers"], softmax_scale=SOFTMAX_SCALE,
        cache_gb=args.cache_gb, steps=grid["steps"], scan_unroll=bench_step.SCAN_UNROLL),
        step=[], not_run=[], failed={})
    labels = [(bench_sparse.step_label(b, context, grid["h_q"], grid["s_q"]), b, context)
              for context in grid["contexts"] for b in grid["batches"]]
    points = [(label, lambda b=b, context=context: run_point(
        Inputs(b, context, grid, args.cache_gb), grid["steps"]))
        for label, b, context in labels if bench_sparse.matches(label, args.points)]
    run_points(points, result, result["step"], deadline_s=args.deadline_s,
               line=v32_report.point_line,
               save=lambda: args.out and v32_report.write_report(result, args.out))
    if args.out:
        v32_report.write_report(result, args.out)
    print("\n".join(v32_report.summary_lines(result)))
    return result


if __name__ == "__main__":
    main()
