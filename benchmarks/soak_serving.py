"""A serving loop left running: requests admitted, grown and finished at random, with bad
requests mixed into its batches, every step checked.

Each step decodes one token for every running request (decode_step: write_kv, then mla_decode
with a metadata made with the step's block table and the cache's pages) twice, on two caches
that start equal:
  - guarded: the batch with bad rows in it, each one of: a length past its block table, a
    negative length, a page past the cache, the largest int32 page, a page whose slots wrap
    around int32, a negative page;
  - clean: the same batch with those rows as padding (length 0, no pages).
Every step checks that the good rows' out and lse are the clean run's bit for bit, that every
bad row comes out empty (out 0, lse +inf), and the page allocator's invariants (each page held
by at most one request, held and free pages adding up to the pool); every --cache-check-every
steps, that the two caches are equal (no bad row wrote anything). With device memory, its use
after the first steps and at the end.

    python benchmarks/soak_serving.py --tiny --steps 10000     # CPU: the C++ model
    python benchmarks/soak_serving.py --steps 10000            # a Hopper GPU: FlashMLA

Writes --out.json and --out.md.
"""
import argparse
import dataclasses
import functools
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_flashmla as jf
from jax_flashmla.serving import PageAllocator
from jax_flashmla.serving.block_table import block_table_from_pages

from results_io import write_json

BAD_KINDS = ("length_past_table", "negative_length", "page_past_cache", "page_int32_max",
             "page_wrapping_int32", "negative_page")


@dataclasses.dataclass(frozen=True)
class Sizes:
    pages: int
    batch: int  # rows per step, bad rows included
    heads: int
    max_pages: int  # block-table width: a request's longest life is max_pages * 64 tokens
    max_prompt: int
    dtype: str  # of q and the cache
    num_sms: int | None  # the schedule's SMs (None: the device's)


# float16 on CPU: XLA:CPU writes a bfloat16 cache row by row, a pass over the cache each.
# Few pages, so that requests also run out of them; short lives, so that 10,000 steps stay cheap.
TINY = Sizes(pages=5, batch=4, heads=16, max_pages=2, max_prompt=16, dtype="float16",
             num_sms=8)
REAL = Sizes(pages=32768, batch=128, heads=128, max_pages=64, max_prompt=2048, dtype="bfloat16",
             num_sms=None)


@functools.lru_cache(maxsize=4096)
def _row_table(seed, request):
    return np.random.default_rng([seed, request]).normal(0, 1, (8, 576)).astype(np.float32)


def rows_for(request, positions, seed):
    """The deterministic (n, 576) cache rows of a request's tokens at positions."""
    positions = np.asarray(positions)
    return _row_table(seed, request)[positions % 8] * (1 + positions[:, None] % 5) / 4


def _decode(cache, block_table, seq_lens, q, kv, num_sms):
    metadata = jf.get_mla_metadata(seq_lens, block_table=block_table, num_pages=cache.shape[0],
                                   num_heads_q=q.shape[2], num_sms=num_sms)
    return jf.serving.decode_step(cache, block_table, seq_lens, q, kv, metadata=metadata,
                                  softmax_scale=0.1)


def _same_bits(a, b):
    as_bits = lambda x: jax.lax.bitcast_convert_type(x, jnp.uint16 if x.itemsize == 2 else
                                                     jnp.uint32)
    return jnp.all(as_bits(a) == as_bits(b), axis=tuple(range(1, a.ndim)))


@functools.partial(jax.jit, donate_argnums=(0, 1), static_argnames=("num_sms",))
def _both_steps(guarded, clean, table, lens, clean_table, clean_lens, q, kv, is_bad, num_sms):
    """Both runs of one step; per row, whether its out and lse are the clean run's bits, and
    whether it came out empty."""
    guarded, out, lse = _decode(guarded, table, lens, q, kv, num_sms)
    clean, clean_out, clean_lse = _decode(clean, clean_table, clean_lens, q, kv, num_sms)
    same = _same_bits(out, clean_out) & _same_bits(lse, clean_lse)
    empty = jnp.all(out == 0, axis=(1, 2, 3)) & jnp.all(jnp.isposinf(lse), axis=(1, 2))
    return guarded, clean, same, empty


@functools.partial(jax.jit, donate_argnums=0)
def _write(cache, slots, kv):
    return jf.write_kv(cache, slots, kv=kv)


