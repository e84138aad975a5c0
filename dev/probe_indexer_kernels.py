"""Where the indexer's custom call spends its time on the GPU: the whole call (scores, then the
top-k), the call with no visible token (the top-k over -inf scores, the scoring skipping every
page), fewer heads (the scoring's tensor-core work over the same bytes), and an XLA reduction
over the same cache bytes (what the memory gives).

    python dev/probe_indexer_kernels.py [--batch 16] [--context 131072] [--out probe.json]

With --single it makes one call at 64 heads and exits: the run to profile under ncu.
"""
import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from jax_flashmla import custom_calls
from jax_flashmla.sparse.index_cache import PAGE_BYTES


IN_GRAPH = 20  # calls per executable: the host's dispatch (~100 µs) would hide a short call


def _time(fn, args, repeats=7):
    """Median µs of one of IN_GRAPH calls of fn(i, *args) inside one executable (a fori_loop;
    i varies the inputs so that XLA cannot hoist the call out of the loop)."""
    looped = jax.jit(lambda *a: jax.lax.fori_loop(
        0, IN_GRAPH, lambda i, acc: acc + fn(i, *a), jnp.float32(0)))
    jax.block_until_ready(looped(*args))
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(looped(*args))
        runs.append((time.perf_counter() - start) / IN_GRAPH * 1e6)
    return float(np.median(runs))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--context", type=int, default=131072)
    parser.add_argument("--topk", type=int, default=2048)
    parser.add_argument("--out", default=None)
    parser.add_argument("--single", action="store_true")
    args = parser.parse_args()
    b, pages = args.batch, args.context // 64
    rng = np.random.default_rng(0)
    cache = jnp.asarray(rng.integers(0, 120, (b * pages, PAGE_BYTES), dtype=np.uint8))
    table = jnp.arange(b * pages, dtype=jnp.int32).reshape(b, pages)
    full = jnp.full((b,), args.context, jnp.int32)

    def call(heads, visible):
        values = jnp.asarray(rng.normal(0, 1, (b, heads, 128)), jnp.float8_e4m3fn)
        weights = jnp.asarray(rng.normal(0, 1, (b, heads)), jnp.float32)
        fn = lambda i, v, w, c, t, s: custom_calls.INDEX_TOPK(
            values=v, weights=w, cache=c, block_table=t, visible=jnp.maximum(s - i % 2, 0),
            topk=args.topk)[0][0, 0].astype(jnp.float32)
        return _time(fn, (values, weights, cache, table, visible))

    if args.single:
        values = jnp.asarray(rng.normal(0, 1, (b, 64, 128)), jnp.float8_e4m3fn)
        weights = jnp.asarray(rng.normal(0, 1, (b, 64)), jnp.float32)
        jax.block_until_ready(jax.jit(lambda *a: custom_calls.INDEX_TOPK(
            values=a[0], weights=a[1], cache=a[2], block_table=a[3], visible=a[4],
            topk=args.topk))(values, weights, cache, table, full))
        return
    result = dict(batch=b, context=args.context, topk=args.topk,
                  device=jax.devices()[0].device_kind,
                  us={"scores and top-k, 64 heads": call(64, full),
                      "scores and top-k, 16 heads": call(16, full),
                      "top-k alone (nothing visible)": call(64, jnp.zeros((b,), jnp.int32)),
                      "XLA: sum over the cache's bytes": _time(
                          lambda i, c: jnp.sum(c + i.astype(jnp.uint8), dtype=jnp.uint32)
                          .astype(jnp.float32), (cache,))})
    result["cache_gb"] = cache.size / 1e9
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
