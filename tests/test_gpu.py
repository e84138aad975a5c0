"""On the GPU machine: the custom call against FlashMLA's torch op called directly."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flashmla as jf
from jax_flashmla.caches import fp8 as fp8_cache
from jax_flashmla.kernels import custom_calls
from jax_flashmla.kernels import library as kernels
from helpers import K_SCALE, call_by_name, fp8_inputs, make_decode_inputs, torch_decode

pytestmark = pytest.mark.gpu

# FlashMLA writes the first 7 fields of each scheduler row; the 8th is unused.
MEANINGFUL_METADATA_FIELDS = 7


def _torch_ops():
    import torch

    ops = kernels.ensure_cuda_targets()
    resolve = lambda name: getattr(getattr(torch.ops, name.split("::")[0]), name.split("::")[1])
    return torch, resolve(ops.decode), resolve(ops.metadata)


@pytest.mark.parametrize("s_q,h_q,varlen", [(1, 128, False), (1, 16, True), (2, 64, True),
                                             (2, 128, True), (4, 32, False)])
def test_bit_identical_to_the_torch_op(s_q, h_q, varlen):
    torch, decode_op, metadata_op = _torch_ops()
    rng = np.random.default_rng(s_q * 1000 + h_q)
    q, kv, bt, sl = make_decode_inputs(rng, batch=64, s_q=s_q, h_q=h_q, mean_sk=2048,
                                       varlen=varlen, dtype=jnp.bfloat16, zero_lengths=2)
    bt, sl = jnp.asarray(bt), jnp.asarray(sl)

    @jax.jit
    def step(q, kv, bt, sl):
        md = jf.get_mla_metadata(sl, block_table=bt, num_pages=kv.shape[0], num_heads_q=h_q,
                                 num_q_tokens=s_q)
        out, lse = jf.mla_decode(q, kv, bt, sl, metadata=md)
        return md, out, lse

    md, out, lse = step(q, kv, bt, sl)
    t = {name: torch.from_dlpack(x) for name, x in
         dict(q=q, kv=kv, bt=bt, sl=sl).items()}
    t_md, t_splits = call_by_name(metadata_op, dict(
        seqlens_k=t["sl"], num_q_tokens_per_head_k=s_q * h_q, num_heads_per_head_k=s_q * h_q,
        h_k=1, num_heads_k=1, h_q=h_q, is_fp8_kvcache=False))[:2]
    t_out, t_lse = call_by_name(decode_op, dict(
        q=t["q"], kv_cache=t["kv"], kcache=t["kv"], head_size_v=512, seqlens_k=t["sl"],
        block_table=t["bt"], softmax_scale=576 ** -0.5, is_causal=True,
        tile_scheduler_metadata=t_md, num_splits=t_splits, is_fp8=False))[:2]
    torch.cuda.synchronize()
    np.testing.assert_array_equal(
        np.asarray(md.tile_scheduler_metadata)[:, :MEANINGFUL_METADATA_FIELDS],
        t_md.cpu().numpy()[:, :MEANINGFUL_METADATA_FIELDS])
    np.testing.assert_array_equal(np.asarray(md.num_splits), t_splits.cpu().numpy())
    np.testing.assert_array_equal(np.asarray(md.tile_scheduler_metadata)[:, 7], 0)
    out_bits = np.asarray(out).view(np.uint16)
    np.testing.assert_array_equal(out_bits, t_out.view(torch.int16).cpu().numpy().view(np.uint16))
    np.testing.assert_array_equal(np.asarray(lse), t_lse.cpu().numpy())


def test_an_error_inside_the_op_is_a_python_exception():
    """A shape FlashMLA rejects (V width 256), bypassing jax_flashmla's own validation."""
    q, kv, bt, sl = make_decode_inputs(np.random.default_rng(0), batch=2, s_q=1, h_q=16,
                                       mean_sk=64, varlen=False, dtype=jnp.bfloat16)
    sl = jnp.asarray(sl)
    md = jf.get_mla_metadata(sl, block_table=jnp.asarray(bt), num_pages=kv.shape[0],
                             num_heads_q=16)
    parts = md.tile_scheduler_metadata.shape[0]
    v = 256
    decode = jax.ffi.ffi_call(custom_calls.DECODE.target, (
        jax.ShapeDtypeStruct((2, 1, 16, v), jnp.bfloat16),
        jax.ShapeDtypeStruct((2, 16, 1), jnp.float32),
        jax.ShapeDtypeStruct((2 + parts, 16, 1, v), jnp.float32),
        jax.ShapeDtypeStruct((2 + parts, 16, 1), jnp.float32)))
    with pytest.raises(Exception, match="failed"):
        out, *_ = decode(q, kv, jnp.asarray(bt), sl, md.tile_scheduler_metadata, md.num_splits,
                         op=kernels.ensure_cuda_targets().decode, softmax_scale=np.float32(0.1),
                         causal=True)
        out.block_until_ready()
    # The process and the GPU are still usable afterwards.
    out, lse = jf.mla_decode(q, kv, jnp.asarray(bt), sl, metadata=md)
    assert np.isfinite(np.asarray(lse)).all()


