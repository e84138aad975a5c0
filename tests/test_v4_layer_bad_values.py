"""DeepSeek-V4's attention layer (jax_flashmla.flax.V4Attention) given bad values: what
one request brings stays in that request.

- A table entry past the cache (or negative) names no page: the request reads nothing there,
  in extend as in decode, never another request's rows (a gather past the cache would read
  its last page, another request's here).
- A length outside [0, s] makes its row empty: out 0, nothing stored, num_tokens kept.
- A NaN in one request's hidden states changes no other request's outputs.
Each case compares the other requests' outputs, bit for bit, with a run without the bad value;
the layers run their pure-JAX references (tests/test_gpu_v4_layer.py holds the kernels to
them).
"""
import dataclasses
import functools

import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_flashmla.flax import V4Attention, V4Config
from jax_flashmla.flax.v4_chunk import chunk_keys
from jax_flashmla.ops.compressor import CompressedEntries

CSA, HCA, SLIDING = V4Config.CSA, V4Config.HCA, V4Config.SLIDING

CONFIG = V4Config(hidden_size=64, num_heads=4, q_lora_rank=32, o_groups=2, o_lora_rank=16,
                  hca_ratio=16, index_n_heads=4, index_topk=8)
MAX_TOKENS = 256
PROMPT, CHUNK = 160, 24  # the prompt fills the 128-token ring; the chunk reads back into it


@functools.lru_cache(maxsize=None)
def _layer(layer_type):
    """(graphdef, state, call): a layer of seeded weights and its forms, jitted once."""
    layer = V4Attention(CONFIG, layer_type, rngs=nnx.Rngs(0))
    layer.sinks[...] = jax.random.normal(jax.random.key(1), layer.sinks.shape)
    graphdef, state = nnx.split(layer)

    @functools.partial(jax.jit, static_argnames="form")
    def call(state, x, cache, lengths, *, form):
        layer = nnx.merge(graphdef, state)
        if form == "decode":
            return layer.decode(x, cache, active=lengths > 0)
        return getattr(layer, form)(x, cache, lengths=lengths)

    return graphdef, state, call


def _cache(layer_type):
    """Two requests' cache, request 0 on the highest pages (those a gather past the cache
    would read)."""
    graphdef, state, _ = _layer(layer_type)
    cache = nnx.merge(graphdef, state).init_cache(2, MAX_TOKENS)
    flipped = {name: getattr(cache, name)[::-1] for name in ("window_table", "compressed_table")
               if getattr(cache, name) is not None}
    return dataclasses.replace(cache, **flipped)


def _hidden(seed, s):
    return jnp.asarray(np.random.default_rng(seed).normal(size=(2, s, CONFIG.hidden_size)),
                       jnp.float32)


@functools.lru_cache(maxsize=None)
def _prefilled(layer_type):
    """The cache after _run's prefill of _hidden(0, PROMPT)."""
    _, state, call = _layer(layer_type)
    return call(state, _hidden(0, PROMPT), _cache(layer_type),
                jnp.asarray([PROMPT, 100], jnp.int32), form="prefill")[1]


@functools.lru_cache(maxsize=None)
def _clean(layer_type):
    """_run on _hidden(0, PROMPT) with nothing bad: each call's out."""
    return _run(layer_type, _hidden(0, PROMPT))[0]


def _run(layer_type, prompts, after_prefill=lambda cache: cache, prompt_lengths=(PROMPT, 100),
         chunk_lengths=(CHUNK, 7)):
    """Prefill, extend by a chunk, two decode steps: each call's out (2, s, hidden) and the
    cache after them."""
    _, state, call = _layer(layer_type)
    outs = []
    out, cache = call(state, prompts, _cache(layer_type), jnp.asarray(prompt_lengths, jnp.int32),
                      form="prefill")
    outs.append(out)
    cache = after_prefill(cache)
    out, cache = call(state, _hidden(2, CHUNK), cache, jnp.asarray(chunk_lengths, jnp.int32),
                      form="extend")
    outs.append(out)
    for step in range(2):
        out, cache = call(state, _hidden(3 + step, 1), cache, jnp.ones((2,), jnp.int32),
                          form="decode")
        outs.append(out)
    return [np.asarray(o) for o in outs], cache


def _past_the_cache(cache):
    """Request 1's first ring page and first entry page named just past the cache (a page
    number whose slots still fit int32: token_slots makes larger ones -1)."""
    replaced = {"window_table": cache.window_table.at[1, 0].set(cache.window.data.shape[0] + 3)}
    if cache.compressed_table is not None:
        replaced["compressed_table"] = cache.compressed_table.at[1, 0].set(
            cache.compressed.data.shape[0])
    return dataclasses.replace(cache, **replaced)


