"""What bench_sparse.py's 61-layer sparse step runs on the GPU, kernel by kernel: for the jax
steps (scanned and unrolled, through AlternatingStep) and the torch CUDA graphs, profiled
steps of each (bench_step.step_activities), their kernels grouped by name (count and µs a step), the GPU's busy time and its
span. The difference between a jax step and the graph with one schedule per step is where the
step bar's margin goes.

    python dev/probe_sparse_step.py [--batches 1 16 64] [--context 32768] [--layers 61]
                                    [--out probe_sparse_step.json]
"""
import argparse
import collections
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
import bench_sparse  # noqa: E402
import bench_step  # noqa: E402
import jax  # noqa: E402

from jax_flashmla import serving  # noqa: E402


def kernel_table(events, steps):
    """events: one variant's GPU activities over `steps` steps -> {name: [count, µs]} a step,
    the busy µs a step (the union of the activities' intervals), the span µs a step."""
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
    runs = {}
    for name, (step, options) in bench_sparse.jax_steps(inp).items():
        queue = bench_step.result_queue(inp)
        pushing = bench_step.pushing_step(lambda *a, step=step: (None, step(*a)), queue,
                                          lambda out: out)
        compiled = serving.AlternatingStep(
            jax.jit(pushing, compiler_options=options).lower(*arguments).compile())
        runs[name] = lambda compiled=compiled, queue=queue: (compiled(*arguments), queue.pop())
    torch_launches, _, skipped = torch_sparse.steps(inp, True)
    for name, (launch, sync) in torch_launches.items():
        runs[name] = lambda launch=launch, sync=sync: (launch(), sync())
    return runs, skipped


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--layers", type=int, default=61)
    parser.add_argument("--cache-gb", type=float, default=40)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch_sparse = bench_sparse.TorchSparse()
    result = dict(device=jax.devices()[0].device_kind, context=args.context,
                  layers=args.layers, points={})
    for b in args.batches:
        inp = bench_sparse.StepInputs(b, args.context, 128, 1, 2048, args.layers, args.cache_gb)
        runs, skipped = launches_of(inp, torch_sparse)
        for run in runs.values():  # AlternatingStep records its graphs over the first calls
            for _ in range(4):
                run()
        point = result["points"][f"b{b}"] = dict(skipped=skipped, variants={})
        for name, steps in bench_step.step_activities(runs).items():
            spans = [max(e.end for e in step) - min(e.start for e in step)
                     for step in steps if step]
            table, busy = kernel_table([e for step in steps for e in step], len(steps))
            point["variants"][name] = dict(
                span_us_per_layer=sorted(spans)[len(spans) // 2] / 1e3 / args.layers,
                busy_us_per_layer=busy / args.layers,
                kernels_per_layer={k: [round(c / args.layers, 3), round(us / args.layers, 3)]
                                   for k, (c, us) in sorted(table.items(),
                                                            key=lambda kv: -kv[1][1])})
            v = point["variants"][name]
            print(f"b={b} {name}: span {v['span_us_per_layer']:.2f} busy "
                  f"{v['busy_us_per_layer']:.2f} us a layer; kernels a layer (count, us):")
            for kernel, (count, us) in list(v["kernels_per_layer"].items())[:8]:
                print(f"    {count:6.3f} {us:8.3f}  {kernel[:110]}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
