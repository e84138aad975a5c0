"""How the per-call ratio jax_flashmla / torch-direct depends on the length of the timed batch,
and what jax's sync adds to each batch (GPU machine).

bench_grid.py times batches of ~50 ms: N calls back to back, then one sync. A cost that a
batch pays once (the first dispatch, the final sync's wake-up) is then charged to its calls:
the grid's fits put jax's at ~0.5-1 ms a batch and torch's at or below 0, i.e. 1-2% of a
50 ms batch. This probe times, at a few of the grid's points, batches of 1/4, 1 and 4 times
~50 ms in turns:
  jax              the grid's per-call jax_flashmla, synced with jax.block_until_ready
  jax_device_sync  the same calls, synced with torch.cuda.synchronize() (a device-wide sync,
                   torch's own), so that both sides wait for the GPU the same way
  torch            FlashMLA's torch op on the same buffers, torch.cuda.synchronize()
and, as a floor with no custom call, a jitted device copy of the cache against torch's copy_.
Prints and writes (--out) per-call ms and the ratio to torch per batch length, and the line
through each variant's batch times (slope: the per-call time; intercept: the per-batch cost).
With --device-time it times instead, at the same points, jax against torch and the jitted copy
against copy_ by device time (device_time.py: calls queued behind a spinning kernel, the GPU's
timestamps), which no batch edge reaches: what XLA's time between executions costs a decode,
and a plain copy of about its length.

    python3 benchmarks/probe_batch_edges.py --out benchmarks/results/batch_edges_h200.json
"""
import argparse
import functools
import json
import statistics

import jax

import jax_flashmla as jf
from jax_flashmla import fp8

from device_time import device_time_in_turns, spin_blockers
from timing import (batches_in_turns, device_copy, fit_sizes, line_fit, paired_ratios,
                    size_calls)
from torch_side import FP8, TorchSide
from workload import PAGE, Workload

SCALES = (0.25, 1.0, 4.0)
# (cache dtype, mean s_k, h_q) at b=128, s_q=1, fixed lengths: the grid's points where the
# per-call ratio was furthest from torch's (benchmarks/results/grid_h200.md).
POINTS = (("bfloat16", 4096, 16), ("bfloat16", 8192, 16), ("bfloat16", 16384, 128),
          (FP8, 8192, 16), (FP8, 16384, 128))


def variants_at(work, dtype, h_q, side, rotations):
    """name -> (call taking the call's index, sync): the per-call variants of one point. With
    an FP8 cache the metadata carries no block table, so each call guards its own (session 7's
    way; bench_grid now gives each set a metadata that carries it)."""
    qs = work.queries(h_q, 1, rotations)
    kv, bts, sl = work.cache(dtype), work.block_tables, work.seq_lens
    k_scale = work.k_scale if dtype == FP8 else None
    kernel_qs = qs if k_scale is None else [fp8.quantize(q, k_scale) for q in qs]
    md = jf.get_mla_metadata(sl, num_heads_q=h_q, fp8=k_scale is not None,
                             implementation="flashmla")
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    decode = jax.jit(functools.partial(jf.mla_decode, implementation="flashmla"),
                     out_shardings=(device, jf.lse_format(1, device)))
    jax_call = lambda i: decode(kernel_qs[i % rotations], kv, bts[i % rotations], sl,
                                metadata=md, k_scale=k_scale)
    md_op, md_args, decode_op, decode_args = side.prepare(kv, k_scale, sl, qs, bts, h_q, 1, 512)
    metadata = md_op(*md_args)[:2]
    torch_args = [side.decode_with(decode_op, list(a), metadata) for a in decode_args]
    return dict(jax=(jax_call, jax.block_until_ready),
                jax_device_sync=(jax_call, side.sync),
                torch=(lambda i: decode_op(*torch_args[i % rotations]), side.sync))


def copy_variants(work, side):
    """A jitted device copy of the bf16 cache against torch's copy_ of it."""
    src = side.view(work.kv)
    dst = side.torch.empty_like(src)
    return dict(jax_copy=(lambda i: device_copy(work.kv), jax.block_until_ready),
                torch_copy=(lambda i: dst.copy_(src), side.sync))


