"""DeepSeek-V3.2's sparse attention on CPU: the 656-byte FP8 cache (its quantization, writes and
round trip) and the pure-JAX sparse decode and prefill against a float64 oracle over the rows
as stored, with FlashMLA-style inputs (invalid indices, NaN in rows never read)."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flashmla as jf
from jax_flashmla.kernels import library as kernels
from jax_flashmla.sparse import (SparseKVCache, mask_indices, sparse_mla_decode, sparse_mla_prefill,
                                 write_sparse_kv)
from jax_flashmla.caches.sparse import (TOKEN_BYTES, dequantize_tokens, quantize_tokens,
                                        sparse_cache_array, tile_scales)
from jax_flashmla.ops import sparse as sparse_ops
from jax_flashmla.ops.decode import default_num_sms
from jax_flashmla.ops.sparse import MaskedIndices
from helpers import SPARSE_LSE_TOL, SPARSE_OUT_TOL, sparse_attention_f64



def _rows(rng, shape, spread=1.0):
    """Rows whose 128-column tiles have different magnitudes, as a model's latents do."""
    rows = rng.normal(0, 1, shape + (576,)) * spread
    rows[..., :512] *= np.repeat(rng.uniform(0.01, 8, shape + (4,)), 128, axis=-1)
    return rows.astype(np.float32)


def test_scales_are_powers_of_two_just_above_amax_over_448():
    rows = _rows(np.random.default_rng(0), (7, 3))
    rows[0, 0, 128:256] = 0.0  # an all-zero tile
    rows[1, 1, :128] = 0.0
    rows[1, 1, 5] = -448.0 / 4  # amax / 448 exactly a power of two
    scales = np.asarray(tile_scales(jnp.asarray(rows[..., :512])))
    amax = np.abs(rows[..., :512].reshape(7, 3, 4, 128)).max(-1) / 448
    exponents = np.log2(scales)
    np.testing.assert_array_equal(exponents, np.round(exponents))
    nonzero = amax > 0
    assert np.all(scales[nonzero] >= amax[nonzero]) and np.all(scales[nonzero] < 2 * amax[nonzero])
    assert scales[0, 0, 1] == 2.0 ** -126 and scales[1, 1, 0] == 0.25


def test_tokens_hold_the_documented_bytes():
    rows = _rows(np.random.default_rng(1), (5, 4))
    tokens = np.asarray(quantize_tokens(jnp.asarray(rows)))
    assert tokens.shape == (5, 4, TOKEN_BYTES) and tokens.dtype == np.uint8
    scales = tokens[..., 512:528].copy().view(np.float32)
    np.testing.assert_array_equal(scales, np.asarray(tile_scales(jnp.asarray(rows[..., :512]))))
    rope = tokens[..., 528:].copy().view(jnp.bfloat16).astype(np.float32)
    np.testing.assert_array_equal(rope, rows[..., 512:].astype(jnp.bfloat16).astype(np.float32))
    latent = tokens[..., :512].copy().view(jnp.float8_e4m3fn).astype(np.float32)
    expected = latent * np.repeat(scales, 128, axis=-1)
    back = np.asarray(dequantize_tokens(jnp.asarray(tokens)))
    np.testing.assert_array_equal(back[..., :512], expected)
    # e4m3 keeps 3 mantissa bits: within half a step (1/16 relative) of what was stored.
    np.testing.assert_allclose(back[..., :512], rows[..., :512], rtol=1 / 16,
                               atol=np.repeat(scales, 128, axis=-1).max() * 2 ** -9)


def test_writes_land_at_their_slots_in_place_and_drop_invalid_slots():
    rng = np.random.default_rng(2)
    cache = SparseKVCache.create(3)
    slots = jnp.asarray([[5, 130], [-1, 192 + 7]], jnp.int32)  # 199 is past 3 pages
    kv = jnp.asarray(_rows(rng, (2, 2)))
    write = jax.jit(write_sparse_kv, donate_argnums=0)
    hlo = write.lower(cache, slots, kv).as_text()
    assert "tf.aliasing_output" in hlo or "jax.buffer_donor" in hlo
    new = write(cache, slots, kv)
    tokens = np.asarray(new.data).reshape(-1, TOKEN_BYTES)
    expected = np.asarray(quantize_tokens(kv))
    np.testing.assert_array_equal(tokens[5], expected[0, 0])
    np.testing.assert_array_equal(tokens[130], expected[0, 1])
    untouched = np.delete(np.arange(tokens.shape[0]), [5, 130])
    zero = np.asarray(quantize_tokens(jnp.zeros((576,))))
    np.testing.assert_array_equal(tokens[untouched], np.broadcast_to(zero, (untouched.size, 656)))


