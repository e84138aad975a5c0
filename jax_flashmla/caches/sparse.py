"""DeepSeek-V3.2's FP8 cache for sparse attention: FlashMLA's 656-byte token format.

Each token of a (num_pages, 64, 1, 656) uint8 cache holds, in this order:
  - bytes 0-511: the 512-d latent (also V) as float8_e4m3fn, in four tiles of 128 columns;
  - bytes 512-527: the four tiles' float32 scales (latent = e4m3 value * its tile's scale);
  - bytes 528-655: the 64-d rope key as bfloat16.
A tile's scale is amax / 448 rounded up to a power of two, as DeepSeek quantizes it: the e4m3
values then never saturate, and multiplying by the scale is exact. An all-zero tile gets the
smallest normal float32 scale, 2**-126 (its values are 0 whatever the scale). Slots, their writes and
their invalid values follow jax_flashmla.caches.paged: slot = page * 64 + offset.
"""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax_flashmla.base.validation import HEAD_DIM, HEAD_DIM_V, PAGE_SIZE
from jax_flashmla.caches.index_keys import PAGE_BYTES as INDEX_PAGE_BYTES
from jax_flashmla.caches.index_keys import IndexKeyCache, write_index_keys
from jax_flashmla.caches.paged import (PagedArray, check_num_pages, checked_rows, droppable_slots,
                                      scatter_rows)
from jax_flashmla.caches.v4 import PAGE_ROWS, ROW_BYTES, V4KVCache, write_v4_kv

TILE = 128
TILES = HEAD_DIM_V // TILE
ROPE_DIM = HEAD_DIM - HEAD_DIM_V
SCALES_AT = HEAD_DIM_V  # byte offsets of the scales and of the rope key
ROPE_AT = SCALES_AT + 4 * TILES
TOKEN_BYTES = ROPE_AT + 2 * ROPE_DIM  # 656
FP8_MAX = 448.0
MIN_EXPONENT = -126  # the smallest normal float32, 2**-126: an all-zero tile's scale


