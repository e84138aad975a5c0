"""FlashMLA's sparse decode and prefill as jax_flashmla's custom calls on a Hopper GPU:
bit-identical to sparse_decode_fwd / sparse_prefill_fwd called from torch on the same buffers
(heads padded to the kernels', invalid indices made -1, topk padded with -1), within tolerance
of the pure-JAX reference, and the same when a jitted step is called again with new inputs."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_flashmla.kernels import library as kernels
from jax_flashmla.sparse import mask_indices, sparse_mla_decode, sparse_mla_prefill
from jax_flashmla.caches.sparse import quantize_tokens
from helpers import SPARSE_LSE_TOL, SPARSE_OUT_TOL, torch_view

pytestmark = pytest.mark.gpu
SCALE = 0.1


def _problem(seed, batch, s_q, h_q, topk=256, pages=40):
    rng = np.random.default_rng(seed)
    rows = rng.normal(0, 0.3, (pages, 64, 1, 576)).astype(np.float32)
    cache = quantize_tokens(jnp.asarray(rows))
    indices = rng.integers(0, pages * 64, (batch, s_q, topk)).astype(np.int32)
    indices[0, 0, ::5] = -1
    indices[-1, -1, 3] = pages * 64 + 10  # past the cache: invalid, never read
    indices[min(1, batch - 1), 0, :] = -1  # a query with no valid index
    q = jnp.asarray(rng.normal(0, 1, (batch, s_q, h_q, 576)), jnp.bfloat16)
    return q, cache, jnp.asarray(indices)


def _torch_decode(q, cache, indices, sink):
    """sparse_decode_fwd from torch on the indices the custom call hands the kernel."""
    import torch

    op = getattr(torch.ops.sgl_kernel, "sparse_decode_fwd")
    capacity = cache.shape[0] * 64
    kernel_indices = jnp.where((indices >= 0) & (indices < capacity), indices, -1)
    kv = torch_view(torch, cache).view(torch.float8_e4m3fn)
    out, lse, *_ = op(torch_view(torch, q), kv, torch_view(torch, kernel_indices), None,
                      None if sink is None else torch_view(torch, sink), None, None, None, None,
                      None, 512, SCALE)
    torch.cuda.synchronize()
    return out.float().cpu().numpy(), lse.cpu().numpy()


@pytest.mark.parametrize("batch,s_q,h_q,with_sink", [(3, 1, 64, False), (5, 2, 128, False),
                                                     (4, 1, 128, True), (1, 2, 64, True)])
def test_the_custom_call_is_flashmlas_op_bit_for_bit(batch, s_q, h_q, with_sink):
    kernels.ensure_cuda_targets()
    q, cache, indices = _problem(batch * 10 + s_q, batch, s_q, h_q)
    sink = (jnp.asarray(np.random.default_rng(1).normal(0, 2, h_q), jnp.float32)
            if with_sink else None)
    decode = jax.jit(functools.partial(sparse_mla_decode, softmax_scale=SCALE,
                                       implementation="custom_call"))
    assert "jax_flashmla_mla_sparse_decode" in decode.lower(q, cache, indices,
                                                            attn_sink=sink).as_text()
    out, lse = decode(q, cache, indices, attn_sink=sink)
    t_out, t_lse = _torch_decode(q, cache, indices, sink)
    np.testing.assert_array_equal(np.asarray(out, np.float32), t_out)
    np.testing.assert_array_equal(np.asarray(lse), t_lse)
    ref_out, ref_lse = sparse_mla_decode(q, cache, indices, softmax_scale=SCALE,
                                         attn_sink=sink, implementation="reference")
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref_out, np.float32),
                               **SPARSE_OUT_TOL)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), **SPARSE_LSE_TOL)


@pytest.mark.parametrize("topk", [16, 100])
def test_a_topk_the_kernel_does_not_take_is_padded_with_invalid_indices(topk):
    """FlashMLA's kernel takes topk in multiples of 64: the custom call pads the indices with
    -1, so a topk of 16 or 100 gives the answer of its indices padded by hand (bit for bit)
    and the reference's (within tolerance)."""
    kernels.ensure_cuda_targets()
    q, cache, indices = _problem(7, 3, 1, 64, topk=topk)
    decode = jax.jit(functools.partial(sparse_mla_decode, softmax_scale=SCALE,
                                       implementation="custom_call"))
    out, lse = decode(q, cache, indices)
    padded = jnp.pad(indices, ((0, 0), (0, 0), (0, -topk % 64)), constant_values=-1)
    t_out, t_lse = _torch_decode(q, cache, padded, None)
    np.testing.assert_array_equal(np.asarray(out, np.float32), t_out)
    np.testing.assert_array_equal(np.asarray(lse), t_lse)
    ref_out, ref_lse = sparse_mla_decode(q, cache, indices, softmax_scale=SCALE,
                                         implementation="reference")
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref_out, np.float32),
                               **SPARSE_OUT_TOL)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), **SPARSE_LSE_TOL)


