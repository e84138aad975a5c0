"""write_kv throughput in GB/s against a device-to-device copy of the same bytes.

write_kv moves n rows of 576 values into a donated cache: it reads the rows, the slots, and
writes the rows (2 * n * 576 * itemsize bytes of traffic, the slots aside). The baseline copies
an array of n rows (the same traffic), so the ratio says how close the scatter gets to the
device's copy bandwidth. Timing: triton.testing.do_bench when triton is importable, else
wall-clock around block_until_ready. Runs tiny on CPU: --tokens 4096 --pages 128.
"""
import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from jax_flashmla.cache import PagedKVCache, write_kv


def bench(fn, repeats):
    """Median milliseconds of fn() (which blocks until its result is ready)."""
    try:
        from triton.testing import do_bench
        return do_bench(fn, rep=repeats * 10, return_mode="median")
    except ImportError:
        fn()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return float(np.median(times))


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--pages", type=int, default=16384, help="cache pages (64 tokens each)")
    parser.add_argument("--tokens", type=int, nargs="+", default=[256, 4096, 65536, 262144])
    parser.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    dtype = jnp.dtype(args.dtype)
    cache = PagedKVCache.create(args.pages, dtype)
    print(f"device {jax.devices()[0].device_kind}; cache {cache.nbytes / 2**30:.2f} GiB {dtype}")

    write = jax.jit(lambda c, s, kv: write_kv(c, s, kv=kv), donate_argnums=0)
    copy = jax.jit(lambda x: x + jnp.zeros((), x.dtype))  # a fused read-write of x's bytes
    rng = np.random.default_rng(0)
    print(f"{'tokens':>8} {'write_kv ms':>12} {'GB/s':>8} {'copy ms':>9} {'GB/s':>8} {'ratio':>6}")
    for n in args.tokens:
        if n > cache.num_tokens:
            print(f"{n:>8} skipped: more than the cache's {cache.num_tokens} tokens")
            continue
        slots = jnp.asarray(rng.permutation(cache.num_tokens)[:n].astype(np.int32))
        rows = jnp.asarray(rng.standard_normal((n, 576)), dtype)
        state = {"cache": cache}

        def run_write():
            state["cache"] = write(state["cache"], slots, rows)
            state["cache"].data.block_until_ready()

        write_ms = bench(run_write, args.repeats)
        copy_ms = bench(lambda: copy(rows).block_until_ready(), args.repeats)
        cache = state["cache"]
        traffic = 2 * n * 576 * dtype.itemsize
        print(f"{n:>8} {write_ms:>12.4f} {traffic / write_ms / 1e6:>8.1f} {copy_ms:>9.4f} "
              f"{traffic / copy_ms / 1e6:>8.1f} {copy_ms / write_ms:>6.2f}")


if __name__ == "__main__":
    main()
