"""DeepSeek-V4's lightning indexer (CSA layers) in JAX, on V3.2's FP8 index-key cache.

As HF transformers' DeepseekV4Indexer, for a request's query at position p over its indexer
compressor's entries (jax_flashmla.ops.compressor, ratio r = 4, 128 dims in V4):
  - q = q_b_proj(q_residual) as (heads, 128), q_residual the main attention's normalised
    q-latent (q_a_norm(q_a_proj(x))); q itself is not normalised; V4's interleaved RoPE (the
    compress rope) on its trailing dims at p, as the compressor ropes its entries;
  - w_h = weights_proj(x)_h * heads**-0.5; score(p, j) = 128**-0.5 * sum_h w_h relu(q_h . k_j);
  - the query sees entries j < (p + 1) // r (the windows it has read to the end, HF's causal
    threshold) and keeps its top min(topk, visible) of them; HF's -1 for the picks it masks
    (entries that a later query of the same chunk completed) is the -1 padding here.
HF keeps q and the entries unquantized. Here, as V3.2's indexer stores its keys, both are
turned by the Hadamard matrix / sqrt(128) (orthonormal: every q . k stays, outliers spread) and
quantized to e4m3 with a power-of-two scale per head of q and per entry (caches/index_keys.py),
so the entries live in an IndexKeyCache (132 bytes an entry, not a bf16 row's 256) and are
scored and selected by V3.2's index_topk (its CUDA kernels on a Hopper GPU). The scores are
HF's but for that rounding (e4m3 has 3 mantissa bits: a few percent of the largest score), so
the selections are HF's but for entries whose exact scores lie that close.
Entry j of a request lives at token_slots(block_table, j): a request's index-key pages hold
its entries, 64 a page, as the main CSA cache holds the compressor's.

Why not indexer_decode / indexer_prefill: a V3.2 token sees its prefix and itself, one more
than the token before it (seq_lens - s_q + j + 1), a V4 query (p + 1) // r entries, and they
return slots only, from which the entry indices cannot be had without inverting the block
table. index_topk takes each row's visible count as given and returns positions, here entry
indices; equal scores keep the earlier entry.
"""
import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jax_flashmla.base import validation
from jax_flashmla.base.validation import PAGE_SIZE, fail
from jax_flashmla.caches.index_keys import (INDEX_HEAD_DIM, index_cache_array,
                                            quantize_index_keys, write_index_keys)
from jax_flashmla.caches.paged import token_slots
from jax_flashmla.ops import compressor
from jax_flashmla.ops.indexer import HADAMARD, HIGHEST, IndexQuery, index_topk

