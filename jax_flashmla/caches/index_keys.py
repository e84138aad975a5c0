"""DeepSeek-V3.2's paged index-key cache: the lightning indexer's keys as FP8, 132 bytes a token.

A cache is a (num_pages, 64 * 132) uint8 array, SGLang's index_k_with_scale_buffer with pages
of 64 tokens (DeepGEMM's fp8_paged_mqa_logits reads the same bytes as (num_pages, 64, 1, 132)).
Page p holds, in this order:
  - bytes [0, 8192): its 64 tokens' 128-d keys as float8_e4m3fn, token t at [128 t, 128 t + 128);
  - bytes [8192, 8448): their float32 scales, token t's at [8192 + 4 t, 8192 + 4 t + 4).
key = e4m3 value * its token's scale. As DeepSeek's act_quant with V3.2's scale_fmt "ue8m0"
quantizes it, a scale is amax / 448 (amax clamped up to 1e-4) rounded up to a power of two: the
values never saturate and multiplying by the scale is exact. Slots are the MLA cache's,
slot = page * 64 + offset (jax_flashmla.caches.paged), and writes drop the same invalid slots.
The CUDA indexer reads the layout from ffi/layouts.h; tests/test_layouts.py checks that the two
agree.
"""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax_flashmla.base.validation import PAGE_SIZE, fail
from jax_flashmla.caches.paged import (PagedArray, check_num_pages, checked_rows, droppable_slots,
                                      scatter_rows)

INDEX_HEAD_DIM = 128
SCALE_BYTES = 4
TOKEN_BYTES = INDEX_HEAD_DIM + SCALE_BYTES  # 132
PAGE_BYTES = PAGE_SIZE * TOKEN_BYTES  # 8448
VALUES_BYTES = PAGE_SIZE * INDEX_HEAD_DIM  # 8192: where a page's scales start
FP8_MAX = 448.0
FP8_MAX_INV = np.float32(1 / 448)  # DeepSeek multiplies amax by it (not divides by 448)
MIN_AMAX = 1e-4  # DeepSeek's floor on amax: an all-zero key gets the scale 2**-22
# A page viewed as 33 chunks of 64 rows of 4 bytes: its scales are the last chunk.
CHUNKS_PER_PAGE = PAGE_BYTES // (PAGE_SIZE * SCALE_BYTES)


