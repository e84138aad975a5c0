"""FlashMLA's decode grid: jax_flashmla against the same FlashMLA op called from
torch, against the pure-JAX reference, and as a decode step of N layers.

Each point is one cache dtype (--dtype): bfloat16, or float8_e4m3fn with one per-tensor k scale
(FlashMLA's dense FP8 decode; q is quantized with that scale once, outside the timed calls, and
given to jax_flashmla and to the torch op alike in FP8, as SGLang hands it to the kernel; the
pure-JAX reference gets it in bf16).

Implementations (--impl):
  flashmla       jf.mla_decode under jax.jit; metadata computed once per (q, block_table) set,
                 outside the timed region (made with the set's block table, as a model's step
                 makes it); lse returned in FlashMLA's layout
                 (jf.serving.lse_format), as the torch op returns it
  torch          FlashMLA's torch op on the same buffers (dlpack), arguments by schema name (GPU)
  reference      the pure-JAX reference under jax.jit, skipped past --ref-budget-gib
  flashmla_step  one jitted decode step as a model's: get_mla_metadata, then --layers decodes
                 sharing it and one block table, each layer over a cache of its own (for an
                 FP8 cache XLA then computes the kernel's table, empty requests as length 1,
                 once for all layers), called through AlternatingStep
  torch_step     the torch loop of the same calls: the metadata op, then --layers decodes (GPU)

Timing, the same for all (benchmarks/timing.py): N calls back to back, then one device sync,
wall clock, median of --repeats; N is chosen so that a repeat lasts about --target-ms, which
keeps the unhidden first dispatch under ~0.5% of it. The implementations take turns within
each repeat, and a ratio to torch is the median of the per-repeat ratios. flashmla and torch
are also timed over batches of N/2 and 2N calls: the slope of a batch's time over its length
is the per-call time without what each batch pays once (the first dispatch, the final sync),
and the ratio of the slopes is reported as the fitted ratio. With --device-time (the default
on a GPU) the two are timed once more under jax.profiler, in turns, by the GPU's own timestamps
(device_time.py): batches of device_time.QUEUED_CALLS calls queued behind a long spinning
kernel, from its end to the batch's last kernel's end, as CUDA events on the stream would be;
the gaps between calls are in it, the host's dispatch (which the profiler slows) and the final
sync are not; the ratio of those is the device ratio. Call i takes set i mod --rotations of
(q, block_table) over one cache, the page order differing between sets, so that the L2 keeps
nothing useful from one call for the next; a step's layers take set 0's block table over
--rotations caches, each cache's pages in another order. FLOPs and bytes follow
FlashMLA's test; GB/s is also given as a fraction of a device-to-device copy measured in the
same run (bytes read + written).

Writes under --out-dir after every point, so that a timeout leaves a partial report: NAME.json,
NAME.md; at the end NAME.png and, with an FP8 cache, NAME_fp8.png (GB/s and TFLOPS;
grid_report.py redraws them from the JSON). NAME defaults to grid_<device>, e.g. grid_h200 or grid_cpu.

    python3 benchmarks/bench_grid.py --deadline-s 420    # a Hopper GPU: the whole grid
    python benchmarks/bench_grid.py --out-dir /tmp/grid   # no GPU: a tiny grid, the C++ model
"""
import argparse
import datetime
import functools
import itertools
import json
import os
import re
import statistics
import time

import jax
import jax.numpy as jnp

import jax_flashmla as jf
from jax_flashmla.caches import fp8

import grid_report
from device_time import QUEUED_CALLS, device_time_in_turns, spin_blockers
from results_io import write_json
from timing import device_copy, paired_ratios, time_in_turns
from torch_side import FP8, TorchSide
from workload import D_QK, D_V, Workload