# The query's weights -> their names under HF's "model.layers.<i>.self_attn.compressor.indexer."
# (the compressor's own under the same prefix: compressor.HF_NAMES).
HF_NAMES = {"wq_b": "q_b_proj.weight", "weights_proj": "scorer.weights_proj.weight"}


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=[*HF_NAMES, "compressor"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class V4IndexerWeights:
    """One CSA layer's indexer weights in HF's layout: wq_b (heads * 128, q_lora_rank),
    weights_proj (heads, hidden), compressor the CompressorWeights of its own compressor
    (kv_proj and gate_proj (256, hidden), position_bias (r, 256), kv_norm (128,))."""

    wq_b: jax.Array
    weights_proj: jax.Array
    compressor: compressor.CompressorWeights

    @classmethod
    def from_state_dict(cls, state_dict, eps, prefix=""):
        """From arrays (NumPy or JAX) under HF's names, each prefix + its HF name; eps: HF's
        config.rms_norm_eps (the compressor's RMSNorm)."""
        return cls(**{field: jnp.asarray(state_dict[prefix + name])
                      for field, name in HF_NAMES.items()},
                   compressor=compressor.CompressorWeights.from_state_dict(state_dict, eps,
                                                                           prefix))

    @property
    def num_heads(self):
        return self.weights_proj.shape[0]


class V4Selection(NamedTuple):
    """Each query's selected entries, ascending, -1 after them: entries (..., topk) int32,
    the entry indices in their request; slots (..., topk) int32, their slots through the
    block table (page * 64 + offset, sparse_mla_decode's indices), -1 where entries is and
    where the table names no page of the cache (such an entry is not selected either)."""

    entries: jax.Array
    slots: jax.Array


def _check_weights(where, weights):
    if not isinstance(weights, V4IndexerWeights):
        fail(TypeError, where, f"weights must be V4IndexerWeights; got {type(weights).__name__}")
    heads = weights.num_heads
    if weights.compressor.head_dim != INDEX_HEAD_DIM or not weights.compressor.overlap \
            or weights.wq_b.shape[0] != heads * INDEX_HEAD_DIM:
        fail(ValueError, where, f"the indexer must be {INDEX_HEAD_DIM} wide (V4's index_head_dim"
                                f", what the IndexKeyCache holds) with an overlapping compressor:"
                                f" wq_b ({heads * INDEX_HEAD_DIM}, q_lora_rank), kv_norm "
                                f"({INDEX_HEAD_DIM},); got wq_b {tuple(weights.wq_b.shape)}, "
                                f"kv_norm {tuple(weights.compressor.kv_norm.shape)}")


def _rotate(x):
    """(..., 128) -> float32 times the Hadamard matrix / sqrt(128)."""
    return jnp.matmul(x.astype(jnp.float32), HADAMARD, precision=HIGHEST) * INDEX_HEAD_DIM ** -0.5


def v4_index_query(weights, x, q_residual, positions, inv_freq, attention_scaling=1.0):
    """The indexer's queries of new tokens, as V3.2's IndexQuery.

    Args:
      weights: V4IndexerWeights.
      x: (..., hidden) the layer's input; q_residual: (..., q_lora_rank) the main attention's
        q_a_norm(q_a_proj(x)), in x's dtype (HF's q_residual).
      positions: int32 of x's leading shape, the tokens' positions in their requests.
      inv_freq: (rope_dim // 2,) float32, the compress rope's frequencies; attention_scaling:
        the factor on its cos and sin (both as compress takes them).

    Returns:
      IndexQuery: values (..., heads, 128) float8_e4m3fn, q rotated and quantized a head at a
      time; weights (..., heads) float32, w_h * 128**-0.5 times that head's scale. q and w_h
      are computed in x's dtype (q's RoPE in float32), as HF does, float32 at float32's
      precision.
    """
    where = "v4_index_query"
    _check_weights(where, weights)
    validation.check_int32(where, "positions", positions)
    lead = tuple(x.shape[:-1])
    if tuple(positions.shape) != lead or tuple(q_residual.shape) != lead + weights.wq_b.shape[1:]:
        fail(ValueError, where, f"positions must have x's leading shape {lead} and q_residual "
                                f"{lead + weights.wq_b.shape[1:]}; got "
                                f"{tuple(positions.shape)}, {tuple(q_residual.shape)}")
    q = jnp.einsum("...r,or->...o", q_residual, weights.wq_b.astype(q_residual.dtype),
                   precision=HIGHEST)
    q = q.reshape(*lead, weights.num_heads, INDEX_HEAD_DIM)
    # The compressor's own RoPE, so that queries and entries turn alike (HF's one rotary).
    q = compressor.interleaved_rope(q, positions[..., None], inv_freq, attention_scaling)
    values, q_scales = quantize_index_keys(_rotate(q))
    w = jnp.einsum("...i,hi->...h", x, weights.weights_proj.astype(x.dtype), precision=HIGHEST)
    head_weights = w.astype(jnp.float32) * weights.num_heads ** -0.5 * INDEX_HEAD_DIM ** -0.5
    return IndexQuery(values, head_weights * q_scales)


def write_v4_index_keys(cache, block_table, compressed):
    """Stores the indexer compressor's new entries, rotated and quantized, at their slots.

    Args:
      cache: IndexKeyCache or its (num_pages, 8448) uint8 array.
      block_table: (batch, max_pages) int32, each request's index-key pages.
      compressed: CompressedEntries of the indexer's compressor (compress's first result):
        entries (batch, n, 128), entry_ids (batch, n) (-1: no entry, not written).

    Returns:
      The updated cache (write_index_keys: entries whose slot is not in the cache are dropped;
      in place under jit with the cache donated).
    """
    where = "write_v4_index_keys"
    validation.check_rank(where, "block_table", block_table, 2, "(batch, max_pages)")
    entries, entry_ids = compressed
    if entries.shape[-1:] != (INDEX_HEAD_DIM,) or entry_ids.shape != entries.shape[:-1] \
            or entries.shape[:1] != block_table.shape[:1]:
        fail(ValueError, where, f"compressed must hold entries (batch, n, {INDEX_HEAD_DIM}) and "
                                f"entry_ids (batch, n) for block_table's batch "
                                f"{block_table.shape[0]}; got {tuple(entries.shape)}, "
                                f"{tuple(entry_ids.shape)}")
    return write_index_keys(cache, token_slots(block_table, entry_ids), _rotate(entries), where)


def visible_entries(start, lengths, seq_len, ratio):
    """(batch, seq_len) int32: how many entries new token j of each request sees, (p + 1) //
    ratio at its position p = start + j, without wrapping int32 (so a start near 2**31 sees
    every entry it has); 0 for j >= lengths (padding), and for a whole request whose start is
    negative or whose lengths is outside [0, seq_len]."""
    j = jnp.arange(seq_len, dtype=jnp.int32)
    good = (start >= 0) & (lengths >= 0) & (lengths <= seq_len)
    start = jnp.maximum(start, 0)[:, None]
    visible = start // ratio + (start % ratio + j + 1) // ratio
    return jnp.where(good[:, None] & (j < lengths[:, None]), visible, 0)


def v4_indexer_select(query, cache, block_table, start, lengths, *, ratio, topk,
                      implementation=None):
    """The compressed entries each new token of a padded batch of requests attends to.

    A decode step is seq_len 1 (2 with a draft token), lengths all seq_len; a prefill or an
    extend is a chunk of each request's next tokens, as compress takes them.

    Args:
      query: IndexQuery (v4_index_query's): values (batch, seq_len, heads, 128), weights
        (batch, seq_len, heads); request b's new tokens are rows [0, lengths[b]).
      cache: IndexKeyCache or its array, this call's new entries already written
        (write_v4_index_keys), as HF scores the entries its compressor has just emitted.
      block_table: (batch, max_pages) int32; negative entries and pages past the cache hold
        nothing (those entries are never selected).
      start: (batch,) int32, the tokens each request had before these (its compressor state's
        num_tokens before this call); lengths: (batch,) int32, its new tokens.
      ratio: the compressor's ratio (4); topk: a Python int, HF's config.index_topk.
      implementation: index_topk's (None: its CUDA kernels on a Hopper GPU, else pure JAX).

    Returns:
      V4Selection of (batch, seq_len, topk): each token's top min(topk, visible) entries
      (visible_entries) of those whose pages are in the cache; nothing for padding rows, for
      requests of bad start or lengths, and for a token that would see more entries than the
      table holds (max_pages * 64).
    """
    where = "v4_indexer_select"
    data = index_cache_array(cache, where)
    if not isinstance(query, IndexQuery) or query.values.ndim != 4:
        fail(TypeError, where, "query must be an IndexQuery of (batch, seq_len, heads, 128) "
                               "values (v4_index_query's)")
    batch, seq_len = query.values.shape[:2]
    validation.check_rank(where, "block_table", block_table, 2, "(batch, max_pages)")
    for name, array in (("block_table", block_table), ("start", start), ("lengths", lengths)):
        validation.check_int32(where, name, array)
    if block_table.shape[0] != batch or start.shape != (batch,) or lengths.shape != (batch,):
        fail(ValueError, where, f"block_table must be (batch, max_pages), start and lengths "
                                f"(batch,), for the query's batch {batch}; got "
                                f"{tuple(block_table.shape)}, {tuple(start.shape)}, "
                                f"{tuple(lengths.shape)}")
    for name, value in (("ratio", ratio), ("topk", topk)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            fail(ValueError, where, f"{name} must be a positive Python int; got {value!r}")
    visible = visible_entries(jnp.asarray(start), jnp.asarray(lengths), seq_len, ratio)
    # More entries than the table can hold were never written through it: a bad start.
    visible = jnp.where(visible <= block_table.shape[1] * PAGE_SIZE, visible, 0)
    rows = IndexQuery(*(a.reshape(batch * seq_len, *a.shape[2:]) for a in query))
    tables = jnp.repeat(jnp.asarray(block_table), seq_len, axis=0)
    entries = index_topk(rows, data, tables, visible.reshape(-1), topk=topk,
                         implementation=implementation)
    # index_topk selects only entries whose pages are in the cache: every slot is in it.
    slots = token_slots(tables, entries)
    shape = (batch, seq_len, topk)
    return V4Selection(entries.reshape(shape), slots.reshape(shape))
