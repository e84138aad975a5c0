"""A model's decode step as a serving loop runs it: L layers, each writing every request's new
576-wide rows into that layer's cache (write_kv) and then decoding (mla_decode), the metadata
once per step, a sync after each step (jitted steps: popping what the step pushed to a
jax_flashmla.serving.HostQueue, as a serving loop reads its sampled tokens).

The layers' caches are one array, as a JAX model holds them: all layers' pages in one
(L * P, 64, 1, 576) cache, layer l's pages at l * P onwards, its block table the step's
plus l * P. As in a model, each layer's inputs come from the layer before: its q from that
out's 512 latent columns and its own 64 rope columns, the latent of its new rows from head 0's
out; so every layer is live, each write follows the decode before it, and the step has one
output. With --rows-from-inputs the new rows are the step's inputs instead: no write then
waits for the decode before it, and XLA copies a stacked cache at each layer's write to keep
that decode's reads intact (the compiled HLO shows the copies).
jax_flashmla runs it jitted three ways: that stacked cache under lax.scan (with
jax_flashmla.serving.AlternatingStep.LOOP_COMPILER_OPTIONS, SCAN_UNROLL layers per iteration)
and unrolled over the layers, and with one cache array per layer. Beside those: the same step
of FlashMLA's torch ops (an indexed write of the rows, the decode, the concatenation) captured
in a torch CUDA graph and replayed, as SGLang serves decode, and eagerly; and the per-layer
step with a trivial fusion in place of each decode, which is what JAX itself costs for that
many arrays. With
--unguarded the unrolled step also runs with the physical decode in place of mla_decode, on the
step's lengths and table as they are and their schedule (no range check, no metadata lengths:
the cost of decoding out-of-range requests empty and stale requests NaN); with --value-checks,
traced under jax_flashmla.value_checks() (checkify), its error thrown after each step.

Reported per point: µs per layer (the median step's wall clock / L) and the GPU's span per
layer (first kernel's start to last kernel's end of a step, from the profiler's trace); for the
torch graph and the stacked steps through AlternatingStep also µs per layer with all steps
launched before one sync (queued: the GPU's time per step, the host's launch hidden); and
whether the jitted steps' out is bit-identical to the torch step's. On CPU (--tiny) it runs a
small configuration through the C++ target, without torch.

  python benchmarks/bench_step.py --out benchmarks/results/step_h200
"""
import argparse
import concurrent.futures
import functools
import json
import os
import platform
import statistics
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
# The GPU span is read from a profile, which must not change how the step runs.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_enable_command_buffers_during_profiling=true").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import checkify  # noqa: E402

import jax_flashmla as jf  # noqa: E402
from jax_flashmla import serving  # noqa: E402
from jax_flashmla.base import validation  # noqa: E402
from jax_flashmla.caches import fp8  # noqa: E402
from jax_flashmla.kernels import custom_calls, decode_primitive  # noqa: E402
from jax_flashmla.ops import decode as ops  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from device_time import profile_options, traced  # noqa: E402
import step_report  # noqa: E402
from step_report import SAFETY_PAIRS, write_report  # noqa: E402
from timing import turn_order  # noqa: E402

PAGE, D_QK, D_V = 64, 576, 512
FP8 = "float8_e4m3fn"
JAX_LAYOUTS = ("scan", "unrolled", "per_layer", "scan_alternating", "unrolled_alternating")
# With --unguarded: the unrolled step of physical decodes on the raw lengths and table;
# with --value-checks: the unrolled step traced under jax_flashmla.value_checks(), checkified,
# its error thrown after each step.
UNGUARDED, CHECKED = "unrolled_unguarded", "unrolled_checked"
SAFETY_LAYOUTS = (UNGUARDED, UNGUARDED + "_alternating", CHECKED)
ALTERNATING = {"scan_alternating": "scan", "unrolled_alternating": "unrolled",
               UNGUARDED + "_alternating": UNGUARDED}
