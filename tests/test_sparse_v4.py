"""sparse_mla_decode over DeepSeek-V4's cache, and sparse_mla_prefill over V4's rows, on
CPU: the reference on the masked indices and clamped lengths, bad values (int32 extremes,
caches of no pages) and bad arguments, what the custom calls are handed (padded heads and
topk, the schedule of the combined lengths), and the logical op's rules (vmap, a batch split
over 8 devices, no gradient). The kernels against FlashMLA's ops from torch are
tests/test_gpu_sparse_v4.py's."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from helpers import SPARSE_LSE_TOL, SPARSE_OUT_TOL
from jax_flashmla.caches.v4 import V4KVCache, write_v4_kv
from jax_flashmla.kernels import custom_calls
from jax_flashmla.ops import sparse as sparse_ops
from jax_flashmla.ops import sparse_v4
from jax_flashmla.reference.v4 import v4_decode_reference
from jax_flashmla.sparse import SparseKVCache, mask_indices, sparse_mla_decode, sparse_mla_prefill

INT32_MIN, INT32_MAX = -2 ** 31, 2 ** 31 - 1


def _cache(rng, pages):
    rows = jnp.asarray(rng.normal(0, 0.3, (pages * 64, 512)), jnp.float32)
    return write_v4_kv(V4KVCache.create(pages), jnp.arange(pages * 64, dtype=jnp.int32), rows)


def _problem(seed, batch=3, s_q=2, h_q=16, topk=40, window=20):
    rng = np.random.default_rng(seed)
    cache, extra = _cache(rng, 2), _cache(rng, 1)
    indices = rng.integers(0, 128, (batch, s_q, topk)).astype(np.int32)
    indices[0, 0, :4] = [-1, 128, INT32_MIN, INT32_MAX]  # invalid: never read
    extra_indices = rng.integers(0, 64, (batch, s_q, window)).astype(np.int32)
    extra_indices[1, -1, :3] = [-7, 64, INT32_MAX]
    q = jnp.asarray(rng.normal(0, 1, (batch, s_q, h_q, 512)), jnp.bfloat16)
    return q, cache, jnp.asarray(indices), extra, jnp.asarray(extra_indices)


def assert_same_evaluation(out, expected_out, lse=None, expected_lse=None):
    """Bit for bit on the CPU, where both sides are the reference; within the sparse tolerances
    on a GPU, where one side ran FlashMLA's kernel (or XLA:GPU against XLA:CPU), whose order of
    sums depends on the batch's schedule."""
    if jax.default_backend() != "gpu":
        np.testing.assert_array_equal(np.asarray(out), np.asarray(expected_out))
        if lse is not None:
            np.testing.assert_array_equal(np.asarray(lse), np.asarray(expected_lse))
        return
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(expected_out, np.float32),
                               **SPARSE_OUT_TOL)
    if lse is not None:
        np.testing.assert_allclose(np.asarray(lse), np.asarray(expected_lse), **SPARSE_LSE_TOL)


def test_the_decode_is_the_reference_on_masked_indices_and_clamped_lengths():
    q, cache, indices, extra, extra_indices = _problem(0)
    lengths = jnp.asarray([40, INT32_MIN, INT32_MAX], jnp.int32)
    extra_lengths = jnp.asarray([-1, 20, 9], jnp.int32)
    sink = jnp.asarray(np.random.default_rng(1).normal(0, 2, 16), jnp.float32)
    out, lse = jax.jit(sparse_mla_decode)(q, cache, indices, topk_length=lengths,
                                          attn_sink=sink, extra_kv_cache=extra,
                                          extra_indices=extra_indices,
                                          extra_topk_length=extra_lengths)
    masked = lambda x, n: jnp.where((x >= 0) & (x < n), x, -1)
    expected = v4_decode_reference(
        q, cache.data, masked(indices, 128), softmax_scale=512 ** -0.5,
        topk_length=jnp.asarray([40, 0, 40], jnp.int32), attn_sink=sink,
        extra_kv_cache=extra.data, extra_indices=masked(extra_indices, 64),
        extra_topk_length=jnp.asarray([0, 20, 9], jnp.int32))
    assert_same_evaluation(out, expected[0], lse, expected[1])
    # Request 1 reads its window alone, request 0 its compressed entries alone.
    assert np.isfinite(np.asarray(lse)).all()


def test_a_main_cache_of_no_pages_leaves_the_window_or_the_empty_answer():
    q, _, indices, extra, extra_indices = _problem(2)
    empty = jnp.zeros((0, 65, 576), jnp.uint8)
    out, lse = sparse_mla_decode(q, empty, indices, extra_kv_cache=extra,
                                 extra_indices=extra_indices)
    window_only = sparse_mla_decode(q, extra, extra_indices)
    # The same keys, summed over 60 slots against 20: a bf16 ulp apart at most.
    np.testing.assert_allclose(np.asarray(out, np.float32),
                               np.asarray(window_only[0], np.float32), rtol=1e-2, atol=1e-5)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(window_only[1]), rtol=1e-6)
    out, lse = sparse_mla_decode(q, empty, indices, extra_kv_cache=empty,
                                 extra_indices=extra_indices)
    assert not np.asarray(out).any() and np.isposinf(np.asarray(lse)).all()


