"""Several requests in one mla_prefill call against each request in a call of its own.

A batch of B requests, each of T new tokens over S cached ones (S = 0: new prompts), bf16,
DeepSeek-V3's head dims, h heads:
  - packed: one mla_prefill call of the B requests (cuDNN's packed layout, its padding masks,
    v padded to 192; the prefix axis B * S);
  - one by one: B mla_prefill calls of one request each, in the same jitted function (cuDNN's
    plain layout without masks where a request holds every row; the prefix axis S).
Both timed in turns (the order reversed every other round), wall clock over calls queued back
to back; out compared.

  python dev/probe_prefill_batch.py [--heads 16 128] [--batches 2 4] [--shapes T:S ...]
      [--out FILE]
"""
import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_flashmla as jf

RANK, ROPE, D_NOPE, D_V, PAGE = 512, 64, 128, 128, 64
SCALE = (D_NOPE + ROPE) ** -0.5
SHAPES = ("2048:32768", "512:8192", "2048:0")  # new tokens : cached tokens, per request


def inputs(b, t, s, h, seed=0):
    keys = jax.random.split(jax.random.key(seed), 5)
    bf16 = jnp.bfloat16
    q = jax.random.normal(keys[0], (b * t, h, D_NOPE + ROPE), bf16)
    kv = jax.random.normal(keys[1], (b * t, RANK + ROPE), bf16)
    w_uk, w_uv = (jax.random.normal(k, (RANK, h, d), bf16) * bf16(RANK ** -0.5)
                  for k, d in ((keys[2], D_NOPE), (keys[3], D_V)))
    pages = max(b * s // PAGE, 1)
    cache = jax.random.normal(keys[4], (pages, PAGE, 1, RANK + ROPE), bf16)
    order = np.random.default_rng(seed).permutation(pages).astype(np.int32)
    table = jnp.asarray(order[:b * s // PAGE].reshape(b, s // PAGE)) if s else \
        jnp.zeros((b, 1), jnp.int32)
    return q, kv, cache, table, w_uk, w_uv


def packed(b, t, s):
    def call(q, kv, cache, table, w_uk, w_uv):
        return jf.mla_prefill(q, kv, cache, table, jnp.full((b,), s, jnp.int32),
                              jnp.full((b,), t, jnp.int32), w_uk=w_uk, w_uv=w_uv,
                              softmax_scale=SCALE, max_prefix_tokens=b * s)
    return jax.jit(call)


def one_by_one(b, t, s):
    def call(q, kv, cache, table, w_uk, w_uv):
        parts = [jf.mla_prefill(q[r * t:(r + 1) * t], kv[r * t:(r + 1) * t], cache,
                                table[r:r + 1], jnp.full((1,), s, jnp.int32),
                                jnp.full((1,), t, jnp.int32), w_uk=w_uk, w_uv=w_uv,
                                softmax_scale=SCALE, max_prefix_tokens=s)
                 for r in range(b)]
        return (jnp.concatenate([o for o, _ in parts]),
                jnp.concatenate([lse for _, lse in parts], axis=1))
    return jax.jit(call)


def batch_ms(fn, args, calls):
    start = time.perf_counter()
    for _ in range(calls):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / calls * 1e3


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", type=int, nargs="+", default=[16, 128])
    parser.add_argument("--batches", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), metavar="T:S")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--deadline-s", type=float, default=300)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    began, rows = time.monotonic(), []
    for h in args.heads:
        for b in args.batches:
            for t, s in (map(int, shape.split(":")) for shape in args.shapes):
                if time.monotonic() - began > args.deadline_s:
                    print(f"deadline: h={h} b={b} T={t} S={s} not run", flush=True)
                    continue
                a = inputs(b, t, s, h)
                variants = {"packed": packed(b, t, s), "one by one": one_by_one(b, t, s)}
                outs = {name: jax.block_until_ready(fn(*a)) for name, fn in variants.items()}
                first = batch_ms(variants["packed"], a, 1)
                calls = max(3, min(20, int(200 / max(first, 1e-3))))
                times = {name: [] for name in variants}
                for rnd in range(args.rounds):
                    names = list(variants)[::(-1 if rnd % 2 else 1)]
                    for name in names:
                        times[name].append(batch_ms(variants[name], a, calls))
                ratios = [o / p for o, p in zip(times["one by one"], times["packed"])]
                diff = float(np.max(np.abs(np.asarray(outs["packed"][0], np.float32)
                                           - np.asarray(outs["one by one"][0], np.float32))))
                row = dict(heads=h, batch=b, tokens=t, prefix=s, calls=calls,
                           packed_ms=statistics.median(times["packed"]),
                           one_by_one_ms=statistics.median(times["one by one"]),
                           one_by_one_over_packed=statistics.median(ratios), out_diff=diff,
                           packed_ms_rounds=times["packed"],
                           one_by_one_ms_rounds=times["one by one"])
                rows.append(row)
                print(f"h={h:3d} b={b} T={t:5d} S={s:6d}: packed {row['packed_ms']:.3f} ms, "
                      f"one by one {row['one_by_one_ms']:.3f} ms, ratio "
                      f"{row['one_by_one_over_packed']:.3f}, out diff {diff:.3g}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(jax=jax.__version__, device=str(jax.devices()[0]), rows=rows), f,
                      indent=1)


if __name__ == "__main__":
    main()
