"""mla_decode with an FP8 (e4m3) KV cache against the bf16 cache, on the GPU machine.

For b=128, s_q=1, s_k in {4096, 8192}, h_q in {16, 128}: time per jitted call of each path
(metadata computed once outside the timed region, each path with its own scheduler), the
bandwidth each reaches counting its own cache's bytes (576 per token in FP8, 1152 in bf16),
the speed-up, and the FP8 output's difference from the bf16 output on the same data (the
cache quantized with a per-tensor scale amax / 448). Timing: N calls back to back, then a
device sync, wall clock, the two paths in turns within each repeat; the
speed-up is the median of per-repeat ratios.

    python benchmarks/bench_fp8.py --out benchmarks/results/fp8_h200.json
    python benchmarks/bench_fp8.py --tiny   # a small shape, for CPU (the custom call's C++ model)
"""
import argparse
import statistics

import jax
import jax.numpy as jnp
import numpy as np

import jax_flashmla as jf
from jax_flashmla.caches import fp8

from results_io import write_json
from timing import in_turns, paired_ratios


def _inputs(batch, s_k, h_q, seed=0):
    """bf16 q and cache in FlashMLA's test scale (N(0, 1)/10 clipped to [-1, 1]), the cache
    also quantized to FP8 with its per-tensor scale, a shuffled block table, equal lengths."""
    pages_per_req = -(-s_k // 64)
    key_q, key_kv = jax.random.split(jax.random.key(seed))
    q = jnp.clip(jax.random.normal(key_q, (batch, 1, h_q, 576)) / 10, -1, 1).astype(jnp.bfloat16)
    kv = jnp.clip(jax.random.normal(key_kv, (batch * pages_per_req, 64, 1, 576)) / 10, -1, 1)
    kv = kv.astype(jnp.bfloat16)
    scale = (jnp.max(jnp.abs(kv.astype(jnp.float32))) / fp8.FP8_MAX).astype(jnp.float32)
    kv8 = jax.jit(fp8.quantize)(kv, scale)
    perm = np.random.default_rng(seed).permutation(batch * pages_per_req).astype(np.int32)
    bt = jnp.asarray(perm.reshape(batch, pages_per_req))
    sl = jnp.full((batch,), s_k, jnp.int32)
    return q, kv, kv8, scale, bt, sl


def bench_one(batch, s_k, h_q, calls, repeats):
    q, kv, kv8, scale, bt, sl = _inputs(batch, s_k, h_q)
    md = jf.get_mla_metadata(sl, block_table=bt, num_pages=kv.shape[0], num_heads_q=h_q,
                             implementation="custom_call")
    md8 = jf.get_mla_metadata(sl, block_table=bt, num_pages=kv8.shape[0], num_heads_q=h_q,
                              fp8=True, implementation="custom_call")
    decode = jax.jit(lambda q, kv, bt, sl, md: jf.mla_decode(q, kv, bt, sl, metadata=md,
                                                             implementation="custom_call"))
    decode8 = jax.jit(lambda q, kv, bt, sl, md, s: jf.mla_decode(
        q, kv, bt, sl, metadata=md, k_scale=s, implementation="custom_call"))
    samples = in_turns(dict(
        bf16=(lambda: decode(q, kv, bt, sl, md), jax.block_until_ready, calls, 1),
        fp8=(lambda: decode8(q, kv8, bt, sl, md8, scale), jax.block_until_ready, calls, 1)),
        repeats=repeats, warmup=3)
    bf16_s, fp8_s = (statistics.median(samples[k]) for k in ("bf16", "fp8"))
    speedup = paired_ratios(samples["bf16"], samples["fp8"])
    out = np.asarray(decode(q, kv, bt, sl, md)[0], np.float64)
    out8 = np.asarray(decode8(q, kv8, bt, sl, md8, scale)[0], np.float64)
    cos_diff = 1 - 2 * (out * out8).sum() / max((out * out).sum() + (out8 * out8).sum(), 1e-30)
    tokens = batch * s_k
    return dict(batch=batch, s_k=s_k, h_q=h_q, s_q=1, k_scale=float(scale),
                bf16_ms=bf16_s * 1e3, fp8_ms=fp8_s * 1e3, speedup=speedup[0],
                speedup_range=speedup[1:],
                bf16_cache_gbps=tokens * 576 * 2 / bf16_s / 1e9,
                fp8_cache_gbps=tokens * 576 / fp8_s / 1e9,
                fp8_vs_bf16_max_abs=float(np.abs(out8 - out).max()),
                fp8_vs_bf16_rel_l2=float(np.linalg.norm(out8 - out) / np.linalg.norm(out)),
                fp8_vs_bf16_cos_diff=float(cos_diff))


def _comparison_line(r):
    return (f"b={r['batch']} s_k={r['s_k']} h_q={r['h_q']:3d}: bf16 {r['bf16_ms']:.4f} ms "
            f"{r['bf16_cache_gbps']:.0f} GB/s  fp8 {r['fp8_ms']:.4f} ms "
            f"{r['fp8_cache_gbps']:.0f} GB/s  speed-up {r['speedup']:.2f}  fp8 vs bf16: max abs "
            f"{r['fp8_vs_bf16_max_abs']:.3g} rel l2 {r['fp8_vs_bf16_rel_l2']:.3g} cos diff "
            f"{r['fp8_vs_bf16_cos_diff']:.3g}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--tiny", action="store_true", help="b=2, s_k=128, h_q=16 (for CPU)")
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()
    name, lengths, calls, line, bench = "runs", (4096, 8192), args.calls, _comparison_line, \
        bench_one
    if args.tiny:
        grid, calls, repeats = [(2, 128, 16)], 2, 2
    else:
        grid, repeats = [(128, s_k, h_q) for s_k in lengths for h_q in (16, 128)], 7
    results = {"device": jax.devices()[0].device_kind, name: []}
    for batch, s_k, h_q in grid:
        results[name].append(bench(batch, s_k, h_q, calls=calls, repeats=repeats))
        print(line(results[name][-1]), flush=True)
    if args.out:
        write_json(results, args.out)


if __name__ == "__main__":
    main()
