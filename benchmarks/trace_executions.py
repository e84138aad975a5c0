"""What the GPU waits for between two jitted executions, as XLA's own profiler sees it.

torch's profiler records only torch's CUDA API calls (profile_decode.py); XLA's CUPTI tracer
(jax.profiler) records every driver call in the process, XLA's included. For each variant (one
jitted mla_decode per call, the same keeping every call's results alive, one jitted device copy
per call, and the torch op and torch's copy_ in the same loops; with --fp8, an FP8 cache with q
given in bf16 or already in FP8, and the torch op given it in FP8) this runs `--calls` calls
under jax.profiler, then reports:
  - per call: the GPU's span, busy and idle time (all streams), each GPU activity's count and
    mean duration, each driver API call's count and mean duration (all threads), and XLA's
    host-side annotations (TraceMe) per call;
  - the longest gaps and where in the run they fall;
  - for a few consecutive gaps in the steady state: the activities on either side, the gap,
    how long before the gap's end the second activity was launched (positive: the GPU waited
    on something other than the host), and every driver call the host made between the two
    launches, with its thread.

    python benchmarks/trace_executions.py --s-k 8192 --h-q 16 --out results/trace.txt
"""
import argparse
import collections
import statistics

import jax
import jax.numpy as jnp

import jax_flashmla as jf
from jax_flashmla import fp8

from device_time import profile_options, traced

GAPS_SHOWN = 4


def per_call(events, calls):
    by_name = collections.defaultdict(list)
    for e in events:
        by_name[e.name[:80]].append((e.end - e.start) / 1e3)
    rows = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))
    return {name: dict(per_call=len(d) / calls, mean_us=statistics.mean(d)) for name, d in rows}


def gaps(gpu, api):
    """Each idle stretch of the GPU: (idle µs, activity before, activity after, how long the
    after-activity's launch call returned before the GPU went idle... negative: launched late)."""
    launches = {e.correlation: e for e in api if e.correlation is not None}
    found, cursor = [], gpu[0]
    for e in gpu[1:]:
        if e.start > cursor.end:
            launch = launches.get(e.correlation)
            found.append(dict(idle_us=(e.start - cursor.end) / 1e3, before=cursor, after=e,
                              launch=launch))
        if e.end > cursor.end:
            cursor = e
    return found