def test_masked_indices_reach_the_kernel_without_a_mask():
    """MaskedIndices go to the kernel as they are (no select in the compiled module, where raw
    indices have the mask's), and give the raw indices' answer bit for bit."""
    kernels.ensure_cuda_targets()
    q, cache, indices = _problem(9, 3, 1, 64)
    decode = jax.jit(functools.partial(sparse_mla_decode, softmax_scale=SCALE,
                                       implementation="custom_call"))
    masked = mask_indices(indices, cache)
    assert "select(" in decode.lower(q, cache, indices).compile().as_text()
    assert "select(" not in decode.lower(q, cache, masked).compile().as_text()
    out, lse = decode(q, cache, masked)
    t_out, t_lse = _torch_decode(q, cache, indices, None)
    np.testing.assert_array_equal(np.asarray(out, np.float32), t_out)
    np.testing.assert_array_equal(np.asarray(lse), t_lse)


def test_a_step_called_again_with_new_inputs_gives_their_answer():
    kernels.ensure_cuda_targets()
    decode = jax.jit(functools.partial(sparse_mla_decode, softmax_scale=SCALE,
                                       implementation="custom_call"))
    first, second = _problem(1, 4, 1, 128), _problem(2, 4, 1, 128)
    decode(*first)
    out, lse = decode(*second)
    fresh_out, fresh_lse = _torch_decode(*second, None)
    np.testing.assert_array_equal(np.asarray(out, np.float32), fresh_out)
    np.testing.assert_array_equal(np.asarray(lse), fresh_lse)


def test_topk_length_masks_the_kernels_indices():
    kernels.ensure_cuda_targets()
    q, cache, indices = _problem(3, 3, 1, 64)
    lengths = jnp.asarray([256, 100, 7], jnp.int32)
    out, lse = sparse_mla_decode(q, cache, indices, softmax_scale=SCALE, topk_length=lengths,
                                 implementation="custom_call")
    cut = jnp.where(jnp.arange(256)[None, None, :] < lengths[:, None, None], indices, -1)
    t_out, t_lse = _torch_decode(q, cache, cut, None)
    np.testing.assert_array_equal(np.asarray(out, np.float32), t_out)
    np.testing.assert_array_equal(np.asarray(lse), t_lse)


def test_fewer_heads_are_padded_to_the_kernels():
    kernels.ensure_cuda_targets()
    q, cache, indices = _problem(4, 3, 2, 64)
    q16 = q[:, :, :16]
    out, lse = sparse_mla_decode(q16, cache, indices, softmax_scale=SCALE,
                                 implementation="custom_call")
    assert out.shape == (3, 2, 16, 512) and lse.shape == (3, 16, 2)
    padded = jnp.pad(q16, ((0, 0), (0, 0), (0, 48), (0, 0)))
    t_out, t_lse = _torch_decode(padded, cache, indices, None)
    np.testing.assert_array_equal(np.asarray(out, np.float32), t_out[:, :, :16])
    np.testing.assert_array_equal(np.asarray(lse), t_lse[:, :16])


