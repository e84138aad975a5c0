"""Speculative decoding through decode_step and decode_loop: target verify (one decode_step of
the drafts) against single-token steps and float64 attention, multi-step drafting (decode_loop
over a toy draft model)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_flashmla.caches import fp8
from jax_flashmla import get_mla_metadata
from jax_flashmla.serving import decode_loop, decode_step
from helpers import request_attention_f64

IMPLEMENTATIONS = ["custom_call", "reference"]
SCALE = 576 ** -0.5
TOL = 2e-2  # bf16 on unit-scale data


def attention_f64(q, keys, length):
    """q (s_q, h, 576), keys (>= length, 576): causal attention of the last s_q tokens."""
    return request_attention_f64(q, keys, length, softmax_scale=SCALE)


def _setup(seed=0, h=4, num_new=3):
    rng = np.random.default_rng(seed)
    prefix = np.array([5, 64, 126, 0], np.int32)  # 126 + 3 crosses a page; 0 is padding
    table = np.array([[7, -1, -1], [2, 4, -1], [0, 6, 1], [-1, -1, -1]], np.int32)
    cache = jnp.asarray(rng.standard_normal((8, 64, 1, 576)), jnp.bfloat16)
    q = jnp.asarray(rng.standard_normal((4, num_new, h, 576)), jnp.bfloat16)
    kv = jnp.asarray(rng.standard_normal((4, num_new, 576)), jnp.bfloat16)
    return cache, jnp.asarray(table), jnp.asarray(prefix), q, kv


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_target_verify_equals_single_token_steps(implementation):
    cache, table, prefix, q, kv = _setup()
    d = q.shape[1]
    lens = jnp.where(prefix > 0, prefix + d, 0)
    metadata = get_mla_metadata(lens, block_table=table, num_pages=cache.shape[0],
                                num_heads_q=q.shape[2], num_q_tokens=d,
                                implementation=implementation)
    assert (metadata.tile_scheduler_metadata is None) == (implementation == "reference")
    verify = jax.jit(lambda c, m: decode_step(c, table, lens, q, kv, metadata=m,
                                              implementation=implementation),
                     donate_argnums=0)
    cache_v, out_v, lse_v = verify(jnp.array(cache), metadata)
    assert out_v.shape == (4, d, 4, 512) and lse_v.shape == (4, 4, d)

    cache_s = cache
    for i in range(d):  # the same drafts, one decode step each
        lens = jnp.where(prefix > 0, prefix + i + 1, 0)
        cache_s, out, lse = decode_step(cache_s, table, lens, q[:, i:i + 1], kv[:, i:i + 1],
                                        implementation=implementation)
        np.testing.assert_allclose(np.asarray(out_v[:, i], np.float32),
                                   np.asarray(out[:, 0], np.float32), atol=TOL, rtol=TOL)
        np.testing.assert_allclose(np.asarray(lse_v[:, :, i]), np.asarray(lse[:, :, 0]),
                                   rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(cache_v, np.float32), np.asarray(cache_s, np.float32))

    flat = np.asarray(cache_v, np.float64).reshape(-1, 576)
    for b, n in enumerate(np.asarray(prefix)):
        if n == 0:
            np.testing.assert_array_equal(np.asarray(out_v[b], np.float32), 0)
            continue
        keys = flat[(np.asarray(table[b])[:, None] * 64 + np.arange(64)).reshape(-1)]
        np.testing.assert_array_equal(keys[n:n + d], np.asarray(kv[b], np.float64))
        out, lse = attention_f64(q[b], keys, n + d)
        np.testing.assert_allclose(np.asarray(out_v[b], np.float64), out, atol=TOL, rtol=TOL)
        np.testing.assert_allclose(np.asarray(lse_v[b]), lse, atol=TOL, rtol=TOL)


def _draft_inputs(num_steps, h):
    """Each step's base q (num_steps + 1, 4, 1, h, 576) and row (num_steps + 1, 4, 1, 576),
    float32, and the first step's in bfloat16."""
    rng = np.random.default_rng(1)
    base_q = jnp.asarray(rng.standard_normal((num_steps + 1, 4, 1, h, 576)), jnp.float32)
    base_kv = jnp.asarray(rng.standard_normal((num_steps + 1, 4, 1, 576)), jnp.float32)
    return base_q, base_kv, base_q[0].astype(jnp.bfloat16), base_kv[0].astype(jnp.bfloat16)


