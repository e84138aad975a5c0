"""DeepSeek-V3.2's sparse MLA decode (jax_flashmla.sparse.sparse_mla_decode: FlashMLA's
sparse_decode_fwd as a custom call) against the same op called from torch, and beside the dense
decode (jax_flashmla.mla_decode) over the same context.

Each request attends to topk (2048) of its context's tokens: one random token of each of topk
equal stretches of the context, in random order (distinct, spread over the whole context),
through a random page order as a block table places them. The sparse cache holds 656-byte FP8
tokens (jax_flashmla.caches.sparse), copies of 1024 quantized pages of random rows; the dense
cache the same context in bf16.

Per call, at b in {1, 16, 64, 128}, h_q in {64, 128}, s_q in {1, 2} over contexts of 8192,
32768 and 131072 tokens: three calls timed in turns on the same q (benchmarks/workload.py's),
  sparse  sparse_mla_decode jitted (its validity mask of the indices, the decode; its
          schedule a constant of the program), lse returned as FlashMLA wrote it
          (jax_flashmla.serving.lse_format);
  premasked  the same on MaskedIndices made once outside the timed calls (mask_indices):
          the decode alone, as a step's layers sharing masked indices run it;
  torch   sparse_decode_fwd from torch on the same buffers (the same q, cache, indices and
          schedule);
  dense   jax_flashmla.mla_decode over the whole context, its metadata made once outside the
          timed calls (a model makes it once per step).
Call i takes set i mod 4 of (q, indices / block table), so that the L2 keeps little of one call
for the next. Timed by wall clock over batches of calls (benchmarks/timing.py) and, on a GPU,
by device time from the GPU's timestamps (benchmarks/device_time.py: batches queued behind a
spinning kernel, from its end to the batch's last kernel's end), sparse, premasked and torch in
turns and the dense decode in turns of its own (a batch after its sweep of the whole cache runs
slower). Ratios are medians of per-repeat ratios; the sparse call's out and lse are compared
with torch's bit for bit.

The step: 61 layers of sparse_mla_decode at h_q 128, s_q 1 over a context of 32768 tokens, b in
{1, 16, 64, 128}, each layer with its own indices and the next layer's q made from its out (its
512 latent columns and the layer's own 64 rope columns, as bench_step.py chains them), so that
every layer is live. The layers' caches are one stacked array; 61 layers of b=128 x 32768
tokens would be 168 GB, so it holds as many layer caches as fit in --cache-gb (40 GiB: all 61
up to b=16, 31 at b=64, 15 at b=128) and layer l reads cache l mod that many. Where caches are
shared, one layer alone reads b x 2048 tokens of 656 bytes (86 MB at b=64), more than the L2
holds, so a layer finds little of what an earlier layer over the same cache read.
jax_flashmla's step runs jitted, unrolled and under lax.scan (--scan-unroll layers an
iteration, by default SCAN_UNROLL, and AlternatingStep.LOOP_COMPILER_OPTIONS), each called
through AlternatingStep and synced by popping what it pushed to a HostQueue, as
bench_step.py's, their schedule a constant of the program and the layers' indices masked
once per step (mask_indices: one kernel over the step's indices, where a layer of its own
would run one a layer; in a model the mask fuses into the conversion of the
indexer's positions to slots), the unrolled step's layers each reading its row of them in
place (masked[layer], as torch's layers read views of one tensor); against the same torch ops
(sparse_decode_fwd making its own schedule per layer, the concatenation) captured in a torch
CUDA graph and replayed, and that graph with the schedule made once per step by
get_mla_decoding_metadata (topk), as SGLang serves V3.2. The steps are timed in turns
(STEP_ROUNDS rounds of each, the order reversed every other round), so that a drift of the
GPU's clock or the host's load falls on all of them alike. --xla-option adds compiler options
to both jax steps. Reported: µs per layer (the median step's wall clock / layers) and the GPU's
span per layer (from a profile); µs per layer with --steps steps launched before one sync
(queued: the GPU's time per step wherever the host launches ahead of it, as a serving loop
that schedules the next step while the GPU runs this one); whether every step's last out is
torch's bit for bit. With --unguarded the step also runs unrolled with FlashMLA's custom call in
place of sparse_mla_decode on the raw indices (bare_decode: no mask, no checks; the indices are
all in range), as bench_step.py's --unguarded: reported, the unrolled step's cost over it (the
median ratio of the two steps run in turns, a step of each per turn; bar +2% at b=1, +1% at
b=128, 61 layers) and whether their outs are the same bit for bit.

On CPU, --tiny runs a small configuration through the pure-JAX sparse reference and the C++
model of the dense decode, without torch (and --unguarded the reference on the raw indices in
place of the custom call, which is CUDA only).

  python benchmarks/bench_sparse.py --out benchmarks/results/sparse_h200
  python benchmarks/bench_sparse.py --points 'call/*' --out /tmp/sparse_calls   # a part
  python benchmarks/bench_sparse.py --unguarded --points 'step/b1/*' 'step/b128/*' \
      --out benchmarks/results/sparse_unguarded_h200
"""
import argparse
import concurrent.futures
import datetime
import fnmatch
import functools
import gc
import json
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
from jax_flashmla.kernels import custom_calls  # noqa: E402
from jax_flashmla.kernels import library as kernels  # noqa: E402
from jax_flashmla.ops import decode as ops  # noqa: E402
from jax_flashmla.reference import sparse as reference  # noqa: E402
from jax_flashmla.sparse import mask_indices, sparse_mla_decode  # noqa: E402
from jax_flashmla.caches.sparse import quantize_tokens  # noqa: E402
from jax_flashmla.caches.sparse import TOKEN_BYTES  # noqa: E402
from jax_flashmla.kernels.sparse_forms import (KERNEL_HEADS, KERNEL_TOPK_BLOCK,  # noqa: E402
                                               kernel_schedule)