def _bad_row(kind, sizes, rng):
    """(length, block-table row) of a bad request whose write lands nowhere."""
    row = np.full(sizes.max_pages, -1, np.int32)
    length = int(rng.integers(1, 64))
    if kind == "length_past_table":
        length = sizes.max_pages * 64 + int(rng.integers(1, 100))
    elif kind == "negative_length":
        length = -int(rng.integers(1, 100))
    elif kind == "page_past_cache":
        row[0] = sizes.pages + int(rng.integers(0, 1000))
    elif kind == "page_int32_max":
        row[0] = 2**31 - 1
    elif kind == "page_wrapping_int32":  # page * 64 wraps around int32 onto a real slot
        row[0] = 2**26 + int(rng.integers(0, sizes.pages))
    else:
        row[0] = -int(rng.integers(2, 1000))
    return length, row


class Soak:
    def __init__(self, sizes, seed, p_admit, p_finish, p_bad):
        self.sizes, self.seed = sizes, seed
        self.p_admit, self.p_finish, self.p_bad = p_admit, p_finish, p_bad
        self.rng = np.random.default_rng(seed)
        self.allocator = PageAllocator(sizes.pages)
        cache = jnp.zeros((sizes.pages, 64, 1, 576), sizes.dtype)
        self.caches = {"guarded": cache, "clean": jnp.array(cache)}
        self.next_id = 0
        self.q_pool = jnp.asarray(self.rng.normal(0, 1, (16, sizes.batch, 1, sizes.heads, 576)),
                                  sizes.dtype)
        self.counts = dict(steps=0, admitted=0, finished=0, out_of_pages=0, bad_rows=0,
                           good_rows=0, cache_checks=0, **{k: 0 for k in BAD_KINDS})

    def _admit(self):
        sizes = self.sizes
        if len(self.allocator.requests) >= sizes.batch - 1 or self.rng.random() > self.p_admit:
            return
        request, prompt = self.next_id, int(self.rng.integers(1, sizes.max_prompt + 1))
        try:
            pages = self.allocator.admit(request, prompt)
        except PageAllocator.OutOfPagesError:
            self.counts["out_of_pages"] += 1
            return
        self.next_id += 1
        self.counts["admitted"] += 1
        positions = np.arange(sizes.max_prompt)
        slots = np.where(positions < prompt,
                         np.asarray(pages + [0] * sizes.max_pages)[positions // 64] * 64
                         + positions % 64, -1).astype(np.int32)
        kv = jnp.asarray(rows_for(request, positions, self.seed), self.sizes.dtype)
        for name in self.caches:
            self.caches[name] = _write(self.caches[name], jnp.asarray(slots), kv)

    def _finish_some(self):
        for request in self.allocator.requests:
            full = self.allocator.num_tokens(request) >= self.sizes.max_pages * 64
            if full or self.rng.random() < self.p_finish:
                self.allocator.finish(request)
                self.counts["finished"] += 1

    def _grow(self):
        """Grows each request by one token (finishing those the pool cannot grow)."""
        for request in self.allocator.requests:
            try:
                self.allocator.grow(request, self.allocator.num_tokens(request) + 1)
            except PageAllocator.OutOfPagesError:
                self.allocator.finish(request)
                self.counts["finished"] += 1
                self.counts["out_of_pages"] += 1

    def _check_allocator(self):
        held = [p for r in self.allocator.requests for p in self.allocator.pages(r)]
        assert len(held) == len(set(held)), "a page is held by two requests"
        assert len(held) == self.allocator.num_used, "a page leaked"
        assert self.allocator.num_used + self.allocator.num_free == self.sizes.pages

    def step(self, check_cache):
        sizes, rng = self.sizes, self.rng
        self._finish_some()
        self._admit()
        self._grow()
        self._check_allocator()
        requests = self.allocator.requests
        lens = [self.allocator.num_tokens(r) for r in requests]
        tables = [self.allocator.pages(r) for r in requests]
        bad = []
        while len(requests) + len(bad) < sizes.batch and rng.random() < self.p_bad:
            bad.append(BAD_KINDS[rng.integers(len(BAD_KINDS))])
        order = rng.permutation(len(requests) + len(bad))
        seq_lens = np.zeros(sizes.batch, np.int32)
        table = np.full((sizes.batch, sizes.max_pages), -1, np.int32)
        table[:len(requests)] = block_table_from_pages(tables, sizes.max_pages)
        seq_lens[:len(requests)] = lens
        kv = np.zeros((sizes.batch, 1, 576), np.float32)
        for i, request in enumerate(requests):
            kv[i, 0] = rows_for(request, [lens[i] - 1], self.seed)[0]
        for i, kind in enumerate(bad):
            seq_lens[len(requests) + i], table[len(requests) + i] = _bad_row(kind, sizes, rng)
            self.counts[kind] += 1
        rows = np.concatenate([order, np.arange(len(order), sizes.batch)])
        seq_lens, table, kv = seq_lens[rows], table[rows], kv[rows]
        is_bad = np.zeros(sizes.batch, bool)
        is_bad[np.isin(rows, np.arange(len(requests), len(order)))] = True
        q = self.q_pool[self.counts["steps"] % len(self.q_pool)]
        clean_lens = np.where(is_bad, 0, seq_lens).astype(np.int32)
        clean_table = np.where(is_bad[:, None], -1, table).astype(np.int32)
        self.caches["guarded"], self.caches["clean"], same, empty = _both_steps(
            self.caches["guarded"], self.caches["clean"], table, seq_lens, clean_table,
            clean_lens, q, jnp.asarray(kv, sizes.dtype), is_bad, num_sms=sizes.num_sms)
        same, empty = np.asarray(same), np.asarray(empty)
        step = self.counts["steps"]
        assert same[~is_bad].all(), f"step {step}: good rows {np.flatnonzero(~is_bad & ~same)} " \
                                    "differ from the clean run"
        assert empty[is_bad].all(), f"step {step}: bad rows {np.flatnonzero(is_bad & ~empty)} " \
                                    "are not empty"
        if check_cache:
            np.testing.assert_array_equal(np.asarray(self.caches["guarded"]),
                                          np.asarray(self.caches["clean"]))
            self.counts["cache_checks"] += 1
        self.counts["steps"] += 1
        self.counts["bad_rows"] += len(bad)
        self.counts["good_rows"] += len(requests)


def _device_bytes():
    """Device memory in use: XLA's, and torch's where the CUDA bridge brought torch in (its
    caching allocator must stay empty: FlashMLA's op allocates only in XLA's buffers)."""
    stats = jax.devices()[0].memory_stats()
    torch = sys.modules.get("torch")
    on_torch = (torch is not None and jax.default_backend() == "gpu"
                and torch.cuda.is_initialized())
    return dict(xla=None if not stats else int(stats.get("bytes_in_use", 0)),
                torch_allocated=int(torch.cuda.memory_allocated()) if on_torch else None,
                torch_reserved=int(torch.cuda.memory_reserved()) if on_torch else None)


def run(steps, sizes, seed=0, p_admit=0.5, p_finish=0.05, p_bad=0.3, cache_check_every=500):
    soak = Soak(sizes, seed, p_admit, p_finish, p_bad)
    start, memory = time.perf_counter(), {}
    for i in range(steps):
        soak.step(check_cache=(i + 1) % cache_check_every == 0 or i + 1 == steps)
        if i == min(99, steps - 1):
            memory["after_100_steps"] = _device_bytes()
    memory["at_end"] = _device_bytes()
    for request in soak.allocator.requests:
        soak.allocator.finish(request)
    assert soak.allocator.num_free == sizes.pages, "pages leaked once every request finished"
    return dict(device=jax.devices()[0].device_kind, jax=jax.__version__,
                sizes=dataclasses.asdict(sizes), seed=seed, p_admit=p_admit,
                p_finish=p_finish, p_bad=p_bad, seconds=round(time.perf_counter() - start, 1),
                device_bytes_in_use=memory,
                memory_flat=memory["at_end"] == memory["after_100_steps"], **soak.counts)


def report_markdown(result):
    lines = [f"# Serving soak: {result['device']}", "",
             f"jax {result['jax']}; sizes {result['sizes']}; seed {result['seed']}; "
             f"{result['seconds']} s.", "",
             "| what | count |", "| --- | --- |"]
    for key in ("steps", "admitted", "finished", "out_of_pages", "good_rows", "bad_rows",
                *BAD_KINDS, "cache_checks"):
        lines.append(f"| {key} | {result[key]} |")
    lines += ["", "Every step: good rows bit-identical to the clean run, bad rows empty, the "
              "allocator's invariants; the caches equal at every cache check. Device memory in "
              f"use (bytes): {result['device_bytes_in_use']}; the same at the end as after "
              f"100 steps: {result['memory_flat']}.", ""]
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=10000)
    parser.add_argument("--tiny", action="store_true", help="CPU sizes (default: GPU sizes)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cache-check-every", type=int, default=500)
    parser.add_argument("--out", default=None, help="path stem of the JSON and markdown")
    args = parser.parse_args(argv)
    result = run(args.steps, TINY if args.tiny else REAL, seed=args.seed,
                 cache_check_every=args.cache_check_every)
    if args.out:
        write_json(result, args.out + ".json")
        with open(args.out + ".md", "w") as f:
            f.write(report_markdown(result))
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