def _decode_problem(seed, batch=3, s_q=2, h_q=16, pages=6, topk=40):
    rng = np.random.default_rng(seed)
    cache = quantize_tokens(jnp.asarray(_rows(rng, (pages, 64, 1), spread=0.3)))
    slots = pages * 64
    indices = rng.integers(0, slots, (batch, s_q, topk)).astype(np.int32)
    indices[0, 0, ::3] = -1
    indices[1, :, 5] = slots + 3  # past the cache
    indices[1, 1, 7] = indices[1, 1, 8]  # a duplicate counts twice
    indices[2, 1, :] = -1  # a query with no valid index
    q = jnp.asarray(rng.normal(0, 1, (batch, s_q, h_q, 576)), jnp.bfloat16)
    return q, cache, jnp.asarray(indices)


@pytest.mark.parametrize("with_length,with_sink", [(False, False), (True, False), (False, True),
                                                   (True, True)])
def test_sparse_decode_matches_the_float64sparse_attention_f64(with_length, with_sink):
    q, cache, indices = _decode_problem(3)
    batch, s_q, h_q, _ = q.shape
    topk_length = jnp.asarray([40, 17, 0], jnp.int32) if with_length else None
    sink = jnp.asarray(np.random.default_rng(4).normal(0, 2, h_q), jnp.float32) if with_sink \
        else None
    decode = jax.jit(functools.partial(sparse_mla_decode, softmax_scale=0.1))
    out, lse = decode(q, cache, indices, topk_length=topk_length, attn_sink=sink)
    assert out.shape == (batch, s_q, h_q, 512) and out.dtype == jnp.bfloat16
    assert lse.shape == (batch, h_q, s_q)
    rows = np.asarray(dequantize_tokens(cache)).reshape(-1, 576)
    idx = np.asarray(indices)
    valid = (idx >= 0) & (idx < rows.shape[0])
    if with_length:
        valid &= np.arange(idx.shape[-1]) < np.asarray(topk_length)[:, None, None]
    expected_out, expected_lse = sparse_attention_f64(
        np.asarray(q, np.float32).reshape(batch * s_q, h_q, 576),
        rows[np.where(valid, idx, 0)].reshape(batch * s_q, -1, 576),
        valid.reshape(batch * s_q, -1), 0.1, None if sink is None else np.asarray(sink))
    np.testing.assert_allclose(np.asarray(out, np.float32).reshape(batch * s_q, h_q, 512),
                               expected_out, **SPARSE_OUT_TOL)
    np.testing.assert_allclose(np.asarray(lse).transpose(0, 2, 1).reshape(-1, h_q),
                               expected_lse, **SPARSE_LSE_TOL)
    assert np.all(np.asarray(out[2, 1]) == 0) and np.all(np.isposinf(np.asarray(lse[2, :, 1])))


def test_rows_no_query_reads_change_nothing():
    q, cache, indices = _decode_problem(5)
    read = set(np.asarray(indices).ravel().tolist())
    tokens = np.asarray(cache).reshape(-1, TOKEN_BYTES).copy()
    unread = [s for s in range(tokens.shape[0]) if s not in read]
    tokens[unread] = 0xFF  # NaN latent and scales in every row no index names
    poisoned = jnp.asarray(tokens.reshape(np.asarray(cache).shape))
    decode = jax.jit(sparse_mla_decode)
    for a, b in zip(decode(q, cache, indices), decode(q, poisoned, indices)):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_a_nan_in_a_row_read_poisons_only_the_queries_that_read_it():
    """As FlashMLA's sparse decode does (measured on a Hopper GPU): a NaN byte in a row's
    latent makes every query naming that row NaN in all 512 columns and in its lse; the other
    queries are unchanged."""
    q, cache, indices = _decode_problem(6)
    slot = int(indices[0, 1, 2])
    tokens = np.asarray(cache).reshape(-1, TOKEN_BYTES).copy()
    tokens[slot, 7] = 0x7F  # an e4m3 NaN
    poisoned = jnp.asarray(tokens.reshape(np.asarray(cache).shape))
    decode = jax.jit(sparse_mla_decode)
    (out, lse), (clean_out, clean_lse) = decode(q, poisoned, indices), decode(q, cache, indices)
    out, clean_out = np.asarray(out, np.float32), np.asarray(clean_out, np.float32)
    reads = (np.asarray(indices) == slot).any(-1)  # (batch, s_q)
    assert reads[0, 1]
    assert np.isnan(out[reads]).all() and np.isnan(np.asarray(lse).transpose(0, 2, 1)[reads]).all()
    np.testing.assert_array_equal(out[~reads], clean_out[~reads])
    np.testing.assert_array_equal(np.asarray(lse).transpose(0, 2, 1)[~reads],
                                  np.asarray(clean_lse).transpose(0, 2, 1)[~reads])