def summarize(name, gpu, api, host, calls):
    span = gpu[-1].end - gpu[0].start
    busy = 0
    cursor = gpu[0].start
    for e in gpu:
        start = max(e.start, cursor)
        if e.end > start:
            busy += e.end - start
            cursor = e.end
    # Launch calls are recorded on either plane, by version.
    calls_made = sorted(api + host, key=lambda e: e.start)
    found = gaps(gpu, calls_made)
    median_gap = statistics.median(g["idle_us"] for g in found) if found else 0.0
    lines = [f"== {name}: {calls} calls, per call: span {span / calls / 1e3:.1f} us, busy "
             f"{busy / calls / 1e3:.1f}, idle {(span - busy) / calls / 1e3:.2f} "
             f"({len(found)} gaps; median {median_gap:.2f} us)"]
    # jax 0.11's tracer puts the driver calls on the host plane, among XLA's annotations;
    # other versions give them a plane of their own.
    tables = (("GPU", gpu), ("driver API", api), ("host: XLA and driver calls", host))
    for title, events in tables:
        if not events:
            continue
        lines.append(f"  {title}, per call:")
        lines += [f"    {row['per_call']:6.2f} x {row['mean_us']:8.2f} us  {n}"
                  for n, row in per_call(events, calls).items()]
    streams = sorted({e.line for e in gpu})
    lines.append(f"  GPU lines: {streams}")
    # Where the long gaps fall: the first calls of a run (the host not yet ahead) or anywhere.
    longest = sorted(range(len(found)), key=lambda i: -found[i]["idle_us"])[:GAPS_SHOWN]
    lines.append("  longest gaps (us at gap number): " + ", ".join(
        f"{found[i]['idle_us']:.1f} at {i}" for i in sorted(longest)))
    # Consecutive gaps from the middle of the run, where the queue is in its steady state.
    middle = found[len(found) // 2:len(found) // 2 + GAPS_SHOWN]
    for g in middle:
        before, after, launch = g["before"], g["after"], g["launch"]
        lines.append(f"  gap {g['idle_us']:.2f} us: {before.name[:50]} [{before.line}] -> "
                     f"{after.name[:50]} [{after.line}]")
        if launch is None:
            lines.append("    (no launch call found for the second activity)")
            continue
        lines.append(f"    launched {(before.end - launch.end) / 1e3:+.1f} us before the GPU "
                     f"went idle, by {launch.name[:60]} [{launch.line}]")
        previous = [e for e in calls_made if e.correlation == before.correlation]
        since = previous[0].end if previous else launch.start
        between = [e for e in calls_made if since <= e.start < launch.start]
        lines.append(f"    host calls between the two launches ({len(between)}):")
        lines += [f"      {(e.start - since) / 1e3:8.2f} us +{(e.end - e.start) / 1e3:6.2f}  "
                  f"{e.name[:60]} [{e.line}]" for e in between[:40]]
    return "\n".join(lines)


def looped(call, sync, calls, keep_results=False):
    """A run of `calls` calls of call(i), then sync on the last result; with keep_results,
    every call's result stays alive until the end (none of their buffers is reused)."""
    def run():
        kept = []
        for i in range(calls):
            result = call(i)
            if keep_results:
                kept.append(result)
        sync(result)
    return run


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--s-k", type=int, default=8192)
    parser.add_argument("--h-q", type=int, default=16)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--calls", type=int, default=40)
    parser.add_argument("--fp8", action="store_true",
                        help="an FP8 cache: q given in bf16 (quantized in the call) or in FP8")
    parser.add_argument("--no-torch", action="store_true", help="only the jax variants")
    parser.add_argument("--out", help="also write the report here")
    args = parser.parse_args()
    from bench_decode import _inputs
    from timing import device_copy

    q, kv, bt, sl = _inputs(args.batch, args.s_k, args.h_q, 1)
    jax_sync, variants = jax.block_until_ready, {}
    side = None
    if not args.no_torch:
        from torch_side import TorchSide
        side = TorchSide()
    if args.fp8:
        k_scale = jnp.max(jnp.abs(kv)).astype(jnp.float32) / fp8.FP8_MAX
        kv8, q8 = (jax_sync(fp8.quantize(x, k_scale)) for x in (kv, q))
        md = jax_sync(jf.get_mla_metadata(sl, num_heads_q=args.h_q, fp8=True))
        decode = jax.jit(lambda q, kv, bt, sl, md, s: jf.mla_decode(q, kv, bt, sl, metadata=md,
                                                                    k_scale=s))
        variants["jax_decode_q_bf16"] = looped(lambda _: decode(q, kv8, bt, sl, md, k_scale),
                                               jax_sync, args.calls)
        variants["jax_decode_q_fp8"] = looped(lambda _: decode(q8, kv8, bt, sl, md, k_scale),
                                              jax_sync, args.calls)
        if side:
            torch_call = side.decode_call(kv8, sl, q, bt, args.h_q, 1, k_scale=k_scale)
            variants["torch_decode_q_fp8"] = looped(lambda _: torch_call(), side.sync,
                                                    args.calls)
    else:
        md = jax_sync(jf.get_mla_metadata(sl, num_heads_q=args.h_q))
        decode = jax.jit(lambda q, kv, bt, sl, md: jf.mla_decode(q, kv, bt, sl, metadata=md))
        sources = [jnp.full((kv.size // 2,), i, jnp.bfloat16) for i in range(2)]
        variants["jax_decode"] = looped(lambda _: decode(q, kv, bt, sl, md), jax_sync, args.calls)
        variants["jax_decode_results_kept"] = looped(lambda _: decode(q, kv, bt, sl, md),
                                                     jax_sync, args.calls, keep_results=True)
        variants["jax_copy"] = looped(lambda i: device_copy(sources[i % 2]), jax_sync,
                                      args.calls)
        if side:
            torch_call = side.decode_call(kv, sl, q, bt, args.h_q, 1)
            torch_sources = [side.torch.from_dlpack(x) for x in sources]
            destination = side.torch.empty_like(torch_sources[0])
            variants["torch_decode"] = looped(lambda _: torch_call(), side.sync, args.calls)
            variants["torch_copy"] = looped(
                lambda i: destination.copy_(torch_sources[i % 2]), side.sync, args.calls)
    reports = [f"trace_executions: b={args.batch} s_k={args.s_k} h_q={args.h_q} s_q=1, "
               f"{'FP8' if args.fp8 else 'bf16'} cache, {args.calls} calls per variant, "
               f"{jax.devices()[0].device_kind}"]
    for name, run in variants.items():
        run()  # compiles and warms up outside the trace
        reports.append(summarize(name, *traced(run, profile_options()), args.calls))
        print(reports[-1], flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n\n".join(reports) + "\n")


if __name__ == "__main__":
    main()