@functools.partial(jax.tree_util.register_dataclass, data_fields=["data"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class IndexKeyCache(PagedArray):
    """One layer's index-key cache: data (num_pages, 8448) uint8 (module doc).

    A pytree, so it passes through jit, scan and donation like its array."""

    data: jax.Array

    @classmethod
    def create(cls, num_pages):
        """A cache of num_pages pages of 64 tokens, every key 0 (with the scale 2**-22)."""
        num_pages = check_num_pages("IndexKeyCache.create", num_pages)
        _, zero_scale = quantize_index_keys(jnp.zeros((PAGE_SIZE, INDEX_HEAD_DIM)))
        scale_bytes = jax.lax.bitcast_convert_type(zero_scale, jnp.uint8).reshape(-1)
        data = jnp.zeros((num_pages, PAGE_BYTES), jnp.uint8)
        return cls(data.at[:, VALUES_BYTES:].set(scale_bytes))


def index_cache_array(cache, where):
    """The (num_pages, 8448) uint8 array of an IndexKeyCache or of an array, checked."""
    data = cache.data if isinstance(cache, IndexKeyCache) else cache
    if not hasattr(data, "shape") or data.ndim != 2 or data.shape[1] != PAGE_BYTES \
            or data.dtype != jnp.uint8 or data.shape[0] < 1:
        seen = (f"{data.dtype} {tuple(data.shape)}" if hasattr(data, "shape")
                else type(data).__name__)
        fail(ValueError, where, f"cache must be an IndexKeyCache or a (num_pages >= 1, "
                                 f"{PAGE_BYTES}) uint8 array; got {seen}")
    return data


def power_of_two_scales(x):
    """(..., 128) -> (...,) float32: 2 ** ceil(log2(max(amax, 1e-4) / 448)), exactly (from the
    exponent, not through a rounded log2), as DeepSeek's fast_round_scale computes it."""
    amax = jnp.maximum(jnp.max(jnp.abs(x.astype(jnp.float32)), axis=-1), MIN_AMAX)
    mantissa, exponent = jnp.frexp(amax * FP8_MAX_INV)  # mantissa in [0.5, 1)
    exponent = jnp.where(mantissa == 0.5, exponent - 1, exponent)
    return jnp.ldexp(jnp.ones_like(amax), exponent)


def quantize_index_keys(x):
    """(..., 128) keys (or one head's query), any float dtype -> (values (..., 128)
    float8_e4m3fn, scales (...,) float32) with x ~= values * scales[..., None]."""
    if x.shape[-1] != INDEX_HEAD_DIM or not jnp.issubdtype(x.dtype, jnp.floating):
        fail(ValueError, "quantize_index_keys", f"x must be floating with a last dimension "
                                                 f"of {INDEX_HEAD_DIM}; got {x.dtype} "
                                                 f"{tuple(x.shape)}")
    scales = power_of_two_scales(x)
    values = jnp.clip(x.astype(jnp.float32) / scales[..., None], -FP8_MAX, FP8_MAX)
    return values.astype(jnp.float8_e4m3fn), scales


def dequantize_index_keys(values, scales):
    """float8_e4m3fn values (..., 128), float32 scales (...,) -> (..., 128) float32."""
    return values.astype(jnp.float32) * scales[..., None].astype(jnp.float32)


def write_index_keys(cache, slots, keys, where="write_index_keys"):
    """Stores new tokens' index keys, quantized, at their slots.

    Args:
      cache: IndexKeyCache or its (num_pages, 8448) uint8 array.
      slots: int32 of any shape S, slot = page * 64 + offset. Slots < 0 or >= num_pages * 64
        are dropped. Two equal valid slots in one call store one of their keys (unspecified).
      keys: S + (128,) index keys (indexer.index_keys: Hadamard-rotated), any float dtype.

    Returns:
      The updated cache, of cache's kind. Under jax.jit(..., donate_argnums=<the cache>) the
      write is in place (two scatters into reshaped views of the one buffer).
    """
    data = index_cache_array(cache, where)
    slots, keys = checked_rows(where, slots, keys, INDEX_HEAD_DIM, name="keys")
    values, scales = quantize_index_keys(keys)
    num_pages = data.shape[0]
    flat = droppable_slots(slots, num_pages)  # num_pages * 64 where dropped
    as_bytes = lambda x: jax.lax.bitcast_convert_type(x, jnp.uint8)
    token_rows = data.reshape(num_pages, PAGE_BYTES // INDEX_HEAD_DIM, 1, INDEX_HEAD_DIM)
    data = scatter_rows(token_rows, flat, as_bytes(values)).reshape(num_pages, PAGE_BYTES)
    chunks = data.reshape(num_pages, CHUNKS_PER_PAGE, PAGE_SIZE, SCALE_BYTES)
    # A dropped slot's page is num_pages, past the end: dropped here too.
    scale_at = (flat // PAGE_SIZE, CHUNKS_PER_PAGE - 1, flat % PAGE_SIZE)
    data = chunks.at[scale_at].set(as_bytes(scales), mode="drop").reshape(num_pages, PAGE_BYTES)
    return IndexKeyCache(data) if isinstance(cache, IndexKeyCache) else data


def read_index_keys(data, slots):
    """(values float8_e4m3fn slots.shape + (128,), scales float32 slots.shape) of a
    (num_pages, 8448) uint8 cache at slots that must lie in [0, num_pages * 64)."""
    num_pages = data.shape[0]
    page, offset = slots // PAGE_SIZE, slots % PAGE_SIZE
    # Gathers from reshapes of the whole buffer (free), not from slices (possibly copies).
    values = data.reshape(num_pages, PAGE_BYTES // INDEX_HEAD_DIM, INDEX_HEAD_DIM)[page, offset]
    scales = data.reshape(num_pages, CHUNKS_PER_PAGE, PAGE_SIZE, SCALE_BYTES)[
        page, CHUNKS_PER_PAGE - 1, offset]
    return (jax.lax.bitcast_convert_type(values, jnp.float8_e4m3fn),
            jax.lax.bitcast_convert_type(scales, jnp.float32))