@pytest.mark.parametrize("change,exc,pattern", [
    (dict(q=jnp.zeros((3, 2, 16, 576), jnp.bfloat16)), ValueError,
     r"q must have a last dimension of 512 over a V4KVCache"),
    (dict(extra_indices=None), TypeError, r"extra_kv_cache and extra_indices go together"),
    (dict(indices=jnp.zeros((3, 1, 8), jnp.int32)), ValueError,
     r"indices must have shape \(3, 2, 'topk >= 1'\)"),
    (dict(extra_topk_length=jnp.zeros((2,), jnp.int32)), ValueError,
     r"extra_topk_length must have shape \(3,\)"),
    (dict(topk_length=np.zeros((3,), np.int64)), TypeError, r"topk_length must be int32"),
    (dict(attn_sink=jnp.zeros((16,), jnp.bfloat16)), ValueError,
     r"attn_sink must be float32 of shape \(16,\)"),
    (dict(kv_cache=jnp.zeros((2, 64, 576), jnp.uint8)), ValueError,
     r"kv_cache must be a V4KVCache or a \(num_pages, 65, 576\) uint8 array"),
])
def test_bad_arguments_are_named(change, exc, pattern):
    q, cache, indices, extra, extra_indices = _problem(3)
    args = dict(q=q, kv_cache=cache, indices=indices, extra_kv_cache=extra,
                extra_indices=extra_indices)
    args.update(change)
    with pytest.raises(exc, match=pattern):
        sparse_mla_decode(**args)


def test_the_cache_kind_picks_the_model():
    q, cache, indices, extra, extra_indices = _problem(4)
    with pytest.raises(TypeError, match="extra_kv_cache, extra_indices and extra_topk_length "
                                        "are V4's"):
        sparse_mla_decode(jnp.zeros((3, 2, 16, 576), jnp.bfloat16), SparseKVCache.create(1),
                          indices, extra_kv_cache=extra, extra_indices=extra_indices)
    with pytest.raises(TypeError, match="a V4KVCache takes int32 indices, not MaskedIndices"):
        sparse_mla_decode(q, cache, mask_indices(indices, SparseKVCache.create(2)))


def test_the_scheduler_counts_the_main_length_by_pages_before_the_window():
    main = jnp.asarray([0, 5, 64, 65], jnp.int32)
    np.testing.assert_array_equal(sparse_v4.scheduled_lengths(main, None), [1, 5, 64, 65])
    np.testing.assert_array_equal(
        sparse_v4.scheduled_lengths(main, jnp.asarray([0, 3, 128, 1], jnp.int32)),
        [64, 67, 192, 129])


def _custom_calls(jaxpr):
    return {eqn.primitive.name: eqn for eqn in jaxpr.jaxpr.eqns
            if eqn.primitive.name.startswith("jax_flashmla_")}


@pytest.mark.parametrize("with_extra", [True, False])
def test_the_kernel_gets_padded_heads_and_topk_and_the_combined_lengths_schedule(with_extra):
    q, cache, indices, extra, extra_indices = _problem(5, batch=3, s_q=1, h_q=16)
    lengths = jnp.asarray([40, 0, 7], jnp.int32)
    named = dict(q=q, kv_cache=cache.data, indices=indices, topk_length=lengths)
    if with_extra:
        named.update(extra_kv_cache=extra.data, extra_indices=extra_indices,
                     extra_topk_length=jnp.asarray([20, 3, 0], jnp.int32))
    jaxpr = jax.make_jaxpr(lambda n: sparse_v4._kernels(n, softmax_scale=0.1, num_sms=132))(
        named)
    calls = _custom_calls(jaxpr)
    decode = calls[custom_calls.SPARSE_DECODE_V4.target]
    shapes = [v.aval.shape for v in decode.invars]
    assert shapes[0] == (3, 1, 64, 512)  # heads padded to the kernel's 64
    assert shapes[2] == (3, 1, 64)  # topk 40 padded to 64
    assert shapes[5] == ((3, 1, 64) if with_extra else (3, 1, 0))
    assert decode.params["with_extra"] is with_extra and decode.params["with_sink"] is False
    assert decode.params["softmax_scale"] == 0.1
    # The schedule: FlashMLA's metadata call over the combined lengths, 132 SM parts at 64
    # heads and s_q 1, its rows then num_splits.
    assert shapes[8] == (132 * 8 + 4,)
    metadata = calls[custom_calls.METADATA.target]
    assert metadata.params["num_sm_parts"] == 132 and metadata.params["num_heads_q"] == 64


