"""DeepSeek-V4's attention kernels in JAX (jax_flashmla.sparse over V4KVCache: FlashMLA's MODEL1
sparse decode and its 512-wide sparse prefill as custom calls) against the same FlashMLA ops
called from torch.

The step: 43 layers shaped as V4-Flash's attention (64 heads, s_q 1, the layer types HF's
DeepseekV4Config gives 43 layers: 23 HCA, 20 CSA), b in {1, 16, 64, 128}, a context of 32768
tokens. Every layer
  - writes its new token's row into its window (a ring of 128 tokens, 2 pages a request),
    quantized to the MODEL1 page;
  - runs the sparse decode over its compressed entries (the main cache: an HCA layer all of its
    context / 128, a CSA layer 512 of its context / 4 at random, as its indexer would pick
    them) and its window (the extra cache: its 128 tokens), with a sink per head;
  - hands its out to the next layer as q.
jax: the layers unrolled in one jitted step (the windows donated, written in place), its last
out pushed to a HostQueue as a serving loop pushes its tokens, called through AlternatingStep;
the schedule made in the program once per distinct set of lengths, one per layer type.
torch: the same in a CUDA graph, replayed: each layer's row quantized by torch ops to the same
bytes and stored by index_put, then sparse_decode_fwd making its own schedule ("torch graph"),
and the same graph with the schedules made once before it ("torch graph, shared schedule": what
a schedule per step costs at least). Steps are timed in turns (ROUNDS rounds, the order reversed
every other round); reported: µs per layer (the median step / 43), with all steps launched
before one sync (queued: the GPU's time), the ratio to the faster torch graph (bar 1.05 at
b >= 16, 1.15 at b = 1), and whether the last out and the windows' bytes equal torch's.

The step with the indexer ("indexer" rows): the same step but each CSA layer picks its 512
entries as V4's indexer does (V4-Flash's 64 index heads of 128 dims, index_topk 512): a query
of its own (random e4m3 values and float32 weights, made once) scored against the layer's
index-key cache (an IndexKeyCache holding random keys of its context / 4 entries at the main
cache's slots: one block table names both), its top 512 the decode's main-cache indices. jax:
v4_indexer_select (jax_flashmla's CUDA scoring and top-k), its selection's slots into the
decode. torch: the same kernels called from torch (torch_indexer.py: neither DeepGEMM's
fp8_paged_mqa_logits nor SGLang's top-k runs here), the positions turned into slots by torch
ops (each entry's slot through the table made once a step, a gather a layer), then
sparse_decode_fwd, all in the graph. Reported beside the out: whether the last CSA layer's
selection equals torch's. This is the step the product's bars are for; the plain step
("step" rows) reads 512 entries picked at random.

The decodes alone ("decode" rows): the plain step with no layer writing its window, on both
sides (torch's writes are torch ops, a dozen kernels a layer where XLA fuses the quantization
into two scatters; without them the step compares the decode calls alone).

Per call, heads: the decode of a CSA layer (512 entries and a 128-token window) at b in {16,
128} for h_q 16, 32, 64 and 128; 16 and 32 run padded to 64 heads (their cost against 64 is the
padding's), and torch's op (64 and 128 only) beside them.

Prefill: sparse_mla_prefill over 512-wide bf16 rows (32768 keys, 4096 query tokens, a sink and
topk lengths) against sparse_prefill_fwd from torch on the same inputs (the indices already in
range and of the kernel's width, so the op's own masking is all it adds), h_q 64 and 128, topk
384 (HCA: 256 entries and the window) and 640 (CSA: 512 and the window); bar: jax at least 0.95x
torch's speed. Per-call times are batches of calls timed in turns (benchmarks/timing.py); on
a GPU also each side's device time (benchmarks/device_time.py: calls queued behind a blocker,
so that no host time counts) and the kernels each side's call runs, µs a call by name: where
the wall clock and the device time disagree, the difference is the host's. The host's own time
to issue a batch, µs a call, says which: near the wall clock, the calls' dispatch (or a wait
inside them) set the pace; far under it, the host sat idle at the sync. jax_thunks is jax's
call compiled without command buffers (XLA launches each op from the host instead of recording
them, the custom call too, into a CUDA graph).

  python benchmarks/bench_v4.py --out benchmarks/results/v4_h200
  python benchmarks/bench_v4.py --parts indexer --out ...   # the step with the indexer alone
  python benchmarks/bench_v4.py --tiny      # CPU: the reference, small, without torch
"""
import argparse
import datetime
import functools
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_step  # noqa: E402  (first: it sets XLA's flags before JAX starts)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jax_flashmla import serving  # noqa: E402
from jax_flashmla.caches.index_keys import INDEX_HEAD_DIM, IndexKeyCache, write_index_keys  # noqa
from jax_flashmla.caches.v4 import PAGE_ROWS, ROW_BYTES, ROW_DIM, V4KVCache  # noqa: E402
from jax_flashmla.base import validation  # noqa: E402
from jax_flashmla.kernels import custom_calls  # noqa: E402
from jax_flashmla.kernels import library as kernels  # noqa: E402
from jax_flashmla.ops import decode, sparse_v4  # noqa: E402
from jax_flashmla.ops.indexer import IndexQuery  # noqa: E402
from jax_flashmla.ops.v4_indexer import v4_indexer_select  # noqa: E402
from jax_flashmla.sparse import sparse_mla_decode, sparse_mla_prefill, write_sparse_kv  # noqa