@pytest.mark.parametrize("layer_type", [SLIDING, HCA, CSA])
def test_a_table_past_the_cache_reads_no_other_requests_rows(layer_type):
    prompts = _hidden(0, PROMPT)
    other = prompts.at[0].set(_hidden(1, PROMPT)[0])  # request 0's rows, all different
    runs = [_run(layer_type, p, _past_the_cache)[0] for p in (prompts, other)]
    clean = _clean(layer_type)
    for form, got, want, unharmed in zip(("extend", "decode", "decode"), runs[0][1:],
                                         runs[1][1:], clean[1:]):
        assert np.isfinite(got[1]).all(), form
        np.testing.assert_array_equal(got[1], want[1], err_msg=form)
        # Request 1 wrote nothing into request 0's pages either.
        np.testing.assert_array_equal(got[0], unharmed[0], err_msg=form)


def test_a_chunk_names_no_row_of_a_page_past_the_cache():
    """The extend's index rows (flax/v4_chunk.py) skip the ring slots and cached entries whose
    page request 1's tables name past the cache, as decode's masked indices skip them, rather
    than read a zero row in their place (which would join the softmax)."""
    _, state, call = _layer(HCA)
    _, cache = call(state, _hidden(0, PROMPT), _cache(HCA), jnp.asarray([PROMPT, 100], jnp.int32),
                    form="prefill")
    b, s, ring, capacity = 2, 3, cache.ring_size, cache.entry_capacity
    positions = cache.num_tokens[:, None] + jnp.arange(s, dtype=jnp.int32)
    ids = jnp.arange(capacity, dtype=jnp.int32)
    picked = jnp.broadcast_to(jnp.where(ids < positions[..., None] // CONFIG.hca_ratio, ids, -1),
                              (b, s, capacity))
    entries = CompressedEntries(jnp.zeros((b, 1, 512)), jnp.full((b, 1), -1, jnp.int32))
    ring_base = b * s  # the rows: the chunk's, the rings, the call's entries, the cached ones
    entry_base = ring_base + b * ring + b

    def named(cache):
        """Request 1's ring slots and cached entries that its index rows name."""
        keys = chunk_keys(jnp.zeros((b, s, 512)), positions, jnp.ones((b, s), bool), cache,
                          window=CONFIG.sliding_window, read_cache=True, entries=entries,
                          picked=picked)
        rows = np.asarray(keys.indices).reshape(b, s, -1)[1]
        in_ring = (rows >= ring_base + ring) & (rows < ring_base + 2 * ring)
        return rows[in_ring] - ring_base - ring, rows[rows >= entry_base + capacity] - (
            entry_base + capacity)

    ring_slots, cached = named(cache)
    assert (ring_slots // 64 == 0).any() and len(cached)  # pages 0 of both are read
    ring_slots, cached = named(_past_the_cache(cache))
    assert len(ring_slots) and not (ring_slots // 64 == 0).any()
    assert not len(cached)  # request 1's entries all sit on its first page


@pytest.mark.parametrize("layer_type", [SLIDING, HCA, CSA])
@pytest.mark.parametrize("bad", [-3, CHUNK + 1, np.iinfo(np.int32).max, np.iinfo(np.int32).min])
def test_a_length_outside_the_chunk_makes_its_row_empty(layer_type, bad):
    clean = _clean(layer_type)
    _, state, call = _layer(layer_type)
    cache = _prefilled(layer_type)
    got, after = call(state, _hidden(2, CHUNK), cache, jnp.asarray([CHUNK, bad], jnp.int32),
                      form="extend")
    assert not np.asarray(got[1]).any()
    np.testing.assert_array_equal(np.asarray(got[0]), clean[1][0])
    np.testing.assert_array_equal(np.asarray(after.num_tokens), [PROMPT + CHUNK, 100])
    for name in ("window", "compressed"):
        if getattr(cache, name) is not None:  # request 1's pages as the prefill left them
            pages = np.asarray(getattr(cache, f"{name}_table")[1])
            np.testing.assert_array_equal(np.asarray(getattr(after, name).data)[pages],
                                          np.asarray(getattr(cache, name).data)[pages])


@pytest.mark.parametrize("layer_type", [SLIDING, HCA, CSA])
def test_a_nan_token_stays_in_its_request(layer_type):
    clean = _clean(layer_type)
    poisoned, _ = _run(layer_type, _hidden(0, PROMPT).at[1, 40].set(jnp.nan))
    for form, got, want in zip(("prefill", "extend", "decode", "decode"), poisoned, clean):
        np.testing.assert_array_equal(got[0], want[0], err_msg=form)
    assert np.isnan(poisoned[0][1]).any()