import sparse_report  # noqa: E402
from device_time import device_time_in_turns, spin_blockers  # noqa: E402
from timing import compiler_option, time_in_turns  # noqa: E402
from torch_side import TorchSide, captured  # noqa: E402
from workload import D_QK, D_V, PAGE, Workload  # noqa: E402

SOFTMAX_SCALE = 192 ** -0.5  # DeepSeek's q/k head dim (128 + 64)
# Distinct pages of rows quantized for a sparse cache; the rest of the cache repeats them.
BASE_PAGES = 1024
CALL_IMPLS = ("sparse", "premasked", "torch", "dense")
# Rounds in which a step point's variants take turns, its steps split among them.
STEP_ROUNDS = 4
# Layers an iteration of the scanned step's loop: its own kernels (the counter, the compare,
# the select) run once an iteration, ~1.4 us a layer at 4 on the H200.
SCAN_UNROLL = 8
# With --unguarded: the unrolled step of bare decodes (bare_decode) on the raw indices.
UNGUARDED = "jax_unrolled_unguarded"
GPU = dict(call_b=(1, 16, 64, 128), call_contexts=(8192, 32768, 131072), call_h_q=(64, 128),
           call_s_q=(1, 2), step_b=(1, 16, 64, 128), step_context=32768, step_h_q=128,
           step_s_q=1, topk=2048, layers=61, rotations=4, target_ms=20.0, repeats=3, steps=40)
# 16 heads: on CPU the C++ model of the dense decode takes ~0.1 ms a head here.
TINY = dict(call_b=(2,), call_contexts=(128,), call_h_q=(16,), call_s_q=(1, 2), step_b=(2,),
            step_context=128, step_h_q=16, step_s_q=1, topk=64, layers=3, rotations=2,
            target_ms=2.0, repeats=2, steps=3)


def sparse_implementation():
    """FlashMLA's kernel on a GPU (never the reference there by accident), else the reference."""
    return "custom_call" if jax.default_backend() == "gpu" else "reference"


def call_label(b, context, h_q, s_q):
    return f"call/b{b}/ctx{context}/h{h_q}/s{s_q}"


def step_label(b, context, h_q, s_q):
    return f"step/b{b}/ctx{context}/h{h_q}/s{s_q}"


@functools.partial(jax.jit, static_argnums=(1, 2))
def random_rows(key, shape, dtype):
    """Normal / 10, clipped to [-1, 1], as FlashMLA's tests draw their data."""
    return jnp.clip(jax.random.normal(key, shape) / 10, -1, 1).astype(dtype)