IMPLS = ("flashmla", "torch", "reference", "flashmla_step", "torch_step")
TORCH_IMPLS = ("torch", "torch_step")
# FlashMLA's own grid (tests/test_flash_mla_decoding.py's benchmark), and a tiny one for CI.
GPU_GRID = dict(batch=128, s_k=[1024, 4096, 8192, 16384], h_q=[16, 32, 64, 128], s_q=[1, 2],
                layers=8, target_ms=50.0, repeats=5, copy_mib=1024)
CPU_GRID = dict(batch=2, s_k=[64, 128], h_q=[16], s_q=[1, 2], layers=2, target_ms=5.0,
                repeats=3, copy_mib=64)
# How a point is timed, recorded in the JSON (--resume only completes a report timed alike):
# implementations in turns within each repeat (the order reversed every other repeat), ratios
# per repeat; the per-call ones also as the slope over batches of 0.5, 1 and 2 times their
# calls (as timing.fit_in_turns); flashmla's lse returned as FlashMLA wrote it (lse_format);
# a step's layers share one block table, each over its own cache, the step called through
# AlternatingStep.
TIMING = ("in alternating turns, per call fitted, lse as written, step over layer caches "
          "through AlternatingStep, metadata with the block table")
FITTED = ("flashmla", "torch")
# Timed by the GPU's timestamps too, where --device-time (device_time.py).
DEVICE_TIMED = ("flashmla", "torch")
# Its batches are short (device_time.QUEUED_CALLS calls): more of them, for a steadier median.
DEVICE_REPEATS_PER_REPEAT = 3
# How the FP8 points hand q to jax_flashmla (reports before this key quantized it in the call).
FP8_Q = "given quantized"


def flashmla_work(batch, sum_s_k, h_q, s_q, dtype):
    """FlashMLA's FLOPs and bytes of one decode (its tests' formulas): the cache and q in the
    cache's dtype (1 byte in FP8), out in bf16."""
    flops = 2 * s_q * sum_s_k * h_q * (D_QK + D_V)
    element = 1 if dtype == FP8 else 2
    nbytes = element * (sum_s_k * D_QK + batch * s_q * h_q * D_QK) + 2 * batch * s_q * h_q * D_V
    return flops, nbytes


def copy_bandwidth(mib, target_ms, repeats, torch_side):
    """GB/s of a device-to-device copy (bytes read + written) through JAX, and through torch
    where it runs; the larger is the ceiling GB/s is compared with."""
    # A copy's speed does not depend on the values copied: ramps, cheap to make (random
    # draws of 64 MiB took 9 s of the CPU grid's run).
    n = mib * 2**19
    xs = [(jnp.arange(n, dtype=jnp.float32) / n + i).astype(jnp.bfloat16) for i in range(2)]
    traffic = 2 * mib * 2**20
    variants = dict(jax=(lambda i: device_copy(xs[i % 2]), jax.block_until_ready))
    if torch_side:
        src = [torch_side.torch.from_dlpack(x) for x in xs]
        dst = torch_side.torch.empty_like(src[0])
        variants["torch"] = (lambda i: dst.copy_(src[i % 2]), torch_side.sync)
    timed, failed = time_in_turns(variants, target_ms=target_ms, repeats=repeats, max_calls=1000,
                                  fitted=())
    if failed:
        raise RuntimeError(f"the copy benchmark failed: {failed}")
    result = dict(mib=mib, **{f"{name}_gbps": traffic / statistics.median(t["samples"]) / 1e9
                              for name, t in timed.items()})
    result["ceiling_gbps"] = max(v for k, v in result.items() if k.endswith("_gbps"))
    return result


@jax.jit
def decode_step(qs, caches, block_table, seq_lens, k_scale):
    """A model's decode step: the metadata once, then one decode per layer, each over its own
    cache, all sharing the metadata and the block table (FP8 caches when k_scale is not
    None)."""
    md = jf.get_mla_metadata(seq_lens, block_table=block_table, num_pages=caches[0].shape[0],
                             num_heads_q=qs[0].shape[2], num_q_tokens=qs[0].shape[1],
                             fp8=k_scale is not None, implementation="custom_call")
    return [jf.mla_decode(q, kv, block_table, seq_lens, metadata=md, k_scale=k_scale,
                          implementation="custom_call")[0]
            for q, kv in zip(qs, caches)]


