"""The paged MLA KV cache: FlashMLA's (num_pages, 64, 1, 576) array, slots and writes.

A token's slot is its row in the cache viewed as (num_pages * 64, 576): page * 64 + offset.
write_kv scatters rows into slots with XLA's "drop" mode, so under jit with the cache donated
the update happens in place (the compiled module aliases the cache input to the output and
copies nothing). Slots outside [0, num_tokens) are dropped, never wrapped or clamped onto
another token; token_slots maps every position it cannot place to INVALID_SLOT (-1).
On CPU a bfloat16 cache is written row by row instead (still in place, but each row costs a
pass over the cache there): XLA:CPU would run a bf16 scatter in float32 on a copy.
A float8_e4m3fn cache (FlashMLA's FP8 decode) stores rows quantized with the layer's scale,
as SGLang's scaled_fp8_quant does; the scale is the caller's, passed to write_kv and
mla_decode.
"""
import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jax_flashmla.base import checks, validation
from jax_flashmla.base.validation import HEAD_DIM, HEAD_DIM_V, PAGE_SIZE
from jax_flashmla.caches import fp8

ROPE_DIM = HEAD_DIM - HEAD_DIM_V  # 64-d decoupled rope key after the 512-d latent
INVALID_SLOT = -1
MAX_SLOT_PAGE = (np.iinfo(np.int32).max - PAGE_SIZE + 1) // PAGE_SIZE  # its last slot fits int32
CACHE_DTYPES = validation.SUPPORTED_DTYPES + (validation.FP8_DTYPE,)


def check_num_pages(where, num_pages):
    """num_pages as an int, or a ValueError naming it unless it is a positive int."""
    if isinstance(num_pages, bool) or not isinstance(num_pages, (int, np.integer)) \
            or num_pages < 1:
        raise ValueError(f"{where}: num_pages must be a positive int; got {num_pages!r}")
    return int(num_pages)


class PagedArray:
    """A cache whose data's first axis is its pages of 64 tokens."""

    @property
    def num_pages(self):
        return self.data.shape[0]

    @property
    def num_tokens(self):
        """Capacity in tokens (num_pages * 64)."""
        return self.num_pages * PAGE_SIZE