@functools.partial(jax.jit, static_argnums=0)
def sparse_cache(num_pages, key):
    """A (num_pages, 64, 1, 656) sparse cache: BASE_PAGES pages of random rows quantized,
    repeated. What a page holds does not change what a decode costs; quantizing GBs of rows
    at once would take float32 temporaries of several times the cache. A gather writes the
    cache once (a tile then a slice could hold two)."""
    base = quantize_tokens(random_rows(key, (min(num_pages, BASE_PAGES), PAGE, 1, D_QK),
                                       jnp.float32))
    return base[jnp.arange(num_pages) % base.shape[0]]


def random_positions(rng, shape, context, topk):
    """(*shape, topk) int32 token positions in [0, context): one at random from each of topk
    equal stretches of the context, in random order."""
    stretch = context // topk
    positions = np.arange(topk) * stretch + rng.integers(0, stretch, (*shape, topk))
    return rng.permuted(positions, axis=-1).astype(np.int32)


token_slots = jax.jit(jf.token_slots)


def sparse_indices(rng, block_table, s_q, topk, context):
    """(b, s_q, topk) slots of random positions in each request's context (its pages in
    block_table), each query token its own."""
    positions = random_positions(rng, (block_table.shape[0], s_q), context, topk)
    return token_slots(block_table, jnp.asarray(positions))


def sparse_schedule(b, h_q, s_q, topk):
    """(tile_scheduler_metadata, num_splits) on the device for torch's op: the constant that
    sparse_mla_decode holds for these shapes (topk a multiple of 64, h_q the kernel's 64 or
    128), split into its two arrays."""
    schedule = kernel_schedule(b, h_q, s_q, topk, ops.default_num_sms())
    rows = schedule.size - (b + 1)
    return jax.device_put((schedule[:rows].reshape(-1, 8), schedule[rows:]))


class TorchSparse:
    """sparse_decode_fwd from torch on JAX's buffers, arguments by schema name; the schedule op
    is get_mla_decoding_metadata, which makes the sparse schedule when given topk."""

    def __init__(self):
        self.side = TorchSide()
        self.torch = self.side.torch
        ops = kernels.ensure_cuda_targets()
        if ops.sparse_decode is None:
            raise RuntimeError("the kernel library has no sparse decode (sparse_decode_fwd)")
        resolve = lambda name: getattr(getattr(self.torch.ops, name.split("::")[0]),
                                       name.split("::")[1])
        self.decode, self.schedule = resolve(ops.sparse_decode), resolve(ops.metadata)
        self.schedule_takes_topk = "topk" in [
            a.name for a in self.schedule.default._schema.arguments]
        self.info = dict(self.side.info, sparse_decode_op=ops.sparse_decode)

    def sync(self, _=None):
        self.torch.cuda.synchronize()

    def kv(self, cache):
        """The uint8 cache as the float8_e4m3fn bytes the op takes."""
        return self.side.view(cache).view(self.torch.float8_e4m3fn)

    def decode_args(self, q, kv, indices, schedule=(None, None)):
        return kernels.arguments_by_name(self.decode, dict(
            q=q, kv=kv, indices=indices, d_v=D_V, sm_scale=SOFTMAX_SCALE,
            tile_scheduler_metadata=schedule[0], num_splits=schedule[1]))

    def call(self, q, cache, indices, schedule):
        """A call of the op on these JAX arrays and schedule (sparse_schedule's), without
        arguments."""
        schedule = tuple(self.side.view(x) for x in schedule)
        args = self.decode_args(self.side.view(q), self.kv(cache), self.side.view(indices),
                                schedule)
        return lambda: self.decode(*args)

    def steps(self, inp, shared_schedule=True):
        """({name: (launch, sync)}, {name: the step's out}, {name: why not made}) of the step
        over StepInputs inp captured in CUDA graphs: "torch_graph" with the op's own schedule
        per layer and, with shared_schedule, "torch_graph_shared" with one schedule per step."""
        torch, view = self.torch, self.side.view
        kv, indices, rope = self.kv(inp.cache), view(inp.indices), view(inp.rope)
        q0, seq_lens = view(inp.q0), view(inp.seq_lens)
        schedule_args = kernels.arguments_by_name(self.schedule, dict(
            seqlens_k=seq_lens, num_q_tokens_per_head_k=inp.s_q * inp.h_q, h_k=1,
            h_q=inp.h_q, is_fp8_kvcache=True, topk=inp.topk))

        def step(shared):
            schedule = tuple(self.schedule(*schedule_args)[:2]) if shared else (None, None)
            q = q0
            for layer in range(inp.layers):
                out = self.decode(*self.decode_args(q, kv, indices[layer], schedule))[0]
                q = torch.cat([out, rope[layer]], dim=-1)
            return q[..., :D_V]

        launches, outs, skipped = {}, {}, {}
        variants = {"torch_graph": False}
        if not shared_schedule:
            skipped["torch_graph_shared"] = "left out (--no-shared-schedule)"
        elif self.schedule_takes_topk:
            variants["torch_graph_shared"] = True
        else:
            skipped["torch_graph_shared"] = "get_mla_decoding_metadata takes no topk here"
        for name, shared in variants.items():
            try:
                replay, outs[name] = captured(torch, functools.partial(step, shared))
                launches[name] = (replay, self.sync)
            except RuntimeError as e:  # the shared schedule is not the op's own: may be refused
                if not shared:
                    raise
                skipped[name] = f"failed: {str(e)[:400]}"
        return launches, outs, skipped