@pytest.mark.parametrize("s_q,h_q", [(1, 128), (2, 32)])
def test_a_layered_step_sharing_one_schedule_replays_with_new_inputs(s_q, h_q):
    """Six layers, jitted (enough custom calls for XLA's command buffer), their schedule one
    constant of the program, and no metadata kernel in it; called on new q and indices, and on
    buffers at new addresses: every layer bit-identical to sparse_decode_fwd from torch making
    its own schedule."""
    kernels.ensure_cuda_targets()
    layers, batch, topk = 6, 5, 256

    @jax.jit
    def step(qs, cache, indices):
        return [sparse_mla_decode(qs[i], cache, indices[i], softmax_scale=SCALE,
                                  implementation="custom_call") for i in range(layers)]

    def inputs(seed):
        problems = [_problem(seed * 100 + i, batch, s_q, 128, topk) for i in range(layers)]
        return (jnp.stack([p[0][:, :, :h_q] for p in problems]), problems[0][1],
                jnp.stack([p[2] for p in problems]))

    hlo = step.lower(*inputs(1)).compile().as_text()
    assert "jax_flashmla_mla_metadata" not in hlo
    pad = ((0, 0), (0, 0), (0, 128 - h_q if h_q > 64 else 64 - h_q), (0, 0))
    for seed in (1, 2, 1, 3):
        qs, cache, indices = inputs(seed)
        for i, (out, lse) in enumerate(step(qs, cache, indices)):
            t_out, t_lse = _torch_decode(jnp.pad(qs[i], pad), cache, indices[i], None)
            np.testing.assert_array_equal(np.asarray(out, np.float32), t_out[:, :, :h_q])
            np.testing.assert_array_equal(np.asarray(lse), t_lse[:, :h_q])


def test_a_step_reads_its_layers_rows_of_one_masked_stack_in_place():
    """A step masking its layers' indices once and handing each decode its layer's row
    (masked[i]): every custom call takes the whole stack (no slice of it, no dynamic-slice thunk in
    the compiled module), and each layer is bit-identical to sparse_decode_fwd from torch on
    its own indices, called again with new inputs."""
    kernels.ensure_cuda_targets()
    layers, batch, h_q, topk = 6, 5, 128, 256

    @jax.jit
    def step(qs, cache, indices):
        masked = mask_indices(indices, cache)
        return [sparse_mla_decode(qs[i], cache, masked[i], softmax_scale=SCALE,
                                  implementation="custom_call")
                for i in range(layers)]

    def inputs(seed):  # each layer's q its own array, as a step's layers make theirs
        problems = [_problem(seed * 100 + i, batch, 1, h_q, topk) for i in range(layers)]
        return ([p[0] for p in problems], problems[0][1], jnp.stack([p[2] for p in problems]))

    hlo = step.lower(*inputs(1)).compile().as_text()
    calls = [line for line in hlo.splitlines()
             if 'custom_call_target="jax_flashmla_mla_sparse_decode"' in line]
    assert len(calls) == layers, hlo
    assert all(f"s32[{layers},{batch},1,{topk}]" in line for line in calls), calls
    assert "dynamic_slice_fusion" not in hlo and "address_computation" not in hlo
    for seed in (1, 2):
        qs, cache, indices = inputs(seed)
        for i, (out, lse) in enumerate(step(qs, cache, indices)):
            t_out, t_lse = _torch_decode(qs[i], cache, indices[i], None)
            np.testing.assert_array_equal(np.asarray(out, np.float32), t_out)
            np.testing.assert_array_equal(np.asarray(lse), t_lse)


def _prefill_problem(seed, tokens, h_q, topk, keys=500):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(0, 1, (tokens, h_q, 576)), jnp.bfloat16)
    kv = jnp.asarray(rng.normal(0, 0.3, (keys, 576)), jnp.bfloat16)
    indices = rng.integers(-3, keys + 3, (tokens, topk)).astype(np.int32)  # a few invalid
    indices[1] = -1  # a query with no valid index
    return q, kv, jnp.asarray(indices)


