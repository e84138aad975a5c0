"""What cuDNN's padding masks cost at mla_prefill's sizes, and the forms that avoid them.

jax's cuDNN wrapper (the one beneath jax.nn.dot_product_attention) with q/k 192 and v 128,
bf16, h heads, timed in turns (so that the GPU's clock, which falls as it heats, falls on each
alike):
  - the new tokens over the prefix (T x S, no causality): no mask; a padding mask over all
    keys (what mla_prefill passes for one request); over S - 1000; no mask with the head dim
    widened to 208 by a column of 1 in q and of 0 / -1e30 in k (a key mask through the
    products); a lax.cond choosing the unmasked call when every key is held;
  - the new tokens over themselves (T x T): causal against padding-causal over all rows;
  - a new prompt (P x P): the same two.

  python dev/probe_cudnn_masks.py [--heads 16] [--tokens 2048] [--prefix 32768] [--prompt 16384]
"""
import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax._src.cudnn import fused_attention_stablehlo as fa

MASKED_KEY = -1e30


def timed_us(fn, args, calls=10, repeats=3):
    """Median over repeats of the mean µs a call, calls queued back to back."""
    jax.block_until_ready(fn(*args))
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(samples)


def attention(mask_type, scale, q_len=None, kv_len=None):
    def call(q, k, v):
        lens = () if q_len is None else (None, None, jnp.array([q_len], jnp.int32),
                                          jnp.array([kv_len], jnp.int32))
        return fa.dot_product_attention(q, k, v, *lens, scale=scale, mask_type=mask_type,
                                        qkv_layout="BTNH", return_residual=True)
    return call


def with_key_mask(q, k, held):
    """q, k widened by 16 columns: q's first is 1, k's first 0 where held and MASKED_KEY
    where not, so that q.k adds 0 or MASKED_KEY to each score."""
    extra = lambda x, first: jnp.concatenate(
        [x, first[..., None].astype(x.dtype), jnp.zeros(x.shape[:-1] + (15,), x.dtype)], -1)
    ones = jnp.ones(q.shape[:-1], q.dtype)
    bias = jnp.where(held, 0.0, MASKED_KEY)[:, None]
    return extra(q, ones), extra(k, jnp.broadcast_to(bias, k.shape[:-1]))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--prefix", type=int, default=32768)
    parser.add_argument("--prompt", type=int, default=16384)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    t, s, h, p = args.tokens, args.prefix, args.heads, args.prompt
    keys = jax.random.split(jax.random.key(0), 6)
    q = jax.random.normal(keys[0], (1, t, h, 192), jnp.bfloat16)
    k = jax.random.normal(keys[1], (1, s, h, 192), jnp.bfloat16)
    v = jax.random.normal(keys[2], (1, s, h, 128), jnp.bfloat16)
    qp = jax.random.normal(keys[3], (1, p, h, 192), jnp.bfloat16)
    kp = jax.random.normal(keys[4], (1, p, h, 192), jnp.bfloat16)
    vp = jax.random.normal(keys[5], (1, p, h, 128), jnp.bfloat16)
    scale = 192 ** -0.5
    held = jnp.arange(s) < s

    def key_masked(q, k, v):
        q2, k2 = with_key_mask(q[0], k[0], held)
        return attention(fa.MaskType.NO_MASK, scale)(q2[None], k2[None], v)

    def chosen(q, k, v):
        full = jnp.sum(held) == s
        return jax.lax.cond(full, attention(fa.MaskType.NO_MASK, scale),
                            attention(fa.MaskType.PADDING, scale, t, s), q, k, v)

    extend_flops = t * s * h * 2 * 320
    variants = {
        "extend, no mask": (attention(fa.MaskType.NO_MASK, scale), (q, k, v), extend_flops),
        "extend, padding over all keys": (
            attention(fa.MaskType.PADDING, scale, t, s), (q, k, v), extend_flops),
        "extend, padding over S - 1000": (
            attention(fa.MaskType.PADDING, scale, t, s - 1000), (q, k, v),
            extend_flops * (s - 1000) // s),
        "extend, key mask through a 208-wide head": (key_masked, (q, k, v), extend_flops),
        "extend, lax.cond (all held)": (chosen, (q, k, v), extend_flops),
        "chunk, causal": (attention(fa.MaskType.CAUSAL, scale), (q, k[:, :t], v[:, :t]),
                          t * t // 2 * h * 2 * 320),
        "chunk, padding-causal over all": (
            attention(fa.MaskType.PADDING_CAUSAL, scale, t, t), (q, k[:, :t], v[:, :t]),
            t * t // 2 * h * 2 * 320),
        "prompt, causal": (attention(fa.MaskType.CAUSAL, scale), (qp, kp, vp),
                           p * p // 2 * h * 2 * 320),
        "prompt, padding-causal over all": (
            attention(fa.MaskType.PADDING_CAUSAL, scale, p, p), (qp, kp, vp),
            p * p // 2 * h * 2 * 320),
    }
    jitted = {name: jax.jit(fn) for name, (fn, _, _) in variants.items()}
    reference = {name: jax.block_until_ready(jitted[name](*a))
                 for name, (_, a, _) in variants.items()}
    times = {name: [] for name in variants}
    for _ in range(3):
        for name, (_, call_args, _) in variants.items():
            times[name].append(timed_us(jitted[name], call_args))
    results = {}
    base = {"extend": "extend, padding over all keys", "chunk": "chunk, padding-causal over all",
            "prompt": "prompt, padding-causal over all"}
    for name, (_, _, flops) in variants.items():
        us = statistics.median(times[name])
        out, lse = reference[name]
        ref_out, ref_lse = reference[base[name.split(",")[0]]]
        diff = lambda a, b: float(np.max(np.abs(np.asarray(a, np.float32)
                                                - np.asarray(b, np.float32))))
        row = dict(us=round(us, 1), tflops=round(flops / us / 1e6, 1),
                   out_diff=diff(out, ref_out) if "S - 1000" not in name else None,
                   lse_diff=diff(lse, ref_lse) if "S - 1000" not in name else None)
        results[name] = row
        print(f"{name:44s} {us:9.1f} us {row['tflops']:7.1f} TFLOPS  out {row['out_diff']}"
              f"  lse {row['lse_diff']}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(tokens=t, prefix=s, prompt=p, heads=h, jax=jax.__version__,
                           device=str(jax.devices()[0]), results=results), f, indent=1)


if __name__ == "__main__":
    main()
