"""Pallas Mosaic GPU's FlashAttention-3 kernel against cuDNN's at the extend sizes.

A chunk of T new tokens over S prefix keys, non-causal, h heads: what mla_prefill's prefix
part runs. cuDNN (jax's wrapper beneath jax.nn.dot_product_attention) takes q/k 192 and v 128
in bf16; jax's Mosaic GPU kernel (jax.experimental.pallas.ops.gpu.attention_mgpu) takes one
head dim and float16 (its shared-memory buffers are float16), so it runs at 192 with v padded
(1.2x the products) and at 128 (its own best case, for scale); it applies no softmax scale, so
q is scaled before it. TFLOPS count the
products each call makes: T S h 2 (d_qk + d_v).

  python dev/probe_mgpu_attention.py [--heads 16] [--tokens 2048] [--prefix 32768]
"""
import argparse
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
from jax._src.cudnn import fused_attention_stablehlo as fa

from probe_cudnn_masks import timed_us

timed = functools.partial(timed_us, calls=20, repeats=5)  # as its results ran


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--prefix", type=int, default=32768)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    t, s, h = args.tokens, args.prefix, args.heads
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (1, t, h, 192), jnp.bfloat16)
    k = jax.random.normal(keys[1], (1, s, h, 192), jnp.bfloat16)
    v = jax.random.normal(keys[2], (1, s, h, 128), jnp.bfloat16)
    scale = 192 ** -0.5
    results = {}

    def report(name, us, d_qk, d_v, out=None, expected=None):
        tflops = t * s * h * 2 * (d_qk + d_v) / us / 1e6
        row = dict(us=round(us, 1), tflops=round(tflops, 1))
        if out is not None:
            row["max_abs_diff"] = float(np.max(np.abs(
                np.asarray(out, np.float32) - np.asarray(expected, np.float32))))
        results[name] = row
        print(f"{name:40s} {us:9.1f} us {tflops:7.1f} TFLOPS {row.get('max_abs_diff', '')}",
              flush=True)

    cudnn = jax.jit(lambda q, k, v: fa.dot_product_attention(
        q, k, v, scale=scale, mask_type=fa.MaskType.NO_MASK, qkv_layout="BTNH"))
    expected = cudnn(q, k, v)
    v192 = jnp.pad(v, ((0, 0), (0, 0), (0, 0), (0, 64)))
    report("cudnn bf16 192/128", timed(cudnn, (q, k, v)), 192, 128)
    report("cudnn bf16 192/192 (v padded)", timed(cudnn, (q, k, v192)), 192, 192)

    from jax.experimental.pallas.ops.gpu import attention_mgpu as am
    q16, k16, v16 = (x.astype(jnp.float16) for x in (q, k, v192))
    for d in (192, 128):
        qd, kd, vd = q16[..., :d], k16[..., :d], v16[..., :d]
        for block_q, block_kv, steps in ((64, 64, 2), (64, 128, 2), (64, 64, 3), (64, 128, 3)):
            name = f"mgpu f16 {d}/{d} bq{block_q} bkv{block_kv} steps{steps}"
            try:
                config = am.TuningConfig(block_q=block_q, block_kv=block_kv,
                                         max_concurrent_steps=steps)
                fn = jax.jit(lambda q, k, v, config=config: am.attention(
                    (q * scale).astype(q.dtype), k, v, config))
                out = fn(qd, kd, vd)
                us = timed(fn, (qd, kd, vd))
                check = expected if d == 192 else None
                report(name, us, d, d, None if check is None else out[..., :128], check)
            except Exception as error:  # noqa: BLE001 - a config the kernel refuses
                results[name] = dict(error=str(error)[:300])
                print(f"{name:40s} failed: {str(error)[:200]}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(tokens=t, prefix=s, heads=h, jax=jax.__version__,
                           device=str(jax.devices()[0]), results=results), f, indent=1)


if __name__ == "__main__":
    main()