def bench_point(work, dtype, h_q, s_q, impls, args, torch_side, ceiling_gbps, blockers=None):
    """Times the chosen implementations at one grid point, in turns; returns its JSON record.
    With blockers (device_time.spin_blockers), flashmla and torch also by device time."""
    rot, layers = args.rotations, args.layers
    qs = work.queries(h_q, s_q, rot)
    flops, nbytes = flashmla_work(work.batch, work.sum_s_k, h_q, s_q, dtype)
    point = dict(batch=work.batch, mean_s_k=work.mean_s_k, varlen=work.varlen, dtype=dtype,
                 h_q=h_q, s_q=s_q, sum_s_k=work.sum_s_k, max_s_k=int(work.seq_lens_np.max()),
                 flops=flops, bytes=nbytes, impls={}, skipped={}, checks={})
    bts, sl, kv = work.block_tables, work.seq_lens, work.cache(dtype)
    k_scale = work.k_scale if dtype == FP8 else None
    jax_sync = jax.block_until_ready
    variants, per_call = {}, {}

    # The kernels' q: for an FP8 cache quantized here, once, as the torch side does.
    kernel_qs = qs if k_scale is None else [jax_sync(fp8.quantize(q, k_scale)) for q in qs]
    if "flashmla" in impls:
        # A metadata per set, as a model makes one per step for its block table.
        mds = [jax_sync(jf.get_mla_metadata(sl, block_table=bt, num_pages=kv.shape[0],
                                            num_heads_q=h_q, num_q_tokens=s_q,
                                            fp8=k_scale is not None,
                                            implementation="custom_call"))
               for bt in bts]
        # lse comes back as FlashMLA wrote it, as the torch op returns it (a transposed view
        # for s_q > 1), not transposed by XLA into a new buffer.
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        decode = jax.jit(functools.partial(jf.mla_decode, implementation="custom_call"),
                         out_shardings=(device, jf.serving.lse_format(s_q, device)))
        variants["flashmla"] = (
            lambda i: decode(kernel_qs[i % rot], kv, bts[i % rot], sl, metadata=mds[i % rot],
                             k_scale=k_scale),
            jax_sync)
    if "reference" in impls:
        need = work.reference_bytes(h_q, s_q)
        if need > args.ref_budget_gib * 2**30:
            point["skipped"]["reference"] = (f"needs ~{need / 2**30:.0f} GiB of temporaries, over "
                                             f"--ref-budget-gib {args.ref_budget_gib:g}")
        else:
            reference = jax.jit(functools.partial(jf.mla_decode, implementation="reference"))
            variants["reference"] = (
                lambda i: reference(qs[i % rot], kv, bts[i % rot], sl, k_scale=k_scale), jax_sync)
    if "flashmla_step" in impls:
        step_qs = [kernel_qs[j % rot] for j in range(layers)]
        caches = work.layer_caches(dtype, rot)
        step_caches = [caches[j % rot] for j in range(layers)]
        # Called as a serving loop calls a step, through AlternatingStep.
        step = jf.serving.AlternatingStep(
            decode_step.lower(step_qs, step_caches, bts[0], sl, k_scale).compile())
        variants["flashmla_step"] = (
            lambda i: step(step_qs, step_caches, bts[0], sl, k_scale), jax_sync)
        per_call["flashmla_step"] = layers
    if set(impls) & set(TORCH_IMPLS):
        try:
            md_op, metadata_args, decode_op, decode_args = torch_side.prepare(
                kv, k_scale, sl, qs, bts, h_q, s_q, D_V)
        except RuntimeError as e:  # e.g. a kernel library without the FP8 decode
            for name in set(impls) & set(TORCH_IMPLS):
                point["skipped"][name] = str(e)
            impls = [name for name in impls if name not in TORCH_IMPLS]
    if "torch" in impls:
        metadata = md_op(*metadata_args)[:2]
        torch_calls = [torch_side.decode_with(decode_op, list(a), metadata) for a in decode_args]
        variants["torch"] = (lambda i: decode_op(*torch_calls[i % rot]), torch_side.sync)
    if "torch_step" in impls:
        # Layer j: set j's q over cache j, with set 0's block table, as the jitted step.
        step_args = [torch_side.prepare(cache, k_scale, sl, [q], bts[:1], h_q, s_q, D_V)[3][0]
                     for q, cache in zip(qs, work.layer_caches(dtype, rot))]

        def torch_step(_):
            metadata = md_op(*metadata_args)[:2]
            return [decode_op(*torch_side.decode_with(decode_op, step_args[j % rot], metadata))
                    for j in range(layers)]
        variants["torch_step"] = (torch_step, torch_side.sync)
        per_call["torch_step"] = layers

    timed, failed = time_in_turns(variants, target_ms=args.target_ms, repeats=args.repeats,
                                  max_calls=args.max_calls, fitted=FITTED)
    device_times = {}
    if blockers and set(DEVICE_TIMED) <= set(timed):
        try:
            device_times = device_time_in_turns(
                {name: (*variants[name], blockers[side])
                 for name, side in zip(DEVICE_TIMED, ("jax", "torch"))},
                DEVICE_REPEATS_PER_REPEAT * args.repeats)
            point["checks"]["device_time_kernels"] = {
                name: device_times[name]["kernels"] for name in DEVICE_TIMED}
        except Exception as e:  # the wall-clock figures stand without it
            point["skipped"]["device_time"] = f"failed: {type(e).__name__}: {str(e)[:400]}"
    for name, e in failed.items():
        point["skipped"][name] = f"failed: {type(e).__name__}: {str(e)[:400]}"
        print(f"{name} failed at b={work.batch} s_k={work.mean_s_k} h_q={h_q} s_q={s_q}:",
              point["skipped"][name], flush=True)
    for name in IMPLS:  # the JSON's order
        if name not in timed:
            continue
        t, layers_per_call = timed[name], per_call.get(name, 1)
        samples = t["samples"]
        seconds = statistics.median(samples) / layers_per_call
        r = point["impls"][name] = dict(
            ms=seconds * 1e3, tflops=flops / seconds / 1e12, gbps=nbytes / seconds / 1e9,
            of_copy=nbytes / seconds / 1e9 / ceiling_gbps, calls=t["calls"],
            spread=(max(samples) - min(samples)) / statistics.median(samples),
            repeats_ms=[x / layers_per_call * 1e3 for x in samples])
        if layers_per_call > 1:
            r.update(layers=layers_per_call, step_ms=seconds * layers_per_call * 1e3)
        if t["fits"]:
            r.update(ms_fitted=statistics.median(slope for slope, _ in t["fits"]) * 1e3,
                     per_batch_ms=statistics.median(edge for _, edge in t["fits"]) * 1e3)
        if name in device_times:
            device_samples = device_times[name]["per_call"]
            r.update(device_ms=statistics.median(device_samples) * 1e3,
                     device_busy_ms=statistics.median(device_times[name]["busy_per_call"]) * 1e3,
                     device_repeats_ms=[x * 1e3 for x in device_samples])
        base = "torch_step" if name.endswith("_step") else "torch"
        if name not in TORCH_IMPLS and base in timed:
            # Per repeat, the two were timed one after the other: the median of those ratios.
            r["vs_torch"] = paired_ratios(samples, timed[base]["samples"])[0]
            if name in device_times:
                r["vs_torch_device"] = paired_ratios(device_times[name]["per_call"],
                                                     device_times[base]["per_call"])[0]
            if t["fits"] and timed[base]["fits"]:
                r["vs_torch_fitted"] = paired_ratios([slope for slope, _ in t["fits"]],
                                                     [slope for slope, _ in timed[base]["fits"]])[0]
    _check_outputs(point, {name: t["first"] for name, t in timed.items()}, torch_side)
    return point