def test_sparse_prefill_matches_the_float64sparse_attention_f64():
    rng = np.random.default_rng(6)
    tokens, keys, h_q, topk = 9, 300, 16, 64
    q = jnp.asarray(rng.normal(0, 1, (tokens, h_q, 576)), jnp.bfloat16)
    kv = jnp.asarray(_rows(rng, (keys,), spread=0.2), jnp.bfloat16)
    indices = rng.integers(-5, keys + 5, (tokens, topk)).astype(np.int32)
    indices[4] = -1
    out, lse = jax.jit(sparse_mla_prefill)(q, kv, jnp.asarray(indices))
    assert out.shape == (tokens, h_q, 512) and out.dtype == jnp.bfloat16
    assert lse.shape == (h_q, tokens)
    valid = (indices >= 0) & (indices < keys)
    rows = np.asarray(kv, np.float32)[np.where(valid, indices, 0)]
    expected_out, expected_lse = sparse_attention_f64(np.asarray(q, np.float32), rows, valid, 576 ** -0.5, None)
    np.testing.assert_allclose(np.asarray(out, np.float32), expected_out, **SPARSE_OUT_TOL)
    np.testing.assert_allclose(np.asarray(lse).T, expected_lse, **SPARSE_LSE_TOL)


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="checks the error off the GPU")
def test_the_custom_call_off_the_gpu_is_refused():
    q, cache, indices = _decode_problem(7, h_q=64)
    with pytest.raises(RuntimeError, match="sparse_mla_decode: .* needs a Hopper GPU"):
        sparse_mla_decode(q, cache, indices, implementation="custom_call")
    with pytest.raises(RuntimeError, match="sparse_mla_prefill: .* needs a Hopper GPU"):
        sparse_mla_prefill(q[:, 0], jnp.zeros((9, 576), jnp.bfloat16), indices[:, 0],
                           implementation="custom_call")


def test_the_prefill_hands_its_kernel_padded_heads_and_topk():
    """What the prefill's custom call is given and gives back, traced on any backend: heads
    padded to 64, topk 100 to 128 with -1, kv as (keys, 1, 576) bfloat16; out in q's dtype,
    lse (h_q, tokens)."""
    q = jnp.zeros((5, 16, 576), jnp.float32)
    kv, indices = jnp.zeros((9, 576), jnp.float32), jnp.zeros((5, 100), jnp.int32)
    jaxpr = jax.make_jaxpr(lambda q, kv, indices: sparse_ops._kernel_prefill(
        dict(q=q, kv=kv, indices=indices), softmax_scale=0.1))(q, kv, indices)
    (call,) = [e for e in jaxpr.eqns if e.primitive.name == "jax_flashmla_mla_sparse_prefill"]
    assert [(v.aval.shape, v.aval.dtype) for v in call.invars] == [
        ((5, 64, 576), jnp.bfloat16), ((9, 1, 576), jnp.bfloat16), ((5, 1, 128), jnp.int32),
        ((0,), jnp.float32), ((0,), jnp.int32)]  # no sink, no lengths: empty operands
    assert call.params == dict(softmax_scale=0.1, with_sink=False, with_topk_length=False)
    out, lse = (v.aval for v in jaxpr.jaxpr.outvars)
    assert (out.shape, out.dtype, lse.shape, lse.dtype) == ((5, 16, 512), jnp.float32, (16, 5),
                                                            jnp.float32)