def _draft_fn(base_q, base_kv):
    """A deterministic toy draft model: the next token's q and row follow from the output."""
    def draft_fn(t, out):
        feature = jnp.concatenate([out, out[..., :64]], axis=-1).astype(jnp.float32)
        return t + 1, base_q[t + 1] + feature, base_kv[t + 1] + feature.mean(axis=2)
    return draft_fn


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_a_draft_chain_through_decode_loop(implementation):
    cache, table, prefix, _, _ = _setup()
    num_steps, h = 3, 4
    base_q, base_kv, q0, kv0 = _draft_inputs(num_steps, h)
    draft = jax.jit(lambda c: decode_loop(
        c, table, prefix, q0, kv0, _draft_fn(base_q, base_kv), jnp.int32(0),
        num_steps=num_steps, implementation=implementation))
    cache_d, out_d, lse_d, steps = draft(cache)
    assert int(steps) == num_steps
    np.testing.assert_array_equal(np.asarray(out_d[:, 3], np.float32), 0)  # padded request
    # Step 0 against float64: the first draft token over prefix + 1 keys.
    flat = np.asarray(cache_d, np.float64).reshape(-1, 576)
    for b in range(3):
        keys = flat[(np.asarray(table[b])[:, None] * 64 + np.arange(64)).reshape(-1)]
        out, _ = attention_f64(q0[b], keys, int(prefix[b]) + 1)
        np.testing.assert_allclose(np.asarray(out_d[0, b], np.float64), out, atol=TOL, rtol=TOL)


K_SCALE = 1 / 16  # unit-normal data: |x| / scale stays well inside e4m3's +-448


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_fp8_target_verify_equals_single_token_steps(implementation):
    cache, table, prefix, q, kv = _setup()
    k_scale = jnp.float32(K_SCALE)
    cache = fp8.quantize(cache, k_scale)
    d = q.shape[1]
    lens = jnp.where(prefix > 0, prefix + d, 0)
    metadata = get_mla_metadata(lens, block_table=table, num_pages=cache.shape[0],
                                num_heads_q=q.shape[2], num_q_tokens=d, fp8=True,
                                implementation=implementation)
    cache_v, out_v, lse_v = jax.jit(lambda c: decode_step(
        c, table, lens, q, kv, metadata=metadata, implementation=implementation,
        k_scale=k_scale))(cache)
    assert out_v.dtype == jnp.bfloat16
    cache_s = cache
    for i in range(d):
        lens = jnp.where(prefix > 0, prefix + i + 1, 0)
        cache_s, out, lse = decode_step(cache_s, table, lens, q[:, i:i + 1], kv[:, i:i + 1],
                                        implementation=implementation, k_scale=k_scale)
        np.testing.assert_allclose(np.asarray(out_v[:, i], np.float32),
                                   np.asarray(out[:, 0], np.float32), atol=TOL, rtol=TOL)
        np.testing.assert_allclose(np.asarray(lse_v[:, :, i]), np.asarray(lse[:, :, 0]),
                                   rtol=1e-5)
    as_bytes = lambda c: np.asarray(c).view(np.uint8)
    np.testing.assert_array_equal(as_bytes(cache_v), as_bytes(cache_s))
    np.testing.assert_array_equal(np.asarray(out_v[3], np.float32), 0)  # padded request
    assert np.isposinf(np.asarray(lse_v[3])).all()


def test_input_errors():
    cache, table, prefix, q, kv = _setup(num_new=1)
    with pytest.raises(ValueError, match=r"kv must have shape \(4, 1, 576\)"):
        decode_step(cache, table, prefix + 1, q, kv[:, :, :512])


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_an_out_of_range_draft_request_is_decoded_empty(implementation):
    """A draft chain's request reading a page past the cache is decoded empty at every step,
    the others as with it padded."""
    cache, table, prefix, _, _ = _setup()
    num_steps, h = 3, 4
    base_q, base_kv, q0, kv0 = _draft_inputs(num_steps, h)

    def draft(table, prefix):
        return decode_loop(cache, table, prefix, q0, kv0, _draft_fn(base_q, base_kv),
                           jnp.int32(0), num_steps=num_steps, implementation=implementation)

    _, out, lse, _ = jax.jit(draft)(table.at[0, 0].set(99), prefix)
    _, want_out, want_lse, _ = jax.jit(draft)(table, prefix.at[0].set(0))
    assert not np.any(np.asarray(out[:, 0], np.float32))
    assert np.all(np.isposinf(np.asarray(lse[:, 0])))
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(want_out, np.float32))
    np.testing.assert_array_equal(np.asarray(lse), np.asarray(want_lse))