GRID_B = (1, 4, 16, 32, 64, 128)
GRID_S_K = (1024, 4096, 16384)
GRID_H_Q = (16, 128)
EXTRA_B = (1, 16, 128)  # FP8 and s_q = 2, at s_k = 4096
PROFILED_STEPS = 2
# Layers per iteration of the scanned step's loop (lax.scan's unroll): the loop's own kernels
# (its counter, the slices of the stacked inputs) then run once per SCAN_UNROLL layers.
SCAN_UNROLL = 4
# What each jitted step pushes to the host (jax_flashmla.serving.HostQueue): the first
# RESULT_COLUMNS of head 0's last out per request, as a model's step pushes its sampled tokens;
# the queue holds the steps of queued_steps_us's rounds.
RESULT_COLUMNS = 8
QUEUE_DEPTH = 64
# Also timed with all steps launched before one sync: the GPU's own time per step (the
# report's queued columns, less their jax_ prefix).
QUEUED = tuple(key.removeprefix("jax_") for key, _ in step_report.QUEUED)


def grid_points():
    """s_k = 4096 first, then FP8 and s_q = 2 there, then the other lengths."""
    bf16 = lambda s_k: [(b, s_k, h, 1, "bfloat16") for h in GRID_H_Q for b in GRID_B]
    extra = [(b, 4096, h, s_q, dtype) for h in GRID_H_Q for b in EXTRA_B
             for s_q, dtype in ((1, FP8), (2, "bfloat16"))]
    return bf16(4096) + extra + [p for s_k in GRID_S_K if s_k != 4096 for p in bf16(s_k)]


def default_cache_gb(device):
    """GiB for one copy of the layers' caches: 30, or a third of what JAX may allocate on the
    device (its bytes_limit, 75% of the memory by default) where that is less. The stacked and
    per-layer caches and torch's are three copies: 3 x 30 GiB do not fit an 80 GB card, and
    a step then waits on XLA's allocator instead of failing. 30 where the device reports no
    limit (CPU)."""
    limit = (device.memory_stats() or {}).get("bytes_limit")
    return 30.0 if limit is None else min(30.0, limit / 2**30 / 3)