@pytest.mark.parametrize("change,exc,pattern", [
    (dict(q=jnp.zeros((2, 1, 16, 512), jnp.bfloat16)), ValueError, r"q must be .* last dimension of 576"),
    (dict(q=jnp.zeros((2, 16, 576), jnp.bfloat16)), ValueError, r"q must have rank 4"),
    (dict(kv_cache=jnp.zeros((2, 64, 1, 576), jnp.uint8)), ValueError, r"kv_cache must be a SparseKVCache or a \(num_pages, 64, 1, 656\) uint8"),
    (dict(indices=np.zeros((2, 1, 8), np.int64)), TypeError, r"indices must be int32"),
    (dict(indices=jnp.zeros((3, 1, 8), jnp.int32)), ValueError, r"indices must have shape \(2, 1, 'topk >= 1'\)"),
    (dict(topk_length=jnp.zeros((3,), jnp.int32)), ValueError, r"topk_length must have shape \(2,\)"),
    (dict(attn_sink=jnp.zeros((16,), jnp.bfloat16)), ValueError, r"attn_sink must be float32 of shape \(16,\)"),
    (dict(softmax_scale=float("nan")), ValueError, r"softmax_scale must be finite"),
])
def test_bad_arguments_are_named(change, exc, pattern):
    args = dict(q=jnp.zeros((2, 1, 16, 576), jnp.bfloat16), kv_cache=SparseKVCache.create(1),
                indices=jnp.zeros((2, 1, 8), jnp.int32))
    args.update(change)
    with pytest.raises(exc, match="sparse_mla_decode: " + pattern):
        sparse_mla_decode(args.pop("q"), args.pop("kv_cache"), args.pop("indices"), **args)


def test_the_schedule_is_a_constant_of_the_shapes():
    """The decode's schedule is the dense scheduler's over requests of topk keys for the
    kernel's heads (h_q 16 is scheduled as 64, topk 100 as 128), made at trace time and held
    by the program as constants: no metadata operation is traced, and none is passed in."""
    batch, s_q, topk = 5, 2, 100
    q = jnp.zeros((batch, s_q, 16, 576), jnp.bfloat16)
    stack = jnp.zeros((1, batch, s_q, topk), jnp.int32)
    jaxpr = jax.make_jaxpr(lambda q, data, stack: sparse_ops.SPARSE_DECODE(
        dict(q=q, kv_cache=data, indices=stack), implementation="custom_call",
        softmax_scale=0.1, layer=0, num_sms=default_num_sms()))(
            q, SparseKVCache.create(2).data, stack)
    (call,) = jaxpr.eqns  # the op alone: no metadata operation
    assert call.params["operands"] == ("q", "kv_cache", "indices", "schedule")
    dense = jf.get_mla_metadata(jnp.full((batch,), 128, jnp.int32),
                                block_table=jnp.zeros((batch, 2), jnp.int32), num_pages=1,
                                num_heads_q=64, num_q_tokens=s_q, implementation="custom_call")
    schedule = dict(zip(jaxpr.jaxpr.constvars, jaxpr.consts))[call.invars[3]]
    rows = dense.tile_scheduler_metadata.size
    np.testing.assert_array_equal(schedule[:rows], np.ravel(dense.tile_scheduler_metadata))
    np.testing.assert_array_equal(schedule[rows:], dense.num_splits)


def test_masked_indices_are_made_by_mask_indices_alone():
    """The kernel trusts MaskedIndices: none is built from an array or changed, while those
    mask_indices makes cross jit, scan and slicing as their array does."""
    with pytest.raises(TypeError, match=r"MaskedIndices is made by mask_indices\(indices, "
                                        r"kv_cache\); it cannot be built from arrays"):
        MaskedIndices(jnp.full((1, 1, 4), 10**6, jnp.int32), 10**7)
    masked = mask_indices(jnp.asarray([[[3, 64, -5, 63]]] * 2, jnp.int32), SparseKVCache.create(1))
    with pytest.raises(AttributeError, match="immutable"):
        masked.slots = jnp.full((2, 1, 4), 10**6, jnp.int32)
    through = jax.jit(lambda m: m)(masked)
    assert isinstance(through, MaskedIndices) and through.num_keys == 64
    np.testing.assert_array_equal(through.slots, [[[3, -1, -1, 63]]] * 2)
    rows = jax.lax.scan(lambda c, m: (c, m.slots.sum()), 0, masked)[1]
    np.testing.assert_array_equal(rows, [64, 64])
    np.testing.assert_array_equal(masked[1].slots, [[3, -1, -1, 63]])


