"""Where the GPU time of one decode goes: mla_decode under jit against the torch op, as seen by
CUPTI (torch's profiler records every kernel and copy in the process, XLA's included).

For each variant (the torch op in a loop, the torch op plus two copies of its results, one
jitted mla_decode per call, a jitted step of 8 decodes with 8 different queries and the torch
loop over the same queries (on the default stream, on a created one as XLA's is, and keeping
its results as the step does), jitted steps of 1 and 2 decodes, and with no custom call at all
one jitted device copy per call against torch's copy_) it reports per decode (per call): the
span from the first GPU activity to the last, the time the GPU was busy, the idle rest, and
each kernel or copy with its count and mean duration; how long each GPU activity waited after
its launch call returned (near zero: the GPU was starved by the host); the host's pace, the
median time between the launches of successive decodes; the costliest host-side torch ops and
CUDA API calls per decode, and the count of each CUDA API call that torch's profiler sees.

    python benchmarks/profile_decode.py --out benchmarks/results/profile_h200.json
"""
import argparse
import json
import os
import statistics
import tempfile

import jax
import jax.numpy as jnp

import jax_flashmla as jf

from bench_decode import _inputs
from timing import device_copy
from torch_side import TorchSide

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_CATEGORIES = ("cuda_runtime", "cuda_driver")
DECODE_KERNEL = "flash_fwd_splitkv_mla_kernel"  # FlashMLA's main kernel, once per decode
HOST_CATEGORIES = ("cpu_op", "cuda_runtime", "cuda_driver")
HOST_ROWS = 12


def summarize_trace(trace, decodes):
    """Per-decode GPU timeline statistics of a chrome trace (torch.profiler's export)."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    gpu = sorted((e for e in events if e.get("cat") in GPU_CATEGORIES), key=lambda e: e["ts"])
    if not gpu:
        raise RuntimeError("the profile holds no GPU activity (is CUPTI available?)")
    busy, cursor = 0.0, gpu[0]["ts"]
    for e in gpu:
        start, end = max(e["ts"], cursor), e["ts"] + e["dur"]
        if end > start:
            busy += end - start
            cursor = end
    span = max(e["ts"] + e["dur"] for e in gpu) - gpu[0]["ts"]
    by_name = {}
    for e in gpu:
        by_name.setdefault(e["name"][:90], []).append(e["dur"])
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("cat") in LAUNCH_CATEGORIES and "correlation" in e.get("args", {})}
    launched = [(e, launches[e["args"]["correlation"]]) for e in gpu
                if e.get("args", {}).get("correlation") in launches]
    waits = [e["ts"] - (launch["ts"] + launch["dur"]) for e, launch in launched]
    # The host's pace: time between the launches of successive decodes' first kernel.
    decode_launches = sorted(launch["ts"] for e, launch in launched if DECODE_KERNEL in e["name"])
    intervals = [b - a for a, b in zip(decode_launches, decode_launches[1:])]
    # The host side: torch ops and CUDA API calls (from any thread: XLA's too), the costliest.
    host = {}
    for e in events:
        if e.get("cat") in HOST_CATEGORIES:
            host.setdefault(e["name"][:60], []).append(e["dur"])
    top_host = sorted(host.items(), key=lambda kv: -sum(kv[1]))[:HOST_ROWS]
    # Every CUDA API call the trace holds, however cheap, as calls per decode. Only torch's:
    # CUPTI through torch's profiler does not record the driver calls XLA makes.
    api_calls = {}
    for e in events:
        if e.get("cat") in LAUNCH_CATEGORIES:
            api_calls[e["name"]] = api_calls.get(e["name"], 0) + 1
    per_decode = lambda groups: {name: dict(per_decode=len(durs) / decodes,
                                            mean_us=statistics.mean(durs))
                                 for name, durs in groups}
    return dict(
        span_us=span / decodes, busy_us=busy / decodes, idle_us=(span - busy) / decodes,
        activities=per_decode(sorted(by_name.items(), key=lambda kv: -sum(kv[1]))),
        host_activities=per_decode(top_host),
        api_calls_per_decode={name: n / decodes for name, n in sorted(api_calls.items())},
        launch_to_start_us=dict(median=statistics.median(waits), min=min(waits)) if waits else None,
        host_us_between_decodes=statistics.median(intervals) if intervals else None)


def profile(torch, run, sync, decodes):
    """Runs `run` (which issues `decodes` decodes) under torch's profiler, once warm."""
    from torch.profiler import ProfilerActivity
    run()
    sync()
    with torch.profiler.profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run()
        sync()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            return summarize_trace(json.load(f), decodes)


