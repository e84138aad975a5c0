"""DeepSeek-V4's FP8 cache for sparse attention: FlashMLA's MODEL1 page format.

V4 keeps one 512-d row a token, both its key and its value: 448 no-RoPE dims, then 64 RoPE
dims. A (num_pages, 65, 576) uint8 cache holds 64 tokens a page in 65 rows of 576 bytes:
  - rows 0-63, one a token: bytes 0-447 the no-RoPE dims as float8_e4m3fn, in seven tiles of
    64; bytes 448-575 the RoPE dims as bfloat16;
  - row 64: bytes 8t to 8t+6 token t's seven tile scales as ue8m0 (the byte e stands for
    2**(e - 127)), byte 8t+7 zero; bytes 512-575 zero.
A tile's scale is max(amax / 448, 1e-4) rounded up to a power of two, as FlashMLA quantizes
it: the e4m3 values never saturate, and dequantizing (e4m3 value * scale) is exact. FlashMLA's
kernel reads a page as a (64, 1, 584) view whose pages lie 65 * 576 = 37,440 bytes apart.
Slots, their writes and their invalid values follow jax_flashmla.caches.paged: slot = page *
64 + offset.
"""
import dataclasses
import functools

import jax
import jax.numpy as jnp

from jax_flashmla.base.validation import PAGE_SIZE
from jax_flashmla.caches.paged import PagedArray, check_num_pages, checked_rows, droppable_slots

ROW_DIM = 512  # the key, which is also the value
ROPE_DIM = 64
NOPE_DIM = ROW_DIM - ROPE_DIM  # 448, stored as e4m3
TILE = 64
TILES = NOPE_DIM // TILE  # 7
ROW_BYTES = NOPE_DIM + 2 * ROPE_DIM  # 576
SCALE_BYTES = 8  # seven ue8m0 scales and a zero byte, a token
PAGE_ROWS = PAGE_SIZE + 1  # the tokens' rows, then the row of their scales
KERNEL_TOKEN_BYTES = ROW_BYTES + SCALE_BYTES  # 584: the token width of the kernel's view
FP8_MAX = 448.0
MIN_RATIO = 1e-4  # a tile's amax / 448 is raised to this before rounding (FlashMLA's floor)
UE8M0_BIAS = 127


