"""The FP8 (e4m3) KV cache on CPU: quantization against a NumPy model of e4m3 rounding and
saturation, the decode (the custom call's C++ target and the reference) against dequantized
float64 attention, one compilation for any scale, writes into an FP8 cache, and every input
error. The decode tests run on the CPU device on every machine (the C++ model); the kernel's
side is tests/test_gpu_fp8.py. Quantization runs on the default device, GPU included."""
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jax_flashmla as jf
from jax_flashmla.caches import fp8
from helpers import (K_SCALE, LSE_TOL, OUT_TOL, assert_flashmla_close, dense_attention_f64,
                     fp8_inputs, fp8_kernel_tables, make_decode_inputs)

IMPLEMENTATIONS = ["custom_call", "reference"]
SCALE = 576 ** -0.5
# Test data are N(0, 1)/10 clipped to [-1, 1] (oracle.make_decode_inputs): this scale maps
# them onto e4m3's range with the largest values saturating, as a calibrated scale would not.


# Values of the finite non-negative e4m3fn codes 0..126 from the bit layout (4 exponent bits
# of bias 7, 3 mantissa bits, subnormals at exponent 0); 127 (S.1111.111) is NaN.
_CODES = np.arange(127)
E4M3_VALUES = np.where(_CODES >> 3 == 0, (_CODES & 7) * 2.0 ** -9,
                       (1 + (_CODES & 7) / 8) * 2.0 ** ((_CODES >> 3) - 7))


def e4m3_model(x, scale):
    """NumPy model of the quantization, as uint8 codes: x * (1/scale) in float32, clamped to
    +-448, rounded to the nearest e4m3fn value with ties to the even code (even mantissa)."""
    scaled = np.asarray(x, np.float32) * (np.float32(1) / np.float32(scale))
    clamped = np.clip(scaled, -448, 448).astype(np.float64).reshape(-1)
    codes, values = _CODES, E4M3_VALUES
    distance = np.abs(np.abs(clamped)[:, None] - values[None, :])
    nearest = distance == distance.min(axis=1, keepdims=True)
    even = nearest & (codes % 2 == 0)
    code = np.where(even.any(axis=1), even.argmax(axis=1), nearest.argmax(axis=1))
    return (code | np.where(np.signbit(clamped), 0x80, 0)).astype(np.uint8).reshape(np.shape(x))


def _codes(x8):
    return np.asarray(jax.lax.bitcast_convert_type(x8, jnp.uint8))


def _midpoints():
    """Every value halfway between two adjacent e4m3 values (exact in float32), both signs."""
    mids = ((E4M3_VALUES[:-1] + E4M3_VALUES[1:]) / 2).astype(np.float32)
    return np.concatenate([mids, -mids])


@pytest.mark.parametrize("scale", [1.0, 0.0173, 3.5])
def test_quantize_matches_the_numpy_model(scale):
    rng = np.random.default_rng(0)
    x = np.concatenate([
        rng.standard_normal(20000) * 100 * scale,                 # the normal range
        rng.standard_normal(5000) * 2.0 ** -8 * scale,            # subnormals and zeros
        np.array([447.9, 448, 449, 463.9, 464, 480, 1e6, np.inf, -np.inf, -1e6]) * scale,
        _midpoints() * scale,                                     # ties (exact when scale is 1)
    ]).astype(np.float32)
    got = _codes(jax.jit(fp8.quantize)(jnp.asarray(x), jnp.float32(scale)))
    np.testing.assert_array_equal(got, e4m3_model(x, scale))


def test_quantize_saturates_and_keeps_nan():
    x = jnp.asarray([1e30, -1e30, np.inf, -np.inf, 448, 464, np.nan], jnp.float32)
    got = np.asarray(fp8.quantize(x, jnp.float32(1.0)).astype(jnp.float32))
    np.testing.assert_array_equal(got[:6], [448, -448, 448, -448, 448, 448])
    assert np.isnan(got[6])