class Point:
    """One configuration's inputs: the stacked cache of L layers (P pages each, a random base
    cache shifted by a page per layer), the step's block table (a random page order) and
    lengths (all s_k), each layer's rows, rope columns and first q."""

    def __init__(self, b, s_k, h_q, s_q, dtype, layers, cache_gb, rows_from_inputs=False,
                 unguarded=False, value_checks=False, seed=0):
        if (unguarded or value_checks) and dtype == FP8:
            # The protections are measured on bf16 points (the unguarded step calls the bf16
            # decode's custom call).
            raise ValueError("--unguarded and --value-checks are for bf16 points")
        self.b, self.s_k, self.h_q, self.s_q, self.dtype = b, s_k, h_q, s_q, dtype
        self.rows_from_inputs, self.unguarded = rows_from_inputs, unguarded
        self.value_checks = value_checks
        pages_per_request = -(-s_k // PAGE)
        self.pages = b * pages_per_request
        itemsize = 1 if dtype == FP8 else 2
        layer_bytes = self.pages * PAGE * D_QK * itemsize
        self.layers = max(1, min(layers, int(cache_gb * 2**30 // layer_bytes)))
        rng = np.random.default_rng(seed)
        order = rng.permutation(self.pages).astype(np.int32)
        self.block_table = jnp.asarray(order.reshape(b, pages_per_request))
        self.seq_lens = jnp.full((b,), s_k, jnp.int32)
        # The new tokens are each request's last s_q.
        positions = s_k - s_q + jnp.arange(s_q, dtype=jnp.int32)
        self.slots = jf.token_slots(self.block_table, jnp.broadcast_to(positions, (b, s_q)))
        keys = jax.random.split(jax.random.key(seed), 4)
        self.k_scale = jnp.float32(1 / 400) if dtype == FP8 else None
        base = jnp.clip(jax.random.normal(keys[0], (self.pages, PAGE, 1, D_QK), jnp.float32)
                        / 10, -1, 1)
        base = fp8.quantize(base, self.k_scale) if dtype == FP8 else base.astype(jnp.bfloat16)
        self.base = jax.block_until_ready(base)
        self.rows = jax.random.normal(keys[1], (self.layers, b, s_q, D_QK), jnp.bfloat16) / 10
        self.rope = jax.random.normal(keys[2], (self.layers, b, s_q, h_q, D_QK - D_V),
                                      jnp.bfloat16) / 10
        self.q0 = jax.random.normal(keys[3], (b, s_q, h_q, D_QK), jnp.bfloat16) / 10
        self.softmax_scale = 192 ** -0.5

    def tables(self):
        """The step's block table, lengths, new rows' slots and FP8 scale: arguments of the
        jitted steps, not constants in them (AlternatingStep needs an executable without
        closed-over arrays)."""
        return dict(block_table=self.block_table, seq_lens=self.seq_lens, slots=self.slots,
                    k_scale=self.k_scale)

    def stacked_cache(self):
        """All layers' pages in one cache: layer l's are the base cache rolled by l pages."""
        L, base = self.layers, self.base
        # base is an argument: closed over, a cache of GBs would be a constant of the program.
        return jax.jit(lambda base: jnp.concatenate([jnp.roll(base, l, axis=0)
                                                     for l in range(L)]))(base)

    def layer_caches(self):
        roll = jax.jit(lambda base, layer: jnp.roll(base, layer, axis=0))
        return [roll(self.base, jnp.int32(layer)) for layer in range(self.layers)]


def _layer(p, t, cache, offset, q, latent, rows, md):
    """One layer on a cache whose layer pages start at page `offset`: the write of the new
    rows (their latent from the layer before, as a model's come from its hidden state), then
    the decode through the step's block table shifted there; md is the step's metadata, or
    with --unguarded the schedule (tile_scheduler_metadata, num_splits) of its raw lengths."""
    if not p.rows_from_inputs:
        rows = jnp.concatenate([latent, rows[..., D_V:]], axis=-1)
    cache = jf.write_kv(cache, t["slots"] + offset * PAGE, kv=rows, scale=t["k_scale"])
    table = t["block_table"] + offset
    if isinstance(md, tuple):
        return cache, _unguarded_decode(p, q, cache, table, t["seq_lens"], md)
    scale = dict(k_scale=t["k_scale"]) if p.dtype == FP8 else {}
    out, _ = jf.mla_decode(q, cache, table, t["seq_lens"], metadata=md,
                           softmax_scale=p.softmax_scale, implementation="custom_call", **scale)
    return cache, out


def _unguarded_decode(p, q, cache, block_table, seq_lens, schedule):
    """The bf16 decode's custom call on the inputs as they are: mla_decode less its range
    check and its metadata's lengths."""
    operands = dict(q=q, kv_cache=cache, block_table=block_table, seq_lens=seq_lens,
                    tile_scheduler_metadata=schedule[0], num_splits=schedule[1])
    out, _ = decode_primitive.mla_decode(operands, softmax_scale=float(p.softmax_scale),
                                         causal=True, num_sms=ops.default_num_sms(),
                                         implementation="custom_call")
    return out


def _next(out, rope):
    """The next layer's q (out's 512 latent columns and its own rope columns) and the latent
    of its new rows (head 0's out)."""
    out = out.astype(jnp.bfloat16)
    return jnp.concatenate([out, rope], axis=-1), out[:, :, 0, :]


def _metadata(p, t, unguarded=False):
    """The step's metadata (from its block table and a layer's pages: an out-of-range request
    is decoded empty); unguarded, the schedule of the raw lengths alone."""
    if unguarded:
        return tuple(custom_calls.schedule(
            t["seq_lens"], num_heads_q=p.h_q, num_q_tokens=p.s_q, fp8=False,
            num_sm_parts=validation.num_sm_parts(ops.default_num_sms(), p.h_q, p.s_q)))
    return jf.get_mla_metadata(t["seq_lens"], block_table=t["block_table"], num_pages=p.pages,
                               num_heads_q=p.h_q, num_q_tokens=p.s_q, fp8=p.dtype == FP8,
                               implementation="custom_call")


def result_queue(p):
    """The HostQueue a jitted step of point p pushes its result to."""
    return serving.HostQueue((p.b, RESULT_COLUMNS), jnp.bfloat16, depth=QUEUE_DEPTH)


def pushing_step(step, queue, last_out):
    """step (returning (caches, out)) that also pushes RESULT_COLUMNS of last_out(out), head 0's
    per request, to queue."""
    def step_that_pushes(*args):
        caches, out = step(*args)
        queue.push(last_out(out)[:, 0, 0, :RESULT_COLUMNS])
        return caches, out
    return step_that_pushes


def jax_steps(p, xla_options=None, scan_unroll=SCAN_UNROLL, queues=None):
    """{layout: (jitted step, its arguments maker)}; each step returns (caches, last out).
    xla_options: more compiler options for every jitted step; scan_unroll: lax.scan's unroll
    (layers per iteration of the scanned step's loop); queues: {layout: HostQueue} into which
    that layout's step pushes RESULT_COLUMNS of its last out (jax_flashmla.serving.HostQueue:
    a serving loop's sampled tokens), made here where not given."""
    queues = {} if queues is None else queues

    def pushing(layout, step):
        if layout not in queues:
            queues[layout] = result_queue(p)
        return pushing_step(step, queues[layout],
                            (lambda out: out[0]) if layout == CHECKED else (lambda out: out))

    def scan_step(stack, rows, rope, q, t):
        md = _metadata(p, t)

        def body(carry, xs):
            stack, q, latent = carry
            layer, rows_l, rope_l = xs
            stack, out = _layer(p, t, stack, layer * p.pages, q, latent, rows_l, md)
            return (stack, *_next(out, rope_l)), None
        (stack, q, _), _ = jax.lax.scan(body, (stack, q, rows[0, ..., :D_V]),
                                        (jnp.arange(p.layers, dtype=jnp.int32), rows, rope),
                                        unroll=scan_unroll)
        return stack, q[..., :D_V]

    def unrolled_step(stack, rows, rope, q, t, unguarded=False):
        md = _metadata(p, t, unguarded)
        latent = rows[0, ..., :D_V]
        for layer in range(p.layers):
            stack, out = _layer(p, t, stack, layer * p.pages, q, latent, rows[layer], md)
            q, latent = _next(out, rope[layer])
        return stack, q[..., :D_V]

    def per_layer_step(caches, rows, rope, q, t):
        md = _metadata(p, t)
        caches, latent = list(caches), rows[0, ..., :D_V]
        for layer in range(p.layers):
            caches[layer], out = _layer(p, t, caches[layer], 0, q, latent, rows[layer], md)
            q, latent = _next(out, rope[layer])
        return caches, q[..., :D_V]

    def trivial_step(caches, rows, rope, q, t):
        """per_layer_step with a fusion in place of each decode."""
        caches, latent = list(caches), rows[0, ..., :D_V]
        for layer in range(p.layers):
            new = rows[layer] if p.rows_from_inputs else jnp.concatenate(
                [latent, rows[layer][..., D_V:]], axis=-1)
            caches[layer] = jf.write_kv(caches[layer], t["slots"], kv=new, scale=t["k_scale"])
            q, latent = _next(q[..., :D_V] * 0.5, rope[layer])
        return caches, q[..., :D_V]

    extra = dict(xla_options or {})
    jit = lambda f, options=None: jax.jit(f, donate_argnums=0,
                                          compiler_options={**(options or {}), **extra} or None)
    loop_options = jf.serving.AlternatingStep.LOOP_COMPILER_OPTIONS
    steps = {"scan": (scan_step, loop_options, p.stacked_cache),
             "unrolled": (unrolled_step, None, p.stacked_cache),
             "per_layer": (per_layer_step, None, p.layer_caches),
             "per_layer_trivial": (trivial_step, None, p.layer_caches)}
    if p.unguarded:
        steps[UNGUARDED] = (functools.partial(unrolled_step, unguarded=True), None,
                           p.stacked_cache)
    if p.value_checks:
        def checked_step(stack, rows, rope, q, t):
            with jf.value_checks():
                error, (stack, out) = checkify.checkify(unrolled_step)(stack, rows, rope, q, t)
            return stack, (out, error)
        steps[CHECKED] = (checked_step, None, p.stacked_cache)
    return {layout: (jit(pushing(layout, step), options), make)
            for layout, (step, options, make) in steps.items()}


def time_steps(run, steps, warmup=3):
    """Wall clock (µs) of each of `steps` steps, each synced; after `warmup` steps."""
    for _ in range(warmup):
        run()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        run()
        times.append((time.perf_counter() - start) * 1e6)
    return times


def steps_in_rounds(runs, steps, rounds):
    """{name: wall clock (µs) of each of about `steps` synced steps of runs[name]}, the runs
    taking turns over `rounds` rounds, the order reversed every other round: no variant always
    follows the same one (torch's heavier graph, say), and a drift hits all alike."""
    times = {name: [] for name in runs}
    for round_ in range(rounds):
        for name in turn_order(runs, round_):
            times[name] += time_steps(runs[name], -(-steps // rounds),
                                      warmup=3 if round_ == 0 else 1)
    return times


def queued_steps_us(launch, sync, steps, rounds=3):
    """Wall clock (µs) per step with `steps` steps launched before one sync, the median of
    `rounds`: the GPU's time per step wherever the host launches faster than the GPU runs."""
    launch(), sync()
    per_step = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(steps):
            launch()
        sync()
        per_step.append((time.perf_counter() - start) * 1e6 / steps)
    return statistics.median(per_step)


def cost_in_turns(plain, other, steps):
    """Median over `steps` turns of other's step time over plain's, minus 1; each turn runs a
    step of each, in an order that alternates between turns, so that drift affects both."""
    for _ in range(3):
        plain(), other()
    ratios = []
    for turn in range(steps):
        times = {}
        for name, run in (("plain", plain), ("other", other))[::1 if turn % 2 else -1]:
            start = time.perf_counter()
            run()
            times[name] = time.perf_counter() - start
        ratios.append(times["other"] / times["plain"])
    return statistics.median(ratios) - 1


def step_activities(runs):
    """{name: the GPU activities of each of PROFILED_STEPS steps}: each run's steps under one
    trace, each inside a host annotation; a step's activities are those starting inside it."""
    def all_runs():
        for name, run in runs.items():
            for k in range(PROFILED_STEPS):
                with jax.profiler.TraceAnnotation(f"step {name} {k}"):
                    run()
    gpu, _, host = traced(all_runs, profile_options())
    steps = {}
    for name in runs:
        steps[name] = []
        for k in range(PROFILED_STEPS):
            (window,) = [(e.start, e.end) for e in host if e.name == f"step {name} {k}"]
            steps[name].append([e for e in gpu if window[0] <= e.start < window[1]])
    return steps


def gpu_span_us(runs):
    """{name: median GPU span (µs) of a step}: step_activities' steps, a step's span its first
    GPU activity's start to its last's end."""
    spans = {}
    for name, steps in step_activities(runs).items():
        per_step = [(max(e.end for e in inside) - min(e.start for e in inside)) / 1e3
                    for inside in steps if inside]
        spans[name] = statistics.median(per_step) if per_step else None
    return spans


def run_point(p, steps, torch_side, xla_options=None, sync="host_queue"):
    """sync: how the host waits for a jitted step: "host_queue" pops what the step pushed,
    "block" is jax.block_until_ready on its out."""
    started = time.perf_counter()
    record = dict(b=p.b, s_k=p.s_k, h_q=p.h_q, s_q=p.s_q, dtype=p.dtype, layers=p.layers)
    launches, outs = {}, {}  # name: (launch a step, sync)
    if torch_side is not None:
        torch_launches, torch_out = torch_side.steps(p)
        launches.update(torch_launches)
    queues = {}
    variants = jax_steps(p, xla_options, queues=queues)
    unpopped = {layout: 0 for layout in queues}
    args = (p.rows, p.rope, p.q0, p.tables())
    # Variants of one cache layout share its arrays (each donates and returns them): every
    # step writes the same rows to the same slots, so they hold the same values for each.
    made = {make: make() for _, make in variants.values()}
    state = {name: made[make] for name, (_, make) in variants.items()}
    # Compiling the variants at once: XLA compiles on other threads than Python's.
    with concurrent.futures.ThreadPoolExecutor(len(variants)) as pool:
        start = time.perf_counter()
        compiled = dict(zip(variants, pool.map(
            lambda name: variants[name][0].lower(state[name], *args).compile(), variants)))
        record["compile_s"] = round(time.perf_counter() - start, 1)
    for name, single in ALTERNATING.items():
        if single in compiled:
            compiled[name] = jf.serving.AlternatingStep(compiled[single])
            variants[name] = variants[single]

    def launcher(name):
        make, layout = variants[name][1], ALTERNATING.get(name, name)

        def launch():
            made[make], outs[name] = compiled[name](made[make], *args)
            unpopped[layout] += 1
            if name == CHECKED:
                outs[name], error = outs[name]
                error.throw()  # a host sync, as a loop that checks each step pays it

        def wait():  # for every step launched: each pushed once
            for _ in range(unpopped[layout]):
                queues[layout].pop()
            unpopped[layout] = 0
            if sync == "block":
                jax.block_until_ready(outs[name])
        return launch, wait

    for name in variants:
        launches[name] = launcher(name)
    runs = {name: (lambda launch=launch, sync=sync: (launch(), sync()))
            for name, (launch, sync) in launches.items()}
    wall = {name: statistics.median(time_steps(run, steps)) / p.layers
            for name, run in runs.items()}
    queued = {name: queued_steps_us(*launches[name], steps) / p.layers
              for name in QUEUED if name in launches}
    for plain, other, _ in SAFETY_PAIRS:  # timed in turns for the cost, a step of each per turn
        if plain in runs and other in runs:
            record[f"{other}_cost"] = round(cost_in_turns(runs[plain], runs[other], steps), 5)
    on_gpu = jax.default_backend() == "gpu"
    span = {name: (s / p.layers if s is not None else None)
            for name, s in (gpu_span_us(runs) if on_gpu else dict.fromkeys(runs)).items()}
    for name in runs:
        key = "jax_" + name if name in variants else name
        record[f"{key}_us"] = round(wall[name], 2)
        record[f"{key}_gpu_us"] = None if span[name] is None else round(span[name], 2)
        if name in queued:
            record[f"{key}_queued_us"] = round(queued[name], 2)
    decodes = [name for name in variants if name != "per_layer_trivial"]
    first = np.asarray(outs[decodes[0]], np.float32)
    record["layouts_agree"] = all(np.array_equal(np.asarray(outs[name], np.float32), first)
                                  for name in decodes[1:])
    if torch_side is not None:
        expected = np.asarray(torch_out(), np.float32)
        for name in decodes:
            record[f"{name}_out_identical"] = bool(np.array_equal(
                np.asarray(outs[name], np.float32), expected))
    record["point_s"] = round(time.perf_counter() - started, 1)
    return record


def records_by_layout(raw):
    """The result's records: one per (point, jax layout) measured."""
    records = []
    for r in raw:
        base = {k: r[k] for k in ("b", "s_k", "h_q", "s_q", "dtype", "layers", "compile_s")}
        for layout in (l for l in (*JAX_LAYOUTS, *SAFETY_LAYOUTS) if f"jax_{l}_us" in r):
            rec = dict(base, layout=layout, jax_us=r[f"jax_{layout}_us"],
                       jax_gpu_us=r[f"jax_{layout}_gpu_us"])
            if f"jax_{layout}_queued_us" in r:
                rec["jax_queued_us"] = r[f"jax_{layout}_queued_us"]
            for key in ("torch_graph", "torch_eager"):
                for suffix in ("_us", "_gpu_us", "_queued_us"):
                    if key + suffix in r:
                        rec[key + suffix] = r[key + suffix]
            if "torch_graph_us" in r:
                rec["vs_torch_graph"] = round(rec["jax_us"] / r["torch_graph_us"], 3)
                rec["out_identical"] = r[f"{layout}_out_identical"]
            if layout == "per_layer":
                rec["trivial_fusion_us"] = r["jax_per_layer_trivial_us"]
            records.append(rec)
    return records


def _option(text):
    """NAME=VALUE as XLA takes it: true/false as a bool, digits as an int, else the text."""
    name, value = text.split("=", 1)
    if value in ("true", "false"):
        return name, value == "true"
    return name, int(value) if value.lstrip("-").isdigit() else value


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=61, help="layers per step (default 61)")
    parser.add_argument("--cache-gb", type=float, default=None,
                        help="GiB for one copy of the layers' caches, fewer layers where L do "
                             "not fit (default 30, or a third of what JAX may allocate where "
                             "less; the stacked and per-layer caches and torch's are three "
                             "copies)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per variant")
    parser.add_argument("--points", default="grid",
                        help="'grid' (the whole grid), or b,s_k,h_q,s_q,dtype;... (default grid)")
    parser.add_argument("--part", default="0/1",
                        help="K/N: run every N-th point from the K-th (default 0/1, all)")
    parser.add_argument("--deadline-s", type=float, default=None,
                        help="start no point after this many seconds (default: none)")
    parser.add_argument("--xla-option", action="append", default=[], metavar="NAME=VALUE",
                        help="a compiler option for every jitted step (repeatable)")
    parser.add_argument("--rows-from-inputs", action="store_true",
                        help="each layer's new rows are inputs of the step, not made from the "
                             "layer before (default: made from it, as in a model)")
    parser.add_argument("--unguarded", action="store_true",
                        help="also the unrolled step of the physical decode on the raw lengths "
                             "and table (no range check, no metadata lengths), to compare; "
                             "bf16 only")
    parser.add_argument("--value-checks", action="store_true",
                        help="also the unrolled step traced under jax_flashmla.value_checks() "
                             "(checkified, its error thrown after each step), to compare; "
                             "bf16 only")
    parser.add_argument("--sync", choices=("host_queue", "block"), default="host_queue",
                        help="how the host waits for a jitted step: pop what it pushed to a "
                             "jax_flashmla.serving.HostQueue (default, as a serving loop reads "
                             "its tokens), or also jax.block_until_ready on its out")
    parser.add_argument("--tiny", action="store_true",
                        help="a small configuration on the default device, without torch")
    parser.add_argument("--out", default=None, help="path prefix of the .json/.md/.png results")
    args = parser.parse_args()
    if args.tiny:
        points, torch_side = [(2, 128, 16, 1, "bfloat16"), (2, 128, 16, 2, FP8)], None
    else:
        from torch_side import TorchStep
        torch_side = TorchStep()
        points = grid_points() if args.points == "grid" else [
            (*map(int, p.split(",")[:4]), p.split(",")[4]) for p in args.points.split(";")]
    xla_options = dict(_option(option) for option in args.xla_option)
    cache_gb = args.cache_gb or default_cache_gb(jax.devices()[0])
    k, n = map(int, args.part.split("/"))
    start, raw = time.perf_counter(), []
    for b, s_k, h_q, s_q, dtype in points[k::n]:
        if args.deadline_s is not None and time.perf_counter() - start > args.deadline_s:
            print(f"deadline: stopped before b={b} s_k={s_k} h_q={h_q} s_q={s_q} {dtype}")
            break
        p = Point(b, s_k, h_q, s_q, dtype, 3 if args.tiny else args.layers, cache_gb,
                  args.rows_from_inputs, args.unguarded, args.value_checks)
        raw.append(run_point(p, 3 if args.tiny else args.steps, torch_side, xla_options,
                             args.sync))
        print(json.dumps(raw[-1]), flush=True)
        del p
        result = dict(device=jax.devices()[0].device_kind, jax=jax.__version__,
                      host=platform.node(), xla_options=xla_options, scan_unroll=SCAN_UNROLL,
                      sync=args.sync,
                      rows_from_inputs=args.rows_from_inputs,
                      unguarded=args.unguarded,
                      value_checks=args.value_checks,
                      records=records_by_layout(raw), raw=raw,
                      torch=None if torch_side is None else torch_side.info)
        if args.out:  # after every point, so that a run cut short keeps what it measured
            write_report(result, args.out)
    return result


if __name__ == "__main__":
    main()
