"""On the GPU machine: the FP8 (e4m3) cache path against FlashMLA's FP8 torch ops called
directly, its accuracy against the bf16 path, and the in-place FP8 write. With $OUT set, the
accuracy numbers are also written to $OUT/fp8_accuracy.json."""
import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flashmla as jf
from jax_flashmla.caches import fp8
from jax_flashmla.kernels import library as kernels
from jax_flashmla.base import validation
from helpers import (K_SCALE, cache_shaped_buffers, call_by_name, dense_attention_f64,
                     fp8_kernel_tables, make_decode_inputs, scan_over_fp8_layers, torch_view)

pytestmark = pytest.mark.gpu

# FlashMLA's FP8 scheduler (its original one) writes 5 fields of each row: begin request,
# begin token, end request, end token, begin split; jax_flashmla zeroes the other 3.
WRITTEN_FP8_METADATA_FIELDS = 5
ACCURACY = {}


@pytest.fixture(scope="module", autouse=True)
def _record_accuracy():
    yield
    if ACCURACY and os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "fp8_accuracy.json"), "w") as f:
            json.dump(ACCURACY, f, indent=2)


def _fp8_torch_ops():
    import torch

    ops = kernels.ensure_cuda_targets()
    assert ops.decode_fp8 and ops.metadata_fp8, f"no FP8 ops found in {ops.library.path}"
    resolve = lambda name: getattr(getattr(torch.ops, name.split("::")[0]), name.split("::")[1])
    return torch, resolve(ops.decode_fp8), resolve(ops.metadata_fp8)


def _inputs(seed, *, batch, s_q, h_q, mean_sk, varlen):
    """bf16 q, the bf16 cache and the same cache quantized to FP8, block table, lengths."""
    q, kv, bt, sl = make_decode_inputs(np.random.default_rng(seed), batch=batch, s_q=s_q, h_q=h_q,
                                       mean_sk=mean_sk, varlen=varlen, dtype=jnp.float32,
                                       zero_lengths=2 if varlen else 0)
    return (q.astype(jnp.bfloat16), kv.astype(jnp.bfloat16), fp8.quantize(kv, jnp.float32(K_SCALE)),
            jnp.asarray(bt), jnp.asarray(sl))


@pytest.mark.parametrize("q_quantized", [False, True], ids=["q_bf16", "q_fp8"])
@pytest.mark.parametrize("s_q,h_q,varlen", [(1, 128, False), (1, 16, True), (2, 64, True),
                                             (2, 128, True), (4, 32, False)])
