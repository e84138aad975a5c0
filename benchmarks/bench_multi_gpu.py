"""A model's decode step over several GPUs: bench_step.py's step (per layer the new rows
written, then the decode; the layers' caches stacked, the layers unrolled, called through
jax_flashmla.serving.AlternatingStep) with the query heads split over TP devices and each request's
tokens over DCP devices (round robin), TP * DCP of the GPUs there are, 128 query heads in all.

Per (b, mean s_k) and (TP, DCP): µs per layer (the median synced step's wall clock over its
layers), the speed-up over one GPU, and how far the last layer's out is from one GPU's (the
DCP merge adds float rounding; TP alone is bit-identical). Each point has as many layers as
one GPU's cache holds in --cache-gb (stated per point). Writes JSON, a markdown table and a
plot (µs per layer against the number of GPUs).

  python benchmarks/bench_multi_gpu.py --out benchmarks/results/multi_gpu_h200
  python benchmarks/bench_multi_gpu.py --tiny   # 8 CPU devices, 4 splits, through the C++ target
"""
import argparse
import itertools
import json
import os
import statistics
import sys
import time

if "--tiny" in sys.argv:  # the CPU devices must exist before JAX starts
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import jax_flashmla as jf  # noqa: E402
from jax_flashmla import context_parallel as cp  # noqa: E402

from results_io import save_png, write_json  # noqa: E402

PAGE, D_QK, D_V = 64, 576, 512
DEGREES = (1, 2, 4, 8)
GRID_B = (16, 64)
GRID_S_K = (4096, 32768, 131072)
H_Q = 128
# (TP, DCP) of --tiny: one device, each split at its extreme, and one of both.
TINY_SPLITS = ((1, 1), (8, 1), (2, 4), (1, 8))