def test_quantize_from_bfloat16_input():
    x = jnp.asarray(np.random.default_rng(1).standard_normal(4096) * 30, jnp.bfloat16)
    got = _codes(fp8.quantize(x, jnp.float32(0.25)))
    np.testing.assert_array_equal(got, e4m3_model(np.asarray(x, np.float32), 0.25))


def _dequantized_oracle(q, kv8, bt, sl, scale, causal=True):
    """float64 attention over what the kernel sees: q quantized with the scale, both dequantized."""
    q8 = fp8.quantize(q, jnp.float32(scale))
    deq = lambda x: np.asarray(x.astype(jnp.float32), np.float64) * np.float64(np.float32(scale))
    return dense_attention_f64(deq(q8), deq(kv8), np.asarray(bt), np.asarray(sl),
                               softmax_scale=SCALE, causal=causal)


@pytest.mark.usefixtures("on_cpu")
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_every_e4m3_code_is_decoded_exactly(implementation):
    """One key per request, so out is that key's V row: its bytes decoded, times the scale."""
    codes = np.tile(np.arange(256), 3)[:576].astype(np.uint8)
    codes[(codes & 0x7f) == 0x7f] = 0  # a NaN in the key would make the score NaN
    kv = np.zeros((1, 64, 1, 576), np.uint8)
    kv[0, 0, 0] = codes
    kv8 = jax.lax.bitcast_convert_type(jnp.asarray(kv), jnp.float8_e4m3fn)
    q = jnp.zeros((1, 1, 16, 576), jnp.bfloat16)
    out, _ = jf.mla_decode(q, kv8, jnp.zeros((1, 1), jnp.int32), jnp.ones((1,), jnp.int32),
                           k_scale=jnp.float32(2.0), implementation=implementation)
    v = codes[:512].astype(np.int64)
    expected = np.where(v & 0x80, -1.0, 1.0) * E4M3_VALUES[v & 0x7f] * 2.0  # exact in bf16
    np.testing.assert_array_equal(np.asarray(out, np.float64)[0, 0], np.tile(expected, (16, 1)))


@pytest.mark.usefixtures("on_cpu")
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("s_q,causal", [(1, True), (2, True), (4, True), (3, False)])
def test_decode_matches_dequantized_float64_attention(implementation, s_q, causal):
    q, kv8, bt, sl = fp8_inputs(s_q, s_q=s_q)
    decode = jax.jit(lambda q, kv, bt, sl, s: jf.mla_decode(
        q, kv, bt, sl, k_scale=s, causal=causal, implementation=implementation))
    out, lse = decode(q, kv8, bt, sl, jnp.float32(K_SCALE))
    assert out.dtype == jnp.bfloat16 and out.shape == q.shape[:3] + (512,)
    assert lse.dtype == jnp.float32 and lse.shape == (q.shape[0], q.shape[2], s_q)
    ref_out, ref_lse = _dequantized_oracle(q, kv8, bt, sl, K_SCALE, causal)
    assert_flashmla_close("out", out, ref_out, **OUT_TOL)
    assert_flashmla_close("lse", lse, ref_lse, **LSE_TOL)


def test_the_fp8_schedule_plans_empty_requests_as_length_one():
    """FlashMLA's FP8 decode faults on a request of length 0: the guard gives the kernel such
    a request as length 1 over page 0 (fp8.guard_empty_requests), so the FP8 schedule is that
    of the lengths raised to at least 1."""
    sl = jnp.asarray([0, 100, 10, 0], jnp.int32)
    bt = jnp.zeros((4, 2), jnp.int32)
    metadata = lambda lens: jf.get_mla_metadata(lens, block_table=bt, num_pages=1, num_heads_q=16,
                                                fp8=True, implementation="custom_call")
    for field in ("tile_scheduler_metadata", "num_splits"):
        np.testing.assert_array_equal(getattr(metadata(sl), field),
                                      getattr(metadata(jnp.maximum(sl, 1)), field))