def test_bit_identical_to_the_torch_fp8_op(s_q, h_q, varlen, q_quantized):
    """q_fp8: q handed to mla_decode already quantized with k_scale."""
    torch, decode_op, metadata_op = _fp8_torch_ops()
    q, _, kv8, bt, sl = _inputs(s_q * 1000 + h_q, batch=64, s_q=s_q, h_q=h_q, mean_sk=2048,
                                varlen=varlen)
    scale = jnp.float32(K_SCALE)

    @jax.jit
    def step(q, kv8, bt, sl, scale):
        md = jf.get_mla_metadata(sl, block_table=bt, num_pages=kv8.shape[0], num_heads_q=h_q,
                                 num_q_tokens=s_q, fp8=True)
        q8 = fp8.quantize(q, scale)  # the q the kernel is given
        out, lse = jf.mla_decode(q8 if q_quantized else q, kv8, bt, sl, metadata=md,
                                 k_scale=scale)
        return md, out, lse, q8

    md, out, lse, q8 = step(q, kv8, bt, sl, scale)
    # The torch op gets what jax_flashmla gives the kernel: empty requests as length 1 over
    # page 0 (FlashMLA's FP8 kernel faults on a length of 0), their results then set to out 0,
    # lse +inf.
    guarded_bt, guarded_sl, empty = fp8.guard_empty_requests(bt, sl)
    descale = torch_view(torch, scale.reshape(1))
    t_md, t_splits = call_by_name(metadata_op, dict(
        seqlens_k=torch_view(torch, guarded_sl), num_heads_per_head_k=s_q * h_q,
        num_heads_k=1))[:2]
    t_out, t_lse = call_by_name(decode_op, dict(
        q=torch_view(torch, q8), kcache=torch_view(torch, kv8), head_size_v=512,
        seqlens_k=torch_view(torch, guarded_sl), block_table=torch_view(torch, guarded_bt),
        softmax_scale=576 ** -0.5, is_causal=True, tile_scheduler_metadata=t_md,
        num_splits=t_splits, descale_q=descale, descale_k=descale))[:2]
    t_empty = torch_view(torch, empty)
    t_out[t_empty] = 0
    t_lse[t_empty] = float("inf")
    torch.cuda.synchronize()
    # The FP8 scheduler's row count: jax_flashmla assumes the bf16 formula.
    expected_parts = validation.num_sm_parts(kernels.gpu_sm_count(), h_q, s_q, 1)
    assert tuple(t_md.shape) == (expected_parts, 8) == md.tile_scheduler_metadata.shape
    written = slice(0, WRITTEN_FP8_METADATA_FIELDS)
    np.testing.assert_array_equal(np.asarray(md.tile_scheduler_metadata)[:, written],
                                  t_md.cpu().numpy()[:, written])
    np.testing.assert_array_equal(np.asarray(md.tile_scheduler_metadata)[:, 5:], 0)
    np.testing.assert_array_equal(np.asarray(md.num_splits), t_splits.cpu().numpy())
    assert out.dtype == jnp.bfloat16 and t_out.dtype == torch.bfloat16
    np.testing.assert_array_equal(np.asarray(out).view(np.uint16),
                                  t_out.view(torch.int16).cpu().numpy().view(np.uint16))
    np.testing.assert_array_equal(np.asarray(lse), t_lse.cpu().numpy())


def _differences(name, actual, expected):
    a, e = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    finite = np.isfinite(e)
    np.testing.assert_array_equal(np.isfinite(a), finite, err_msg=f"{name}: inf/NaN positions")
    a, e = a[finite], e[finite]
    return dict(max_abs=float(np.abs(a - e).max()),
                rel_l2=float(np.linalg.norm(a - e) / np.linalg.norm(e)),
                cos_diff=float(1 - 2 * (a * e).sum() / ((a * a).sum() + (e * e).sum())))


@pytest.mark.parametrize("s_q,h_q", [(1, 16), (1, 128), (2, 64)])
def test_accuracy_against_the_bf16_path(s_q, h_q):
    """FP8 rounds q and the cache to 3 mantissa bits: the bound is loose, the numbers recorded."""
    q, kv, kv8, bt, sl = _inputs(7 + h_q, batch=32, s_q=s_q, h_q=h_q, mean_sk=1024, varlen=True)
    out, lse = jax.jit(jf.mla_decode)(q, kv, bt, sl)
    out8, lse8 = jax.jit(lambda *a: jf.mla_decode(*a[:4], k_scale=a[4]))(
        q, kv8, bt, sl, jnp.float32(K_SCALE))
    # And against the exact attention over the dequantized FP8 values: what FP8 inputs allow.
    q8 = fp8.quantize(q, jnp.float32(K_SCALE))
    deq = lambda x: np.asarray(x.astype(jnp.float32), np.float64) * np.float64(K_SCALE)
    exact_out, exact_lse = dense_attention_f64(deq(q8), deq(kv8), np.asarray(bt), np.asarray(sl),
                                               softmax_scale=576 ** -0.5, causal=True)
    record = dict(out_vs_bf16=_differences("out", out8, out),
                  lse_vs_bf16=_differences("lse", lse8, lse),
                  out_vs_dequantized_f64=_differences("out", out8, exact_out),
                  lse_vs_dequantized_f64=_differences("lse", lse8, exact_lse))
    ACCURACY[f"b=32 s_k~1024 s_q={s_q} h_q={h_q} k_scale={K_SCALE:.6g}"] = record
    print(f"FP8 accuracy s_q={s_q} h_q={h_q}: {json.dumps(record)}")
    # The C++ model on CPU gives cosine differences of ~4e-4 against bf16 and ~1e-6 against the
    # dequantized attention; the kernel may round more (e.g. P to FP8 before P.V).
    assert record["out_vs_bf16"]["cos_diff"] < 5e-3
    assert record["out_vs_dequantized_f64"]["cos_diff"] < 5e-3
    assert record["lse_vs_bf16"]["max_abs"] < 0.1