@functools.partial(jax.tree_util.register_dataclass, data_fields=["data"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class PagedKVCache(PagedArray):
    """One layer's paged MLA KV cache.

    Attributes:
      data: (num_pages, 64, 1, 576) bfloat16, float16 or float8_e4m3fn, FlashMLA's layout:
        page, offset in page, the single latent KV head, then the 512-d latent (also V) and the
        64-d rope key.

    A pytree, so it passes through jit, scan and donation like its array.
    """

    data: jax.Array

    @classmethod
    def create(cls, num_pages, dtype=jnp.bfloat16):
        """A zero-filled cache of num_pages pages of 64 tokens."""
        num_pages = check_num_pages("PagedKVCache.create", num_pages)
        if np.dtype(dtype) not in CACHE_DTYPES:
            raise TypeError(f"PagedKVCache.create: dtype must be bfloat16, float16 or "
                            f"float8_e4m3fn; got {dtype}")
        return cls(jnp.zeros((num_pages, PAGE_SIZE, 1, HEAD_DIM), dtype))

    @property
    def dtype(self):
        return self.data.dtype

    @property
    def bytes_per_token(self):
        return HEAD_DIM * np.dtype(self.data.dtype).itemsize

    @property
    def nbytes(self):
        return self.num_tokens * self.bytes_per_token


def cache_array(kv_cache, where="write_kv"):
    """The (num_pages, 64, 1, 576) array of a PagedKVCache or of an array, checked."""
    data = kv_cache.data if isinstance(kv_cache, PagedKVCache) else kv_cache
    if data.ndim != 4 or data.shape[1:] != (PAGE_SIZE, 1, HEAD_DIM):
        raise ValueError(f"{where}: kv_cache must have shape (num_pages, {PAGE_SIZE}, 1, "
                         f"{HEAD_DIM}); got {tuple(data.shape)}")
    if np.dtype(data.dtype) not in CACHE_DTYPES:
        raise TypeError(f"{where}: kv_cache must be bfloat16, float16 or float8_e4m3fn; "
                        f"got {data.dtype}")
    return data


def _rows(slots_shape, latent, rope, kv):
    """The (..., 576) rows to store, from kv or from latent + rope."""
    if kv is not None:
        if latent is not None or rope is not None:
            raise TypeError("write_kv: pass either kv or latent and rope, not both")
        parts = (("kv", kv, HEAD_DIM),)
    elif latent is None or rope is None:
        raise TypeError("write_kv: pass kv (..., 576) or both latent (..., 512) and rope (..., 64)")
    else:
        parts = (("latent", latent, HEAD_DIM_V), ("rope", rope, ROPE_DIM))
    for name, x, width in parts:
        expected = tuple(slots_shape) + (width,)
        if tuple(x.shape) != expected:
            raise ValueError(f"write_kv: {name} must have shape {expected} (slots' shape + "
                             f"({width},)); got {tuple(x.shape)}")
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(f"write_kv: {name} must be a floating dtype; got {x.dtype}")
    return parts


def checked_rows(where, slots, rows, width, name="kv"):
    """A sparse cache writer's slots (int32 of any shape S) and its rows (S + (width,), any
    float dtype), checked: slots as a JAX array and the rows as (n, width)."""
    # Checked before jnp.asarray, which would narrow a NumPy int64 array without a word.
    slots = slots if hasattr(slots, "dtype") else jnp.asarray(slots)
    validation.check_int32(where, "slots", slots)
    slots = jnp.asarray(slots)
    expected = tuple(slots.shape) + (width,)
    if tuple(rows.shape) != expected or not jnp.issubdtype(rows.dtype, jnp.floating):
        validation.fail(ValueError, where, f"{name} must be floating with shape {expected} "
                                           f"(slots' shape + ({width},)); got {rows.dtype} "
                                           f"{tuple(rows.shape)}")
    return slots, rows.reshape(-1, width)


def droppable_slots(slots, num_pages):
    """slots flattened to (n,), each outside [0, num_pages * 64) sent to num_pages * 64, past
    the end, where scatter_rows drops it: jnp indexing would wrap a negative one first."""
    capacity = num_pages * PAGE_SIZE
    flat = slots.reshape(-1)
    return jnp.where((flat >= 0) & (flat < capacity), flat, capacity)


def scatter_rows(data, slots, rows):
    """One scatter of rows (n, width) into token slots (n,) of a (num_pages, 64, 1, width)
    cache; slots >= capacity are dropped."""
    return data.at[slots // PAGE_SIZE, slots % PAGE_SIZE].set(rows[:, None, :], mode="drop")


def _write_rows_loop(data, slots, rows):
    """Row by row with dynamic_update_slice, over the valid slots only (moved to the front):
    dynamic_update_slice clamps rather than drops, and selecting between the new and the old
    row would put the bf16 cache through XLA:CPU's float32 path again."""
    valid = slots < data.shape[0] * PAGE_SIZE
    order = jnp.argsort(~valid, stable=True)
    slots, rows = slots[order], rows[order]

    def write_one(i, data):
        start = (slots[i] // PAGE_SIZE, slots[i] % PAGE_SIZE, 0, 0)
        return jax.lax.dynamic_update_slice(data, rows[i].reshape(1, 1, 1, HEAD_DIM), start)

    return jax.lax.fori_loop(0, jnp.sum(valid), write_one, data)


def _to_cache_dtype(rows, dtype, scale):
    if np.dtype(dtype) == validation.FP8_DTYPE:
        if scale is None:
            raise TypeError("write_kv: a float8_e4m3fn kv_cache needs scale, its float32 scale of "
                            "shape () or (1,)")
        validation.check_scale("write_kv", "scale", scale)
        if checks.enabled():
            checks.scale("write_kv", "scale", scale)
        return fp8.quantize(rows, jnp.asarray(scale))
    if scale is not None:
        raise TypeError(f"write_kv: scale is only for a float8_e4m3fn kv_cache; kv_cache is {dtype}")
    return rows.astype(dtype)


def write_kv(kv_cache, slots, *, latent=None, rope=None, kv=None, scale=None):
    """Stores new tokens' KV rows at their slots.

    Args:
      kv_cache: PagedKVCache, or its (num_pages, 64, 1, 576) bfloat16/float16 array.
      slots: int32 of any shape S (usually (n,)), slot = page * 64 + offset in page. Slots < 0
        or >= num_pages * 64 are dropped: that row is not written anywhere. Two equal valid
        slots in one call store one of their rows, which one is unspecified (as in XLA scatter).
      latent: S + (512,) latent (the V part), with rope: S + (64,) rope key; or
      kv: S + (576,) whole rows. Cast to the cache's dtype.
      scale: with a float8_e4m3fn cache (and only then), its float32 scale of shape () or (1,):
        rows are stored as rows / scale, saturated at +-448 (jax_flashmla/caches/fp8.py).

    Returns:
      The updated cache, of kv_cache's kind (PagedKVCache or array). Under
      jax.jit(..., donate_argnums=<the cache>) the write is in place.
    """
    data = cache_array(kv_cache)
    slots = jnp.asarray(slots)
    validation.check_int32("write_kv", "slots", slots)
    parts = _rows(slots.shape, latent, rope, kv)
    rows = jnp.concatenate([x.reshape(-1, width) for _, x, width in parts], axis=-1)
    rows = _to_cache_dtype(rows, data.dtype, scale)
    flat_slots = droppable_slots(slots, data.shape[0])
    if np.dtype(data.dtype) == validation.FP8_DTYPE:
        # XLA:CPU would scatter float8 in float16 on a converted copy of the whole cache; the
        # same bytes as uint8 scatter natively (in place) everywhere.
        as_bytes = lambda x: jax.lax.bitcast_convert_type(x, jnp.uint8)
        new = jax.lax.bitcast_convert_type(
            scatter_rows(as_bytes(data), flat_slots, as_bytes(rows)), data.dtype)
    elif data.dtype == jnp.bfloat16:
        # XLA:CPU runs a bfloat16 scatter in float32, converting (so copying) the whole cache;
        # there a loop of dynamic_update_slice is the in-place write. GPUs scatter bf16 natively.
        new = jax.lax.platform_dependent(data, flat_slots, rows, cpu=_write_rows_loop,
                                         default=scatter_rows)
    else:
        new = scatter_rows(data, flat_slots, rows)
    return PagedKVCache(new) if isinstance(kv_cache, PagedKVCache) else new


def token_slots(block_table, positions):
    """Slots of token positions through a block table.

    Args:
      block_table: (batch, max_pages) int32; entry j of request i is the page holding its
        tokens [64 j, 64 j + 64); negative entries (the filler of build_block_table) hold none.
      positions: int32 of shape (batch, ...), token positions within each request.

    Returns:
      int32 of positions' shape: block_table[i, p // 64] * 64 + p % 64 for position p of
      request i; INVALID_SLOT (-1, which write_kv drops) where p < 0, p >= max_pages * 64 or
      the page entry is negative or so large that its slots overflow int32 (>= 2**25).
    """
    validation.check_rank("token_slots", "block_table", block_table, 2, "(batch, max_pages)")
    validation.check_int32("token_slots", "block_table", block_table)
    positions = jnp.asarray(positions)
    validation.check_int32("token_slots", "positions", positions)
    batch, max_pages = block_table.shape
    if positions.ndim < 1 or positions.shape[0] != batch:
        raise ValueError(f"token_slots: positions must have shape ({batch}, ...) for "
                         f"block_table's batch {batch}; got {tuple(positions.shape)}")
    flat = positions.reshape(batch, math.prod(positions.shape[1:]))  # -1 fails with no rows
    page_index = flat // PAGE_SIZE
    in_table = (flat >= 0) & (page_index < max_pages)
    pages = jnp.take_along_axis(block_table, jnp.clip(page_index, 0, max_pages - 1), axis=1)
    # A page past MAX_SLOT_PAGE would wrap page * 64 around int32, possibly onto another
    # request's token: no cache holds that many pages, so it places nothing.
    valid = in_table & (pages >= 0) & (pages <= MAX_SLOT_PAGE)
    slots = jnp.where(valid, pages * PAGE_SIZE + flat % PAGE_SIZE, INVALID_SLOT)
    return slots.reshape(positions.shape)
