"""The keys a chunk of new tokens reads in a DeepSeek-V4 attention layer (flax/v4_mla.py's
prefill and extend), in sparse_mla_prefill's form: one flat bfloat16 array of K=V rows and,
for each query token, a row of indices into it.

For b requests' chunks of s tokens (request r's token i at position p = num_tokens[r] + i,
real for i < its length), the rows are, in this order:
  - the chunk's rows as computed: request r's token i at r * s + i;
  - extend only: each request's ring, dequantized from FP8, R rows a request (ring slot k
    holds its latest token at a position t < num_tokens[r] with t % R == k);
  - in HCA and CSA layers, the entries the call completed, as computed: E = max_entries(ratio,
    s) rows a request, the e-th the request's entry entry_count[r] + e (entry_count before the
    call);
  - extend only, in HCA and CSA layers: each request's cached entries, dequantized, all C of
    its table (entry j at row j of its block): as many rows as the compressed cache holds
    (at V4's ratio 4, 1M tokens' 262144 entries are 256 MiB of bf16), where gathering each
    token's own selection would hold s * index_topk rows, which is more for chunks of more
    than C / index_topk tokens.
The FP8 rows are exact in bf16 (e4m3 values times a power of two; the RoPE dims are bf16).
A token's index row is its window, newest first (positions p, p - 1, ..., p - W + 1: a chunk
row from num_tokens[r] on, a ring row below it in extend, -1 below 0 and, in prefill, below
num_tokens[r]), then the entries it reads, as their rows, in the order given (-1 for an entry
neither completed by the call nor, in extend, cached), then -1. A ring slot or cached entry
whose page the table names outside the cache (negative, or past it) is not held: -1 too, so a
bad table reads nothing, as decode's sparse_mla_decode masks it. Its topk_length is W plus the
entries it reads; a padding token's is 0, so it reads nothing. Memory: b * s * (W + K) indices,
K the entries' columns, beside the rows.
"""
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jax_flashmla.base.validation import PAGE_SIZE
from jax_flashmla.caches.v4 import gather_rows


class ChunkKeys(NamedTuple):
    """rows (keys, 512) bfloat16; indices (b * s, W + K) int32 rows of them; topk_length
    (b * s,) int32 (module doc)."""

    rows: jax.Array
    indices: jax.Array
    topk_length: jax.Array


def chunk_keys(kv, positions, real, cache, *, window, read_cache, entries=None, picked=None):
    """The keys of a chunk and each token's index row into them (module doc).

    Args:
      kv: (b, s, 512) the chunk's K=V rows as computed.
      positions: (b, s) int32, cache.num_tokens[:, None] + arange(s).
      real: (b, s) bool, the tokens that are not padding.
      cache: the V4LayerCache before the call (its compressor's state not yet advanced).
      window: the sliding window W.
      read_cache: extend (True) reads the rings and the cached entries; prefill (False) not.
      entries: the call's CompressedEntries (b, E, 512) (HCA and CSA), or None (sliding).
      picked: (b, s, K) int32 entry indices each token reads, valid ones first, -1 after
        them (with entries).

    Returns:
      ChunkKeys.
    """
    b, s = positions.shape
    request = jnp.arange(b, dtype=jnp.int32)[:, None, None]
    back = jnp.arange(window, dtype=jnp.int32)
    offset = jnp.arange(s, dtype=jnp.int32)[:, None] - back  # (s, W): in the chunk from 0
    rows = [kv.reshape(b * s, -1).astype(jnp.bfloat16)]
    index = jnp.broadcast_to(jnp.where(offset >= 0, request * s + offset, -1), (b, s, window))
    columns = [index]
    read = jnp.full((b, s), window, jnp.int32)
    base = b * s
    if read_cache:
        ring = cache.ring_size
        slots = cache.window_slots(jnp.broadcast_to(jnp.arange(ring, dtype=jnp.int32), (b, ring)))
        ring_rows, held = _dequantized(cache.window, slots)
        rows.append(ring_rows)
        seen = positions[:, :, None] - back
        slot = seen % ring
        columns[0] = jnp.where((offset < 0) & (seen >= 0) & _at(held, slot),
                               base + request * ring + slot, index)
        base += b * ring
    if entries is not None:
        completed = entries.entries.shape[1]
        rows.append(entries.entries.reshape(b * completed, -1).astype(jnp.bfloat16))
        fresh = picked - cache.compressor.entry_count[:, None, None]
        column = jnp.where((picked >= 0) & (fresh >= 0) & (fresh < completed),
                           base + request * completed + fresh, -1)
        base += b * completed
        if read_cache:
            capacity = cache.entry_capacity
            ids = jnp.broadcast_to(jnp.arange(capacity, dtype=jnp.int32), (b, capacity))
            entry_rows, held = _dequantized(cache.compressed, cache.entry_slots(ids))
            rows.append(entry_rows)
            column = jnp.where((picked >= 0) & (fresh < 0) & (picked < capacity)
                               & _at(held, jnp.clip(picked, 0, capacity - 1)),
                               base + request * capacity + picked, column)
        columns.append(column)
        read = read + jnp.sum(picked >= 0, axis=-1, dtype=jnp.int32)
    indices = jnp.concatenate(columns, axis=-1)
    return ChunkKeys(jnp.concatenate(rows), indices.reshape(b * s, -1),
                     jnp.where(real, read, 0).reshape(-1))


def _at(held, at):
    """held (b, n) bool looked up at `at` (b, ...) int32 in [0, n), at's shape."""
    return jnp.take_along_axis(held, at.reshape(at.shape[0], -1), axis=1).reshape(at.shape)


def _dequantized(kv_cache, slots):
    """(rows (b * n, 512) bfloat16 of a V4KVCache at slots (b, n), held (b, n) bool): a slot
    outside the cache (-1, or a table's page past it) holds no row, its row zeros, and no
    index names it (gather would read the cache's last page, another request's)."""
    held = (slots >= 0) & (slots < kv_cache.data.shape[0] * PAGE_SIZE)
    got = gather_rows(kv_cache.data, jnp.where(held, slots, 0))
    rows = jnp.where(held[..., None], got, 0).astype(jnp.bfloat16)
    return rows.reshape(-1, got.shape[-1]), held
