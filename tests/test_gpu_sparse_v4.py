"""DeepSeek-V4's sparse decode as jax_flashmla's custom call on a Hopper GPU: bit-identical to
FlashMLA's sparse_decode_fwd (its MODEL1 kernel) called from torch on the same bytes, making its
own schedule, at odd shapes (window-only, compressed-only and empty rows, sinks of +-inf,
heads padded to the kernel's); within tolerance of the pure-JAX reference; one schedule for the
layers of a step that share their lengths; the same when the step is called again."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import SPARSE_LSE_TOL, SPARSE_OUT_TOL, torch_view
from jax_flashmla.caches.v4 import V4KVCache
from jax_flashmla.kernels import custom_calls
from jax_flashmla.kernels import library as kernels
from jax_flashmla.ops import sparse_v4
from jax_flashmla.sparse import sparse_mla_decode, sparse_mla_prefill, write_sparse_kv

pytestmark = pytest.mark.gpu
SCALE = 512 ** -0.5


def _cache(rng, pages):
    rows = jnp.asarray(rng.normal(0, 0.3, (pages * 64, 512)), jnp.float32)
    return write_sparse_kv(V4KVCache.create(pages), jnp.arange(pages * 64, dtype=jnp.int32),
                           rows)


def _problem(seed, batch, s_q, h_q, topk, window, sink):
    rng = np.random.default_rng(seed)
    cache, extra = _cache(rng, 9), _cache(rng, 3)
    indices = rng.integers(0, 9 * 64, (batch, s_q, topk)).astype(np.int32)
    indices[:, 0, ::7] = -1
    indices[-1, -1, 2] = 9 * 64 + 5  # past the cache
    extra_indices = rng.integers(0, 3 * 64, (batch, s_q, window)).astype(np.int32)
    indices[0] = -1  # request 0: window keys only
    if batch > 1:
        extra_indices[1] = -1  # request 1: compressed keys only
    if batch > 2:
        indices[2, -1] = extra_indices[2, -1] = -1  # request 2's last query: no key
    lengths = rng.integers(0, topk + 1, batch).astype(np.int32)
    extra_lengths = rng.integers(0, window + 1, batch).astype(np.int32)
    attn_sink = None
    if sink != "none":
        attn_sink = rng.normal(0, 2, h_q).astype(np.float32)
        if sink == "infinite":
            attn_sink[:2] = [np.inf, -np.inf]
        attn_sink = jnp.asarray(attn_sink)
    q = jnp.asarray(rng.normal(0, 1, (batch, s_q, h_q, 512)), jnp.bfloat16)
    return dict(q=q, kv_cache=cache, indices=jnp.asarray(indices),
                topk_length=jnp.asarray(lengths), attn_sink=attn_sink, extra_kv_cache=extra,
                extra_indices=jnp.asarray(extra_indices),
                extra_topk_length=jnp.asarray(extra_lengths))


def _kernel_view(torch, cache):
    pages = cache.data.shape[0]
    return torch_view(torch, cache.data).view(torch.float8_e4m3fn).as_strided(
        (pages, 64, 1, 584), (65 * 576, 584, 584, 1))


def _torch_decode(p):
    """sparse_decode_fwd from torch, making its own schedule, on what the custom call hands the
    kernel: indices masked and padded to 64, lengths clamped, q and the sink padded to 64 or
    128 heads. Returns out and lse (its heads), and the op's schedule."""
    import torch

    h_q = p["q"].shape[2]
    heads = 64 if h_q <= 64 else 128
    pad_to = lambda x, n: jnp.pad(x, ((0, 0), (0, 0), (0, -x.shape[-1] % n)), constant_values=-1)
    indices, lengths = sparse_v4.masked_indices(p["indices"], p["topk_length"], 9)
    extra, extra_lengths = sparse_v4.masked_indices(p["extra_indices"],
                                                    p["extra_topk_length"], 3)
    q = jnp.pad(p["q"], ((0, 0), (0, 0), (0, heads - h_q), (0, 0)))
    sink = None if p["attn_sink"] is None else torch_view(
        torch, jnp.pad(p["attn_sink"], (0, heads - h_q)))
    out, lse, tile_md, splits = torch.ops.sgl_kernel.sparse_decode_fwd(
        torch_view(torch, q), _kernel_view(torch, p["kv_cache"]),
        torch_view(torch, pad_to(indices, 64)), torch_view(torch, lengths), sink, None, None,
        _kernel_view(torch, p["extra_kv_cache"]), torch_view(torch, pad_to(extra, 64)),
        torch_view(torch, extra_lengths), 512, SCALE)
    torch.cuda.synchronize()
    return (out[:, :, :h_q].float().cpu().numpy(), lse[:, :h_q].cpu().numpy(),
            tile_md.cpu().numpy(), splits.cpu().numpy(), lengths, extra_lengths, heads)


