"""Decode-step throughput of the served example's model (examples/serve_deepseek_mla.py).

    python benchmarks/bench_flax_decode.py --batch 1 16 64 --context 1024 4096 --out r.json

Times the jitted decode step — embedding, per layer: projections, cache write, absorbed
query, mla_decode (one FlashMLA schedule per step), W_UV, o_proj, MLP; LM head and argmax —
over a full batch at a fixed context length, with the caches donated and reused. Reports
ms per step and tokens per second for each implementation, and whether the compiled step
holds the FlashMLA custom call.
"""
import argparse
import dataclasses
import importlib.util
import json
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jax_flashmla import kernels
from jax_flashmla.cache import PagedKVCache


def load_example():
    path = pathlib.Path(__file__).resolve().parents[1] / "examples" / "serve_deepseek_mla.py"
    spec = importlib.util.spec_from_file_location("serve_deepseek_mla", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def bench_one(ex, cfg, implementation, batch, context, iters, warmup):
    pages_per_request = -(-(context + 1) // 64)
    num_pages = batch * pages_per_request
    graphdef, state, _, _ = ex.build(cfg, num_pages)
    _, decode = ex.make_steps(graphdef, implementation)
    key = jax.random.key(1)
    caches = tuple(PagedKVCache((0.5 * jax.random.normal(k, (num_pages, 64, 1, 576))).astype(jnp.bfloat16))
                   for k in jax.random.split(key, cfg.num_layers))
    table = jnp.asarray(np.random.default_rng(0).permutation(num_pages).reshape(
        batch, pages_per_request).astype(np.int32))
    seq_lens = jnp.full((batch,), context + 1, jnp.int32)
    positions = seq_lens - 1
    tokens = jnp.zeros((batch,), jnp.int32)
    hlo = decode.lower(state, tokens, positions, table, seq_lens, caches, None).compile().as_text()
    for _ in range(warmup):
        tokens, _, caches = decode(state, tokens, positions, table, seq_lens, caches, None)
    jax.block_until_ready(tokens)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        tokens, _, caches = decode(state, tokens, positions, table, seq_lens, caches, None)
        jax.block_until_ready(tokens)
        times.append(time.perf_counter() - t0)
    ms = 1e3 * float(np.median(times))
    return {"implementation": implementation, "batch": batch, "context": context,
            "layers": cfg.num_layers, "heads": cfg.attention.num_heads,
            "ms_per_step": ms, "tokens_per_s": batch / (ms / 1e3),
            "custom_call_in_hlo": "jax_flashmla_mla_decode" in hlo}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--implementation", nargs="+", default=None,
                   help="default: flashmla and reference on a Hopper GPU, else reference")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--context", type=int, nargs="+", default=[256])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=None, help="query heads (default: the example's)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    ex = load_example()
    cfg = dataclasses.replace(ex.ModelConfig(), num_layers=args.layers)
    if args.heads:
        cfg = dataclasses.replace(cfg, attention=dataclasses.replace(cfg.attention,
                                                                     num_heads=args.heads))
    impls = args.implementation or (["flashmla", "reference"] if kernels.flashmla_available()
                                    else ["reference"])
    results = []
    for impl in impls:
        for context in args.context:
            for batch in args.batch:
                r = bench_one(ex, cfg, impl, batch, context, args.iters, args.warmup)
                results.append(r)
                print(f"{impl:9s} batch {batch:4d} context {context:6d}: {r['ms_per_step']:8.3f} "
                      f"ms/step {r['tokens_per_s']:10.1f} tok/s custom call "
                      f"{r['custom_call_in_hlo']}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": str(jax.devices()[0].device_kind), "results": results}, f, indent=1)
    return results


if __name__ == "__main__":
    main()