def test_the_guard_model_changes_only_slot_0_of_empty_requests():
    """fp8.guard_empty_requests, what mla_decode and the GPU tests hand FlashMLA's FP8 kernel:
    empty requests get length 1 over page 0, nothing else changes."""
    sentinel = 2**31 - 64
    bt = jnp.asarray([[sentinel, sentinel], [5, 6], [7, sentinel]], jnp.int32)
    sl = jnp.asarray([0, 100, 10], jnp.int32)
    guarded_bt, guarded_sl, empty = fp8.guard_empty_requests(bt, sl)
    np.testing.assert_array_equal(guarded_bt, [[0, sentinel], [5, 6], [7, sentinel]])
    np.testing.assert_array_equal(guarded_sl, [1, 100, 10])
    np.testing.assert_array_equal(empty, [True, False, False])


@pytest.mark.usefixtures("on_cpu")
def test_empty_requests_keep_flashmlas_convention_in_fp8():
    """Row 0 and another row empty, their block-table rows all sentinels: out 0, lse +inf, and
    the other rows as the reference computes them."""
    q, kv8, bt, sl = fp8_inputs(11, batch=5, zero_lengths=0)
    sl = sl.at[jnp.asarray([0, 3])].set(0)
    bt = bt.at[jnp.asarray([0, 3])].set(2**31 - 64)
    scale = jnp.float32(K_SCALE)
    out, lse = jax.jit(lambda *a: jf.mla_decode(*a[:4], k_scale=a[4], implementation="custom_call"))(
        q, kv8, bt, sl, scale)
    ref_out, ref_lse = jf.mla_decode(q, kv8, bt, sl, k_scale=scale, implementation="reference")
    np.testing.assert_array_equal(np.asarray(out[jnp.asarray([0, 3])], np.float32), 0)
    assert np.isposinf(np.asarray(lse[jnp.asarray([0, 3])])).all()
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref_out, np.float32),
                               atol=2e-2)
    np.testing.assert_array_equal(np.isinf(np.asarray(lse)), np.isinf(np.asarray(ref_lse)))


@pytest.mark.usefixtures("on_cpu")
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_q_quantized_beforehand_gives_the_same_result(implementation):
    """q handed over in float8_e4m3fn (quantized with k_scale, as SGLang hands it to the kernel)
    and q quantized by mla_decode give the same bits, empty requests included."""
    q, kv8, bt, sl = fp8_inputs(12, s_q=2, batch=6, zero_lengths=1)
    scale = jnp.float32(K_SCALE)
    decode = jax.jit(lambda q, kv, bt, sl, s: jf.mla_decode(q, kv, bt, sl, k_scale=s,
                                                            implementation=implementation))
    out, lse = decode(q, kv8, bt, sl, scale)
    out8, lse8 = decode(fp8.quantize(q, scale), kv8, bt, sl, scale)
    assert out8.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(out8, np.float32), np.asarray(out, np.float32))
    np.testing.assert_array_equal(np.asarray(lse8), np.asarray(lse))
    assert np.isposinf(np.asarray(lse)).any()  # the empty request was there


@pytest.mark.usefixtures("on_cpu")
def test_with_q_in_fp8_the_decode_is_the_decode_and_its_inputs_guard():
    """Given q in FP8 and the metadata, nothing runs but the FP8 decode and the elementwise
    guard of its inputs (the kernel's table, a stale request's q): no quantization of q."""
    q, kv8, bt, sl = fp8_inputs(13)
    scale = jnp.float32(K_SCALE)
    md = jf.get_mla_metadata(sl, block_table=bt, num_pages=kv8.shape[0], num_heads_q=16, fp8=True,
                             implementation="custom_call")
    decode = jax.jit(lambda q, kv, bt, sl, md, s: jf.mla_decode(
        q, kv, bt, sl, metadata=md, k_scale=s, implementation="custom_call"))
    hlo = decode.lower(fp8.quantize(q, scale), kv8, bt, sl, md, scale).compile().as_text()
    assert [op for _, op in fp8_kernel_tables(hlo)] == ["fusion"]
    assert "custom_call_target" in hlo and hlo.count("custom_call_target=") == 1
    assert "clamp" not in hlo  # fp8.quantize saturates with one