@pytest.mark.parametrize("implementation", ["reference", "custom_call"])
def test_a_cache_of_no_pages_gives_the_empty_answer(implementation):
    """No key at all: out 0 and lse +inf for every query, sink or not, without a kernel (whose
    read of a cache of no pages would be out of bounds). custom_call off the GPU is refused
    first, as anywhere."""
    q = jnp.ones((2, 1, 16, 576), jnp.bfloat16)
    indices = jnp.asarray([[[-1, 0, 5, 2**31 - 1]]] * 2, jnp.int32)
    sink = jnp.zeros((16,), jnp.float32)
    cache = jnp.zeros((0, 64, 1, TOKEN_BYTES), jnp.uint8)  # SparseKVCache.create refuses it
    if implementation == "custom_call" and not kernels.flashmla_available():
        with pytest.raises(RuntimeError, match="implementation='reference'"):
            sparse_mla_decode(q, cache, indices, implementation=implementation)
        return
    for idx in (indices, mask_indices(indices, cache)):
        out, lse = jax.jit(functools.partial(sparse_mla_decode, attn_sink=sink,
                                             implementation=implementation))(q, cache, idx)
        assert out.shape == (2, 1, 16, 512) and out.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(out, np.float32), 0)
        np.testing.assert_array_equal(lse, np.full((2, 16, 1), np.inf, np.float32))
    out, lse = sparse_mla_prefill(q[:, 0], jnp.zeros((0, 576), jnp.float32), indices[:, 0],
                                  implementation=implementation)
    assert out.shape == (2, 16, 512) and out.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(out, np.float32), 0)
    np.testing.assert_array_equal(lse, np.full((16, 2), np.inf, np.float32))


def test_int64_slots_are_refused_not_narrowed():
    slots = np.asarray([[5, 2**33 + 5]], np.int64)  # narrowed to int32, 2**33 + 5 is slot 5
    with pytest.raises(TypeError, match="write_sparse_kv: slots must be int32; got int64"):
        write_sparse_kv(SparseKVCache.create(1), slots, jnp.zeros((1, 2, 576), jnp.float32))


def test_masked_indices_are_the_masks_answer_and_slice_like_their_array():
    """mask_indices over a stack of layers' indices: each entry past the cache or its row's
    topk_length -1, the rest kept; a layer's slice decodes to the answer of the raw indices
    with topk_length, under lax.scan too."""
    q, cache, indices = _decode_problem(11)
    slots = cache.shape[0] * 64
    stacked = jnp.stack([indices, indices[::-1]])  # (layers, batch, s_q, topk)
    lengths = jnp.asarray([30, 64], jnp.int32)  # per layer, over the rest of its dimensions
    masked = jax.jit(mask_indices)(stacked, cache, topk_length=lengths)
    assert isinstance(masked, MaskedIndices) and masked.num_keys == slots
    raw = np.asarray(stacked)
    keep = (raw >= 0) & (raw < slots) & (np.arange(raw.shape[-1]) < np.asarray(lengths)[:, None,
                                                                                       None, None])
    np.testing.assert_array_equal(np.asarray(masked.slots), np.where(keep, raw, -1))
    decode = jax.jit(functools.partial(sparse_mla_decode, softmax_scale=0.1))
    for layer in range(2):
        expected = decode(q, cache, stacked[layer],
                          topk_length=jnp.full((q.shape[0],), lengths[layer], jnp.int32))
        for got, want in zip(decode(q, cache, masked[layer]), expected):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))

    @jax.jit
    def scanned(q, cache, masked):
        return jax.lax.scan(lambda c, m: (c, decode(q, cache, m)), None, masked)[1]

    outs, _ = scanned(q, cache, masked)
    np.testing.assert_array_equal(np.asarray(outs[1]), np.asarray(decode(q, cache, masked[1])[0]))