@functools.partial(jax.tree_util.register_dataclass, data_fields=["data"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class V4KVCache(PagedArray):
    """One V4 cache (a layer's window or its compressed entries): data (num_pages, 65, 576)
    uint8 (module doc).

    A pytree, so it passes through jit, scan and donation like its array."""

    data: jax.Array

    @classmethod
    def create(cls, num_pages):
        """A cache of num_pages pages of 64 tokens, every token 0."""
        num_pages = check_num_pages("V4KVCache.create", num_pages)
        return cls(jnp.zeros((num_pages, PAGE_ROWS, ROW_BYTES), jnp.uint8))


def _bytes(x):
    """x's bytes, flattened into x's last axis."""
    raw = jax.lax.bitcast_convert_type(x, jnp.uint8)
    return raw.reshape(*x.shape[:-1], -1) if raw.ndim > x.ndim else raw


def tile_exponents(rows):
    """(..., 7) int32: log2 of each no-RoPE tile's scale, max(amax / 448, 1e-4) rounded up to
    a power of two (exactly: from the exponent of the ratio, not through a rounded log2)."""
    tiles = rows[..., :NOPE_DIM].astype(jnp.float32).reshape(*rows.shape[:-1], TILES, TILE)
    ratio = jnp.maximum(jnp.max(jnp.abs(tiles), axis=-1) / FP8_MAX, MIN_RATIO)
    mantissa, exponent = jnp.frexp(ratio)  # ratio = mantissa * 2**exponent, mantissa in [0.5, 1)
    return jnp.where(mantissa == 0.5, exponent - 1, exponent).astype(jnp.int32)


def quantize_rows(rows):
    """(..., 512) rows (any float dtype) -> their (..., 576) uint8 token rows and (..., 8)
    uint8 scale rows."""
    if rows.shape[-1] != ROW_DIM:
        raise ValueError(f"quantize_rows: rows must have a last dimension of {ROW_DIM}; got "
                         f"shape {tuple(rows.shape)}")
    exponents = tile_exponents(rows)
    tiles = rows[..., :NOPE_DIM].astype(jnp.float32).reshape(*rows.shape[:-1], TILES, TILE)
    values = jnp.ldexp(tiles, -exponents[..., None]).reshape(*rows.shape[:-1], NOPE_DIM)
    rope = rows[..., NOPE_DIM:].astype(jnp.bfloat16)
    token_rows = jnp.concatenate([_bytes(values.astype(jnp.float8_e4m3fn)), _bytes(rope)], -1)
    scales = (exponents + UE8M0_BIAS).astype(jnp.uint8)
    scale_rows = jnp.concatenate([scales, jnp.zeros_like(scales[..., :1])], axis=-1)
    return token_rows, scale_rows


def dequantize_rows(token_rows, scale_rows):
    """(..., 576) token rows and their (..., 8) scale rows (uint8) -> (..., 512) float32."""
    values = jax.lax.bitcast_convert_type(token_rows[..., :NOPE_DIM], jnp.float8_e4m3fn)
    exponents = scale_rows[..., :TILES].astype(jnp.int32) - UE8M0_BIAS
    tiles = values.astype(jnp.float32).reshape(*values.shape[:-1], TILES, TILE)
    nope = jnp.ldexp(tiles, exponents[..., None]).reshape(values.shape)
    rope_bytes = token_rows[..., NOPE_DIM:].reshape(*token_rows.shape[:-1], ROPE_DIM, 2)
    rope = jax.lax.bitcast_convert_type(rope_bytes, jnp.bfloat16).astype(jnp.float32)
    return jnp.concatenate([nope, rope], axis=-1)


def _scale_rows_of(data):
    """(num_pages, 64, 8): each page's last row read as its tokens' scale rows."""
    pages = data.shape[0]
    return data[:, PAGE_SIZE, :PAGE_SIZE * SCALE_BYTES].reshape(pages, PAGE_SIZE, SCALE_BYTES)


def gather_rows(data, slots):
    """(..., 512) float32: the dequantized rows at slots (int32, any shape, each in [0,
    num_pages * 64); the caller masks the others)."""
    pages, offsets = slots // PAGE_SIZE, slots % PAGE_SIZE
    return dequantize_rows(data[pages, offsets], _scale_rows_of(data)[pages, offsets])


def v4_cache_array(kv_cache, where, name="kv_cache"):
    """The (num_pages, 65, 576) uint8 array of a V4KVCache or of an array, checked."""
    data = kv_cache.data if isinstance(kv_cache, V4KVCache) else kv_cache
    if (data.ndim != 3 or data.shape[1:] != (PAGE_ROWS, ROW_BYTES)
            or data.dtype != jnp.uint8):
        raise ValueError(f"{where}: {name} must be a V4KVCache or a (num_pages, {PAGE_ROWS}, "
                         f"{ROW_BYTES}) uint8 array; got {data.dtype} {tuple(data.shape)}")
    return data


def write_v4_kv(kv_cache, slots, kv, where="write_v4_kv"):
    """Stores new tokens' rows, quantized, at their slots.

    Args:
      kv_cache: V4KVCache or its (num_pages, 65, 576) uint8 array.
      slots: int32 of any shape S, slot = page * 64 + offset. Slots < 0 or >= num_pages * 64
        are dropped. Two equal valid slots in one call store one of their rows (unspecified).
      kv: S + (512,) rows (448 no-RoPE dims, then 64 RoPE dims), any float dtype.

    Returns:
      The updated cache, of kv_cache's kind. Under jax.jit(..., donate_argnums=<the cache>)
      the write is in place: two scatters, the token rows and the scale rows.
    """
    data = v4_cache_array(kv_cache, where)
    slots, rows = checked_rows(where, slots, kv, ROW_DIM)
    token_rows, scale_rows = quantize_rows(rows)
    flat = droppable_slots(slots, data.shape[0])
    pages, offsets = flat // PAGE_SIZE, flat % PAGE_SIZE
    new = data.at[pages, offsets].set(token_rows, mode="drop")
    # The scale rows as 72 rows of 8 bytes a page row: token t's is row 64 * 72 + t.
    per_row = ROW_BYTES // SCALE_BYTES
    as_eighths = new.reshape(data.shape[0], PAGE_ROWS * per_row, SCALE_BYTES)
    as_eighths = as_eighths.at[pages, PAGE_SIZE * per_row + offsets].set(scale_rows, mode="drop")
    new = as_eighths.reshape(data.shape)
    return V4KVCache(new) if isinstance(kv_cache, V4KVCache) else new
