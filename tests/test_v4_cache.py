"""DeepSeek-V4's FP8 cache (FlashMLA's MODEL1 page format) and the pure-JAX V4 sparse decode,
on CPU: the bytes against a NumPy writer of FlashMLA's layout, writes in place, the round
trip, and the decode against a float64 oracle over the rows as stored, with FlashMLA-style
inputs (invalid indices, topk lengths, a window cache, sinks of +-inf, empty rows)."""
import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jax_flashmla.caches.v4 import (KERNEL_TOKEN_BYTES, V4KVCache, dequantize_rows,
                                    quantize_rows, write_v4_kv)
from jax_flashmla.reference.v4 import v4_decode_reference
from helpers import SPARSE_LSE_TOL, SPARSE_OUT_TOL, sparse_attention_f64

PAGE_BYTES = 37440


def _rows(rng, shape, spread=1.0):
    """Rows whose 64-column tiles have different magnitudes, as a model's latents do."""
    rows = rng.normal(0, 1, shape + (512,)) * spread
    rows[..., :448] *= np.repeat(rng.uniform(0.001, 8, shape + (7,)), 64, axis=-1)
    return rows.astype(np.float32)


def _numpy_page(rows):
    """FlashMLA's MODEL1 page from (64, 512) float32 rows, written the way its tests' quantizer
    lays it out: 64 rows of 448 e4m3 + 64 bf16, then 64 rows of 7 ue8m0 scales and a pad
    byte, the page padded to 37,440 bytes."""
    page = np.zeros(PAGE_BYTES, np.uint8)
    ratio = np.maximum(np.abs(rows[:, :448].reshape(64, 7, 64)).max(-1) / np.float32(448),
                       np.float32(1e-4)).astype(np.float32)
    exponent = np.ceil(np.log2(ratio.astype(np.float64))).astype(np.int32)
    values = (rows[:, :448].reshape(64, 7, 64) / np.exp2(exponent)[..., None].astype(np.float32))
    data = np.concatenate([values.reshape(64, 448).astype(ml_dtypes.float8_e4m3fn).view(np.uint8),
                           rows[:, 448:].astype(ml_dtypes.bfloat16).view(np.uint8)], axis=-1)
    page[:64 * 576] = data.reshape(-1)
    scales = np.zeros((64, 8), np.uint8)
    scales[:, :7] = exponent + 127
    page[64 * 576:64 * 584] = scales.reshape(-1)
    return page


def test_pages_hold_flashmlas_bytes():
    rng = np.random.default_rng(0)
    rows = _rows(rng, (2, 64))
    rows[0, 3, 64:128] = 0.0  # an all-zero tile takes the floor's scale, 2**-13
    rows[1, 5, :64] = 0.0
    rows[1, 5, 7] = -448.0 / 4  # amax / 448 exactly a power of two
    cache = write_v4_kv(V4KVCache.create(2), jnp.arange(128, dtype=jnp.int32),
                        jnp.asarray(rows.reshape(128, 512)))
    assert cache.data.shape == (2, 65, 576) and cache.data.dtype == jnp.uint8
    pages = np.asarray(cache.data).reshape(2, PAGE_BYTES)
    for p in range(2):
        np.testing.assert_array_equal(pages[p], _numpy_page(rows[p]))
    assert pages[0, 64 * 576 + 3 * 8 + 1] == 127 - 13
    assert pages[1, 64 * 576 + 5 * 8] == 127 - 2
    # The kernel's (64, 1, 584) view of a page names the same bytes: its tokens' rows first.
    assert 64 * KERNEL_TOKEN_BYTES <= PAGE_BYTES and PAGE_BYTES % 576 == 0