def test_the_kernel_takes_masked_indices_as_they_are(monkeypatch):
    """On the custom call's path, raw indices reach the kernel through the mask; MaskedIndices
    reach it as they are, and a layer's row of a stack of them as the whole stack with the
    row's number (the kernel call stood in for, so that this runs on any backend)."""
    q, cache, indices = _decode_problem(12, h_q=64)
    reached = []
    monkeypatch.setattr(sparse_ops, "_implementation", lambda *_: "custom_call")
    monkeypatch.setattr(sparse_ops, "SPARSE_DECODE", lambda operands, **params: reached.append(
        (operands["indices"], params["layer"])))
    masked = mask_indices(indices, cache)
    stacked = jnp.stack([indices[::-1], indices])
    masked_stack = mask_indices(stacked, cache)
    sparse_mla_decode(q, cache, indices)
    sparse_mla_decode(q, cache, masked)
    sparse_mla_decode(q, cache, stacked[1])
    sparse_mla_decode(q, cache, masked_stack[1])
    sparse_mla_decode(q, cache, masked_stack[-1])
    (raw, raw_layer), (premasked, premasked_layer), (raw_row, row_layer), *rows = reached
    for got in (raw, premasked, raw_row):  # the row read, masked, as a stack of one
        np.testing.assert_array_equal(np.asarray(got), np.asarray(masked.slots)[None])
    assert (raw_layer, premasked_layer, row_layer) == (0, 0, 0)
    assert all(stack is masked_stack.slots and layer == 1 for stack, layer in rows)


def test_a_row_that_crosses_jit_is_its_slice():
    """A layer's row read in place where it is taken; passed through jit or scan, it is the
    row's slice, and decodes to the same answer (the reference off the GPU, the custom call on
    it, bit for bit)."""
    q, cache, indices = _decode_problem(15)
    stack = jnp.stack([indices, indices[::-1], jnp.full_like(indices, -1)])
    masked = mask_indices(stack, cache)
    decode = functools.partial(sparse_mla_decode, softmax_scale=0.1)
    for layer in range(3):
        want = jax.jit(decode)(q, cache, stack[layer])
        crossed = jax.jit(lambda m: m)(masked[layer])
        assert crossed.slots.shape == indices.shape and crossed._in_place()[1] == 0
        for got in (jax.jit(lambda q, c, m, l=layer: decode(q, c, m[l]))(q, cache, masked),
                    jax.jit(decode)(q, cache, masked[layer])):
            for g, w in zip(got, want):
                np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_the_decode_custom_call_takes_the_stack_and_its_row():
    """What the decode's custom call is given, traced on any backend: the whole stack of
    indices (layers, batch, s_q, topk) and the row as a static parameter."""
    q, cache, indices = _decode_problem(14, h_q=64)
    stack = jnp.stack([indices] * 3)
    jaxpr = jax.make_jaxpr(lambda q, data, stack: sparse_ops._kernel_decode(
        dict(q=q, kv_cache=data, indices=stack, schedule=sparse_ops.kernel_schedule(
            q.shape[0], 64, q.shape[1], 64, default_num_sms())),
        softmax_scale=0.1, layer=2, num_sms=default_num_sms()))(
            q, sparse_cache_array(cache, "test"), stack)
    (call,) = [e for e in jaxpr.eqns if e.primitive.name == "jax_flashmla_mla_sparse_decode"]
    assert call.invars[2].aval.shape == (3,) + indices.shape[:2] + (64,)  # topk 40 padded
    assert call.params == dict(softmax_scale=0.1, with_sink=False, layer=2)


@pytest.mark.parametrize("call,pattern", [
    (lambda q, cache, m: sparse_mla_decode(q, cache, m, topk_length=jnp.zeros((3,), jnp.int32)),
     r"sparse_mla_decode: topk_length goes to mask_indices with MaskedIndices"),
    (lambda q, cache, m: sparse_mla_decode(q, SparseKVCache.create(1), m),
     r"sparse_mla_decode: indices were masked for \d+ keys, but the cache holds 64"),
    (lambda q, cache, m: mask_indices(m.slots, cache, topk_length=jnp.zeros((2,), jnp.int32)),
     r"mask_indices: topk_length must have shape \(3,\), indices' first dimension; got \(2,\)"),
    (lambda q, cache, m: mask_indices(m.slots.astype(jnp.int16), cache),
     r"mask_indices: indices must be int32"),
])
def test_bad_masked_indices_are_named(call, pattern):
    q, cache, indices = _decode_problem(13)
    with pytest.raises((ValueError, TypeError), match=pattern):
        call(q, cache, mask_indices(indices, cache))
