"""DeepSeek-V4's attention layer (jax_flashmla.flax.v4_mla.V4Attention) against HF
transformers' DeepseekV4Attention on CPU, per layer type (sliding, HCA): a batch of prompts of
different lengths (HF one request at a time, with its own cache), then decode steps that wrap
the window ring and complete compressed entries; the window and the compressor state carried
in the cache matter.

Tolerances:
  - prefill attends over the rows as computed, in float32, as HF: 2e-5 absolute on outputs of
    order 0.1-1 (torch's and XLA's matmuls and transcendental functions round differently);
  - decode reads K=V rows stored as FP8 (e4m3 with ue8m0 scales per 64 dims, RoPE dims in
    bf16) and its query and output pass through bf16 (FlashMLA's decode contract): a token's
    output differs from HF's by a relative L2 error (|ours - HF| / |HF|) of at most
    FP8_TOKEN_TOL, FP8_MEAN_TOL on average over tokens (V4's FP8 storage is known to move
    HF's outputs by ~0.033, at most ~0.072 on a token).
"""
import dataclasses

import flax.nnx as nnx
import jax.numpy as jnp
import numpy as np
import pytest

from v4_attention_hf import HCA, HIDDEN, LAYER_TYPES, SLIDING, HFLayers, config

from jax_flashmla.caches.compressor_state import CompressorState
from jax_flashmla.caches.v4 import V4KVCache
from jax_flashmla.flax.v4_config import V4Config
from jax_flashmla.flax.v4_mla import V4Attention
from jax_flashmla.flax.v4_weights import load_v4_attention_weights

PREFILL_TOL = dict(rtol=2e-5, atol=2e-5)
FP8_TOKEN_TOL = 0.1
FP8_MEAN_TOL = 0.05
KINDS = {"sliding": SLIDING, "hca": HCA}
STEPS = 24


def _tokens(seed, n):
    return np.random.default_rng(seed).normal(size=(n, HIDDEN)).astype(np.float32)


def _layer(hf, index):
    """Our layer of HF's layer `index`, its weights loaded from HF's state dict."""
    layer = V4Attention(V4Config.from_hf(hf.cfg), LAYER_TYPES[index], rngs=nnx.Rngs(0))
    return load_v4_attention_weights(layer, hf.state_dict(index), prefix="self_attn.")


@nnx.jit
def _prefill(layer, x, cache, lengths):
    return layer.prefill(x, cache, lengths=lengths)


@nnx.jit
def _extend(layer, x, cache, lengths):
    return layer.extend(x, cache, lengths=lengths)


@nnx.jit
def _decode(layer, x, cache, active):
    return layer.decode(x, cache, active=active)


def _relative_errors(ours, want):
    """Each token's |ours - want| / |want| (L2 over hidden)."""
    return np.linalg.norm(ours - want, axis=-1) / np.linalg.norm(want, axis=-1)


class Run:
    """A batch of requests fed to our layer and, a request at a time, to HF's."""

    def __init__(self, hf, index, prompt_lengths, max_tokens, seed=0):
        self.hf, self.index = hf, index
        self.layer = _layer(hf, index)
        self.cache = self.layer.init_cache(len(prompt_lengths), max_tokens)
        self.requests = [hf.request() for _ in prompt_lengths]
        self.lengths = list(prompt_lengths)
        self.rng = np.random.default_rng(seed)

    def prefill(self, lengths=None, form=_prefill):
        """Feeds each request `lengths` new tokens (default the prompt lengths) padded with
        noise, through form (_prefill or _extend); returns (ours, HF's), each a list of (n,
        hidden) float64 arrays."""
        lengths = self.lengths if lengths is None else lengths
        s = max(1, max(lengths))
        x = self.rng.normal(size=(len(lengths), s, HIDDEN)).astype(np.float32)
        out, self.cache = form(self.layer, jnp.asarray(x), self.cache,
                               jnp.asarray(lengths, jnp.int32))
        out = np.asarray(out, np.float64)
        ours = [out[b, :n] for b, n in enumerate(lengths)]
        want = [self.hf.feed(r, x[b, :n])[self.index] if n else np.zeros((0, HIDDEN))
                for b, (r, n) in enumerate(zip(self.requests, lengths))]
        assert not np.any(out[np.arange(s)[None] >= np.asarray(lengths)[:, None]])
        return ours, want

    def step(self, active=None):
        """One decode step of the active requests (default all); returns (ours, HF's), each
        (active requests, hidden) float64. Idle rows must come out 0."""
        active = np.ones(len(self.lengths), bool) if active is None else np.asarray(active)
        x = self.rng.normal(size=(len(self.lengths), 1, HIDDEN)).astype(np.float32)
        out, self.cache = _decode(self.layer, jnp.asarray(x), self.cache, jnp.asarray(active))
        out = np.asarray(out[:, 0], np.float64)
        assert not np.any(out[~active])
        want = np.stack([self.hf.feed(r, x[b])[self.index][0]
                         for b, r in enumerate(self.requests) if active[b]])
        return out[active], want


@pytest.fixture(scope="module")
def hf():
    return HFLayers(config())


def test_ropes_are_hfs(hf):
    cfg = V4Config.from_hf(hf.cfg)
    for layer_type, kind in ((LAYER_TYPES[SLIDING], "main"), (LAYER_TYPES[HCA], "compress")):
        inv_freq, factor = cfg.rope(layer_type)
        np.testing.assert_allclose(inv_freq, getattr(hf.rotary, f"{kind}_inv_freq").numpy(),
                                   rtol=1e-6)
        assert factor == getattr(hf.rotary, f"{kind}_attention_scaling")