def run_call_group(context, b, shapes, grid, torch_sparse, blockers, device_repeats):
    """The per-call records at (context, b) for each (h_q, s_q) in shapes: one sparse and one
    dense cache of b requests x context tokens, shared by those shapes, timed in turns."""
    rot, topk = grid["rotations"], grid["topk"]
    work = Workload(b, context, False, max(s_q for _, s_q in shapes), rot, seed=context + b)
    cache = sparse_cache(work.kv.shape[0], jax.random.key(context + b + 1))
    rng = np.random.default_rng(context + b)
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    sync, variants = jax.block_until_ready, {}
    for h_q, s_q in shapes:
        qs = work.queries(h_q, s_q, rot)
        indices = [sparse_indices(rng, bt, s_q, topk, context) for bt in work.block_tables]
        # lse comes back as the kernels wrote it, as torch's op returns it.
        formats = (device, serving.lse_format(s_q, device))
        sparse = jax.jit(functools.partial(sparse_mla_decode, softmax_scale=SOFTMAX_SCALE,
                                           implementation=sparse_implementation()),
                         out_shardings=formats)
        variants[h_q, s_q, "sparse"] = (
            lambda i, qs=qs, indices=indices, sparse=sparse: sparse(
                qs[i % rot], cache, indices[i % rot]), sync)
        masked = [jax.block_until_ready(mask_indices(idx, cache)) for idx in indices]
        variants[h_q, s_q, "premasked"] = (
            lambda i, qs=qs, masked=masked, sparse=sparse: sparse(
                qs[i % rot], cache, masked[i % rot]), sync)
        # A metadata per set, as a model makes one per step for its block table.
        mds = [jax.block_until_ready(jf.get_mla_metadata(
            work.seq_lens, block_table=bt, num_pages=work.kv.shape[0], num_heads_q=h_q,
            num_q_tokens=s_q, implementation="custom_call")) for bt in work.block_tables]
        dense = jax.jit(functools.partial(jf.mla_decode, softmax_scale=SOFTMAX_SCALE,
                                          implementation="custom_call"), out_shardings=formats)
        variants[h_q, s_q, "dense"] = (
            lambda i, qs=qs, mds=mds, dense=dense: dense(
                qs[i % rot], work.kv, work.block_tables[i % rot], work.seq_lens,
                metadata=mds[i % rot]),
            sync)
        if torch_sparse is not None and h_q in KERNEL_HEADS:  # the op takes no other count
            schedule = sparse_schedule(b, h_q, s_q, topk)
            calls = [torch_sparse.call(q, cache, idx, schedule) for q, idx in zip(qs, indices)]
            variants[h_q, s_q, "torch"] = (lambda i, calls=calls: calls[i % rot](),
                                           torch_sparse.sync)
    # The dense decode sweeps its whole cache, GBs at long contexts, and a batch right after it
    # ran slower: in shared turns (their order reversed every other repeat) the torch and
    # premasked batches took turns to follow it. It is timed in turns of its own.
    timed, failed, device_times, device_failure = {}, {}, {}, None
    for group in ([name for name in variants if name[2] != "dense"],
                  [name for name in variants if name[2] == "dense"]):
        group_timed, group_failed = time_in_turns(
            {name: variants[name] for name in group}, target_ms=grid["target_ms"],
            repeats=grid["repeats"], max_calls=1000, fitted=())
        timed.update(group_timed)
        failed.update(group_failed)
        if blockers is None or device_failure or not group_timed:
            continue
        try:
            device_times.update(device_time_in_turns(
                {name: (*variants[name], blockers["torch" if name[2] == "torch" else "jax"])
                 for name in group_timed}, device_repeats))
        except Exception as e:  # the wall-clock figures stand without it
            device_failure = f"failed: {type(e).__name__}: {str(e)[:400]}"
    records = []
    for h_q, s_q in shapes:
        record = dict(label=call_label(b, context, h_q, s_q), b=b, context=context, h_q=h_q,
                      s_q=s_q, topk=topk, impls={}, checks={}, skipped={})
        for impl in CALL_IMPLS:
            name = (h_q, s_q, impl)
            if name in failed:
                record["skipped"][impl] = f"failed: {type(failed[name]).__name__}: " \
                                          f"{str(failed[name])[:400]}"
            if name not in timed:
                continue
            samples = [s * 1e6 for s in timed[name]["samples"]]
            r = record["impls"][impl] = dict(us=statistics.median(samples), us_repeats=samples)
            if name in device_times:
                device_samples = [s * 1e6 for s in device_times[name]["per_call"]]
                r.update(device_us=statistics.median(device_samples),
                         device_us_repeats=device_samples)
        if device_failure:
            record["skipped"]["device_time"] = device_failure
        record.update(sparse_report.call_ratios(record))
        if {(h_q, s_q, "sparse"), (h_q, s_q, "torch")} <= set(timed):
            out, lse = timed[h_q, s_q, "sparse"]["first"]
            t_out, t_lse = timed[h_q, s_q, "torch"]["first"][:2]
            record["checks"].update(
                out_identical=bool(np.array_equal(np.asarray(out, np.float32),
                                                  t_out.float().cpu().numpy())),
                lse_identical=bool(np.array_equal(np.asarray(lse), t_lse.cpu().numpy())))
        if {(h_q, s_q, "sparse"), (h_q, s_q, "premasked")} <= set(timed):
            outs = [timed[h_q, s_q, impl]["first"] for impl in ("sparse", "premasked")]
            record["checks"]["premasked_identical"] = all(
                bool(np.array_equal(np.asarray(a), np.asarray(b))) for a, b in zip(*outs))
        records.append(record)
    return records