def _torch_prefill(q, kv, indices, sink, lengths):
    """sparse_prefill_fwd from torch on what the custom call hands the kernel: q's heads padded
    to 64 or 128, invalid indices made -1, topk padded with -1 to a multiple of 128. Returns
    out and the natural lse (h_q, tokens) of the real heads."""
    import torch

    h_q, keys, topk = q.shape[1], kv.shape[0], indices.shape[1]
    heads = 64 if h_q <= 64 else 128
    valid = (indices >= 0) & (indices < keys)
    if lengths is not None:
        valid &= jnp.arange(topk)[None, :] < lengths[:, None]
    kernel_indices = jnp.pad(jnp.where(valid, indices, -1), ((0, 0), (0, -topk % 128)),
                             constant_values=-1)
    t_sink = None if sink is None else torch_view(torch, jnp.pad(sink, (0, heads - h_q)))
    op = getattr(torch.ops.sgl_kernel, "sparse_prefill_fwd")
    out, _, lse_base2 = op(torch_view(torch, jnp.pad(q, ((0, 0), (0, heads - h_q), (0, 0)))),
                           torch_view(torch, kv)[:, None, :],
                           torch_view(torch, kernel_indices)[:, None, :], SCALE, 512, t_sink,
                           None)
    torch.cuda.synchronize()
    natural = lse_base2.cpu().numpy()[:, :h_q] * np.float32(np.log(2))
    return out.float().cpu().numpy()[:, :h_q], natural.T


@pytest.mark.parametrize("tokens,h_q,topk,with_sink,with_length", [
    (70, 64, 128, False, False),
    (70, 128, 256, True, True), (33, 32, 100, False, True)])
def test_the_prefill_is_flashmlas_op_with_a_natural_lse(tokens, h_q, topk, with_sink,
                                                        with_length):
    kernels.ensure_cuda_targets()
    q, kv, indices = _prefill_problem(h_q, tokens, h_q, topk)
    rng = np.random.default_rng(topk)
    sink = jnp.asarray(rng.normal(0, 2, h_q), jnp.float32) if with_sink else None
    lengths = (jnp.asarray(rng.integers(0, topk + 1, tokens), jnp.int32) if with_length
               else None)
    prefill = jax.jit(functools.partial(sparse_mla_prefill, softmax_scale=SCALE,
                                        implementation="custom_call"))
    assert "jax_flashmla_mla_sparse_prefill" in prefill.lower(
        q, kv, indices, attn_sink=sink, topk_length=lengths).as_text()
    out, lse = jax.block_until_ready(prefill(q, kv, indices, attn_sink=sink,
                                             topk_length=lengths))
    t_out, t_lse = _torch_prefill(q, kv, indices, sink, lengths)
    np.testing.assert_array_equal(np.asarray(out, np.float32), t_out)
    np.testing.assert_array_equal(np.asarray(lse), t_lse)
    ref_out, ref_lse = sparse_mla_prefill(q, kv, indices, softmax_scale=SCALE, attn_sink=sink,
                                          topk_length=lengths, implementation="reference")
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref_out, np.float32),
                               **SPARSE_OUT_TOL)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), **SPARSE_LSE_TOL)


def test_a_float32_prefill_runs_the_kernel_in_bfloat16():
    """The custom call casts a float32 q and kv to bfloat16 (exact for these values) and its
    out back: the bfloat16 call's answer, and a second call with new inputs gives theirs."""
    kernels.ensure_cuda_targets()
    prefill = jax.jit(functools.partial(sparse_mla_prefill, softmax_scale=SCALE,
                                        implementation="custom_call"))
    for seed in (1, 2):
        q, kv, indices = _prefill_problem(seed, 40, 16, 128)
        out, lse = prefill(q.astype(jnp.float32), kv.astype(jnp.float32), indices)
        assert out.dtype == jnp.float32
        want_out, want_lse = prefill(q, kv, indices)
        np.testing.assert_array_equal(np.asarray(out), np.asarray(want_out, np.float32))
        np.testing.assert_array_equal(np.asarray(lse), np.asarray(want_lse))