class Point:
    """One (b, s_k): every request s_k tokens long; layer l's token t of request i is row
    (l, i, t) of one random array, so that every split of it holds the same keys."""

    def __init__(self, b, s_k, h_q, layers, cache_gb, seed=0):
        if s_k % (PAGE * max(DEGREES)):
            raise ValueError(f"s_k must be a multiple of {PAGE * max(DEGREES)}; got {s_k}")
        self.b, self.s_k, self.h_q = b, s_k, h_q
        layer_bytes = b * s_k * D_QK * 2
        self.layers = max(1, min(layers, int(cache_gb * 2**30 // layer_bytes)))
        keys = jax.random.split(jax.random.key(seed), 4)
        L = self.layers
        self.tokens = (jax.random.normal(keys[0], (L, b, s_k, D_QK), jnp.float32) / 10
                       ).astype(jnp.bfloat16)
        self.qs = (jax.random.normal(keys[1], (L, b, 1, h_q, D_QK), jnp.float32) / 10
                   ).astype(jnp.bfloat16)
        self.rows = (jax.random.normal(keys[2], (L, b, 1, D_QK), jnp.float32) / 10
                     ).astype(jnp.bfloat16)
        self.softmax_scale = 192 ** -0.5

    def split(self, dcp):
        """(stacked cache, block tables (dcp, b, pages), local lengths (dcp, b)): device r of
        the dcp axis holds tokens r, r + dcp, ... of every request, layer l's pages at
        l * b * pages onwards of its part."""
        L, b, s_k = self.layers, self.b, self.s_k
        local = self.tokens.reshape(L, b, s_k // dcp, dcp, D_QK).transpose(3, 0, 1, 2, 4)
        pages = s_k // dcp // PAGE
        cache = local.reshape(dcp * L * b * pages, PAGE, 1, D_QK)
        table = jnp.arange(b * pages, dtype=jnp.int32).reshape(b, pages)
        lens = jnp.full((dcp, b), s_k // dcp, jnp.int32)
        return cache, jnp.broadcast_to(table, (dcp, b, pages)), lens


def make_step(p, tp, dcp, devices, implementation=None):
    """(AlternatingStep, its arguments) of the step on tp * dcp devices."""
    mesh = Mesh(np.array(devices[:tp * dcp]).reshape(dcp, tp), ("dcp", "tp"))
    put = lambda x, *spec: jax.device_put(x, NamedSharding(mesh, P(*spec)))
    cache, tables, lens = p.split(dcp)
    layer_pages = tables.shape[1] * tables.shape[2]
    positions = jnp.full((p.b, 1), p.s_k - 1, jnp.int32)  # the new token: each request's last

    def step(cache, qs, rows, tables, lens, positions):
        out = None
        for layer in range(p.layers):
            # The layer's rows and q come from the layer before, as a model's do.
            rows_l = rows[layer] if out is None else jnp.concatenate(
                [out[:, :, 0], rows[layer][..., D_V:]], axis=-1)
            q = qs[layer] if out is None else jnp.concatenate(
                [out, qs[layer][..., D_V:]], axis=-1)
            layer_tables = tables + layer * layer_pages
            cache = cp.dcp_write_kv(cache, layer_tables, positions, mesh=mesh, axis="dcp",
                                    layout="round_robin", kv=rows_l)
            out, _ = cp.dcp_mla_decode(q, cache, layer_tables, lens, mesh=mesh, axis="dcp",
                                       head_axis="tp", softmax_scale=p.softmax_scale,
                                       implementation=implementation)
        return cache, out

    args = (put(cache, "dcp"), put(p.qs, None, None, None, "tp", None), put(p.rows),
            put(tables, "dcp"), put(lens, "dcp"), put(positions))
    compiled = jax.jit(step, donate_argnums=0).lower(*args).compile()
    return jf.serving.AlternatingStep(compiled), args


def time_step(run, args, steps, warmup=3):
    """(µs of each timed step, the last out); each step synced, the cache carried."""
    cache, rest = args[0], args[1:]
    times = []
    for k in range(warmup + steps):
        start = time.perf_counter()
        cache, out = run(cache, *rest)
        jax.block_until_ready(out)
        if k >= warmup:
            times.append((time.perf_counter() - start) * 1e6)
    return times, np.asarray(out, np.float32)


def run_point(p, configs, devices, steps, implementation):
    records, one = [], None
    for tp, dcp in configs:
        run, args = make_step(p, tp, dcp, devices, implementation)
        times, out = time_step(run, args, steps)
        del run, args
        us = statistics.median(times) / p.layers
        if one is None:  # (1, 1) runs first
            one = dict(us=us, out=out)
        records.append(dict(b=p.b, s_k=p.s_k, h_q=p.h_q, layers=p.layers, tp=tp, dcp=dcp,
                            gpus=tp * dcp, us_per_layer=round(us, 2),
                            speedup=round(one["us"] / us, 3),
                            out_max_abs_diff=float(np.max(np.abs(out - one["out"]))),
                            out_identical=bool(np.array_equal(out, one["out"]))))
        print(json.dumps(records[-1]), flush=True)
    return records


def markdown(result):
    lines = [f"# A model's decode step over GPUs, µs per layer ({result['device']}, "
             f"jax {result['jax']})", "",
             f"{result['records'][0]['h_q']} query heads split over TP devices, each request's "
             "tokens over DCP devices "
             "(round robin); the step's layers unrolled and called through AlternatingStep. "
             "Speed-up: over one GPU; diff: the last layer's out against one GPU's (max abs).",
             "", "| b | s_k | L | TP | DCP | µs per layer | speed-up | out diff |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in result["records"]:
        diff = "identical" if r["out_identical"] else f"{r['out_max_abs_diff']:.2e}"
        lines.append(f"| {r['b']} | {r['s_k']} | {r['layers']} | {r['tp']} | {r['dcp']} | "
                     f"{r['us_per_layer']:.1f} | {r['speedup']:.2f} | {diff} |")
    return "\n".join(lines) + "\n"


def plot(result, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = result["records"]
    points = sorted({(r["b"], r["s_k"]) for r in records})
    fig, axes = plt.subplots(1, len(points), figsize=(4 * len(points), 3.4), squeeze=False)
    for ax, (b, s_k) in zip(axes[0], points):
        here = [r for r in records if (r["b"], r["s_k"]) == (b, s_k)]
        for label, keep in (("TP", lambda r: r["dcp"] == 1), ("DCP", lambda r: r["tp"] == 1)):
            line = sorted((r for r in here if keep(r)), key=lambda r: r["gpus"])
            ax.plot([r["gpus"] for r in line], [r["us_per_layer"] for r in line], "o-",
                    label=label, markersize=3)
        ax.set_xscale("log", base=2)
        ax.set_title(f"b={b}, s_k={s_k}")
        ax.set_xlabel("GPUs")
        ax.set_ylabel("µs per layer")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    save_png(fig, path)
    plt.close(fig)  # the report is written after every point


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=61, help="layers per step at most "
                        "(default 61; fewer where one GPU's cache does not hold them)")
    parser.add_argument("--cache-gb", type=float, default=40,
                        help="GiB of cache on one GPU (default 40)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per config")
    parser.add_argument("--tiny", action="store_true",
                        help="a small point on 8 CPU devices, through the C++ target")
    parser.add_argument("--out", default=None, help="path prefix of the .json/.md/.png results")
    args = parser.parse_args()
    if args.tiny:
        devices, implementation = jax.devices("cpu"), "custom_call"
        grid, h_q, layers = [(2, 1024)], 16, 2
    else:
        devices, implementation = jax.devices("gpu"), None
        grid, h_q, layers = list(itertools.product(GRID_B, GRID_S_K)), H_Q, args.layers
    configs = list(TINY_SPLITS) if args.tiny else [
        (tp, dcp) for dcp in DEGREES for tp in DEGREES if tp * dcp <= len(devices)]
    result = dict(device=devices[0].device_kind, jax=jax.__version__, gpus=len(devices),
                  records=[])
    for b, s_k in grid:
        p = Point(b, s_k, h_q, layers, args.cache_gb)
        result["records"] += run_point(p, configs, devices, 2 if args.tiny else args.steps,
                                       implementation)
        del p
        if args.out:  # after every point, so that a run cut short keeps what it measured
            write_json(result, args.out + ".json")
            with open(args.out + ".md", "w") as f:
                f.write(markdown(result))
            plot(result, args.out + ".png")
    return result


if __name__ == "__main__":
    main()