def profile_point(side, batch, s_k, h_q, calls, layers, step_layers=()):
    torch = side.torch
    q, kv, bt, sl = _inputs(batch, s_k, h_q, 1)
    q_layers = [q * (1 + i / layers) for i in range(layers)]
    md = jax.block_until_ready(jf.get_mla_metadata(sl, num_heads_q=h_q))
    decode = jax.jit(lambda q, kv, bt, sl, md: jf.mla_decode(q, kv, bt, sl, metadata=md))
    torch_call = side.decode_call(kv, sl, q, bt, h_q, 1)
    out_buf = torch.empty((batch, 1, h_q, 512), dtype=torch.bfloat16, device="cuda")
    lse_buf = torch.empty((batch, h_q, 1), dtype=torch.float32, device="cuda")

    def torch_loop():
        for _ in range(calls):
            torch_call()

    def torch_copies_loop():
        for _ in range(calls):
            out, lse = torch_call()[:2]
            out_buf.copy_(out)
            lse_buf.copy_(lse)

    torch_layer_calls = [side.decode_call(kv, sl, ql, bt, h_q, 1) for ql in q_layers]

    def torch_step_loop():
        for _ in range(calls // layers):
            for call in torch_layer_calls:
                call()

    def torch_step_results_kept_loop():
        """As XLA's step, which returns every layer's out: each call's results stay alive, so
        FlashMLA writes to fresh memory each time instead of the block just freed."""
        kept = []
        for _ in range(calls // layers):
            kept.extend(call() for call in torch_layer_calls)

    # XLA runs on a stream it created; torch's calls above run on the legacy default stream,
    # which may treat FlashMLA's programmatic dependent launches differently.
    created_stream = torch.cuda.Stream()

    def torch_step_on_a_created_stream_loop():
        with torch.cuda.stream(created_stream):
            torch_step_loop()

    def jax_loop():
        for _ in range(calls):
            result = decode(q, kv, bt, sl, md)
        jax.block_until_ready(result)

    def jax_step(n):
        """(a loop of jitted steps of n decodes, the decodes it runs)."""
        step = jax.jit(lambda qs, kv, bt, sl, md: [jf.mla_decode(q, kv, bt, sl, metadata=md)
                                                   for q in qs])

        def loop():
            for _ in range(calls // n):
                result = step(q_layers[:n], kv, bt, sl, md)
            jax.block_until_ready(result)
        return loop, calls // n * n

    # The same per-call pattern with no custom call: one jitted device copy per call, moving the
    # cache's bytes (about the decode's time), against torch's copy_ of the same buffers.
    sources = [jnp.full((kv.size // 2,), i, jnp.bfloat16) for i in range(2)]
    torch_sources = [torch.from_dlpack(x) for x in sources]
    torch_destination = torch.empty_like(torch_sources[0])

    def jax_copy_loop():
        for i in range(calls):
            result = device_copy(sources[i % 2])
        jax.block_until_ready(result)

    def torch_copy_loop():
        for i in range(calls):
            torch_destination.copy_(torch_sources[i % 2])

    sync = torch.cuda.synchronize
    step_loop, step_decodes = jax_step(layers)
    point = dict(batch=batch, s_k=s_k, h_q=h_q, calls=calls, layers=layers,
                 torch=profile(torch, torch_loop, sync, calls),
                 torch_with_copies=profile(torch, torch_copies_loop, sync, calls),
                 jax_one_call=profile(torch, jax_loop, sync, calls),
                 torch_step=profile(torch, torch_step_loop, sync, calls // layers * layers),
                 torch_step_created_stream=profile(torch, torch_step_on_a_created_stream_loop,
                                                   sync, calls // layers * layers),
                 torch_step_results_kept=profile(torch, torch_step_results_kept_loop, sync,
                                                 calls // layers * layers),
                 jax_step=profile(torch, step_loop, sync, step_decodes),
                 jax_copy_one_call=profile(torch, jax_copy_loop, sync, calls),
                 torch_copy=profile(torch, torch_copy_loop, sync, calls))
    # Steps of fewer layers: does FlashMLA's kernel slow down with decodes back to back?
    for n in step_layers:
        loop, decodes = jax_step(n)
        point[f"jax_step_{n}"] = profile(torch, loop, sync, decodes)
    return point


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--calls", type=int, default=64)
    parser.add_argument("--layers", type=int, default=8, help="decodes in the jitted step")
    parser.add_argument("--s-k", type=int, default=4096)
    parser.add_argument("--h-q", type=int, nargs="+", default=[16, 128])
    parser.add_argument("--step-layers", type=int, nargs="*", default=[1, 2],
                        help="also profile jitted steps of these many decodes")
    args = parser.parse_args()
    side = TorchSide()
    results = []
    for h_q in args.h_q:
        point = profile_point(side, 128, args.s_k, h_q, args.calls, args.layers,
                              args.step_layers)
        results.append(point)
        variants = ["torch", "torch_with_copies", "jax_one_call", "torch_step",
                    "torch_step_created_stream", "torch_step_results_kept", "jax_step",
                    *(f"jax_step_{n}" for n in args.step_layers), "jax_copy_one_call",
                    "torch_copy"]
        for variant in variants:
            s = point[variant]
            print(f"s_k={args.s_k} h_q={h_q:3d} {variant:18s} span {s['span_us']:7.1f} us/decode, "
                  f"busy {s['busy_us']:7.1f}, idle {s['idle_us']:6.1f}, host between decodes "
                  f"{s['host_us_between_decodes']} us, launch->start {s['launch_to_start_us']}",
                  flush=True)
            for name, a in s["activities"].items():
                print(f"    {a['per_decode']:4.1f} x {a['mean_us']:7.2f} us  {name}")
            for name, a in s["host_activities"].items():
                print(f"    host {a['per_decode']:4.1f} x {a['mean_us']:7.2f} us  {name}")
            print("    CUDA API calls per decode:", ", ".join(
                f"{name} {n:.2f}" for name, n in s["api_calls_per_decode"].items()))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
