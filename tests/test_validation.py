"""Every input error mla_decode / get_mla_metadata can see at trace time, named clearly."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flashmla as jf


def _args(batch=2, s_q=1, h_q=16, pages=4, max_pages=2, dtype=jnp.bfloat16):
    return dict(q=jnp.zeros((batch, s_q, h_q, 576), dtype),
                kv_cache=jnp.zeros((pages, 64, 1, 576), dtype),
                block_table=jnp.zeros((batch, max_pages), jnp.int32),
                seq_lens=jnp.zeros((batch,), jnp.int32))


def _decode(**overrides):
    args = _args()
    kwargs = {"implementation": "custom_call"}
    kwargs.update({k: overrides.pop(k) for k in list(overrides) if k not in args})
    args.update(overrides)
    return jf.mla_decode(args["q"], args["kv_cache"], args["block_table"], args["seq_lens"],
                         **kwargs)


@pytest.mark.parametrize("overrides,exc,pattern", [
    (dict(q=jnp.zeros((2, 1, 16, 512), jnp.bfloat16)), ValueError, r"q must have head dim 576.*\(2, 1, 16, 512\)"),
    (dict(q=jnp.zeros((2, 16, 576), jnp.bfloat16)), ValueError, r"q must have rank 4.*\(2, 16, 576\)"),
    (dict(kv_cache=jnp.zeros((4, 32, 1, 576), jnp.bfloat16)), ValueError, r"page size 64.*\(4, 32, 1, 576\)"),
    (dict(kv_cache=jnp.zeros((4, 64, 2, 576), jnp.bfloat16)), ValueError, r"one latent KV head.*\(4, 64, 2, 576\)"),
    (dict(kv_cache=jnp.zeros((4, 64, 1, 576), jnp.float16)), TypeError, r"kv_cache must have q's dtype bfloat16; got float16"),
    (dict(q=jnp.zeros((2, 1, 16, 576), jnp.float32), kv_cache=jnp.zeros((4, 64, 1, 576), jnp.float32)), TypeError, r"q must be bfloat16 or float16 \(or float8_e4m3fn with a float8_e4m3fn kv_cache\); got float32"),
    (dict(block_table=jnp.zeros((2, 2), jnp.int64 if jax.config.x64_enabled else jnp.uint32)), TypeError, r"block_table must be int32"),
    (dict(block_table=jnp.zeros((3, 2), jnp.int32)), ValueError, r"block_table must have shape \(2, max_pages >= 1\).*\(3, 2\)"),
    (dict(seq_lens=jnp.zeros((3,), jnp.int32)), ValueError, r"seq_lens must have shape \(2,\); got \(3,\)"),
    (dict(seq_lens=jnp.zeros((2,), jnp.float32)), TypeError, r"seq_lens must be int32; got float32"),
    (dict(implementation="triton"), ValueError, r"implementation must be None or one of"),
    (dict(q=jnp.zeros((2, 64, 256, 576), jnp.bfloat16)), ValueError, r"query rows need 256 tiles of 64, more than the 132 SMs"),
    (dict(seq_lens=[3, 4]), TypeError, r"seq_lens must be an array \(batch,\) \(a jax or NumPy array\); got list"),
    (dict(block_table=jnp.zeros((2, 0), jnp.int32)), ValueError, r"block_table must have shape \(2, max_pages >= 1\).*\(2, 0\)"),
    (dict(kv_cache=jnp.zeros((0, 64, 1, 576), jnp.bfloat16)), ValueError, r"kv_cache must hold at least one page; got shape \(0, 64, 1, 576\)"),
    (dict(softmax_scale=float("nan")), ValueError, r"softmax_scale must be finite; got nan"),
    (dict(softmax_scale=jnp.float32(0.1)), TypeError, r"softmax_scale must be a Python float \(static.*got ArrayImpl"),
])
def test_decode_rejects(overrides, exc, pattern):
    with pytest.raises(exc, match=pattern):
        _decode(**overrides)


def test_decode_rejects_metadata_for_another_layout():
    args = _args(h_q=16)
    md = jf.get_mla_metadata(args["seq_lens"], block_table=args["block_table"],
                             num_pages=args["kv_cache"].shape[0], num_heads_q=32,
                             implementation="custom_call")
    with pytest.raises(ValueError, match="metadata was computed for num_heads_q=32, num_q_tokens=1; "
                                         "q has h_q=16, s_q=1"):
        jf.mla_decode(*args.values(), metadata=md, implementation="custom_call")


def test_decode_rejects_metadata_for_another_batch():
    md = jf.get_mla_metadata(jnp.zeros((5,), jnp.int32), block_table=jnp.zeros((5, 1), jnp.int32),
                             num_pages=1, num_heads_q=16, implementation="custom_call")
    with pytest.raises(ValueError, match=r"seq_lens must have shape \(2,\) for batch 2; got \(5,\)"):
        jf.mla_decode(*_args().values(), metadata=md, implementation="custom_call")


@pytest.mark.parametrize("seq_lens,kwargs,exc,pattern", [
    (jnp.zeros((2, 1), jnp.int32), dict(num_heads_q=16), ValueError, r"seq_lens must have rank 1.*\(2, 1\)"),
    (jnp.zeros((2,), jnp.float32), dict(num_heads_q=16), TypeError, "seq_lens must be int32"),
    (jnp.zeros((2,), jnp.int32), dict(num_heads_q=0), ValueError, "num_heads_q must be a positive"),
    (jnp.zeros((2,), jnp.int32), dict(num_heads_q=16, num_q_tokens=1.5), ValueError, "num_q_tokens must be a positive"),
    ([3, 4], dict(num_heads_q=16), TypeError, r"seq_lens must be an array \(batch,\).*got list"),
    (jnp.zeros((2,), jnp.int32), dict(num_heads_q=16, num_sms=1.5), ValueError, r"num_sms must be a positive int \(the GPU's SM count\); got 1.5"),
])
def test_metadata_rejects(seq_lens, kwargs, exc, pattern):
    with pytest.raises(exc, match=pattern):
        jf.get_mla_metadata(seq_lens, block_table=jnp.zeros((2, 4), jnp.int32), num_pages=4,
                            implementation="custom_call", **kwargs)


def test_errors_are_raised_at_trace_time():
    args = _args()
    bad_q = jax.ShapeDtypeStruct((2, 1, 16, 512), jnp.bfloat16)
    with pytest.raises(ValueError, match="head dim 576"):
        jax.jit(lambda q: jf.mla_decode(q, *list(args.values())[1:])).trace(bad_q)


def test_a_traced_softmax_scale_is_refused_by_name():
    args = _args()
    with pytest.raises(TypeError, match="softmax_scale must be a Python float"):
        jax.jit(lambda s: jf.mla_decode(*args.values(), softmax_scale=s,
                                        implementation="custom_call"))(0.1)


def test_an_int64_array_is_told_how_to_convert():
    q = jnp.zeros((1, 1, 16, 576), jnp.bfloat16)
    kv, bt = jnp.zeros((1, 64, 1, 576), jnp.bfloat16), jnp.zeros((1, 1), jnp.int32)
    sl = np.ones((1,), np.int64)  # NumPy's default integer
    with pytest.raises(TypeError, match=r"seq_lens must be int32; got int64 \(convert it with "
                                        r"jnp.asarray\(seq_lens, jnp.int32\)"):
        jf.mla_decode(q, kv, bt, sl)


def test_value_checks_help_shows_the_recipe():
    assert "checkify.checkify(step)" in jf.value_checks.__doc__
    assert "err.throw()" in jf.value_checks.__doc__
