"""mla_decode against oracles. The same file runs in CI (the custom call's C++ CPU target) and
on the GPU machine (FlashMLA's kernels, on FlashMLA's own test grid)."""
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flashmla as jf
from jax_flashmla.reference.dense import mla_decode_reference
from helpers import (LSE_TOL, OUT_TOL, SENTINEL_PAGE, assert_flashmla_close, dense_attention_f64,
                     make_decode_inputs)

ON_GPU = jax.default_backend() == "gpu"
SCALE = 576 ** -0.5
DTYPES = [jnp.bfloat16, jnp.float16]

# (batch, mean s_k, h_q, s_q, varlen): FlashMLA's grid on the GPU, a small one on CPU.
if ON_GPU:
    GRID = list(itertools.product([128], [4096, 8192, 16384], [16, 32, 64, 128], [1, 2],
                                  [False, True]))
else:
    GRID = list(itertools.product([3], [150], [16, 32, 64, 128], [1, 2, 4], [False, True]))


@functools.cache  # one jitted decode per implementation and options; a shape seen before
def _jitted_decode(implementation, **kwargs):  # reuses its compiled decode
    return jax.jit(functools.partial(jf.mla_decode, implementation=implementation, **kwargs))


def _decode(inputs, implementation, **kwargs):
    return _jitted_decode(implementation, **kwargs)(*inputs)


# The float32 reference, jitted once: the bf16 and float16 cases of a shape share its compile.
_reference = jax.jit(functools.partial(mla_decode_reference, softmax_scale=SCALE, causal=True,
                                       head_dim_v=512))


def _fp32_reference_in_chunks(q, kv, block_table, seq_lens, chunk=16):
    """The reference on float32 copies of the same values (so its output is not rounded to
    dtype), a few requests at a time to bound its memory at FlashMLA's grid sizes."""
    kv32 = kv.astype(jnp.float32)
    parts = [_reference(q[i:i + chunk].astype(jnp.float32), kv32, block_table[i:i + chunk],
                        seq_lens[i:i + chunk]) for i in range(0, q.shape[0], chunk)]
    return (np.concatenate([np.asarray(p[0]) for p in parts]),
            np.concatenate([np.asarray(p[1]) for p in parts]))


@pytest.mark.parametrize("batch,mean_sk,h_q,s_q,varlen", GRID)
@pytest.mark.parametrize("dtype", DTYPES if not ON_GPU else [jnp.bfloat16])
def test_custom_call_matches_fp32_reference(batch, mean_sk, h_q, s_q, varlen, dtype):
    rng = np.random.default_rng(hash((batch, mean_sk, h_q, s_q, varlen)) % 2**32)
    q, kv, bt, sl = make_decode_inputs(rng, batch=batch, s_q=s_q, h_q=h_q, mean_sk=mean_sk,
                                       varlen=varlen, dtype=dtype, zero_lengths=1 if varlen else 0)
    out, lse = _decode((q, kv, bt, sl), "custom_call")
    ref_out, ref_lse = _fp32_reference_in_chunks(q, kv, bt, sl)
    assert out.dtype == dtype and out.shape == (batch, s_q, h_q, 512)
    assert lse.dtype == jnp.float32 and lse.shape == (batch, h_q, s_q)
    assert_flashmla_close("out", out, ref_out, **OUT_TOL)
    assert_flashmla_close("lse", lse, ref_lse, **LSE_TOL)