@functools.partial(jax.tree_util.register_dataclass, data_fields=["data"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class SparseKVCache(PagedArray):
    """One layer's V3.2 sparse-attention cache: data (num_pages, 64, 1, 656) uint8 (module doc).

    A pytree, so it passes through jit, scan and donation like its array."""

    data: jax.Array

    @classmethod
    def create(cls, num_pages):
        """A cache of num_pages pages of 64 tokens, every token 0."""
        num_pages = check_num_pages("SparseKVCache.create", num_pages)
        return cls(quantize_tokens(jnp.zeros((num_pages, PAGE_SIZE, 1, HEAD_DIM))))


def _bytes(x):
    """x's bytes along a new last axis, flattened into x's last axis."""
    raw = jax.lax.bitcast_convert_type(x, jnp.uint8)
    return raw.reshape(*x.shape[:-1], -1) if raw.ndim > x.ndim else raw


def _from_bytes(raw, dtype):
    width = np.dtype(dtype).itemsize
    if width == 1:
        return jax.lax.bitcast_convert_type(raw, dtype)
    return jax.lax.bitcast_convert_type(raw.reshape(*raw.shape[:-1], -1, width), dtype)


def tile_scales(latent):
    """(..., 4) float32: each 128-column tile's amax / 448, rounded up to a power of two
    (exactly: from the exponent of amax / 448, not through a rounded log2)."""
    tiles = latent.astype(jnp.float32).reshape(*latent.shape[:-1], TILES, TILE)
    ratio = jnp.max(jnp.abs(tiles), axis=-1) / FP8_MAX
    mantissa, exponent = jnp.frexp(ratio)  # ratio = mantissa * 2**exponent, mantissa in [0.5, 1)
    exponent = jnp.where(mantissa == 0.5, exponent - 1, exponent)
    exponent = jnp.where(ratio > 0, exponent, MIN_EXPONENT)
    return jnp.ldexp(jnp.ones_like(ratio), jnp.maximum(exponent, MIN_EXPONENT))


def quantize_tokens(rows):
    """(..., 576) rows (any float dtype) -> (..., 656) uint8 tokens of the sparse cache."""
    if rows.shape[-1] != HEAD_DIM:
        raise ValueError(f"quantize_tokens: rows must have a last dimension of {HEAD_DIM}; "
                         f"got shape {tuple(rows.shape)}")
    latent = rows[..., :HEAD_DIM_V].astype(jnp.float32)
    scales = tile_scales(latent)
    tiles = latent.reshape(*latent.shape[:-1], TILES, TILE) / scales[..., None]
    values = tiles.reshape(latent.shape).astype(jnp.float8_e4m3fn)
    rope = rows[..., HEAD_DIM_V:].astype(jnp.bfloat16)
    return jnp.concatenate([_bytes(values), _bytes(scales), _bytes(rope)], axis=-1)


def dequantize_tokens(tokens):
    """(..., 656) uint8 tokens -> (..., 576) float32 rows: latent * its tile's scale, rope."""
    if tokens.shape[-1] != TOKEN_BYTES or tokens.dtype != jnp.uint8:
        raise ValueError(f"dequantize_tokens: tokens must be uint8 with a last dimension of "
                         f"{TOKEN_BYTES}; got {tokens.dtype} {tuple(tokens.shape)}")
    values = _from_bytes(tokens[..., :SCALES_AT], jnp.float8_e4m3fn).astype(jnp.float32)
    scales = _from_bytes(tokens[..., SCALES_AT:ROPE_AT], jnp.float32)
    latent = values.reshape(*values.shape[:-1], TILES, TILE) * scales[..., None]
    rope = _from_bytes(tokens[..., ROPE_AT:], jnp.bfloat16).astype(jnp.float32)
    return jnp.concatenate([latent.reshape(values.shape), rope], axis=-1)


def sparse_cache_array(kv_cache, where):
    """The (num_pages, 64, 1, 656) uint8 array of a SparseKVCache or of an array, checked."""
    data = kv_cache.data if isinstance(kv_cache, SparseKVCache) else kv_cache
    if data.ndim != 4 or data.shape[1:] != (PAGE_SIZE, 1, TOKEN_BYTES) or data.dtype != jnp.uint8:
        raise ValueError(f"{where}: kv_cache must be a SparseKVCache or a (num_pages, "
                         f"{PAGE_SIZE}, 1, {TOKEN_BYTES}) uint8 array; got {data.dtype} "
                         f"{tuple(data.shape)}")
    return data


def write_sparse_kv(kv_cache, slots, kv):
    """Stores new tokens' rows, quantized, at their slots, in any of the sparse attention's
    caches: the cache's kind picks the format.

    Args:
      kv_cache: SparseKVCache or its (num_pages, 64, 1, 656) uint8 array (DeepSeek-V3.2's rows,
        576 wide: the 512-d latent, also V, then the 64-d rope key); V4KVCache or its
        (num_pages, 65, 576) uint8 array (DeepSeek-V4's rows, 512 wide: 448 no-RoPE, 64 RoPE
        dims, key and value both; caches/v4.py); or IndexKeyCache or its (num_pages, 8448)
        uint8 array (V3.2's index keys, 128 wide, Hadamard-rotated; caches/index_keys.py).
      slots: int32 of any shape S, slot = page * 64 + offset. Slots < 0 or >= num_pages * 64
        are dropped. Two equal valid slots in one call store one of their rows (unspecified).
      kv: S + (the format's width,) rows, any float dtype.

    Returns:
      The updated cache, of kv_cache's kind. Under jax.jit(..., donate_argnums=<the cache>)
      the write is in place.
    """
    where = "write_sparse_kv"
    shape = tuple(getattr(getattr(kv_cache, "data", kv_cache), "shape", ()))
    if isinstance(kv_cache, V4KVCache) or shape[1:] == (PAGE_ROWS, ROW_BYTES):
        return write_v4_kv(kv_cache, slots, kv, where)
    if isinstance(kv_cache, IndexKeyCache) or shape[1:] == (INDEX_PAGE_BYTES,):
        return write_index_keys(kv_cache, slots, kv, where)
    if not isinstance(kv_cache, SparseKVCache) and len(shape) != 4:
        raise ValueError(f"{where}: kv_cache must be a SparseKVCache, a V4KVCache or an "
                         f"IndexKeyCache (or the array of one); got shape {shape}")
    data = sparse_cache_array(kv_cache, where)
    slots, rows = checked_rows(where, slots, kv, HEAD_DIM)
    tokens = quantize_tokens(rows)
    new = scatter_rows(data, droppable_slots(slots, data.shape[0]), tokens)
    return SparseKVCache(new) if isinstance(kv_cache, SparseKVCache) else new
