"""mla_decode under jax transformations: vmap, scan over stacked layers, compile-once, grad."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flashmla as jf
from helpers import make_decode_inputs

IMPLEMENTATIONS = ["custom_call", "reference"]


def _inputs(seed, batch=2, s_q=1, h_q=16, mean_sk=100, varlen=True):
    q, kv, bt, sl = make_decode_inputs(np.random.default_rng(seed), batch=batch, s_q=s_q, h_q=h_q,
                                       mean_sk=mean_sk, varlen=varlen, dtype=jnp.bfloat16)
    return q, kv, jnp.asarray(bt), jnp.asarray(sl)


def _assert_same(a, b, implementation="custom_call"):
    """The custom call maps sequentially, so it is bit-exact under vmap and scan; XLA may
    reorder the pure-JAX reference's reductions when batched (seen on the GPU), which can move a
    bf16 output by one unit in the last place."""
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    if implementation == "custom_call":
        np.testing.assert_array_equal(a, b)
    else:
        np.testing.assert_allclose(a, b, rtol=1e-2, atol=1e-3)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_vmap_over_queries_with_a_shared_cache(implementation):
    q, kv, bt, sl = _inputs(0)
    qs = jnp.stack([q, -q, 2 * q])
    decode = lambda q_: jf.mla_decode(q_, kv, bt, sl, implementation=implementation)
    out, lse = jax.jit(jax.vmap(decode))(qs)
    for i in range(3):
        expected = jax.jit(decode)(qs[i])
        _assert_same(out[i], expected[0], implementation)
        _assert_same(lse[i], expected[1], implementation)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_vmap_over_whole_problems_on_a_non_leading_axis(implementation):
    # Fixed lengths give every problem the same shapes; shortening some requests varies them.
    problems = [_inputs(seed, varlen=False) for seed in (1, 2)]
    problems[1] = (*problems[1][:3], problems[1][3] - jnp.array([0, 30], jnp.int32))
    q = jnp.stack([p[0] for p in problems], axis=1)  # mapped axis 1
    kv = jnp.stack([p[1] for p in problems])
    bt = jnp.stack([p[2] for p in problems])
    sl = jnp.stack([p[3] for p in problems])
    decode = lambda *a: jf.mla_decode(*a, implementation=implementation)
    out, lse = jax.jit(jax.vmap(decode, in_axes=(1, 0, 0, 0)))(q, kv, bt, sl)
    for i, p in enumerate(problems):
        expected = jax.jit(decode)(*p)
        _assert_same(out[i], expected[0], implementation)
        _assert_same(lse[i], expected[1], implementation)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_scan_over_stacked_layers_shares_one_metadata(implementation):
    layers = 3
    q, kv, bt, sl = _inputs(3)
    q_layers = jnp.stack([q * (i + 1) for i in range(layers)])
    kv_layers = jnp.stack([kv, kv * 0.5, -kv])

    @jax.jit
    def step(q_layers, kv_layers, bt, sl):
        md = jf.get_mla_metadata(sl, block_table=bt, num_pages=kv_layers.shape[1],
                                 num_heads_q=16, implementation=implementation)

        def layer(carry, xs):
            out, lse = jf.mla_decode(xs[0], xs[1], bt, sl, metadata=md,
                                     implementation=implementation)
            return carry + lse.sum(), out

        return jax.lax.scan(layer, jnp.float32(0), (q_layers, kv_layers))

    total, outs = step(q_layers, kv_layers, bt, sl)
    for i in range(layers):
        out, _ = jax.jit(lambda *a: jf.mla_decode(*a, implementation=implementation))(
            q_layers[i], kv_layers[i], bt, sl)
        _assert_same(outs[i], out, implementation)


def test_repeated_calls_with_the_same_shapes_compile_once():
    decode = jax.jit(lambda *a: jf.mla_decode(*a, implementation="custom_call"))
    q, kv, bt, sl = _inputs(10)
    for scale in (1.0, -1.0, 0.5):
        decode(q * scale, kv, bt, jnp.maximum(sl - 1, 0))
    assert decode._cache_size() == 1


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_grad_raises_decode_only(implementation):
    q, kv, bt, sl = _inputs(4)
    loss = lambda q_: jf.mla_decode(q_, kv, bt, sl, implementation=implementation)[0].astype(
        jnp.float32).sum()
    with pytest.raises(NotImplementedError, match="decode-only"):
        jax.grad(loss)(q)