def _check_outputs(point, firsts, torch_side):
    """Each first call's out (rotation set 0) against flashmla's: bit-identical to the torch op
    (the same kernel on the same schedule), close to the reference."""
    if "flashmla" not in firsts:
        return
    out = firsts["flashmla"][0]
    if "reference" in firsts:
        diff = jnp.abs(out.astype(jnp.float32) - firsts["reference"][0].astype(jnp.float32))
        point["checks"]["max_abs_diff_vs_reference"] = float(jnp.max(diff))
    if "torch" in firsts:
        point["checks"]["equals_torch"] = bool(torch_side.torch.equal(
            torch_side.torch.from_dlpack(out), firsts["torch"][0]))


def _device_name():
    kind = jax.devices()[0].device_kind
    return re.sub(r"[^a-z0-9]+", "_", kind.lower().replace("nvidia", "")).strip("_") or "device"


def _now():
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _key(point):
    return (point["mean_s_k"], point["varlen"], point.get("dtype", "bfloat16"), point["h_q"],
            point["s_q"])


def parse_args(on_gpu):
    grid = GPU_GRID if on_gpu else CPU_GRID
    bool_arg = lambda s: {"true": True, "false": False}[s.lower()]
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=grid["batch"])
    p.add_argument("--s-k", type=int, nargs="+", default=grid["s_k"], help="mean KV lengths")
    p.add_argument("--dtype", nargs="+", choices=("bfloat16", FP8), default=["bfloat16", FP8],
                   help=f"the cache's dtype ({FP8}: one per-tensor scale, q quantized with it)")
    p.add_argument("--h-q", type=int, nargs="+", default=grid["h_q"])
    p.add_argument("--s-q", type=int, nargs="+", default=grid["s_q"])
    p.add_argument("--varlen", type=bool_arg, nargs="+", default=[False, True],
                   help="false: every request has the mean length; true: FlashMLA's varlen")
    p.add_argument("--impl", nargs="+", choices=IMPLS,
                   default=list(IMPLS if on_gpu else [i for i in IMPLS if i not in TORCH_IMPLS]))
    p.add_argument("--layers", type=int, default=grid["layers"], help="decodes per step")
    p.add_argument("--rotations", type=int, default=4, help="(q, block_table) sets per point")
    p.add_argument("--target-ms", type=float, default=grid["target_ms"],
                   help="length of one timed repeat")
    p.add_argument("--repeats", type=int, default=grid["repeats"])
    p.add_argument("--max-calls", type=int, default=1000, help="calls per repeat at most")
    p.add_argument("--copy-mib", type=int, default=grid["copy_mib"],
                   help="size of the copy that measures the bandwidth ceiling")
    p.add_argument("--ref-budget-gib", type=float, default=24.0,
                   help="skip the reference where its temporaries would exceed this")
    p.add_argument("--device-time", type=bool_arg, default=on_gpu,
                   help="also time flashmla and torch per call by the GPU's timestamps "
                        "(device_time.py; default: on a GPU)")
    p.add_argument("--deadline-s", type=float, default=None,
                   help="start no new point after this many seconds; the report is still written")
    p.add_argument("--resume", action="store_true",
                   help="keep the points of an existing NAME.json and run only the others")
    p.add_argument("--out-dir", default=os.path.join(os.path.dirname(__file__), "results"))
    p.add_argument("--name", default=None, help="file name stem; default grid_<device>")
    args = p.parse_args()
    if not on_gpu and set(args.impl) & set(TORCH_IMPLS):
        p.error(f"{TORCH_IMPLS} need a Hopper GPU with FlashMLA's kernels and the CUDA bridge")
    if not on_gpu and args.device_time:
        p.error("--device-time needs a GPU (it reads the GPU's timestamps)")
    return args