class StepInputs:
    """One step point's inputs: the stacked cache of layer_caches caches of b requests x
    context tokens, layer l's indices (b, s_q, topk) into cache l mod layer_caches (each
    request's tokens through one random page order, the same in every cache), the first q,
    each layer's rope columns."""

    def __init__(self, b, context, h_q, s_q, topk, layers, cache_gb, seed=0):
        self.b, self.context, self.h_q, self.s_q = b, context, h_q, s_q
        self.topk, self.layers = topk, layers
        pages = b * context // PAGE
        layer_bytes = pages * PAGE * TOKEN_BYTES
        self.layer_caches = max(1, min(layers, int(cache_gb * 2**30 // layer_bytes)))
        keys = jax.random.split(jax.random.key(seed), 3)
        self.cache = sparse_cache(self.layer_caches * pages, keys[0])
        rng = np.random.default_rng(seed)
        table = rng.permutation(pages).astype(np.int32).reshape(b, -1)
        slots = token_slots(jnp.asarray(table), jnp.asarray(
            random_positions(rng, (b, layers, s_q), context, topk)))
        offsets = (np.arange(layers, dtype=np.int32) % self.layer_caches) * pages * PAGE
        self.indices = jnp.asarray(np.moveaxis(np.asarray(slots), 1, 0)
                                   + offsets[:, None, None, None])
        self.seq_lens = jnp.full((b,), context, jnp.int32)
        self.q0 = random_rows(keys[1], (b, s_q, h_q, D_QK), jnp.bfloat16)
        self.rope = random_rows(keys[2], (layers, b, s_q, h_q, D_QK - D_V), jnp.bfloat16)
        jax.block_until_ready((self.cache, self.indices, self.q0, self.rope))

    def arguments(self):
        return self.cache, self.q0, self.indices, self.rope


def bare_decode(q, cache, indices, layer):
    """Layer `layer`'s out without sparse_mla_decode's protections (the mask of the indices,
    the checks): FlashMLA's custom call on row `layer` of the raw index stack, as the op's
    _kernel_decode calls it, less the padding that the step's shapes do not need; on CPU,
    where the custom call cannot run, the reference on the raw row."""
    if sparse_implementation() == "reference":
        return reference.sparse_decode_reference(q, cache, indices[layer],
                                                 softmax_scale=SOFTMAX_SCALE)[0]
    b, s_q, h_q, _ = q.shape
    topk = indices.shape[-1]
    assert h_q in KERNEL_HEADS and topk % KERNEL_TOPK_BLOCK == 0, \
        f"--unguarded pads nothing: h_q {h_q} must be 64 or 128, topk {topk} a multiple of 64"
    out, *_ = custom_calls.SPARSE_DECODE(
        q=q, kv_cache=cache, indices=indices, attn_sink=jnp.zeros((0,), jnp.float32),
        schedule=kernel_schedule(b, h_q, s_q, topk, ops.default_num_sms()),
        softmax_scale=SOFTMAX_SCALE, with_sink=False, layer=layer)
    return out[:, :, :h_q]


def jax_steps(inp, scan_unroll=SCAN_UNROLL, xla_options=None, unguarded=False):
    """{name: (jitted step, its compiler options)}: the step unrolled and under lax.scan
    (scan_unroll layers an iteration), each returning its last out (q[..., :512] after the
    last layer); xla_options: more compiler options for both; unguarded: also the unrolled
    step of bare_decode on the raw indices (UNGUARDED), to measure what the protections
    cost."""
    def decode(q, cache, indices, rope):
        out, _ = sparse_mla_decode(q, cache, indices, softmax_scale=SOFTMAX_SCALE,
                                   implementation=sparse_implementation())
        return bench_step._next(out, rope)[0]

    def unrolled(cache, q, indices, rope):
        masked = mask_indices(indices, cache)
        for layer in range(inp.layers):  # each layer's row of the stack, read in place
            q = decode(q, cache, masked[layer], rope[layer])
        return q[..., :D_V]

    def unrolled_unguarded(cache, q, indices, rope):
        for layer in range(inp.layers):
            q = bench_step._next(bare_decode(q, cache, indices, layer), rope[layer])[0]
        return q[..., :D_V]

    def scanned(cache, q, indices, rope):
        masked = mask_indices(indices, cache)
        body = lambda q, xs: (decode(q, cache, *xs), None)
        q, _ = jax.lax.scan(body, q, (masked, rope), unroll=scan_unroll)
        return q[..., :D_V]

    extra = xla_options or {}
    steps = {"jax_unrolled": (unrolled, extra or None),
             "jax_scan": (scanned, {**serving.AlternatingStep.LOOP_COMPILER_OPTIONS, **extra})}
    if unguarded:
        steps[UNGUARDED] = (unrolled_unguarded, extra or None)
    return steps


def compiled_jax_steps(inp, scan_unroll=SCAN_UNROLL, xla_options=None, unguarded=False):
    """[(name, the HostQueue its step pushes to, the step through AlternatingStep)] of
    jax_steps, each pushing its out as bench_step.py's steps do, compiled for inp's
    arguments."""
    arguments = inp.arguments()

    def compiled(item):
        name, (step, options) = item
        queue = bench_step.result_queue(inp)
        pushing = bench_step.pushing_step(lambda *a: (None, step(*a)), queue, lambda out: out)
        return name, queue, serving.AlternatingStep(
            jax.jit(pushing, compiler_options=options).lower(*arguments).compile())
    with concurrent.futures.ThreadPoolExecutor(2) as pool:  # XLA compiles off Python's thread
        return list(pool.map(compiled,
                             jax_steps(inp, scan_unroll, xla_options, unguarded).items()))


def run_step_point(inp, steps, torch_sparse, shared_schedule=True,
                   scan_unroll=SCAN_UNROLL, xla_options=None, unguarded=False):
    """The step's record at StepInputs inp: µs per layer, GPU span per layer, outs compared;
    unguarded: also the UNGUARDED step, the protected unrolled step's cost over it
    (unguarded_cost) and whether their outs are the same bit for bit (unguarded_identical)."""
    started = time.perf_counter()
    record = dict(label=step_label(inp.b, inp.context, inp.h_q, inp.s_q), b=inp.b,
                  context=inp.context, h_q=inp.h_q, s_q=inp.s_q, topk=inp.topk,
                  layers=inp.layers, layer_caches=inp.layer_caches, skipped={})
    arguments = inp.arguments()
    launches, outs = {}, {}  # name: (launch a step, sync); name: the last step's out
    start = time.perf_counter()
    made = compiled_jax_steps(inp, scan_unroll, xla_options, unguarded=unguarded)
    record["compile_s"] = round(time.perf_counter() - start, 1)
    for name, queue, step in made:
        pending = [0]  # steps launched and not yet popped: each pushed once

        def launch(name=name, step=step, pending=pending):
            outs[name] = step(*arguments)[1]
            pending[0] += 1

        def wait(queue=queue, pending=pending):
            for _ in range(pending[0]):
                queue.pop()
            pending[0] = 0
        launches[name] = (launch, wait)
    if torch_sparse is not None:
        torch_launches, torch_outs, record["skipped"] = torch_sparse.steps(inp, shared_schedule)
        launches.update(torch_launches)
    runs = {name: (lambda launch=launch, sync=sync: (launch(), sync()))
            for name, (launch, sync) in launches.items()}
    times = bench_step.steps_in_rounds(runs, steps, STEP_ROUNDS)
    for name, samples in times.items():
        record[f"{name}_us"] = round(statistics.median(samples) / inp.layers, 2)
    if unguarded:  # in turns, a step of each per turn: steps timed one variant after the
        # other drifted by up to 3% in bench_step.py, more than the cost's bar
        record["unguarded_cost"] = round(bench_step.cost_in_turns(
            runs[UNGUARDED], runs["jax_unrolled"], steps), 5)
    for name, (launch, sync) in launches.items():
        record[f"{name}_queued_us"] = round(
            bench_step.queued_steps_us(launch, sync, steps) / inp.layers, 2)
    if jax.default_backend() == "gpu":
        for name, span in bench_step.gpu_span_us(runs).items():
            record[f"{name}_gpu_us"] = None if span is None else round(span / inp.layers, 2)
    as_array = lambda out: np.asarray(out if isinstance(out, jax.Array) else out.float().cpu(),
                                      np.float32)
    jax_outs = [as_array(outs[name]) for name, _, _ in made if name != UNGUARDED]
    record["steps_agree"] = all(np.array_equal(out, jax_outs[0]) for out in jax_outs[1:])
    if unguarded:  # the indices are all in range: the protections change no bit
        record["unguarded_identical"] = bool(np.array_equal(as_array(outs[UNGUARDED]),
                                                            as_array(outs["jax_unrolled"])))
    if torch_sparse is not None:
        expected = as_array(torch_outs["torch_graph"])
        for name, out in [*outs.items(), *torch_outs.items()]:
            if name not in ("torch_graph", UNGUARDED):
                record[f"{name}_out_identical"] = bool(np.array_equal(as_array(out), expected))
    record["point_s"] = round(time.perf_counter() - started, 1)
    return record


def matches(label, patterns):
    return any(fnmatch.fnmatch(label, pattern) for pattern in patterns)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--points", nargs="+", default=["*"], metavar="GLOB",
                        help="the points whose label matches, e.g. 'call/*' (per call), "
                             "'step/*', 'call/b128/*' (default: all)")
    parser.add_argument("--layers", type=int, default=GPU["layers"],
                        help="layers per step (default 61)")
    parser.add_argument("--cache-gb", type=float, default=40,
                        help="GiB for the step's stacked cache: layers beyond the caches that "
                             "fit share them (default 40)")
    parser.add_argument("--steps", type=int, default=GPU["steps"],
                        help="timed steps per variant")
    parser.add_argument("--device-repeats", type=int, default=10,
                        help="batches per call's device time (default 10)")
    parser.add_argument("--no-shared-schedule", action="store_true",
                        help="leave out the torch graph with one get_mla_decoding_metadata per "
                             "step (SGLang's way; not yet run: for a run where it faults)")
    parser.add_argument("--call-h-q", type=int, nargs="+", default=None, metavar="H",
                        help="the per-call head counts (default 64 128); others than FlashMLA's "
                             "64 and 128 are padded to them, timed without torch: their cost "
                             "against 64 or 128 heads is the padding's")
    parser.add_argument("--scan-unroll", type=int, default=SCAN_UNROLL,
                        help=f"the scanned step's layers an iteration (default {SCAN_UNROLL})")
    parser.add_argument("--xla-option", action="append", default=[], metavar="NAME=VALUE",
                        help="a compiler option for both jax steps (true/false and integers "
                             "as such), e.g. xla_gpu_enable_dynamic_slice_fusion=true")
    parser.add_argument("--deadline-s", type=float, default=None,
                        help="start no point after this many seconds; the report is still "
                             "written (default: none)")
    parser.add_argument("--unguarded", action="store_true",
                        help="also the unrolled step of the bare custom call on the raw indices "
                             "(no mask, no checks), and the protected step's cost over it "
                             "(h_q 64 or 128, topk a multiple of 64)")
    parser.add_argument("--tiny", action="store_true",
                        help="a small configuration on the default device, without torch")
    parser.add_argument("--out", default=None, help="path prefix of the .json/.md/.png results")
    args = parser.parse_args(argv)
    xla_options = dict(compiler_option(text) for text in args.xla_option)
    grid = TINY if args.tiny else dict(GPU, layers=args.layers, steps=args.steps)
    if args.call_h_q:
        grid = dict(grid, call_h_q=tuple(args.call_h_q))
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    torch_sparse = None if args.tiny else TorchSparse()
    blockers = None if torch_sparse is None else spin_blockers(torch_sparse.torch)
    result = dict(meta=dict(
        device=jax.devices()[0].device_kind, jax=jax.__version__, host=platform.node(),
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        implementation=sparse_implementation(), topk=grid["topk"], layers=grid["layers"],
        softmax_scale=SOFTMAX_SCALE, rotations=grid["rotations"], cache_gb=args.cache_gb,
        device_repeats=None if blockers is None else args.device_repeats,
        steps=grid["steps"], step_rounds=STEP_ROUNDS, scan_unroll=args.scan_unroll,
        xla_options=xla_options,
        torch=None if torch_sparse is None else torch_sparse.info),
        per_call=[], step=[], not_run=[])
    start = time.perf_counter()
    late = lambda: args.deadline_s is not None and time.perf_counter() - start > args.deadline_s

    def save_report():
        if args.out:  # after every part, so that a run cut short keeps what it measured
            sparse_report.write_report(result, args.out)

    for context in grid["call_contexts"]:
        for b in grid["call_b"]:
            shapes = [(h_q, s_q) for h_q in grid["call_h_q"] for s_q in grid["call_s_q"]
                      if matches(call_label(b, context, h_q, s_q), args.points)]
            if not shapes:
                continue
            if late():
                result["not_run"] += [call_label(b, context, *shape) for shape in shapes]
                continue
            records = run_call_group(context, b, shapes, grid, torch_sparse, blockers,
                                     args.device_repeats)
            result["per_call"] += records
            for record in records:
                print(sparse_report.call_line(record), flush=True)
            save_report()
    # The per-call section's executables and garbage left behind slow each synced jax step
    # (its host work, ~2 us a layer at b=1 and 64) until they are gone: the steps run as a
    # serving process, with no other work behind them.
    gc.collect()
    jax.clear_caches()
    h_q, s_q, context = grid["step_h_q"], grid["step_s_q"], grid["step_context"]
    for b in grid["step_b"]:
        label = step_label(b, context, h_q, s_q)
        if not matches(label, args.points):
            continue
        if late():
            result["not_run"].append(label)
            continue
        inp = StepInputs(b, context, h_q, s_q, grid["topk"], grid["layers"], args.cache_gb)
        result["step"].append(run_step_point(inp, grid["steps"], torch_sparse,
                                             not args.no_shared_schedule, args.scan_unroll,
                                             xla_options, args.unguarded))
        print(json.dumps(result["step"][-1]), flush=True)
        del inp
        save_report()
    save_report()
    print("\n".join(sparse_report.summary_lines(result)))
    return result


if __name__ == "__main__":
    main()
