"""What bench_sparse.py's 61-layer sparse step runs on the GPU, kernel by kernel: for the jax
steps (scanned and unrolled, through AlternatingStep) and the torch CUDA graphs, profiled
steps of each (bench_step.step_activities), their kernels grouped by name (count and µs a
step), the GPU's busy time and its span. The difference between a jax step and the graph with
one schedule per step is where the step bar's margin goes. The same for single calls
(--call-batches): sparse_decode_fwd from torch, sparse_mla_decode jitted as bench_sparse.py
times it, the same on indices masked beforehand, and torch's again, CALLS of each queued then
waited for.

    python dev/probe_sparse_step.py [--batches 1 16 64] [--context 32768] [--layers 61]
                                    [--call-batches 1 128] [--out probe_sparse_step.json]
"""
import argparse
import collections
import functools
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
import bench_sparse  # noqa: E402
import bench_step  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jax_flashmla import serving  # noqa: E402
from jax_flashmla.sparse import mask_indices, sparse_mla_decode  # noqa: E402

CALLS = 10  # calls queued a profiled run


def kernel_table(events, steps):
    """events: one variant's GPU activities over `steps` steps -> ({name: [count, µs]} a step,
    the busy µs a step: the union of the activities' intervals)."""
    table = collections.defaultdict(lambda: [0.0, 0.0])
    for e in events:
        table[e.name][0] += 1 / steps
        table[e.name][1] += (e.end - e.start) / 1e3 / steps
    busy, reach = 0, None
    for e in sorted(events, key=lambda e: e.start):
        if reach is None or e.start >= reach:
            busy += e.end - e.start
            reach = e.end
        elif e.end > reach:
            busy += e.end - reach
            reach = e.end
    return dict(table), busy / 1e3 / steps


def launches_of(inp, torch_sparse):
    """{name: run a step and wait for it}: the jax steps as bench_sparse times them, and the
    torch graphs."""
    arguments = inp.arguments()
    runs = {name: lambda step=step, queue=queue: (step(*arguments), queue.pop())
            for name, queue, step in bench_sparse.compiled_jax_steps(inp)}
    torch_launches, _, skipped = torch_sparse.steps(inp, True)
    for name, (launch, sync) in torch_launches.items():
        runs[name] = lambda launch=launch, sync=sync: (launch(), sync())
    return runs, skipped


def call_runs(b, context, torch_sparse, h_q=128, s_q=1, topk=2048):
    """{name: queue CALLS calls and wait}: the op from torch, the jitted op, the jitted op on
    indices masked beforehand (MaskedIndices), and the op from torch again (whether the order
    of the runs moves a kernel's time), on one set of inputs."""
    work = bench_sparse.Workload(b, context, False, s_q, 1, seed=b)
    cache = bench_sparse.sparse_cache(work.kv.shape[0], jax.random.key(b))
    (q,) = work.queries(h_q, s_q, 1)
    indices = bench_sparse.sparse_indices(np.random.default_rng(b), work.block_tables[0], s_q,
                                          topk, context)
    masked = jax.block_until_ready(mask_indices(indices, cache))
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    sparse = jax.jit(functools.partial(sparse_mla_decode, softmax_scale=bench_sparse.SOFTMAX_SCALE,
                                       implementation="custom_call"),
                     out_shardings=(device, serving.lse_format(s_q, device)))
    torch_call = torch_sparse.call(q, cache, indices,
                                   bench_sparse.sparse_schedule(b, h_q, s_q, topk))
    torch_run = lambda: ([torch_call() for _ in range(CALLS)], torch_sparse.sync())  # noqa: E731
    return {
        "torch": torch_run,
        "sparse": lambda: jax.block_until_ready(
            [sparse(q, cache, indices) for _ in range(CALLS)]),
        "sparse_premasked": lambda: jax.block_until_ready(
            [sparse(q, cache, masked) for _ in range(CALLS)]),
        "torch_again": torch_run}


def profile(runs, per, warm=4):
    """{name: span, busy and kernels per `per`} over bench_step.step_activities' runs."""
    for run in runs.values():  # AlternatingStep records its graphs over the first calls
        for _ in range(warm):
            run()
    variants = {}
    for name, steps in bench_step.step_activities(runs).items():
        spans = [max(e.end for e in step) - min(e.start for e in step) for step in steps if step]
        table, busy = kernel_table([e for step in steps for e in step], len(steps))
        variants[name] = dict(
            span_us=statistics.median(spans) / 1e3 / per, busy_us=busy / per,
            kernels={k: [round(c / per, 3), round(us / per, 3)]
                     for k, (c, us) in sorted(table.items(), key=lambda kv: -kv[1][1])})
    return variants


def show(label, unit, variants):
    for name, v in variants.items():
        print(f"{label} {name}: span {v['span_us']:.2f} busy {v['busy_us']:.2f} us a {unit}; "
              f"kernels a {unit} (count, us):")
        for kernel, (count, us) in list(v["kernels"].items())[:10]:
            print(f"    {count:6.3f} {us:8.3f}  {kernel[:110]}")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", type=int, nargs="*", default=[1, 16, 64])
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--layers", type=int, default=61)
    parser.add_argument("--cache-gb", type=float, default=40)
    parser.add_argument("--call-batches", type=int, nargs="*", default=[1, 128])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch_sparse = bench_sparse.TorchSparse()
    result = dict(device=jax.devices()[0].device_kind, context=args.context,
                  layers=args.layers, points={})
    for b in args.batches:
        inp = bench_sparse.StepInputs(b, args.context, 128, 1, 2048, args.layers, args.cache_gb)
        runs, skipped = launches_of(inp, torch_sparse)
        variants = profile(runs, args.layers)
        result["points"][f"b{b}"] = dict(skipped=skipped, variants=variants)
        show(f"step b={b}", "layer", variants)
    for b in args.call_batches:
        variants = profile(call_runs(b, args.context, torch_sparse), CALLS)
        result["points"][f"call b{b}"] = dict(variants=variants)
        show(f"call b={b}", "call", variants)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