def test_vmap_folds_into_the_batch_and_a_batch_split_runs_each_devices_rows():
    q, cache, indices, extra, extra_indices = _problem(6, batch=8, s_q=1)
    decode = lambda q, i, x, **kw: sparse_mla_decode(q, cache, i, extra_kv_cache=extra,
                                                     extra_indices=x, **kw)
    stacked = jax.vmap(decode)(jnp.stack([q, q[::-1]]), jnp.stack([indices, indices[::-1]]),
                               jnp.stack([extra_indices, extra_indices[::-1]]))
    one = decode(q[::-1], indices[::-1], extra_indices[::-1])
    assert_same_evaluation(stacked[0][1], one[0])
    # The 8 devices are the CPU's, where the op is the reference whatever the default backend.
    decode = functools.partial(decode, implementation="reference")
    mesh = Mesh(np.array(jax.devices("cpu")[:8]), ("x",))
    put = lambda x: jax.device_put(x, NamedSharding(mesh, P("x")))
    out, lse = jax.jit(decode)(put(q), put(indices), put(extra_indices))
    assert out.sharding.spec[0] == "x" and lse.sharding.spec[0] == "x"
    for device in range(8):
        rows = slice(device, device + 1)
        alone = decode(q[rows], indices[rows], extra_indices[rows])
        assert_same_evaluation(out[rows], alone[0], lse[rows], alone[1])
    with pytest.raises(NotImplementedError, match="sparse_mla_decode has no gradient"):
        jax.grad(lambda q: decode(q, indices, extra_indices)[1].sum())(q)


def test_the_v4_prefill_over_512_wide_rows_matches_the_float64_oracle():
    """sparse_mla_prefill on V4's rows (q and kv 512 wide, value = key) with a sink and topk
    lengths, against float64 attention over the valid rows."""
    rng = np.random.default_rng(7)
    tokens, h_q, keys, topk = 6, 16, 90, 24
    q = jnp.asarray(rng.normal(0, 1, (tokens, h_q, 512)), jnp.bfloat16)
    kv = jnp.asarray(rng.normal(0, 0.3, (keys, 512)), jnp.bfloat16)
    indices = rng.integers(0, keys, (tokens, topk)).astype(np.int32)
    indices[0, :3] = [-1, keys, INT32_MAX]
    indices[2] = -1  # a query with no valid index
    lengths = np.asarray([24, 10, 24, 0, INT32_MAX, 5], np.int32)
    sink = rng.normal(0, 2, h_q).astype(np.float32)
    out, lse = jax.jit(sparse_mla_prefill)(q, kv, jnp.asarray(indices),
                                           topk_length=jnp.asarray(lengths),
                                           attn_sink=jnp.asarray(sink))
    assert out.shape == (tokens, h_q, 512) and lse.shape == (h_q, tokens)
    rows = np.asarray(kv, np.float64)
    for t in range(tokens):
        valid = [i for j, i in enumerate(indices[t]) if 0 <= i < keys and j < lengths[t]]
        if not valid:
            assert not np.asarray(out[t], np.float32).any() and np.isposinf(lse[:, t]).all()
            continue
        s = np.asarray(q[t], np.float64) @ rows[valid].T * 512 ** -0.5
        m = s.max(-1, keepdims=True)
        p = np.exp(s - m)
        want = p @ rows[valid] / (p.sum(-1) + np.exp(sink - m[:, 0]))[:, None]
        np.testing.assert_allclose(np.asarray(out[t], np.float32), want, **SPARSE_OUT_TOL)
        np.testing.assert_allclose(np.asarray(lse[:, t]), m[:, 0] + np.log(p.sum(-1)),
                                   **SPARSE_LSE_TOL)


def test_the_v4_prefill_kernel_gets_512_wide_rows_and_padded_heads_and_topk():
    q = jnp.zeros((5, 16, 512), jnp.bfloat16)
    kv = jnp.zeros((70, 512), jnp.bfloat16)
    jaxpr = jax.make_jaxpr(lambda n: sparse_ops._kernel_prefill(n, softmax_scale=0.1))(
        dict(q=q, kv=kv, indices=jnp.zeros((5, 40), jnp.int32)))
    call = _custom_calls(jaxpr)[custom_calls.SPARSE_PREFILL.target]
    assert [v.aval.shape for v in call.invars][:3] == [(5, 64, 512), (70, 1, 512), (5, 1, 128)]
    assert not call.params["with_topk_length"]
    jaxpr = jax.make_jaxpr(lambda n: sparse_ops._kernel_prefill(n, softmax_scale=0.1))(
        dict(q=q, kv=kv, indices=jnp.zeros((5, 40), jnp.int32),
             topk_length=jnp.zeros((5,), jnp.int32)))
    call = _custom_calls(jaxpr)[custom_calls.SPARSE_PREFILL.target]
    assert call.params["with_topk_length"] and call.invars[4].aval.shape == (5,)


def test_a_prefill_of_kv_another_width_is_refused():
    with pytest.raises(ValueError, match=r"kv must be floating with q's last dimension, 512"):
        sparse_mla_prefill(jnp.zeros((2, 16, 512), jnp.bfloat16), jnp.zeros((8, 576)),
                           jnp.zeros((2, 4), jnp.int32))