CASES = [(1, 1, 64, 128, 128, "finite"), (3, 2, 128, 512, 128, "infinite"),
         (17, 1, 16, 512, 128, "none"), (131, 2, 32, 64, 128, "finite"),
         (5, 1, 128, 200, 70, "infinite"), (64, 2, 64, 512, 128, "finite")]


@pytest.mark.parametrize("batch,s_q,h_q,topk,window,sink", CASES)
def test_the_custom_call_is_flashmlas_op_bit_for_bit(batch, s_q, h_q, topk, window, sink):
    kernels.ensure_cuda_targets()
    p = _problem(batch * 10 + s_q, batch, s_q, h_q, topk, window, sink)
    decode = jax.jit(functools.partial(sparse_mla_decode, softmax_scale=SCALE,
                                       implementation="custom_call"))
    assert custom_calls.SPARSE_DECODE_V4.target in decode.lower(**p).as_text()
    out, lse = decode(**p)
    t_out, t_lse, t_rows, t_splits, lengths, extra_lengths, heads = _torch_decode(p)
    np.testing.assert_array_equal(np.asarray(out, np.float32), t_out)
    np.testing.assert_array_equal(np.asarray(lse), t_lse)
    # The schedule the op made for itself is the metadata call's over the combined lengths.
    rows, splits = custom_calls.schedule(
        sparse_v4.scheduled_lengths(lengths, extra_lengths), num_heads_q=heads, num_q_tokens=s_q,
        num_sm_parts=t_rows.shape[0], fp8=False)
    np.testing.assert_array_equal(np.asarray(splits), t_splits)
    np.testing.assert_array_equal(np.asarray(rows)[:, :7], t_rows[:, :7])
    reference = sparse_mla_decode(**p, softmax_scale=SCALE, implementation="reference")
    np.testing.assert_allclose(np.asarray(out, np.float32),
                               np.asarray(reference[0], np.float32), **SPARSE_OUT_TOL)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(reference[1]), **SPARSE_LSE_TOL)
    assert np.all(np.isposinf(np.asarray(lse)) == np.isposinf(np.asarray(reference[1])))
    if sink == "infinite":
        assert not np.asarray(out[:, :, 0]).any()


def test_a_step_shares_one_schedule_and_replays_with_new_inputs():
    """Four layers sharing their lengths, jitted: one metadata call in the compiled module
    (XLA merges the layers'), and every layer bit-identical to torch's op on new inputs."""
    kernels.ensure_cuda_targets()
    layers = 4

    @jax.jit
    def step(qs, p):
        return [sparse_mla_decode(**{**p, "q": qs[i]}, softmax_scale=SCALE,
                                  implementation="custom_call") for i in range(layers)]

    def inputs(seed):
        p = _problem(seed, 16, 1, 64, 512, 128, "finite")
        rng = np.random.default_rng(seed + 1)
        qs = jnp.asarray(rng.normal(0, 1, (layers, 16, 1, 64, 512)), jnp.bfloat16)
        return qs, p

    hlo = step.lower(*inputs(1)).compile().as_text()
    assert hlo.count(f'custom_call_target="{custom_calls.METADATA.target}"') == 1, hlo
    assert hlo.count(f'custom_call_target="{custom_calls.SPARSE_DECODE_V4.target}"') == layers
    for seed in (1, 2, 1):
        qs, p = inputs(seed)
        for i, (out, lse) in enumerate(step(qs, p)):
            t_out, t_lse, *_ = _torch_decode({**p, "q": qs[i]})
            np.testing.assert_array_equal(np.asarray(out, np.float32), t_out)
            np.testing.assert_array_equal(np.asarray(lse), t_lse)


