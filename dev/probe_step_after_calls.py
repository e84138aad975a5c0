"""Does bench_sparse.py's per-call section slow the synced step timed after it? The step
points (run_step_point, with the torch graphs in turns) in one process: fresh; after the
per-call points given (bench_sparse.main, its results dropped); and after gc.collect() and
jax.clear_caches(). Prints µs a layer per variant and phase, and writes them as JSON.

  python dev/probe_step_after_calls.py --batches 1 64 --call-points 'call/b128/*' --out r.json
"""
import argparse
import gc
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "benchmarks"))
import bench_sparse  # noqa: E402  (sets XLA_FLAGS as the bench runs)
import jax  # noqa: E402

VARIANTS = ("jax_unrolled", "jax_scan", "torch_graph_shared")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--call-points", nargs="+", default=["call/b128/*"])
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    grid, torch_sparse = bench_sparse.GPU, bench_sparse.TorchSparse()
    phases = []

    def steps(phase):
        for b in args.batches:
            inp = bench_sparse.StepInputs(b, grid["step_context"], grid["step_h_q"],
                                          grid["step_s_q"], grid["topk"], grid["layers"], 40)
            record = bench_sparse.run_step_point(inp, grid["steps"], torch_sparse)
            row = dict(phase=phase, b=b, **{f"{v}{kind}": record.get(f"{v}{kind}")
                                            for v in VARIANTS for kind in ("_us", "_queued_us")})
            phases.append(row)
            print(json.dumps(row), flush=True)
            del inp

    steps("fresh")
    bench_sparse.main(["--points", *args.call_points])
    steps("after_calls")
    gc.collect()
    jax.clear_caches()
    steps("after_cleanup")
    with open(args.out, "w") as f:
        json.dump(phases, f, indent=1)


if __name__ == "__main__":
    main()