def test_decode_lowers_to_the_flashmla_custom_call():
    q, kv, bt, sl = make_decode_inputs(np.random.default_rng(0), batch=2, s_q=1, h_q=16,
                                       mean_sk=64, varlen=False, dtype=jnp.bfloat16)
    hlo = jax.jit(jf.mla_decode).lower(q, kv, jnp.asarray(bt), jnp.asarray(sl)).compile().as_text()
    assert 'custom_call_target="jax_flashmla_mla_decode"' in hlo
    assert 'custom_call_target="jax_flashmla_mla_metadata"' in hlo
    assert "sgl_kernel::fwd_kvcache_mla" in hlo or "flash_mla_legacy::" in hlo


def test_metadata_for_another_sm_count_is_refused_at_lowering():
    sl = jnp.full((4,), 100, jnp.int32)
    bt = jnp.arange(8, dtype=jnp.int32).reshape(4, 2)
    with pytest.raises(ValueError, match="leave num_sms unset on GPUs"):
        jax.jit(lambda s, bt: jf.get_mla_metadata(s, block_table=bt, num_pages=8,
                                                  num_heads_q=16, num_sms=7)).lower(sl, bt)


@pytest.mark.parametrize("fp8", [False, True])
def test_out_of_range_requests_under_flashmla(fp8):
    """A length past the block table and a page past the cache, with the metadata made for
    in-range requests: FlashMLA decodes those requests empty and the others bit for bit as
    without them; the process decodes as torch-direct afterwards."""
    if fp8:
        q, kv, bt, sl = fp8_inputs(7, batch=16, mean_sk=1000, zero_lengths=0)
        k_scale = jnp.float32(K_SCALE)
    else:
        q, kv, bt, sl = make_decode_inputs(np.random.default_rng(7), batch=16, s_q=1, h_q=16,
                                           mean_sk=1000, varlen=True, dtype=jnp.bfloat16)
        bt, sl, k_scale = jnp.asarray(bt), jnp.asarray(sl), None

    @jax.jit
    def step(q, kv, bt, sl):
        md = jf.get_mla_metadata(sl, block_table=bt, num_pages=kv.shape[0], num_heads_q=16,
                                 fp8=fp8)
        return jf.mla_decode(q, kv, bt, sl, metadata=md, softmax_scale=0.1, k_scale=k_scale)

    bad_sl = sl.at[3].set(bt.shape[1] * 64 + 1000)
    bad_bt = bt.at[5, 0].set(kv.shape[0] + 10**6)
    out, lse = jax.block_until_ready(step(q, kv, bad_bt, bad_sl))
    want_out, want_lse = step(q, kv, bt, sl.at[3].set(0).at[5].set(0))
    for i in (3, 5):
        assert not np.any(np.asarray(out[i], np.float32)) and np.all(np.asarray(lse[i]) == np.inf)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(want_out, np.float32))
    np.testing.assert_array_equal(np.asarray(lse), np.asarray(want_lse))
    # The CUDA context is healthy: a clean decode is still torch-direct's.
    out, lse = step(q, kv, bt, sl)
    kernel_q = q if not fp8 else fp8_cache.quantize(q, k_scale)
    ref_out, ref_lse = torch_decode(kernel_q, kv, bt, sl, softmax_scale=0.1, k_scale=k_scale)
    np.testing.assert_array_equal(np.asarray(out, np.float32), ref_out)
    np.testing.assert_array_equal(np.asarray(lse), ref_lse)