def test_fp8_decode_lowers_to_the_fp8_custom_calls():
    q, _, kv8, bt, sl = _inputs(0, batch=2, s_q=1, h_q=16, mean_sk=64, varlen=False)
    step = jax.jit(lambda *a: jf.mla_decode(*a[:4], k_scale=a[4]))
    hlo = step.lower(q, kv8, bt, sl, jnp.float32(1)).compile().as_text()
    assert 'custom_call_target="jax_flashmla_mla_decode_fp8"' in hlo
    assert re.search(r"::fwd_kvcache_mla_fp8\b", hlo)
    assert re.search(r"::get_mla_decoding_metadata_dense_fp8\b", hlo)
    # Given q in FP8 and the metadata, the decode and the elementwise guard of its inputs run
    # alone; the layers of a step share the kernel's table (fp8.guard_empty_requests).
    md = jf.get_mla_metadata(sl, block_table=bt, num_pages=kv8.shape[0], num_heads_q=16,
                             fp8=True)
    q8 = fp8.quantize(q, jnp.float32(1))
    alone = jax.jit(lambda *a: jf.mla_decode(*a[:4], metadata=a[4], k_scale=a[5]))
    hlo = alone.lower(q8, kv8, bt, sl, md, jnp.float32(1)).compile().as_text()
    assert hlo.count("custom_call_target=") == 1
    step = jax.jit(lambda qs, *a: [jf.mla_decode(q, *a[:3], metadata=a[3], k_scale=a[4])
                                   for q in qs])
    qs = [q8, fp8.quantize(q, jnp.float32(2)), fp8.quantize(q, jnp.float32(3))]
    hlo = step.lower(qs, kv8, bt, sl, md, jnp.float32(1)).compile().as_text()
    tables = fp8_kernel_tables(hlo)
    assert len(tables) == 3 and len({name for name, _ in tables}) == 1
    for (out, lse), q_layer in zip(step(qs, kv8, bt, sl, md, jnp.float32(1)), qs):
        one_out, one_lse = alone(q_layer, kv8, bt, sl, md, jnp.float32(1))
        np.testing.assert_array_equal(np.asarray(out, np.float32),
                                      np.asarray(one_out, np.float32))
        np.testing.assert_array_equal(np.asarray(lse), np.asarray(one_lse))


def test_a_scan_over_layers_on_the_gpu():
    """Each layer of a scan sharing the step's metadata equals a decode of its own, the
    request of length 0 among them."""
    kernels.ensure_cuda_targets()
    assert len(fp8_kernel_tables(scan_over_fp8_layers())) == 1


def test_fp8_write_kv_is_in_place():
    cache = jf.PagedKVCache.create(64, jnp.float8_e4m3fn)
    slots = jnp.arange(0, 640, 5, dtype=jnp.int32)
    rows = jnp.ones((slots.shape[0], 576), jnp.bfloat16)
    write = jax.jit(lambda c, s, r, scale: jf.write_kv(c, s, kv=r, scale=scale), donate_argnums=0)
    hlo = write.lower(cache, slots, rows, jnp.float32(0.5)).compile().as_text()
    buffers = cache_shaped_buffers(hlo, cache.data.shape)
    print("cache-shaped instructions:", buffers)
    assert all(opcode != "copy" for _, opcode, _ in buffers), buffers
    assert {dtype for dtype, _, _ in buffers} <= {"f8e4m3fn", "u8"}, buffers
    pointer = cache.data.unsafe_buffer_pointer()
    out = write(cache, slots, rows, jnp.float32(0.5))
    assert out.data.unsafe_buffer_pointer() == pointer
    assert float(out.data[0, 5, 0, 0].astype(jnp.float32)) == 2.0