import v4_report  # noqa: E402
from device_time import QUEUED_CALLS, device_time_in_turns, spin_blockers, traced_calls  # noqa
from results_io import write_json  # noqa: E402
from timing import host_seconds_per_call, paired_ratios, time_in_turns  # noqa: E402
from torch_side import TorchSide, captured  # noqa: E402
import torch_indexer  # noqa: E402

SCALE = ROW_DIM ** -0.5
PAGE = 64
WINDOW = 128
CSA_TOPK = 512  # V4-Flash's index_topk
INDEX_HEADS = 64  # V4-Flash's index_n_heads (of index_head_dim 128)
HCA, CSA = "heavily_compressed_attention", "compressed_sparse_attention"
RATIO = {HCA: 128, CSA: 4}
ROUNDS = 4
STEP_VARIANTS = ("jax", "torch_graph", "torch_graph_shared")
STEP_PARTS = ("step", "indexer", "decode")  # StepInputs' kinds
PARTS = (*STEP_PARTS, "heads", "prefill")
NO_COMMAND_BUFFERS = {"xla_gpu_enable_command_buffer": ""}  # a jit's options: none of its ops
BASE_PAGES = 64  # distinct pages of quantized rows; larger caches repeat them
GPU = dict(step_b=(1, 16, 64, 128), context=32768, layers=43, h_q=64, steps=40,
           call_b=(16, 128), call_h_q=(16, 32, 64, 128), prefill_tokens=4096,
           prefill_keys=32768, prefill_h_q=(64, 128), prefill_topk=(384, 640), target_ms=20.0,
           repeats=5, device_repeats=3)
TINY = dict(step_b=(2,), context=4096, layers=4, h_q=16, steps=3, call_b=(2,),
            call_h_q=(16,), prefill_tokens=16, prefill_keys=256, prefill_h_q=(16,),
            prefill_topk=(128,), target_ms=2.0, repeats=2, device_repeats=0)


def layer_types(layers):
    """HF DeepseekV4Config's default for `layers` layers: two HCA, then CSA and HCA in turn."""
    return [HCA] * min(layers, 2) + [CSA if i % 2 else HCA for i in range(max(layers - 2, 0))]


def implementation():
    return "custom_call" if jax.default_backend() == "gpu" else "reference"