def main():
    started = time.perf_counter()
    # On a GPU the whole comparison or nothing: TorchSide raises naming what FlashMLA lacks.
    on_gpu = jax.default_backend() == "gpu"
    args = parse_args(on_gpu)
    torch_side = TorchSide() if on_gpu else None
    name = args.name or f"grid_{_device_name()}"
    os.makedirs(args.out_dir, exist_ok=True)
    stem = os.path.join(args.out_dir, name)

    if args.resume and os.path.exists(stem + ".json"):
        # A second call completes a first one's grid, on the first's copy ceiling.
        with open(stem + ".json") as f:
            results = json.load(f)
        if results["meta"].get("timing") != TIMING:
            raise SystemExit(f"{stem}.json was timed otherwise ({results['meta'].get('timing')!r}"
                             f", not {TIMING!r}): run the whole grid instead of --resume")
        results["not_run"] = []
        results["meta"].setdefault("resumed", []).append(_now())
        copy = results["meta"]["copy"]
    else:
        copy = copy_bandwidth(args.copy_mib, args.target_ms, args.repeats, torch_side)
        results = dict(meta=dict(
            device=jax.devices()[0].device_kind, backend=jax.default_backend(),
            flashmla_path="FlashMLA's kernels" if on_gpu else "the C++ model (CPU custom call)",
            date=_now(), jax=jax.__version__, dtypes=args.dtype, batch=args.batch,
            layers=args.layers, rotations=args.rotations, target_ms=args.target_ms,
            repeats=args.repeats, timing=TIMING, fp8_q=FP8_Q, impls=args.impl, copy=copy,
            device_time=args.device_time and dict(
                batches=DEVICE_REPEATS_PER_REPEAT * args.repeats, calls=QUEUED_CALLS),
            visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"),
            **(torch_side.info if torch_side else {})), points=[], not_run=[])
    blockers = spin_blockers(torch_side.torch) if args.device_time else None
    print(f"device {jax.devices()[0].device_kind}: copy {copy['ceiling_gbps']:.0f} GB/s "
          f"({json.dumps(copy)})", flush=True)
    done_before = {_key(p) for p in results["points"]}

    grid = list(itertools.product(args.s_k, args.varlen))
    total = len(done_before | set(itertools.product(args.s_k, args.varlen, args.dtype, args.h_q,
                                                    args.s_q)))
    for mean_s_k, varlen in grid:
        work = None
        for dtype, h_q, s_q in itertools.product(args.dtype, args.h_q, args.s_q):
            label = (f"{'varlen' if varlen else 'fixed'} {dtype} s_k={mean_s_k} h_q={h_q} "
                     f"s_q={s_q}")
            if (mean_s_k, varlen, dtype, h_q, s_q) in done_before:
                continue
            if args.deadline_s is not None and time.perf_counter() - started > args.deadline_s:
                results["not_run"].append(dict(mean_s_k=mean_s_k, varlen=varlen, dtype=dtype,
                                               h_q=h_q, s_q=s_q))
                print(f"not run (deadline): {label}", flush=True)
                continue
            if work is None:
                work = Workload(args.batch, mean_s_k, varlen, max(args.s_q), args.rotations,
                                seed=2 * mean_s_k + varlen)
            point = bench_point(work, dtype, h_q, s_q, args.impl, args, torch_side,
                                copy["ceiling_gbps"], blockers)
            results["points"].append(point)
            elapsed = time.perf_counter() - started
            print(f"[{len(results['points'])}/{total} {elapsed:.0f}s] {label}: "
                  f"{grid_report.point_summary(point)}", flush=True)
            write_json(results, stem + ".json")
            grid_report.write_markdown(results, stem + ".md")
        del work  # free this cache before the next one is made
    write_json(results, stem + ".json")
    grid_report.write_markdown(results, stem + ".md")
    written = grid_report.write_plots(results, stem)
    print("\n".join(grid_report.summary_lines(results)))
    print(f"wrote {stem}.json, {stem}.md" + "".join(f", {p}" for p in written)
          + f" in {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