@pytest.mark.usefixtures("on_cpu")
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_one_compilation_serves_any_scale(implementation):
    q, kv, bt, sl = make_decode_inputs(np.random.default_rng(5), batch=3, s_q=2, h_q=16,
                                       mean_sk=100, varlen=True, dtype=jnp.float32)
    bt, sl = jnp.asarray(bt), jnp.asarray(sl)

    @jax.jit
    def step(q, kv, bt, sl, scale):
        md = jf.get_mla_metadata(sl, block_table=bt, num_pages=kv.shape[0], num_heads_q=16,
                                 num_q_tokens=2, fp8=True, implementation=implementation)
        return jf.mla_decode(q, kv, bt, sl, metadata=md, k_scale=scale,
                             implementation=implementation)

    outs = []
    for scale in (np.float32(1 / 400), np.float32(1 / 3000)):
        kv8 = fp8.quantize(kv, jnp.float32(scale))
        out, lse = step(q.astype(jnp.bfloat16), kv8, bt, sl, jnp.asarray(scale))
        ref_out, ref_lse = _dequantized_oracle(q.astype(jnp.bfloat16), kv8, bt, sl, scale)
        assert_flashmla_close("out", out, ref_out, **OUT_TOL)
        assert_flashmla_close("lse", lse, ref_lse, **LSE_TOL)
        outs.append(np.asarray(out, np.float32))
    assert step._cache_size() == 1
    assert not np.array_equal(outs[0], outs[1])  # the second scale was really used


@pytest.mark.usefixtures("on_cpu")
def test_custom_call_equals_reference_and_lowers_to_the_fp8_target():
    q, kv8, bt, sl = fp8_inputs(6, s_q=2, h_q=32)
    scale = jnp.float32(K_SCALE)
    call = jax.jit(lambda *a: jf.mla_decode(*a[:4], k_scale=a[4], implementation="custom_call"))
    ref = jax.jit(lambda *a: jf.mla_decode(*a[:4], k_scale=a[4], implementation="reference"))
    assert 'custom_call_target="jax_flashmla_mla_decode_fp8"' in call.lower(
        q, kv8, bt, sl, scale).as_text(dialect="hlo")
    (out, lse), (ref_out, ref_lse) = call(q, kv8, bt, sl, scale), ref(q, kv8, bt, sl, scale)
    assert_flashmla_close("out", out, np.asarray(ref_out, np.float32), **OUT_TOL)
    assert_flashmla_close("lse", lse, ref_lse, **LSE_TOL)


@pytest.mark.parametrize("shape,batch_axis,head_axis", [((8,), None, "x"), ((2, 4), "x", "y")])
def test_split_fp8_decode_equals_one_device(shape, batch_axis, head_axis):
    devices = jax.devices("cpu")
    assert len(devices) >= 8, "tests/conftest.py sets 8 CPU devices"
    q, kv8, bt, sl = fp8_inputs(7, batch=8, h_q=32, mean_sk=150)
    scale = jnp.float32(K_SCALE)
    decode = jax.jit(lambda *a: jf.mla_decode(*a[:4], k_scale=a[4], implementation="custom_call"))
    expected = decode(*jax.device_put((q, kv8, bt, sl, scale), devices[0]))
    mesh = Mesh(np.array(devices[:np.prod(shape)]).reshape(shape), ("x", "y")[:len(shape)])
    put = lambda x, *spec: jax.device_put(x, NamedSharding(mesh, P(*spec)))
    args = (put(q, batch_axis, None, head_axis, None), put(kv8), put(bt, batch_axis),
            put(sl, batch_axis), put(scale))
    hlo = decode.lower(*args).compile().as_text()
    assert "all-gather" not in hlo
    out, lse = decode(*args)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(expected[0], np.float32))
    np.testing.assert_array_equal(np.asarray(lse), np.asarray(expected[1]))