def filled_cache(pages, key):
    """A V4KVCache of `pages` pages: BASE_PAGES pages of random rows, quantized, repeated."""
    base = min(pages, BASE_PAGES)
    rows = jax.random.normal(key, (base * PAGE, ROW_DIM), jnp.float32) / 3
    data = write_sparse_kv(V4KVCache.create(base), jnp.arange(base * PAGE, dtype=jnp.int32),
                           rows).data
    return V4KVCache(jax.block_until_ready(jnp.tile(data, (-(-pages // base), 1, 1))[:pages]))


def filled_index_keys(pages, key):
    """An IndexKeyCache of `pages` pages, every entry a distinct random key (no repeated pages:
    equal keys would tie), quantized as write_index_keys stores them."""
    keys = jax.random.normal(key, (pages * PAGE, INDEX_HEAD_DIM), jnp.bfloat16)
    return jax.block_until_ready(write_index_keys(
        IndexKeyCache.create(pages), jnp.arange(pages * PAGE, dtype=jnp.int32), keys))


def index_query(b, key):
    """A decode token's IndexQuery: values (b, 1, 64, 128) e4m3 (random, within e4m3's range),
    weights (b, 1, 64) float32."""
    values_key, weights_key = jax.random.split(key)
    values = jnp.clip(jax.random.normal(values_key, (b, 1, INDEX_HEADS, INDEX_HEAD_DIM)) * 64,
                      -448, 448).astype(jnp.float8_e4m3fn)
    return IndexQuery(values, jax.random.normal(weights_key, (b, 1, INDEX_HEADS), jnp.float32))


def slots_of(table, entries):
    """Slots of entries (b, n) of each request through its page table (b, pages)."""
    return (np.take_along_axis(table, entries // PAGE, axis=1) * PAGE + entries % PAGE).astype(
        np.int32)


class StepInputs:
    """A step's caches and indices: layer l's window (2 pages a request) and its main cache
    (its layer type's entries for b requests; CSA layers beyond `cache_gb` share caches), the
    indices of both, the first q, each layer's new rows and the sink.

    With `indexer`, a CSA layer's indices are its indexer's selection instead (indices[l]
    None): self.indexer holds keys (per main cache, its IndexKeyCache; None for HCA caches),
    queries (per layer, its IndexQuery; None for HCA layers), table (b, pages) int32 (the CSA
    main caches' and index keys' block table), start (b,) int32 (context - 1, the tokens
    before the new one) and lengths (b,) int32 (1)."""

    def __init__(self, b, context, h_q, layers, cache_gb, writes=True, indexer=False, seed=0):
        self.b, self.context, self.h_q, self.layers = b, context, h_q, layers
        self.writes = writes  # False: the decodes alone, each layer's window as it is
        self.kind = "indexer" if indexer else "step" if writes else "decode"
        self.types = layer_types(layers)
        rng = np.random.default_rng(seed)
        keys = iter(jax.random.split(jax.random.key(seed), 3 * layers + 2))
        index_keys = iter(jax.random.split(jax.random.fold_in(jax.random.key(seed), 1),
                                           2 * layers))
        entries = {t: context // RATIO[t] for t in RATIO}
        pages = {t: b * -(-entries[t] // PAGE) for t in RATIO}
        budget = int(cache_gb * 2**30 // (pages[CSA] * PAGE_ROWS * ROW_BYTES))
        self.main_of, mains, self.indices = [], {}, []
        tables = {t: rng.permutation(pages[t]).astype(np.int32).reshape(b, -1) for t in RATIO}
        for layer, t in enumerate(self.types):
            slot = (t, layer % max(1, budget) if t == CSA else layer)
            if slot not in mains:
                mains[slot] = filled_cache(pages[t], next(keys))
            self.main_of.append(list(mains).index(slot))
            if t == CSA and indexer:
                self.indices.append(None)
                continue
            picked = (np.tile(np.arange(entries[HCA]), (b, 1)) if t == HCA else
                      np.stack([rng.choice(entries[CSA], CSA_TOPK, replace=False)
                                for _ in range(b)]))
            self.indices.append(jnp.asarray(slots_of(tables[t], picked)[:, None]))
        self.mains = list(mains.values())
        self.lengths = {t: jnp.full((b,), entries[HCA] if t == HCA else CSA_TOPK, jnp.int32)
                        for t in RATIO}
        self.indexer = None if not indexer else dict(
            keys=[filled_index_keys(pages[CSA], next(index_keys)) if slot[0] == CSA else None
                  for slot in mains],
            queries=[index_query(b, next(index_keys)) if t == CSA else None for t in self.types],
            table=jnp.asarray(tables[CSA]), start=jnp.full((b,), context - 1, jnp.int32),
            lengths=jnp.ones((b,), jnp.int32))
        ring = rng.permutation(2 * b).astype(np.int32).reshape(b, 2)
        positions = np.arange(context - WINDOW, context)
        self.window_indices = jnp.asarray(slots_of(ring, np.tile(positions % WINDOW, (b, 1)))
                                          [:, None])
        self.window_length = jnp.full((b,), WINDOW, jnp.int32)
        self.write_slots = self.window_indices[:, 0, -1]  # the new token's, position context-1
        self.windows = [filled_cache(2 * b, next(keys)) for _ in range(layers)]
        self.rows = [jax.random.normal(next(keys), (b, ROW_DIM), jnp.bfloat16) / 3
                     for _ in range(layers)]
        self.q0 = jax.random.normal(next(keys), (b, 1, h_q, ROW_DIM), jnp.bfloat16)
        self.sink = jax.random.normal(next(keys), (h_q,), jnp.float32)
        self.main_gb = sum(m.data.nbytes for m in self.mains) / 2**30
        self.index_keys_gb = 0 if not indexer else sum(
            k.data.nbytes for k in self.indexer["keys"] if k is not None) / 2**30
        jax.block_until_ready(self.arguments())  # torch reads them on a stream of its own

    def arguments(self):
        return (self.windows, self.mains, self.q0, self.rows, self.indices, self.lengths,
                self.window_indices, self.window_length, self.write_slots, self.sink,
                self.indexer)


def jax_step(inp):
    """The jitted step (windows donated) returning (windows, (last out, the last CSA layer's
    selected slots (b, 1, 512), None without the indexer))."""
    def step(windows, mains, q, rows, indices, lengths, window_indices, window_length, slots,
             sink, indexer):
        windows, selected = list(windows), None
        for layer, t in enumerate(inp.types):
            if inp.writes:
                windows[layer] = write_sparse_kv(windows[layer], slots, rows[layer])
            if indices[layer] is None:
                selected = v4_indexer_select(
                    indexer["queries"][layer], indexer["keys"][inp.main_of[layer]],
                    indexer["table"], indexer["start"], indexer["lengths"], ratio=RATIO[CSA],
                    topk=CSA_TOPK, implementation=implementation()).slots
            q, _ = sparse_mla_decode(
                q, mains[inp.main_of[layer]],
                selected if indices[layer] is None else indices[layer], topk_length=lengths[t],
                attn_sink=sink, extra_kv_cache=windows[layer], extra_indices=window_indices,
                extra_topk_length=window_length, softmax_scale=SCALE,
                implementation=implementation())
        return windows, (q, selected)
    queue = bench_step.result_queue(inp)
    pushing = bench_step.pushing_step(step, queue, lambda out: out[0])
    compiled = jax.jit(pushing, donate_argnums=0).lower(*inp.arguments()).compile()
    return serving.AlternatingStep(compiled), queue


class TorchV4:
    """FlashMLA's sparse_decode_fwd and sparse_prefill_fwd from torch on JAX's buffers,
    arguments by schema name; the step's windows are torch's own copies, written by torch."""

    def __init__(self):
        self.side = TorchSide()
        self.torch = torch = self.side.torch
        ops = kernels.ensure_cuda_targets()
        resolve = lambda name: getattr(getattr(torch.ops, name.split("::")[0]),
                                       name.split("::")[1])
        self.decode, self.prefill = resolve(ops.sparse_decode), resolve(ops.sparse_prefill)
        self.info = dict(self.side.info, sparse_decode_op=ops.sparse_decode,
                         sparse_prefill_op=ops.sparse_prefill)

    def kv(self, data):
        """A (pages, 65, 576) uint8 torch cache as the kernel's (pages, 64, 1, 584) view."""
        pages = data.shape[0]
        return data.view(self.torch.float8_e4m3fn).as_strided(
            (pages, PAGE, 1, ROW_BYTES + 8), (PAGE_ROWS * ROW_BYTES, ROW_BYTES + 8,
                                              ROW_BYTES + 8, 1))

    def write(self, window, slots, rows):
        """rows (b, 512) bf16 quantized as jax_flashmla.caches.v4.quantize_rows does, stored at
        slots of the (pages, 65, 576) uint8 window."""
        torch = self.torch
        tiles = rows[:, :448].float().reshape(-1, 7, 64)
        ratio = torch.clamp(tiles.abs().amax(-1) / 448.0, min=1e-4)
        mantissa, exponent = torch.frexp(ratio)
        exponent = torch.where(mantissa == 0.5, exponent - 1, exponent)
        values = torch.ldexp(tiles, -exponent[..., None].float()).reshape(-1, 448)
        token = torch.cat([values.to(torch.float8_e4m3fn).view(torch.uint8),
                           rows[:, 448:].contiguous().view(torch.uint8)], dim=-1)
        scale = torch.cat([(exponent + 127).to(torch.uint8),
                           torch.zeros_like(exponent[:, :1], dtype=torch.uint8)], dim=-1)
        pages, offsets = slots // PAGE, slots % PAGE
        window[pages, offsets] = token
        window.view(window.shape[0], PAGE_ROWS * ROW_BYTES // 8, 8)[
            pages, PAGE * ROW_BYTES // 8 + offsets] = scale

    def steps(self, inp, windows, schedules, variants):
        """({name: (launch, sync)}, {name: (its last out, the last CSA layer's selected slots
        (b, 512) or None)}, {name: why not made}): the step over `windows` (torch's copies of
        the step's) captured in CUDA graphs, "torch_graph" with the op's own schedule per
        layer, "torch_graph_shared" with `schedules` ({layer type: (tile_md, num_splits)}, made
        before); those of them in `variants`."""
        torch, view = self.torch, self.side.view
        mains = [self.kv(view(m.data)) for m in inp.mains]
        rows = [view(r) for r in inp.rows]
        indices = [None if i is None else view(i) for i in inp.indices]
        lengths = {t: view(v) for t, v in inp.lengths.items()}
        window_indices, window_length = view(inp.window_indices), view(inp.window_length)
        slots, sink, q0 = view(inp.write_slots).long(), view(inp.sink), view(inp.q0)
        shared = {t: tuple(view(x) for x in s) for t, s in schedules.items()}
        # The JAX arrays behind the views, alive as long as the graphs that read them: with the
        # schedules left to the garbage collector, the graphs met an illegal address once the
        # jax step ran beside them.
        indexers = None if inp.indexer is None else torch_indexer.StepIndexers(
            view, inp.indexer["queries"], inp.indexer["keys"], inp.indexer["table"],
            inp.indexer["start"], RATIO[CSA], CSA_TOPK)
        self.held = (schedules, indexers)

        def step(schedule):
            q, selected = q0, None
            made = None if indexers is None else indexers.per_step()
            for layer, t in enumerate(inp.types):
                if inp.writes:
                    self.write(windows[layer], slots, rows[layer])
                if indices[layer] is None:
                    selected = indexers.select(layer, inp.main_of[layer], made)
                md = schedule.get(t, (None, None))
                q = self.decode(*kernels.arguments_by_name(self.decode, dict(
                    q=q, kv=mains[inp.main_of[layer]],
                    indices=selected[:, None] if indices[layer] is None else indices[layer],
                    topk_length=lengths[t], attn_sink=sink, tile_scheduler_metadata=md[0],
                    num_splits=md[1], extra_kv=self.kv(windows[layer]),
                    extra_indices=window_indices, extra_topk_length=window_length, d_v=ROW_DIM,
                    sm_scale=SCALE)))[0]
            return q, selected

        launches, outs, skipped = {}, {}, {}
        sync = lambda: torch.cuda.synchronize()
        for name, schedule in (("torch_graph", {}), ("torch_graph_shared", shared)):
            if name not in variants:
                continue
            try:
                replay, outs[name] = captured(torch, functools.partial(step, schedule))
                launches[name] = (replay, sync)
            except RuntimeError as e:  # a schedule not the op's own may be refused
                if not schedule:
                    raise
                skipped[name] = f"failed: {str(e)[:300]}"
        return launches, outs, skipped


def step_schedules(inp):
    """{layer type: (tile_md, num_splits)}: the schedule the step's decodes make in its
    program, made once outside it."""
    parts = validation.num_sm_parts(decode.default_num_sms(), inp.h_q, 1)
    return {t: jax.block_until_ready(custom_calls.schedule(
        sparse_v4.scheduled_lengths(inp.lengths[t], inp.window_length), num_heads_q=inp.h_q,
        num_q_tokens=1, num_sm_parts=parts, fp8=False)) for t in RATIO}


def run_step_point(inp, steps, torch_v4, variants=STEP_VARIANTS):
    record = dict(label=f"{inp.kind}/b{inp.b}", b=inp.b, context=inp.context, h_q=inp.h_q,
                  layers=inp.layers, main_cache_gb=round(inp.main_gb, 2),
                  index_keys_gb=round(inp.index_keys_gb, 2), skipped={})
    start = time.perf_counter()
    step, queue = jax_step(inp)
    record["compile_s"] = round(time.perf_counter() - start, 1)
    state = dict(windows=inp.windows)
    args = inp.arguments()[1:]
    outs, pending = {}, [0]

    def launch():
        state["windows"], outs["jax"] = step(state["windows"], *args)
        pending[0] += 1

    def wait():
        for _ in range(pending[0]):
            queue.pop()
        pending[0] = 0
    launches = {"jax": (launch, wait)} if "jax" in variants else {}
    torch_windows = None if torch_v4 is None else [
        torch_v4.side.view(w.data).clone() for w in inp.windows]  # before jax's donate them
    if launches:
        # A first step before torch captures its graphs: a torch graph captured before the
        # process's first FlashMLA custom call and replayed after it met an illegal address.
        launch(), wait()
    if torch_v4 is not None:
        more, torch_outs, record["skipped"] = torch_v4.steps(
            inp, torch_windows, step_schedules(inp), variants)
        launches.update(more)
        outs.update(torch_outs)
    runs = {name: (lambda launch=launch, sync=sync: (launch(), sync()))
            for name, (launch, sync) in launches.items()}
    times = bench_step.steps_in_rounds(runs, steps, ROUNDS)
    for name, samples in times.items():
        record[f"{name}_us"] = round(statistics.median(samples) / inp.layers, 2)
        record[f"{name}_queued_us"] = round(
            bench_step.queued_steps_us(*launches[name], steps) / inp.layers, 2)
    if "jax" in runs:  # (reading it also surfaces any fault of the step's kernels)
        jax_out, jax_selected = outs["jax"]
        record["jax_out_finite"] = bool(np.isfinite(np.asarray(jax_out, np.float32)).all())
    if torch_v4 is not None and "jax" in runs and len(runs) > 1:
        best = min((n for n in runs if n != "jax"), key=lambda n: record[f"{n}_us"])
        record["torch_best"] = best
        record["ratio"] = round(record["jax_us"] / record[f"{best}_us"], 4)
        record["queued_ratio"] = round(record["jax_queued_us"] / record[f"{best}_queued_us"], 4)
        record["bar"] = 1.15 if inp.b == 1 else 1.05
        jax_out = np.asarray(jax_out, np.float32)
        for name in runs:
            if name != "jax":
                theirs, selected = outs[name]
                theirs = theirs.float().cpu().numpy()
                record[f"{name}_out_identical"] = bool(np.array_equal(jax_out, theirs))
                record[f"{name}_out_max_diff"] = float(np.max(np.abs(jax_out - theirs)))
                if selected is not None:  # the last CSA layer's: (b, 1, 512) against (b, 512)
                    record[f"{name}_selection_identical"] = bool(np.array_equal(
                        np.asarray(jax_selected)[:, 0], selected.cpu().numpy()))
        record["windows_identical"] = all(
            np.array_equal(np.asarray(mine.data), theirs.cpu().numpy())
            for mine, theirs in zip(state["windows"], torch_windows))
    record["point_s"] = round(time.perf_counter() - start, 1)
    return record


def call_variants(b, context, h_qs, torch_v4, seed=0):
    """{name: (call(i), sync)}: a CSA layer's decode at each head count (and torch's at 64,
    128)."""
    inp = StepInputs(b, context, max(h_qs), 4, cache_gb=4, seed=seed)  # its 4th layer CSA
    layer = inp.types.index(CSA)
    decode_jit = jax.jit(functools.partial(
        sparse_mla_decode, softmax_scale=SCALE, implementation=implementation()))
    variants = {}
    for h_q in h_qs:
        q, sink = inp.q0[:, :, :h_q], inp.sink[:h_q]
        kwargs = dict(topk_length=inp.lengths[CSA], attn_sink=sink,
                      extra_kv_cache=inp.windows[layer], extra_indices=inp.window_indices,
                      extra_topk_length=inp.window_length)
        variants[f"jax_h{h_q}"] = (
            lambda i, q=q, kw=kwargs: decode_jit(q, inp.mains[inp.main_of[layer]],
                                                 inp.indices[layer], **kw)[0],
            jax.block_until_ready)
        if torch_v4 is not None and h_q in (64, 128):
            view = torch_v4.side.view
            args = kernels.arguments_by_name(torch_v4.decode, dict(
                q=view(q), kv=torch_v4.kv(view(inp.mains[inp.main_of[layer]].data)),
                indices=view(inp.indices[layer]), topk_length=view(inp.lengths[CSA]),
                attn_sink=view(sink), extra_kv=torch_v4.kv(view(inp.windows[layer].data)),
                extra_indices=view(inp.window_indices),
                extra_topk_length=view(inp.window_length), d_v=ROW_DIM, sm_scale=SCALE))
            variants[f"torch_h{h_q}"] = (lambda i, args=args: torch_v4.decode(*args)[0],
                                         lambda _: torch_v4.torch.cuda.synchronize())
    return variants


def prefill_variants(tokens, keys, h_q, topk, torch_v4, seed=0):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(0, 1, (tokens, h_q, ROW_DIM)), jnp.bfloat16)
    kv = jnp.asarray(rng.normal(0, 0.3, (keys, ROW_DIM)), jnp.bfloat16)
    indices = jnp.asarray(np.stack([rng.choice(keys, topk, replace=False)
                                    for _ in range(tokens)]).astype(np.int32))
    lengths = jnp.asarray(rng.integers(topk // 2, topk + 1, tokens), jnp.int32)
    sink = jnp.asarray(rng.normal(0, 1, h_q), jnp.float32)
    call = functools.partial(sparse_mla_prefill, softmax_scale=SCALE,
                             implementation=implementation())
    # jax_thunks: the same call compiled without command buffers, each op launched from the
    # host, so that a cost of XLA's recording the custom call into a CUDA graph shows.
    variants = {name: (lambda i, prefill=jax.jit(call, compiler_options=options):
                       prefill(q, kv, indices, topk_length=lengths, attn_sink=sink)[0],
                       jax.block_until_ready)
                for name, options in (("jax", None), ("jax_thunks", NO_COMMAND_BUFFERS))}
    if torch_v4 is not None:
        view = torch_v4.side.view
        torch_v4.held = (kv[:, None, :], indices[:, None, :])  # alive while torch reads them
        args = kernels.arguments_by_name(torch_v4.prefill, dict(
            q=view(q), kv=view(torch_v4.held[0]), indices=view(torch_v4.held[1]),
            sm_scale=SCALE, d_v=ROW_DIM, attn_sink=view(sink), topk_length=view(lengths)))
        variants["torch"] = (lambda i: torch_v4.prefill(*args)[0],
                             lambda _: torch_v4.torch.cuda.synchronize())
    return variants


def kernels_per_call(call, sync, calls=QUEUED_CALLS, shown=4):
    """{kernel name (its first 60 characters): µs a call} of `calls` calls of call(i) back to
    back under a trace, the `shown` longest in total."""
    totals = {}
    for e in traced_calls(call, sync, calls):
        totals[e.name[:60]] = totals.get(e.name[:60], 0) + e.end - e.start
    longest = sorted(totals.items(), key=lambda item: -item[1])[:shown]
    return {name: round(ns / calls / 1e3, 2) for name, ns in longest}


def prefill_device_time(variants, blockers, repeats):
    """jax's and torch's prefill device time, µs a call (median of `repeats` batches in turns),
    the ratio torch's / jax's, and each side's kernels (kernels_per_call)."""
    variants = {name: variants[name] for name in blockers if name in variants}
    per_call = device_time_in_turns(
        {name: (call, sync, blockers[name]) for name, (call, sync) in variants.items()}, repeats)
    record = dict(device_us={name: round(statistics.median(r["per_call"]) * 1e6, 2)
                             for name, r in per_call.items()},
                  kernels_us={name: kernels_per_call(call, sync)
                              for name, (call, sync) in variants.items()})
    if "torch" in per_call:
        record["device_speed_vs_torch"] = round(
            record["device_us"]["torch"] / record["device_us"]["jax"], 4)
    return record


def timed(variants, grid):
    """({name: µs per call (median)}, {name: per-repeat seconds}, {name: calls a batch}) of
    variants in turns."""
    results, failed = time_in_turns(variants, target_ms=grid["target_ms"],
                                    repeats=grid["repeats"], max_calls=4000, fitted=())
    for name, e in failed.items():
        print(f"  {name} failed: {str(e)[:300]}", flush=True)
    return ({name: round(statistics.median(r["samples"]) * 1e6, 2)
             for name, r in results.items()},
            {name: r["samples"] for name, r in results.items()},
            {name: r["calls"] for name, r in results.items()})


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", nargs="+", default=PARTS, choices=PARTS,
                        help="what to run (default all): the plain step, the step with the "
                             "indexer, the decodes alone, the decode by heads, the prefill")
    parser.add_argument("--variants", nargs="+", default=STEP_VARIANTS, choices=STEP_VARIANTS,
                        help="the step's variants (default all)")
    parser.add_argument("--b", type=int, nargs="+", default=None, help="the step's batches")
    parser.add_argument("--cache-gb", type=float, default=16,
                        help="GiB for the CSA layers' main caches; beyond, layers share them")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per variant")
    parser.add_argument("--deadline-s", type=float, default=None,
                        help="start no point after this many seconds")
    parser.add_argument("--tiny", action="store_true",
                        help="a small configuration on the default device, without torch")
    parser.add_argument("--out", default=None, help="path prefix of the .json/.md/.png results")
    args = parser.parse_args(argv)
    grid = dict(TINY if args.tiny else GPU)
    if args.b:
        grid["step_b"] = tuple(args.b)
    if args.steps:
        grid["steps"] = args.steps
    torch_v4 = None if args.tiny else TorchV4()
    if torch_v4 is not None and "indexer" in args.parts:  # built and loaded before any point
        torch_v4.info["indexer_library"] = torch_indexer.build()
        torch_indexer.library()
    result = dict(meta=dict(
        device=jax.devices()[0].device_kind, jax=jax.__version__, host=platform.node(),
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        implementation=implementation(), layers=grid["layers"], context=grid["context"],
        h_q=grid["h_q"], steps=grid["steps"], rounds=ROUNDS, cache_gb=args.cache_gb,
        index_heads=INDEX_HEADS, index_topk=CSA_TOPK,
        layer_types={t: layer_types(grid["layers"]).count(t) for t in RATIO},
        torch=None if torch_v4 is None else torch_v4.info),
        step=[], indexer=[], decode=[], heads=[], prefill=[], not_run=[])
    start = time.perf_counter()
    late = lambda: args.deadline_s is not None and time.perf_counter() - start > args.deadline_s

    def save():
        if args.out:
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            write_json(result, args.out + ".json")
            v4_report.write_report(result, args.out)

    for part in STEP_PARTS:
        for b in grid["step_b"] if part in args.parts else ():
            if late():
                result["not_run"].append(f"{part}/b{b}")
                continue
            inp = StepInputs(b, grid["context"], grid["h_q"], grid["layers"], args.cache_gb,
                             writes=part != "decode", indexer=part == "indexer")
            result[part].append(run_step_point(inp, grid["steps"], torch_v4, args.variants))
            print(result[part][-1], flush=True)
            del inp
            save()
    if "prefill" in args.parts:
        blockers = (spin_blockers(torch_v4.torch)
                    if torch_v4 is not None and grid["device_repeats"] else None)
        for h_q in grid["prefill_h_q"]:
            for topk in grid["prefill_topk"]:
                label = f"prefill/h{h_q}/topk{topk}"
                if late():
                    result["not_run"].append(label)
                    continue
                variants = prefill_variants(grid["prefill_tokens"], grid["prefill_keys"], h_q,
                                            topk, torch_v4)
                us, samples, calls = timed(variants, grid)
                # The host's time to issue a wall-clock batch, µs a call: where it nears the
                # wall clock, the host (or a wait inside the call) set the pace.
                host_us = {name: round(host_seconds_per_call(*variants[name], n) * 1e6, 2)
                           for name, n in calls.items()}
                record = dict(label=label, tokens=grid["prefill_tokens"],
                              keys=grid["prefill_keys"], h_q=h_q, topk=topk, us=us,
                              host_us=host_us)
                if "torch" in samples and "jax" in samples:
                    # torch's time over jax's, per repeat: (median, min, max)
                    record["speed_vs_torch"] = [round(r, 4) for r in paired_ratios(
                        samples["torch"], samples["jax"])]
                    record["bar"] = 0.95
                if blockers is not None:
                    try:
                        record.update(prefill_device_time(variants, blockers,
                                                          grid["device_repeats"]))
                    except Exception as e:  # the wall clock stands without it
                        record["device_time_failed"] = f"{type(e).__name__}: {str(e)[:300]}"
                del variants
                result["prefill"].append(record)
                print(record, flush=True)
        save()
    if "heads" in args.parts:
        for b in grid["call_b"]:
            label = f"heads/b{b}"
            if late():
                result["not_run"].append(label)
                continue
            us, samples, _ = timed(
                call_variants(b, grid["context"], grid["call_h_q"], torch_v4), grid)
            record = dict(label=label, b=b, context=grid["context"], us=us)
            if "jax_h64" in samples:
                record["cost_vs_h64"] = {name: round(paired_ratios(s, samples["jax_h64"])[0], 4)
                                         for name, s in samples.items()}
            result["heads"].append(record)
            print(record, flush=True)
            save()
    save()
    print("\n".join(v4_report.summary_lines(result)))
    return result


if __name__ == "__main__":
    main()
