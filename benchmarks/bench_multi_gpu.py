"""Time per decode step on one GPU against two (heads split: TP=2; keys split: DCP=2), at
b=128, s_k=4096, h_q=128, s_q=1, bf16, on a machine of two GPUs.

    python benchmarks/bench_multi_gpu.py --out benchmarks/results/multi_gpu_h200.json
"""
import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jax_flashmla as jf
from jax_flashmla import context_parallel as cp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_sharding import _split_for_dcp  # noqa: E402


def _ms_per_call(fn, args, calls=100, repeats=5):
    jax.block_until_ready(fn(*args))
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            result = fn(*args)
        jax.block_until_ready(result)
        samples.append((time.perf_counter() - start) / calls * 1e3)
    return statistics.median(samples)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    args = parser.parse_args()
    gpus = jax.devices("gpu")[:2]
    batch, s_k, h_q = 128, 4096, 128
    pages = batch * s_k // 64
    key_q, key_kv = jax.random.split(jax.random.key(0))
    q = (jax.random.normal(key_q, (batch, 1, h_q, 576)) / 10).astype(jnp.bfloat16)
    kv = (jax.random.normal(key_kv, (pages, 64, 1, 576)) / 10).astype(jnp.bfloat16)
    bt = jnp.asarray(np.random.default_rng(0).permutation(pages).astype(np.int32).reshape(batch, -1))
    sl = jnp.full((batch,), s_k, jnp.int32)
    decode = jax.jit(jf.mla_decode)
    one = _ms_per_call(decode, jax.device_put((q, kv, bt, sl), gpus[0]))
    mesh = Mesh(np.array(gpus), ("x",))
    put = lambda x, *spec: jax.device_put(x, NamedSharding(mesh, P(*spec)))
    tp = _ms_per_call(decode, (put(q, None, None, "x", None), put(kv), put(bt), put(sl)))
    dcp_pages, tables, lens = _split_for_dcp(kv, bt, sl, 2, "round_robin", None)
    dcp = _ms_per_call(jax.jit(lambda *a: cp.dcp_mla_decode(*a, mesh=mesh, axis="x")),
                       (put(q), put(dcp_pages, "x"), put(tables, "x"), put(lens, "x")))
    results = dict(batch=batch, s_k=s_k, h_q=h_q, one_gpu_ms=one, tp2_ms=tp, dcp2_ms=dcp,
                   tp2_speedup=one / tp, dcp2_speedup=one / dcp, device=gpus[0].device_kind)
    print(json.dumps(results, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