def test_the_round_trip_is_exact_where_it_can_be():
    rows = _rows(np.random.default_rng(1), (5, 3))
    token_rows, scale_rows = quantize_rows(jnp.asarray(rows))
    back = np.asarray(dequantize_rows(token_rows, scale_rows))
    np.testing.assert_array_equal(back[..., 448:],
                                  rows[..., 448:].astype(jnp.bfloat16).astype(np.float32))
    scales = np.exp2(np.asarray(scale_rows[..., :7], np.float64) - 127)
    # e4m3 keeps 3 mantissa bits: within half a step (1/16 relative) of what was stored.
    np.testing.assert_allclose(back[..., :448], rows[..., :448], rtol=1 / 16,
                               atol=np.repeat(scales, 64, axis=-1).max() * 2 ** -9)
    assert np.all(np.asarray(scale_rows[..., 7]) == 0)


def test_writes_land_at_their_slots_in_place_and_drop_invalid_slots():
    rng = np.random.default_rng(2)
    cache = V4KVCache.create(3)
    slots = jnp.asarray([[5, 130], [-1, 192 + 7], [2 ** 31 - 1, -2 ** 31]], jnp.int32)
    kv = jnp.asarray(_rows(rng, (3, 2)))
    write = jax.jit(write_v4_kv, donate_argnums=0)
    hlo = write.lower(cache, slots, kv).as_text()
    assert "tf.aliasing_output" in hlo or "jax.buffer_donor" in hlo
    # On CPU with XLA's default fusion emitters, as users compile it: conftest turns them off
    # in the CPU suite to compile faster, and the older emitters copy the cache here.
    on_cpu = jax.default_backend() == "cpu"
    compiled = write.lower(cache, slots, kv).compile(
        {"xla_cpu_use_fusion_emitters": True} if on_cpu else None).as_text()
    assert "copy(" not in compiled.replace(" ", ""), "the cache was copied, not written in place"
    new = np.array(write(cache, slots, kv).data)
    token_rows, scale_rows = map(np.asarray, quantize_rows(kv))
    for (page, offset), (i, j) in (((0, 5), (0, 0)), ((2, 2), (0, 1))):
        np.testing.assert_array_equal(new[page, offset], token_rows[i, j])
        np.testing.assert_array_equal(new[page, 64, 8 * offset:8 * offset + 8], scale_rows[i, j])
    new[0, 5] = new[2, 2] = 0
    new[0, 64, 40:48] = new[2, 64, 16:24] = 0
    assert not new.any(), "a byte outside the two written tokens changed"


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="kv_cache must be a V4KVCache"):
        write_v4_kv(jnp.zeros((2, 64, 1, 584), jnp.uint8), jnp.zeros(1, jnp.int32),
                    jnp.zeros((1, 512)))
    with pytest.raises(ValueError, match=r"kv must be floating with shape \(4, 512\)"):
        write_v4_kv(V4KVCache.create(1), jnp.zeros(4, jnp.int32), jnp.zeros((4, 576)))
    with pytest.raises((TypeError, ValueError), match="slots"):
        write_v4_kv(V4KVCache.create(1), np.zeros(4, np.int64), jnp.zeros((4, 512)))


def _cache(rng, pages):
    rows = _rows(rng, (pages * 64,), spread=0.3)
    cache = write_v4_kv(V4KVCache.create(pages), jnp.arange(pages * 64, dtype=jnp.int32),
                        jnp.asarray(rows))
    token_rows = np.asarray(cache.data)[:, :64].reshape(-1, 576)
    scale_rows = np.asarray(cache.data)[:, 64, :512].reshape(-1, 8)
    return cache, np.asarray(dequantize_rows(jnp.asarray(token_rows), jnp.asarray(scale_rows)))


def _indices(rng, batch, s_q, topk, slots):
    indices = rng.integers(0, slots, (batch, s_q, topk)).astype(np.int32)
    indices[:, 0, ::5] = -1
    indices[:, -1, 3] = slots + 3  # past the cache
    return indices


def _valid(indices, slots, lengths):
    valid = (indices >= 0) & (indices < slots)
    if lengths is not None:
        valid &= np.arange(indices.shape[-1]) < lengths[:, None, None]
    return valid


@pytest.mark.parametrize("with_window,with_lengths,sink", [
    (True, True, "finite"), (True, False, "infinite"), (False, True, None), (True, True, None)])