@pytest.mark.parametrize("implementation", ["custom_call", "reference"])
@pytest.mark.parametrize("s_q,causal", [(1, True), (2, True), (4, True), (3, False)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_float64_dense_attention(implementation, s_q, causal, dtype):
    rng = np.random.default_rng(s_q)
    inputs = make_decode_inputs(rng, batch=4, s_q=s_q, h_q=16, mean_sk=130, varlen=True,
                                dtype=dtype, zero_lengths=1)
    out, lse = _decode(inputs, implementation, causal=causal)
    ref_out, ref_lse = dense_attention_f64(*inputs, softmax_scale=SCALE, causal=causal)
    assert_flashmla_close("out", out, ref_out, **OUT_TOL)
    assert_flashmla_close("lse", lse, ref_lse, **LSE_TOL)


@pytest.mark.parametrize("implementation", ["custom_call", "reference"])
def test_zero_length_requests_give_zero_out_and_inf_lse(implementation):
    rng = np.random.default_rng(1)
    q, kv, bt, sl = make_decode_inputs(rng, batch=3, s_q=2, h_q=16, mean_sk=70, varlen=False,
                                       dtype=jnp.bfloat16)
    sl = np.array([0, 70, 0], np.int32)
    out, lse = _decode((q, kv, bt, sl), implementation)
    assert np.all(np.asarray(out[0]) == 0) and np.all(np.asarray(out[2]) == 0)
    assert np.all(np.isposinf(np.asarray(lse[0]))) and np.all(np.isposinf(np.asarray(lse[2])))
    assert np.all(np.isfinite(np.asarray(lse[1])))


@pytest.mark.parametrize("s_q", [1, 2])
def test_lse_stays_in_flashmlas_layout_until_read(s_q):
    """The custom call returns lse (b, h_q, s_q) laid out as FlashMLA writes it, s_q outside h_q
    (the same bytes when s_q = 1), so that the kernel writes it in place: XLA transposes it
    where it is read, and a step that drops it copies nothing."""
    q, kv, bt, sl = make_decode_inputs(np.random.default_rng(3), batch=2, s_q=s_q, h_q=16,
                                       mean_sk=100, varlen=True, dtype=jnp.bfloat16)
    out_only = jax.jit(lambda *a: jf.mla_decode(*a, implementation="custom_call")[0])
    hlo = out_only.lower(q, kv, bt, sl).compile().as_text()
    layout = "{1,2,0}" if s_q > 1 else "{2,1,0}"
    # The call's results: out, lse, then FlashMLA's split-KV accumulators.
    assert f"f32[2,16,{s_q}]{layout}, f32[134,16,{s_q},512]{{3,2,1,0}}, f32[134,16,{s_q}]{{2,1,0}}) custom-call(" in hlo
    assert "copy" not in hlo
    _, lse = _decode((q, kv, bt, sl), "custom_call")
    _, ref_lse = _decode((q, kv, bt, sl), "reference")
    assert_flashmla_close("lse", lse, ref_lse, **LSE_TOL)
    # Returned with lse_format, lse leaves the call as FlashMLA wrote it: no transposition.
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    as_written = jax.jit(functools.partial(jf.mla_decode, implementation="custom_call"),
                         out_shardings=(device, jf.serving.lse_format(s_q, device)))
    hlo = as_written.lower(q, kv, bt, sl).compile().as_text()
    assert "copy" not in hlo and "transpose" not in hlo
    # The one fusion makes the lengths safe (s32[batch]); none touches lse.
    fusions = [line for line in hlo.splitlines() if " fusion(" in line]
    assert fusions and all(" = s32[2]{0} fusion(" in line for line in fusions), fusions
    _, lse_as_written = as_written(q, kv, bt, sl)
    assert lse_as_written.format.layout.major_to_minor == ((0, 2, 1) if s_q > 1 else (0, 1, 2))
    np.testing.assert_array_equal(np.asarray(lse_as_written), np.asarray(lse))


@pytest.mark.parametrize("implementation", ["custom_call", "reference"])
def test_unused_pages_and_table_slots_change_nothing(implementation):
    rng = np.random.default_rng(2)
    q, kv, bt, sl = make_decode_inputs(rng, batch=3, s_q=2, h_q=32, mean_sk=100, varlen=True,
                                       dtype=jnp.bfloat16, extra_pages=3)
    used = np.zeros(kv.shape[0], bool)
    for i, n in enumerate(sl):
        used[bt[i, : -(-int(n) // 64)]] = True
    # Same values where a request reads; random numbers instead of NaN everywhere else.
    noise = jax.random.normal(jax.random.key(0), kv.shape, kv.dtype)
    kv_clean = jnp.where(jnp.asarray(used)[:, None, None, None] & ~jnp.isnan(kv), kv, noise)
    bt_other = np.where(bt == SENTINEL_PAGE, 0, bt)  # unused slots point at a real page
    out_a, lse_a = _decode((q, kv, bt, sl), implementation)
    out_b, lse_b = _decode((q, kv_clean, bt_other, sl), implementation)
    assert not np.isnan(np.asarray(out_a, np.float32)).any()
    np.testing.assert_array_equal(np.asarray(out_a, np.float32), np.asarray(out_b, np.float32))
    np.testing.assert_array_equal(np.asarray(lse_a), np.asarray(lse_b))


def test_softmax_scale_is_applied():
    rng = np.random.default_rng(3)
    inputs = make_decode_inputs(rng, batch=2, s_q=1, h_q=16, mean_sk=90, varlen=True,
                                dtype=jnp.bfloat16)
    scale = 0.5 * 192 ** -0.5
    for implementation in ["custom_call", "reference"]:
        out, lse = _decode(inputs, implementation, softmax_scale=scale)
        ref_out, ref_lse = dense_attention_f64(*inputs, softmax_scale=scale, causal=True)
        assert_flashmla_close("out", out, ref_out, **OUT_TOL)
        assert_flashmla_close("lse", lse, ref_lse, **LSE_TOL)


@pytest.mark.skipif(ON_GPU, reason="FlashMLA's scheduler always plans for the GPU's own SMs")
@pytest.mark.parametrize("num_sms", [1, 2, 7, 132])
def test_any_schedule_gives_the_same_attention(num_sms):
    """The CPU target follows the metadata it is given: schedules that split requests
    differently must all cover every key exactly once."""
    rng = np.random.default_rng(4)
    q, kv, bt, sl = make_decode_inputs(rng, batch=5, s_q=2, h_q=16, mean_sk=300, varlen=True,
                                       dtype=jnp.bfloat16, zero_lengths=1)
    args = [q, kv, jnp.asarray(bt), jnp.asarray(sl)]
    md = jf.get_mla_metadata(args[3], block_table=args[2], num_pages=kv.shape[0],
                             num_heads_q=16, num_q_tokens=2, num_sms=num_sms,
                             implementation="custom_call")
    out, lse = jf.mla_decode(*args, metadata=md, implementation="custom_call")
    ref_out, ref_lse = dense_attention_f64(q, kv, bt, sl, softmax_scale=SCALE, causal=True)
    assert_flashmla_close("out", out, ref_out, **OUT_TOL)
    assert_flashmla_close("lse", lse, ref_lse, **LSE_TOL)