def test_write_kv_quantizes_into_an_fp8_cache():
    rng = np.random.default_rng(8)
    cache = jf.PagedKVCache.create(3, jnp.float8_e4m3fn)
    assert cache.dtype == jnp.float8_e4m3fn and cache.bytes_per_token == 576
    slots = np.array([5, 64, -1, 191, 3 * 64], np.int32)
    rows = (rng.standard_normal((5, 576)) * 2).astype(np.float32)
    write = jax.jit(lambda c, s, r, scale: jf.write_kv(c, s, latent=r[:, :512], rope=r[:, 512:],
                                                       scale=scale), donate_argnums=0)
    pointer = cache.data.unsafe_buffer_pointer()
    got = write(cache, jnp.asarray(slots), jnp.asarray(rows, jnp.bfloat16), jnp.float32(0.01))
    assert got.data.unsafe_buffer_pointer() == pointer  # in place
    expected = np.zeros((3 * 64, 576), np.uint8)
    model = e4m3_model(np.asarray(jnp.asarray(rows, jnp.bfloat16), np.float32), 0.01)
    for slot, code in zip(slots, model):
        if 0 <= slot < 3 * 64:
            expected[slot] = code
    np.testing.assert_array_equal(_codes(got.data).reshape(-1, 576), expected)
    assert (_codes(got.data) == 0x7e).any() or (_codes(got.data) == 0xfe).any()  # saturated


def _args(dtype=jnp.float8_e4m3fn, q_dtype=jnp.bfloat16):
    return (jnp.zeros((2, 1, 16, 576), q_dtype), jnp.zeros((4, 64, 1, 576), dtype),
            jnp.zeros((2, 2), jnp.int32), jnp.zeros((2,), jnp.int32))


@pytest.mark.parametrize("args,kwargs,exc,pattern", [
    (_args(jnp.bfloat16, jnp.float8_e4m3fn), {}, TypeError,
     r"q may be float8_e4m3fn only with a float8_e4m3fn kv_cache \(q quantized with k_scale\); "
     r"kv_cache is bfloat16"),
    (_args(q_dtype=jnp.float32), dict(k_scale=jnp.float32(1)), TypeError,
     r"q must be bfloat16 or float16 \(or float8_e4m3fn with a float8_e4m3fn kv_cache\); "
     r"got float32"),
    (_args(), {}, TypeError, r"a float8_e4m3fn kv_cache needs k_scale"),
    (_args(jnp.bfloat16), dict(k_scale=jnp.float32(1)), TypeError,
     r"k_scale is only for a float8_e4m3fn kv_cache; kv_cache is bfloat16"),
    (_args(jnp.float8_e5m2), dict(k_scale=jnp.float32(1)), TypeError,
     r"kv_cache must have q's dtype bfloat16; got float8_e5m2"),
    (_args(), dict(k_scale=0.5), TypeError,
     r"k_scale must be a float32 array of shape \(\) or \(1,\) \(an array.*got float"),
    (_args(), dict(k_scale=jnp.ones((), jnp.bfloat16)), TypeError, r"k_scale must be float32; got bfloat16"),
    (_args(), dict(k_scale=jnp.ones((2,), jnp.float32)), ValueError,
     r"k_scale must have shape \(\) or \(1,\) \(one scale per tensor\); got \(2,\)"),
    (_args(), dict(k_scale=jnp.ones((1, 1), jnp.float32)), ValueError, r"got \(1, 1\)"),
])
def test_decode_rejects(args, kwargs, exc, pattern):
    for implementation in IMPLEMENTATIONS:
        with pytest.raises(exc, match=pattern):
            jf.mla_decode(*args, implementation=implementation, **kwargs)


