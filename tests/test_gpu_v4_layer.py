"""DeepSeek-V4's attention layer (jax_flashmla.flax.V4Attention) with FlashMLA's kernels
beneath it on a Hopper GPU: prefill, extends and decode steps with implementation="custom_call"
against implementation="reference" on the same weights and tokens, per layer type, at a small
V4-like configuration of 64 heads (the kernels' own count) in bf16, a batch of three requests
of different lengths with idle rows.

The caches the two leave are the same bit for bit after every call: what a call stores depends
on no attention. The outputs agree within bf16's rounding: both take q and the rows in bf16 and
give bf16, the kernels rounding the softmax's weights to bf16 before they weigh the rows where
the references stay in float32 (2**-9 relative each); a token's relative L2 difference after
the output projection is at most TOKEN_TOL, MEAN_TOL on average. A CSA layer's indexer scores
with the same implementation (its CUDA kernel against pure JAX, float32 sums in other orders),
so a token whose selections differ between the two (a near-tie) is left out of the comparison;
such tokens must be few.
"""
import functools

import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_flashmla.flax import V4Attention, V4Config
from jax_flashmla.kernels import custom_calls
from jax_flashmla.kernels import library as kernels

CSA, HCA, SLIDING = V4Config.CSA, V4Config.HCA, V4Config.SLIDING

pytestmark = pytest.mark.gpu
CONFIG = V4Config(hidden_size=512, num_heads=64, q_lora_rank=128, o_groups=8, o_lora_rank=64,
                  sliding_window=128, csa_ratio=4, hca_ratio=16, index_n_heads=16,
                  index_topk=32)
IMPLEMENTATIONS = ("custom_call", "reference")
TOKEN_TOL, MEAN_TOL = 0.03, 0.008
MAX_TOKENS = 320
# Each call: (form, each request's new tokens (a decode step: 1 active, 0 idle), padded to).
# Request 0 wraps the 128-token ring within the prompt, request 1 in the second extend;
# request 2 sits the prompt out and idles every other decode step.
CALLS = ([("prefill", [150, 37, 0], 150), ("extend", [129, 3, 64], 129),
          ("extend", [1, 130, 37], 130)]
         + [("decode", [1, 1, step % 2], 1) for step in range(6)])


def _layer(layer_type, seed=0):
    """A bf16 layer of random weights, its sinks N(0, 1) (zero sinks would hide them)."""
    layer = V4Attention(CONFIG, layer_type, rngs=nnx.Rngs(seed), dtype=jnp.bfloat16,
                        param_dtype=jnp.bfloat16)
    layer.sinks[...] = jax.random.normal(jax.random.key(seed + 1), layer.sinks.shape)
    return layer


def _functions(graphdef):
    """(call, select): jitted over the layer's state, the form and implementation static."""

    @functools.partial(jax.jit, static_argnames=("form", "implementation"))
    def call(state, x, cache, lengths, *, form, implementation):
        layer = nnx.merge(graphdef, state)
        if form == "decode":
            return layer.decode(x, cache, active=lengths > 0, implementation=implementation)
        return getattr(layer, form)(x, cache, lengths=lengths, implementation=implementation)

    @functools.partial(jax.jit, static_argnames=("implementation",))
    def select(state, x, cache, lengths, *, implementation):
        layer = nnx.merge(graphdef, state)
        return layer.select_entries(x, cache, lengths=lengths,
                                    implementation=implementation)[0].entries

    return call, select


@pytest.mark.parametrize("layer_type", [SLIDING, HCA, CSA])
def test_the_kernels_path_is_the_references(layer_type):
    kernels.ensure_cuda_targets()
    graphdef, state = nnx.split(_layer(layer_type))
    call, select = _functions(graphdef)
    caches = {i: nnx.merge(graphdef, state).init_cache(3, MAX_TOKENS) for i in IMPLEMENTATIONS}
    rng = np.random.default_rng(1)
    errors, differing, tokens = [], 0, 0
    for number, (form, lengths, s) in enumerate(CALLS):
        x = jnp.asarray(rng.normal(size=(3, s, CONFIG.hidden_size)), jnp.bfloat16)
        lengths = jnp.asarray(lengths, jnp.int32)
        if number == 0:
            lowered = call.lower(state, x, caches["custom_call"], lengths, form=form,
                                 implementation="custom_call").as_text()
            assert custom_calls.SPARSE_PREFILL.target in lowered
        same = np.ones((3, s), bool)
        if layer_type == CSA:
            picks = [np.asarray(select(state, x, caches[i], lengths, implementation=i))
                     for i in IMPLEMENTATIONS]
            same = (picks[0] == picks[1]).all(-1)
        outs = {}
        for i in IMPLEMENTATIONS:
            outs[i], caches[i] = call(state, x, caches[i], lengths, form=form, implementation=i)
        for got, want in zip(jax.tree.leaves(caches["custom_call"]),
                             jax.tree.leaves(caches["reference"])):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=form)
        got, want = (np.asarray(outs[i], np.float64) for i in IMPLEMENTATIONS)
        real = np.arange(s) < np.asarray(lengths)[:, None]
        assert not got[~real].any() and not want[~real].any(), form
        kept = real & same
        errors.append(np.linalg.norm(got[kept] - want[kept], axis=-1)
                      / np.linalg.norm(want[kept], axis=-1))
        differing += int((real & ~same).sum())
        tokens += int(real.sum())
    errors = np.concatenate(errors)
    assert errors.max() < TOKEN_TOL, errors.max()
    assert errors.mean() < MEAN_TOL, errors.mean()
    assert differing < tokens / 8, (differing, tokens)
    assert len(errors) + differing == tokens == 150 + 37 + 129 + 3 + 64 + 1 + 130 + 37 + 15
    np.testing.assert_array_equal(caches["custom_call"].num_tokens, [286, 176, 104])