@pytest.mark.parametrize("tokens,h_q,keys,topk,with_sink", [(64, 64, 1000, 512, True),
                                                             (130, 128, 4096, 200, False),
                                                             (7, 32, 300, 128, True)])
def test_the_v4_prefill_is_flashmlas_op_bit_for_bit(tokens, h_q, keys, topk, with_sink):
    """sparse_mla_prefill on 512-wide rows against sparse_prefill_fwd from torch (d_qk 512,
    sink, topk lengths) on what the custom call hands it: heads padded to 64 or 128, topk to
    128 with -1, invalid indices -1, the lengths; its lse in base 2 made natural."""
    import torch

    kernels.ensure_cuda_targets()
    rng = np.random.default_rng(tokens)
    q = jnp.asarray(rng.normal(0, 1, (tokens, h_q, 512)), jnp.bfloat16)
    kv = jnp.asarray(rng.normal(0, 0.3, (keys, 512)), jnp.bfloat16)
    indices = rng.integers(0, keys, (tokens, topk)).astype(np.int32)
    indices[0] = -1
    indices[-1, :3] = [-5, keys, 2 ** 31 - 1]
    lengths = rng.integers(0, topk + 1, tokens).astype(np.int32)
    lengths[1:3] = [topk + 1000, -3]  # clamped to [0, topk] before the kernel gets them
    lengths = jnp.asarray(lengths)
    sink = jnp.asarray(rng.normal(0, 2, h_q), jnp.float32) if with_sink else None
    prefill = jax.jit(functools.partial(sparse_mla_prefill, softmax_scale=SCALE,
                                        implementation="custom_call"))
    out, lse = prefill(q, kv, jnp.asarray(indices), topk_length=lengths, attn_sink=sink)
    heads = 64 if h_q <= 64 else 128
    clamped = np.clip(np.asarray(lengths), 0, topk)
    valid = (indices >= 0) & (indices < keys) & (np.arange(topk) < clamped[:, None])
    kernel_indices = np.pad(np.where(valid, indices, -1), ((0, 0), (0, -topk % 128)),
                            constant_values=-1)
    t_out, _, t_lse = torch.ops.sgl_kernel.sparse_prefill_fwd(
        torch_view(torch, jnp.pad(q, ((0, 0), (0, heads - h_q), (0, 0)))),
        torch_view(torch, kv[:, None, :]), torch_view(torch, jnp.asarray(kernel_indices)[:, None]),
        SCALE, 512, None if sink is None else torch_view(torch, jnp.pad(sink, (0, heads - h_q))),
        torch_view(torch, jnp.asarray(clamped)))
    torch.cuda.synchronize()
    np.testing.assert_array_equal(np.asarray(out, np.float32),
                                  t_out[:, :h_q].float().cpu().numpy())
    np.testing.assert_array_equal(np.asarray(lse),
                                  (t_lse[:, :h_q] * np.log(2)).T.cpu().numpy())
    reference = sparse_mla_prefill(q, kv, jnp.asarray(indices), topk_length=lengths,
                                   attn_sink=sink, softmax_scale=SCALE,
                                   implementation="reference")
    np.testing.assert_allclose(np.asarray(out, np.float32),
                               np.asarray(reference[0], np.float32), **SPARSE_OUT_TOL)