@pytest.mark.parametrize("kind", list(KINDS))
def test_prefill_of_a_batch_equals_hf(hf, kind):
    # Past the window (150 > 128), between, and one token; HCA's ratio is 16.
    run = Run(hf, KINDS[kind], [150, 37, 1], max_tokens=160)
    ours, want = run.prefill()
    for o, w in zip(ours, want):
        np.testing.assert_allclose(o, w, **PREFILL_TOL)
    np.testing.assert_array_equal(run.cache.num_tokens, run.lengths)


@pytest.mark.parametrize("kind", list(KINDS))
def test_decode_steps_equal_hf(hf, kind):
    # 120 + 24 wraps the 128-token ring during decode; 150 has wrapped it already; 5 stays
    # short of one HCA window until step 11.
    run = Run(hf, KINDS[kind], [120, 150, 5], max_tokens=200, seed=1)
    run.prefill()
    errors = []
    for _ in range(STEPS):
        ours, want = run.step()
        errors.append(_relative_errors(ours, want))
    errors = np.array(errors)
    assert errors.max() < FP8_TOKEN_TOL, errors.max()
    assert errors.mean() < FP8_MEAN_TOL, errors.mean()
    np.testing.assert_array_equal(run.cache.num_tokens, np.asarray(run.lengths) + STEPS)


@pytest.mark.parametrize("kind", list(KINDS))
def test_extend_from_nothing_is_prefill(hf, kind):
    runs = [Run(hf, KINDS[kind], [150, 37, 1], max_tokens=160) for _ in range(2)]
    (prefilled, _), (extended, _) = runs[0].prefill(), runs[1].prefill(form=_extend)
    for a, b in zip(prefilled, extended):
        np.testing.assert_allclose(a, b, **PREFILL_TOL)


@pytest.mark.parametrize("kind", list(KINDS))
def test_chunks_then_decode_equal_hf(hf, kind):
    """Prompts fed in chunks of different sizes a request (a request idle in a chunk: length
    0), each chunk over the cache the earlier ones left, then decode steps."""
    run = Run(hf, KINDS[kind], [37, 5, 0], max_tokens=400, seed=3)
    errors = []
    for lengths in ([37, 5, 0], [100, 0, 130], [1, 140, 17], [64, 3, 0]):
        ours, want = run.prefill(lengths, form=_extend)
        errors += [_relative_errors(o, w) for o, w in zip(ours, want) if len(w)]
    for step in range(8):  # the last request idle every other step
        errors.append(_relative_errors(*run.step([True, True, step % 2 == 0])))
    errors = np.concatenate(errors)
    assert errors.max() < FP8_TOKEN_TOL, errors.max()
    assert errors.mean() < FP8_MEAN_TOL, errors.mean()
    np.testing.assert_array_equal(run.cache.num_tokens, [210, 156, 151])


@pytest.mark.parametrize("dropped", ["window", "compressor"])
def test_decode_needs_what_the_cache_carries(hf, dropped):
    """The same run with the window's rows or the compressor's unfinished window wiped after
    prefill strays from HF beyond the FP8 tolerance: both are read."""
    # 40 tokens: 8 wait in the compressor's unfinished window; step 8 completes an entry.
    run = Run(hf, HCA, [40], max_tokens=64, seed=2)
    run.prefill()
    if dropped == "window":
        wiped = dict(window=V4KVCache.create(run.cache.window.data.shape[0]))
    else:
        state = run.cache.compressor
        wiped = dict(compressor=CompressorState(
            window_kv=jnp.zeros_like(state.window_kv),
            window_gate=jnp.zeros_like(state.window_gate), overlap_kv=None, overlap_gate=None,
            num_tokens=state.num_tokens))
    run.cache = dataclasses.replace(run.cache, **wiped)
    errors = np.concatenate([_relative_errors(*run.step()) for _ in range(10)])
    assert errors.max() > FP8_TOKEN_TOL, errors


def test_hca_at_v4s_ratio():
    """HCA at ratio 128: a prompt of 250 (one entry, 122 tokens waiting), then decode steps
    that complete the second entry at token 256."""
    run = Run(HFLayers(config(hca_ratio=128)), HCA, [250, 3], max_tokens=300, seed=4)
    ours, want = run.prefill()
    for o, w in zip(ours, want):
        np.testing.assert_allclose(o, w, **PREFILL_TOL)
    errors = np.concatenate([_relative_errors(*run.step()) for _ in range(10)])
    assert errors.max() < FP8_TOKEN_TOL, errors.max()
    assert int(run.cache.compressor.entry_count[0]) == 2


def test_compressed_sparse_attention_needs_the_indexer(hf):
    with pytest.raises(NotImplementedError, match="indexer"):
        V4Attention(V4Config.from_hf(hf.cfg), "compressed_sparse_attention", rngs=nnx.Rngs(0))


def test_weights_must_fit(hf):
    layer = V4Attention(V4Config.from_hf(hf.cfg), LAYER_TYPES[HCA], rngs=nnx.Rngs(0))
    weights = hf.state_dict(HCA)
    with pytest.raises(KeyError, match="compressor.position_bias"):
        load_v4_attention_weights(layer, {k: v for k, v in weights.items()
                                          if "position_bias" not in k}, prefix="self_attn.")
    with pytest.raises(ValueError, match="sinks"):
        load_v4_attention_weights(layer, {**weights, "self_attn.sinks": np.zeros(3)},
                                  prefix="self_attn.")