@pytest.mark.parametrize("cache_fp8", [True, False])
def test_decode_rejects_metadata_of_the_other_scheduler(cache_fp8):
    q, kv, bt, sl = _args(jnp.float8_e4m3fn if cache_fp8 else jnp.bfloat16)
    md = jf.get_mla_metadata(sl, block_table=bt, num_pages=kv.shape[0], num_heads_q=16,
                             fp8=not cache_fp8, implementation="custom_call")
    kwargs = dict(k_scale=jnp.float32(1)) if cache_fp8 else {}
    pattern = (f"metadata was computed with fp8={not cache_fp8}, but the kv_cache is "
               f"{'' if cache_fp8 else 'not '}float8_e4m3fn; call get_mla_metadata\\(..., "
               f"fp8={cache_fp8}\\)")
    with pytest.raises(ValueError, match=pattern):
        jf.mla_decode(q, kv, bt, sl, metadata=md, implementation="custom_call", **kwargs)


def test_errors_are_raised_at_trace_time():
    q, kv, bt, sl = _args()
    bad_scale = jax.ShapeDtypeStruct((2,), jnp.float32)
    with pytest.raises(ValueError, match=r"k_scale must have shape"):
        jax.jit(lambda s: jf.mla_decode(q, kv, bt, sl, k_scale=s)).trace(bad_scale)


@pytest.mark.parametrize("dtype,kwargs,exc,pattern", [
    (jnp.float8_e4m3fn, {}, TypeError, r"write_kv: a float8_e4m3fn kv_cache needs scale"),
    (jnp.bfloat16, dict(scale=jnp.float32(1)), TypeError,
     r"write_kv: scale is only for a float8_e4m3fn kv_cache; kv_cache is bfloat16"),
    (jnp.float8_e4m3fn, dict(scale=jnp.ones((3,), jnp.float32)), ValueError,
     r"write_kv: scale must have shape \(\) or \(1,\)"),
    (jnp.float8_e4m3fn, dict(scale=1.0), TypeError, r"write_kv: scale must be a float32 array"),
])
def test_write_kv_rejects(dtype, kwargs, exc, pattern):
    cache = jf.PagedKVCache.create(1, dtype)
    with pytest.raises(exc, match=pattern):
        jf.write_kv(cache, jnp.zeros((1,), jnp.int32), kv=jnp.zeros((1, 576)), **kwargs)


def test_fp8_benchmark_runs_tiny(tmp_path):
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_fp8.py"
    out = tmp_path / "fp8.json"
    result = subprocess.run([sys.executable, str(script), "--tiny", "--out", str(out)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert re.search(r"fp8 .* GB/s", result.stdout), result.stdout
    assert out.stat().st_size > 0


@pytest.mark.parametrize("value", [0.0, -0.5, float("inf"), float("nan")])
def test_a_known_bad_scale_is_refused_at_trace_time(value):
    """A scale whose value is known while tracing (not a traced argument) that is not positive
    and finite: a ValueError naming it in write_kv, mla_decode and mla_prefill."""
    scale = jnp.float32(value)
    cache = jnp.zeros((4, 64, 1, 576), jnp.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"write_kv: scale must be positive and finite.*got"):
        jf.write_kv(cache, jnp.asarray([3], jnp.int32), kv=jnp.ones((1, 576)), scale=scale)
    q = jnp.ones((1, 1, 16, 576), jnp.bfloat16)
    bt, sl = jnp.zeros((1, 1), jnp.int32), jnp.ones((1,), jnp.int32)
    with pytest.raises(ValueError, match=r"k_scale must be positive and finite"):
        jax.jit(lambda q: jf.mla_decode(q, cache, bt, sl, k_scale=scale))(q)
    with pytest.raises(ValueError, match=r"mla_prefill: k_scale must be positive and finite"):
        jf.mla_prefill(jnp.ones((2, 1, 192), jnp.bfloat16), jnp.ones((2, 576), jnp.bfloat16),
                       cache, bt, jnp.ones((1,), jnp.int32), jnp.full((1,), 2, jnp.int32),
                       w_uk=jnp.ones((512, 1, 128)),
                       w_uv=jnp.ones((512, 1, 128)), softmax_scale=0.1, max_prefix_tokens=64,
                       k_scale=scale)
