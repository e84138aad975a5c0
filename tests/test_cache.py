"""PagedKVCache, write_kv and token_slots against NumPy oracles, and the in-place write."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_flashmla.caches.paged import INVALID_SLOT, PagedKVCache, token_slots, write_kv
from helpers import cache_shaped_buffers

DTYPES = [jnp.bfloat16, jnp.float16]


def test_create_and_sizes():
    cache = PagedKVCache.create(3, jnp.float16)
    assert cache.data.shape == (3, 64, 1, 576) and cache.dtype == jnp.float16
    assert (cache.num_pages, cache.num_tokens) == (3, 192)
    assert cache.bytes_per_token == 576 * 2
    assert cache.nbytes == cache.data.nbytes == 192 * 576 * 2
    leaves, treedef = jax.tree.flatten(cache)
    assert len(leaves) == 1 and jax.tree.unflatten(treedef, leaves).num_pages == 3
    assert jax.jit(lambda c: c)(cache).num_pages == 3
    with pytest.raises(ValueError, match="num_pages"):
        PagedKVCache.create(0)
    with pytest.raises(TypeError, match="dtype"):
        PagedKVCache.create(2, jnp.float32)


def _oracle(cache, slots, rows):
    """NumPy write: rows cast to the cache dtype, slots outside [0, capacity) skipped."""
    flat = np.array(cache).reshape(-1, 576)
    for slot, row in zip(slots.reshape(-1), rows.reshape(-1, 576)):
        if 0 <= slot < flat.shape[0]:
            flat[slot] = row.astype(flat.dtype)
    return flat.reshape(cache.shape)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("form", ["kv", "latent_rope"])
def test_write_kv_matches_numpy(dtype, form):
    rng = np.random.default_rng(0)
    num_pages = 5
    capacity = num_pages * 64
    cache = jnp.asarray(rng.standard_normal((num_pages, 64, 1, 576)), dtype)
    valid = rng.permutation(capacity)[:40]  # distinct: one row per slot
    invalid = np.array([-1, -64, -capacity, capacity, capacity + 7, 2**31 - 1])
    slots = rng.permutation(np.concatenate([valid, invalid])).astype(np.int32).reshape(2, 23)
    rows = rng.standard_normal(slots.shape + (576,)).astype(np.float32)
    if form == "kv":
        write = jax.jit(lambda c, s, r: write_kv(c, s, kv=r))
    else:
        write = jax.jit(lambda c, s, r: write_kv(c, s, latent=r[..., :512], rope=r[..., 512:]))
    got = write(PagedKVCache(cache), jnp.asarray(slots), jnp.asarray(rows))
    assert isinstance(got, PagedKVCache)
    expected = _oracle(cache, slots, rows)
    np.testing.assert_array_equal(np.asarray(got.data, np.float32), expected.astype(np.float32))
    # A bare array in, a bare array out.
    got_array = write(cache, jnp.asarray(slots), jnp.asarray(rows))
    np.testing.assert_array_equal(np.asarray(got_array, np.float32), expected.astype(np.float32))


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv_drops_every_out_of_range_slot(dtype):
    cache = jnp.full((2, 64, 1, 576), 3.0, dtype)
    slots = jnp.array([-1, -128, 128, 129, 10_000], jnp.int32)
    got = write_kv(cache, slots, kv=jnp.zeros((5, 576), jnp.float32))
    np.testing.assert_array_equal(np.asarray(got, np.float32), 3.0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv_is_in_place_when_donated(dtype):
    cache = PagedKVCache.create(6, dtype)
    slots = jnp.array([3, 64, -1, 200, 6 * 64], jnp.int32)
    latent = jnp.ones((5, 512), jnp.float32)
    rope = jnp.ones((5, 64), jnp.float32)
    write = jax.jit(lambda c, s, l, r: write_kv(c, s, latent=l, rope=r), donate_argnums=0)
    hlo = write.lower(cache, slots, latent, rope).compile().as_text()
    assert re.search(r"input_output_alias=\{ \{\}: \(0, \{\}", hlo), "cache output not aliased"
    buffers = cache_shaped_buffers(hlo, cache.data.shape)
    assert buffers, "no cache-shaped instruction found; the HLO format changed"
    dtype_name = {jnp.bfloat16: "bf16", jnp.float16: "f16"}[dtype]
    for op_dtype, opcode, name in buffers:
        assert opcode != "copy", f"{name} copies the cache"
        assert op_dtype == dtype_name, f"{name} materialises the cache as {op_dtype}"
    # At run time the output is the donated buffer itself.
    pointer = cache.data.unsafe_buffer_pointer()
    out = write(cache, slots, latent, rope)
    assert cache.data.is_deleted()
    assert out.data.unsafe_buffer_pointer() == pointer
    assert float(out.data[0, 3, 0, 0]) == 1.0 and float(out.data[3, 8, 0, 575]) == 1.0


def _slots_oracle(block_table, positions):
    batch, max_pages = block_table.shape
    out = np.full(positions.shape, INVALID_SLOT, np.int64)
    for i in range(batch):
        for idx in np.ndindex(positions.shape[1:]):
            p = positions[(i,) + idx]
            if 0 <= p < max_pages * 64 and block_table[i, p // 64] >= 0:
                out[(i,) + idx] = block_table[i, p // 64] * 64 + p % 64
    return out


def test_token_slots_matches_numpy():
    rng = np.random.default_rng(1)
    block_table = np.full((3, 4), -1, np.int32)
    pages = rng.permutation(20)
    block_table[0, :4] = pages[:4]
    block_table[1, :2] = pages[4:6]  # ragged: pages 2 and 3 are filler
    positions = np.array([
        [0, 63, 64, 255, 256, -1, 130, 1000],
        [0, 127, 128, 200, -64, 65, 64, 1],
        [0, 1, 2, 3, 64, -5, 300, 9],  # request 2 holds no page at all
    ], np.int32).reshape(3, 2, 4)
    got = jax.jit(token_slots)(jnp.asarray(block_table), jnp.asarray(positions))
    assert got.shape == positions.shape and got.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(got), _slots_oracle(block_table, positions))


def test_token_slots_of_no_requests_are_empty():
    got = jax.jit(token_slots)(jnp.zeros((0, 4), jnp.int32), jnp.zeros((0, 2, 3), jnp.int32))
    assert got.shape == (0, 2, 3) and got.dtype == jnp.int32


def test_a_page_whose_slots_overflow_int32_places_nothing():
    """page * 64 of a page >= 2**25 wraps around int32, onto another request's slots (2**26 + 3
    would land on page 3): such a page holds no slot."""
    block_table = jnp.asarray([[2**26 + 3, 2**25 - 1], [2**25, 5]], jnp.int32)
    positions = jnp.asarray([[0, 64], [7, 70]], jnp.int32)
    got = np.asarray(jax.jit(token_slots)(block_table, positions))
    np.testing.assert_array_equal(got, [[-1, (2**25 - 1) * 64], [-1, 5 * 64 + 6]])


def test_input_errors_name_the_argument():
    cache = PagedKVCache.create(1)
    slots = jnp.zeros((2,), jnp.int32)
    with pytest.raises(ValueError, match=r"kv must have shape \(2, 576\).*\(2, 512\)"):
        write_kv(cache, slots, kv=jnp.zeros((2, 512)))
    with pytest.raises(ValueError, match="rope must have shape"):
        write_kv(cache, slots, latent=jnp.zeros((2, 512)), rope=jnp.zeros((2, 576)))
    with pytest.raises(TypeError, match="either kv or latent"):
        write_kv(cache, slots, kv=jnp.zeros((2, 576)), latent=jnp.zeros((2, 512)))
    with pytest.raises(TypeError, match="both latent"):
        write_kv(cache, slots, latent=jnp.zeros((2, 512)))
    with pytest.raises(TypeError, match="slots must be int32"):
        write_kv(cache, slots.astype(jnp.float32), kv=jnp.zeros((2, 576)))
    with pytest.raises(ValueError, match="kv_cache must have shape"):
        write_kv(jnp.zeros((1, 32, 1, 576), jnp.bfloat16), slots, kv=jnp.zeros((2, 576)))
    with pytest.raises(ValueError, match=r"positions must have shape \(2, ...\)"):
        token_slots(jnp.zeros((2, 3), jnp.int32), jnp.zeros((3, 1), jnp.int32))
    with pytest.raises(TypeError, match="block_table must be int32"):
        token_slots(jnp.zeros((2, 3), jnp.float32), jnp.zeros((2, 1), jnp.int32))
