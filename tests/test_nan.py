"""NaN in q or in the cache: one semantics on every implementation, FlashMLA's (these tests
run it where "custom_call" is FlashMLA, on the GPU machine; on CPU that is the C++ model).
- A NaN in q's row of (token i, head h), or in any column of a key that query i sees, makes
  the out of every (i, head) whose scores include it NaN in all 512 columns.
- The lse of such a query is +inf when its request is decoded in one split, as always on the
  reference. Decoded in several (FlashMLA and the C++ model, by the metadata's schedule), it is
  the log-sum-exp of the splits without the NaN. So out, not lse, is what carries the NaN.
- A NaN in V column d of a key the causal mask hides from query i reaches column d of query
  i's out (the kernel weighs hidden keys by 0, and 0 * NaN is NaN); that lse is unchanged.
  In a hidden key's rope columns it changes nothing for that query.
- NaN in rows past a request's length changes nothing (every problem here has them).
- Every other request's out and lse are bit for bit those of the run without the NaN."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flashmla as jf
from helpers import K_SCALE, NAN_LENGTHS, nan_problem, with_nan_in_key

H_Q = 16
LATENT, ROPE = 7, 540  # a V column and a rope column of a key or query row


@functools.cache  # one jitted decode per implementation and cache dtype, shared by the tests
def _decode(implementation, fp8_cache):
    k_scale = jnp.float32(K_SCALE) if fp8_cache else None

    @jax.jit
    def decode(q, kv, bt, sl):
        md = jf.get_mla_metadata(sl, block_table=bt, num_pages=kv.shape[0], num_heads_q=H_Q,
                                 num_q_tokens=q.shape[1], fp8=fp8_cache,
                                 implementation=implementation)
        out, lse = jf.mla_decode(q, kv, bt, sl, metadata=md, softmax_scale=0.1, k_scale=k_scale,
                                 implementation=implementation)
        return out, lse, jnp.zeros(1, jnp.int32) if md.num_splits is None else md.num_splits

    def run(q, kv, bt, sl):
        out, lse, splits = decode(q, kv, bt, sl)
        splits = np.diff(np.asarray(splits)) if implementation != "reference" else None
        return np.array(out, np.float32), np.array(lse), splits
    return run


def _assert_poisoned_lse(lse, clean_lse, splits, request):
    """lse (h, ...) of queries whose out is NaN: +inf in one split, else finite and below the
    clean lse (the splits without the NaN)."""
    if splits is None or splits[request] == 1:
        assert np.all(np.isposinf(lse))
    else:
        assert np.all(np.isfinite(lse)) and np.all(lse < clean_lse)


def _assert_others_untouched(out, lse, clean_out, clean_lse, request):
    others = np.arange(len(NAN_LENGTHS)) != request
    np.testing.assert_array_equal(out[others], clean_out[others])
    np.testing.assert_array_equal(lse[others], clean_lse[others])


@pytest.fixture(params=["reference", "custom_call"])
def implementation(request):
    return request.param


@pytest.fixture(params=[False, True], ids=["bf16", "fp8"])
def fp8_cache(request):
    return request.param


@pytest.mark.parametrize("request_index", [0, 1])
@pytest.mark.parametrize("column", [LATENT, ROPE])
def test_a_nan_in_q_poisons_that_head(implementation, fp8_cache, request_index, column):
    run = _decode(implementation, fp8_cache)
    q, kv, bt, sl = nan_problem(1, fp8_cache)
    clean_out, clean_lse, _ = run(q, kv, bt, sl)
    out, lse, _ = run(q.at[request_index, 0, 3, column].set(jnp.nan), kv, bt, sl)
    assert np.all(np.isnan(out[request_index, 0, 3]))
    assert np.isposinf(lse[request_index, 3, 0])  # every split of that head is NaN
    clean_out[request_index, 0, 3] = out[request_index, 0, 3]
    clean_lse[request_index, 3, 0] = np.inf
    np.testing.assert_array_equal(out, clean_out)
    np.testing.assert_array_equal(lse, clean_lse)


@pytest.mark.parametrize("request_index,token", [(0, 5), (1, 5), (1, NAN_LENGTHS[1] - 1)])
@pytest.mark.parametrize("column", [LATENT, ROPE])
def test_a_nan_in_a_seen_key_poisons_its_request(implementation, fp8_cache, request_index,
                                                 token, column):
    run = _decode(implementation, fp8_cache)
    q, kv, bt, sl = nan_problem(1, fp8_cache)
    clean_out, clean_lse, splits = run(q, kv, bt, sl)
    out, lse, _ = run(q, with_nan_in_key(kv, bt, request_index, token, column), bt, sl)
    assert np.all(np.isnan(out[request_index]))
    _assert_poisoned_lse(lse[request_index], clean_lse[request_index], splits, request_index)
    _assert_others_untouched(out, lse, clean_out, clean_lse, request_index)


@pytest.mark.parametrize("request_index", [0, 1])
def test_a_nan_in_a_hidden_keys_v_reaches_that_column(implementation, fp8_cache, request_index):
    """s_q = 2: the request's last key is hidden from query 0 and seen by query 1."""
    run = _decode(implementation, fp8_cache)
    q, kv, bt, sl = nan_problem(2, fp8_cache)
    clean_out, clean_lse, splits = run(q, kv, bt, sl)
    last = NAN_LENGTHS[request_index] - 1
    out, lse, _ = run(q, with_nan_in_key(kv, bt, request_index, last, LATENT), bt, sl)
    hidden_from, seen_by = out[request_index, 0], out[request_index, 1]
    assert np.all(np.isnan(seen_by))
    _assert_poisoned_lse(lse[request_index, :, 1], clean_lse[request_index, :, 1], splits,
                         request_index)
    assert np.all(np.isnan(hidden_from[:, LATENT]))
    rest = np.arange(hidden_from.shape[-1]) != LATENT
    np.testing.assert_array_equal(hidden_from[:, rest], clean_out[request_index, 0][:, rest])
    np.testing.assert_array_equal(lse[request_index, :, 0], clean_lse[request_index, :, 0])
    _assert_others_untouched(out, lse, clean_out, clean_lse, request_index)


def test_a_nan_in_a_hidden_keys_rope_changes_nothing_for_that_query(implementation, fp8_cache):
    run = _decode(implementation, fp8_cache)
    q, kv, bt, sl = nan_problem(2, fp8_cache)
    clean_out, clean_lse, _ = run(q, kv, bt, sl)
    out, lse, _ = run(q, with_nan_in_key(kv, bt, 0, NAN_LENGTHS[0] - 1, ROPE), bt, sl)
    assert np.all(np.isnan(out[0, 1]))
    np.testing.assert_array_equal(out[0, 0], clean_out[0, 0])
    np.testing.assert_array_equal(lse[0, :, 0], clean_lse[0, :, 0])
    _assert_others_untouched(out, lse, clean_out, clean_lse, 0)