def test_v4_decode_matches_the_float64sparse_attention_f64(with_window, with_lengths, sink):
    rng = np.random.default_rng(3)
    batch, s_q, h_q, topk, window = 4, 2, 16, 48, 24
    cache, rows = _cache(rng, 3)
    extra, extra_rows = _cache(rng, 2)
    indices = _indices(rng, batch, s_q, topk, rows.shape[0])
    extra_indices = _indices(rng, batch, s_q, window, extra_rows.shape[0])
    indices[1] = -1  # request 1: window keys only
    extra_indices[2] = -1  # request 2: compressed keys only
    indices[3, 1] = extra_indices[3, 1] = -1  # request 3's second query: no key at all
    lengths = np.asarray([48, 0, 17, 48], np.int32) if with_lengths else None
    extra_lengths = np.asarray([24, 9, 0, 24], np.int32) if with_lengths else None
    attn_sink = None
    if sink is not None:
        attn_sink = rng.normal(0, 2, h_q).astype(np.float32)
        if sink == "infinite":
            attn_sink[:2] = [np.inf, -np.inf]
    q = jnp.asarray(rng.normal(0, 1, (batch, s_q, h_q, 512)), jnp.bfloat16)
    as_jnp = lambda x: None if x is None else jnp.asarray(x)
    decode = jax.jit(functools.partial(v4_decode_reference, softmax_scale=512 ** -0.5))
    window_args = dict(extra_kv_cache=extra.data, extra_indices=jnp.asarray(extra_indices),
                       extra_topk_length=as_jnp(extra_lengths)) if with_window else {}
    out, lse = decode(q, cache.data, jnp.asarray(indices), topk_length=as_jnp(lengths),
                      attn_sink=as_jnp(attn_sink), **window_args)
    assert out.shape == (batch, s_q, h_q, 512) and out.dtype == jnp.bfloat16
    assert lse.shape == (batch, h_q, s_q) and lse.dtype == jnp.float32
    valid = _valid(indices, rows.shape[0], lengths)
    keys = rows[np.where(valid, indices, 0)]
    if with_window:
        extra_valid = _valid(extra_indices, extra_rows.shape[0], extra_lengths)
        keys = np.concatenate([keys, extra_rows[np.where(extra_valid, extra_indices, 0)]], 2)
        valid = np.concatenate([valid, extra_valid], 2)
    n = batch * s_q
    expected_out, expected_lse = sparse_attention_f64(np.asarray(q, np.float32).reshape(n, h_q, 512),
                                         keys.reshape(n, -1, 512), valid.reshape(n, -1),
                                         512 ** -0.5, attn_sink)
    np.testing.assert_allclose(np.asarray(out, np.float32).reshape(n, h_q, 512), expected_out,
                               **SPARSE_OUT_TOL)
    np.testing.assert_allclose(np.asarray(lse).transpose(0, 2, 1).reshape(n, h_q), expected_lse,
                               **SPARSE_LSE_TOL)
    assert np.all(np.asarray(out[3, 1]) == 0) and np.all(np.isposinf(np.asarray(lse[3, :, 1])))
    if sink == "infinite":
        assert np.all(np.asarray(out[:, :, 0]) == 0)


def test_rows_no_query_reads_change_nothing():
    rng = np.random.default_rng(5)
    cache, rows = _cache(rng, 2)
    indices = _indices(rng, 2, 1, 32, rows.shape[0])
    q = jnp.asarray(rng.normal(0, 1, (2, 1, 16, 512)), jnp.bfloat16)
    decode = functools.partial(v4_decode_reference, softmax_scale=0.05)
    out, lse = decode(q, cache.data, jnp.asarray(indices))
    unread = np.setdiff1d(np.arange(rows.shape[0]), indices)
    poisoned = np.asarray(cache.data).copy()
    poisoned[unread // 64, unread % 64, :448] = 0x7F  # e4m3 NaN
    poisoned_out, poisoned_lse = decode(q, jnp.asarray(poisoned), jnp.asarray(indices))
    np.testing.assert_array_equal(np.asarray(out), np.asarray(poisoned_out))
    np.testing.assert_array_equal(np.asarray(lse), np.asarray(poisoned_lse))