def probe(variants, *, target_ms, repeats, max_calls, base):
    """Per variant: batch lengths, per-call ms per length (median over repeats), the ratio to
    `base` per length (median of per-repeat ratios), and the line through the batch times."""
    sizes = {name: fit_sizes(size_calls(call, sync, target_ms=target_ms, max_calls=max_calls)[0],
                             SCALES)
             for name, (call, sync) in variants.items()}
    runs = [batches_in_turns(variants, sizes, repeat) for repeat in range(repeats)]
    # name -> per batch length, the seconds per call of each repeat
    per_call = {name: [[run[name][k] / n for run in runs] for k, n in enumerate(sizes[name])]
                for name in variants}
    report = {}
    for name in variants:
        fits = [line_fit(sizes[name], run[name]) for run in runs]
        report[name] = dict(
            calls=sizes[name], ms=[statistics.median(x) * 1e3 for x in per_call[name]],
            fit_ms_per_call=statistics.median(f[0] for f in fits) * 1e3,
            fit_ms_per_batch=statistics.median(f[1] for f in fits) * 1e3)
        if name != base:
            report[name]["vs_" + base] = [paired_ratios(mine, theirs)[0]
                                          for mine, theirs in zip(per_call[name], per_call[base])]
    return report


def device_probe(variants, base, blockers, repeats):
    """Per variant but jax_device_sync (the same calls as jax): device ms per call and busy ms
    (medians over the batches), and the ratio to `base` (the median of per-batch ratios)."""
    sides = {name: (*variants[name], blockers["torch" if name.startswith("torch") else "jax"])
             for name in variants if name != "jax_device_sync"}
    times = device_time_in_turns(sides, repeats)
    report = {name: dict(device_ms=statistics.median(t["per_call"]) * 1e3,
                         device_busy_ms=statistics.median(t["busy_per_call"]) * 1e3)
              for name, t in times.items()}
    for name in report:
        if name != base:
            report[name]["device_vs_" + base] = paired_ratios(times[name]["per_call"],
                                                              times[base]["per_call"])[0]
    return report


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target-ms", type=float, default=50.0, help="the middle batch length")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--max-calls", type=int, default=1000)
    p.add_argument("--rotations", type=int, default=4)
    p.add_argument("--out", default=None)
    p.add_argument("--device-time", action="store_true",
                   help="time by device time instead of over batch lengths")
    args = p.parse_args()
    side = TorchSide()
    blockers = spin_blockers(side.torch) if args.device_time else None
    results = dict(scales=SCALES, target_ms=args.target_ms, repeats=args.repeats,
                   device_time=args.device_time,
                   device=jax.devices()[0].device_kind, points=[])
    for dtype, s_k, h_q in POINTS:
        work = Workload(128, s_k, False, 1, args.rotations, seed=2 * s_k)
        jobs = [(f"{dtype} s_k={s_k} h_q={h_q}", "torch",
                 lambda: variants_at(work, dtype, h_q, side, args.rotations))]
        if dtype != FP8:  # the FP8 points' caches are the bf16 points' quantized
            jobs.append((f"copy of the s_k={s_k} cache", "torch_copy",
                         lambda: copy_variants(work, side)))
        for label, base, make_variants in jobs:
            if args.device_time:
                report = device_probe(make_variants(), base, blockers, 3 * args.repeats)
                results["points"].append(dict(label=label, dtype=dtype, s_k=s_k, h_q=h_q,
                                              **report))
                print(label, json.dumps(report), flush=True)
                continue
            report = probe(make_variants(), target_ms=args.target_ms, repeats=args.repeats,
                           max_calls=args.max_calls, base=base)
            results["points"].append(dict(label=label, dtype=dtype, s_k=s_k, h_q=h_q,
                                          pages=int(work.kv.shape[0]), page=PAGE, **report))
            print(label)
            for name, r in report.items():
                ratios = r.get("vs_" + base)
                print(f"  {name:16s} calls {r['calls']}  ms/call "
                      + " ".join(f"{x:.4f}" for x in r["ms"])
                      + (f"  vs {base} " + " ".join(f"{x:.3f}" for x in ratios) if ratios else "")
                      + f"  fit {r['fit_ms_per_call']:.4f} ms/call + "
                        f"{r['fit_ms_per_batch']:.3f} ms/batch", flush=True)
        del work
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
