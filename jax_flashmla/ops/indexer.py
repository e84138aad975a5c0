"""DeepSeek-V3.2's lightning indexer in JAX: which tokens each query's sparse attention reads.

As DeepSeek's inference/model.py (Indexer, act_quant, fp8_index) and HF's DeepseekV32Indexer:
  - q = wq_b(q_lora) as (heads, 128); k = LayerNorm(wk(x)), 128 wide (eps 1e-6);
  - the first rope_dim columns (2 * len(inv_freq), 64 in V3.2) of q's heads and of k rotated by
    non-interleaved RoPE, pairs (x_i, x_{i + rope_dim / 2}) (MLA's rope pairs neighbours);
  - q and k times the Sylvester Hadamard matrix / sqrt(128) (orthonormal: dot products stay,
    outliers spread), then quantized to e4m3 with a power-of-two scale per 128 columns
    (index_cache): one per head of q, one per token of k;
  - head weights w_h = weights_proj(x)_h * heads**-0.5 * q_scale_h * 128**-0.5;
  - score(m, n) = k_scale(n) * sum_h relu(q_h(m) . k(n)) * w_h(m) over the e4m3 values of
    q_h(m) and k(n), their products summed in float32;
  - a query keeps its top min(topk, visible) tokens, visible = those of its request up to and
    including itself. Of equal scores the earlier token is kept (as lax.top_k keeps them), so
    for given inputs on a backend the selection is deterministic; it is returned in position
    order.
On a Hopper GPU one CUDA kernel scores query rows straight from the paged cache (FP8 tensor-core
products, the relu-weighted sum over heads in registers) and another selects each row's top
positions by a radix select (ffi/index_topk.h); elsewhere pure JAX computes the same.
HF skips the rotation and the quantization: its scores are these but for FP8 rounding. Up to
the quantization this runs in float32 (DeepSeek's rounds to bfloat16 between steps).

The scoring and selection of rows is a logical op (kernels/logical.py), SELECTION: no
gradient, vmap folded into its rows, and under jit on several devices the rows (a decode's
batch, a prefill's tokens) may be split, the cache staying whole.
"""
import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_flashmla.base import checks, validation
from jax_flashmla.base.validation import PAGE_SIZE, fail
from jax_flashmla.caches.index_keys import (INDEX_HEAD_DIM, index_cache_array, quantize_index_keys,
                                            read_index_keys)
from jax_flashmla.caches.paged import token_slots
from jax_flashmla.kernels import custom_calls, logical
from jax_flashmla.kernels import library as kernels

INDEX_TOPK = 2048
LAYER_NORM_EPS = 1e-6
ROWS_PER_BLOCK = 16  # query rows scored at once: memory grows with rows * context * heads
MAX_PAGES = (2 ** 31 - 1) // PAGE_SIZE  # a row's positions, max_pages * 64 of them, fit int32
SCORES_PER_CALL = 2 ** 26  # the custom call's scores buffer: at most 256 MB a call
KERNEL_MAX_HEADS = 256  # the heads whose q the scoring kernel holds in shared memory
HIGHEST = jax.lax.Precision.HIGHEST  # float32 matmuls in float32, not TF32 or bf16 passes
# Sylvester's order, [[H, H], [H, -H]], as fast_hadamard_transform computes it.
HADAMARD = functools.reduce(np.kron, [np.array([[1, 1], [1, -1]], np.float32)] * 7)
# The selection's operands' and results' dims as Shardy factors: n rows, h heads, c 128
# columns, g the cache's pages, y a page's bytes, m block-table width, k topk, w scores width.
SELECT_FACTORS = {"values": "n h c", "weights": "n h", "cache": "g y", "block_table": "n m",
                  "visible": "n", "positions": "n k", "scores": "n w"}
HF_NAMES = {"wq_b": "wq_b.weight", "wk": "wk.weight", "k_norm_weight": "k_norm.weight",
            "k_norm_bias": "k_norm.bias", "weights_proj": "weights_proj.weight"}


@functools.partial(jax.tree_util.register_dataclass, data_fields=list(HF_NAMES), meta_fields=[])
@dataclasses.dataclass(frozen=True)
class IndexerWeights:
    """One layer's indexer weights in HF's layout (a Linear's weight is (out, in)):
    wq_b (heads * 128, q_lora_rank), wk (128, hidden), k_norm_weight and k_norm_bias (128,),
    weights_proj (heads, hidden). HF_NAMES gives each one's name under HF's
    "model.layers.<i>.self_attn.indexer."."""

    wq_b: jax.Array
    wk: jax.Array
    k_norm_weight: jax.Array
    k_norm_bias: jax.Array
    weights_proj: jax.Array

    @classmethod
    def from_state_dict(cls, state_dict, prefix=""):
        """From arrays (NumPy or JAX) under HF's names, each prefix + HF_NAMES[field]."""
        return cls(**{field: jnp.asarray(state_dict[prefix + name])
                      for field, name in HF_NAMES.items()})

    @property
    def num_heads(self):
        return self.weights_proj.shape[0]


class IndexQuery(NamedTuple):
    """Queries of the indexer: values (..., heads, 128) float8_e4m3fn, each head quantized with
    its own scale; weights (..., heads) float32, w_h with that scale folded in (module doc)."""

    values: jax.Array
    weights: jax.Array


def _project(x, weight):
    """x (..., in) @ weight (out, in).T in float32."""
    return jnp.einsum("...i,oi->...o", x, weight, precision=HIGHEST,
                      preferred_element_type=jnp.float32)


def _rope_and_rotate(x, positions, inv_freq, attention_factor):
    """x (..., [heads,] 128) float32: non-interleaved RoPE on the first 2 * len(inv_freq)
    columns, then the Hadamard rotation. positions has x's leading shape (no heads axis)."""
    half = np.shape(inv_freq)[0]
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)
    cos, sin = jnp.cos(angles) * attention_factor, jnp.sin(angles) * attention_factor
    if x.ndim > angles.ndim:  # a heads axis
        cos, sin = cos[..., None, :], sin[..., None, :]
    x1, x2, rest = x[..., :half], x[..., half:2 * half], x[..., 2 * half:]
    x = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], axis=-1)
    return jnp.matmul(x, HADAMARD, precision=HIGHEST) * INDEX_HEAD_DIM ** -0.5


def _check_projection(where, weights, x, positions, inv_freq, q_lora=None):
    if not isinstance(weights, IndexerWeights):
        fail(TypeError, where, f"weights must be IndexerWeights; got {type(weights).__name__}")
    heads, hidden = weights.weights_proj.shape
    for field, shape in (("wq_b", (heads * INDEX_HEAD_DIM, weights.wq_b.shape[-1])),
                         ("wk", (INDEX_HEAD_DIM, hidden)), ("k_norm_weight", (INDEX_HEAD_DIM,)),
                         ("k_norm_bias", (INDEX_HEAD_DIM,))):
        if tuple(getattr(weights, field).shape) != shape:
            fail(ValueError, where, f"weights.{field} must have shape {shape} for weights_proj "
                                    f"of shape {(heads, hidden)}; got "
                                    f"{tuple(getattr(weights, field).shape)}")
    if x.shape[-1:] != (hidden,):
        fail(ValueError, where, f"x must have a last dimension of {hidden} (weights' hidden "
                                f"size); got {tuple(x.shape)}")
    validation.check_int32(where, "positions", positions)
    if tuple(positions.shape) != tuple(x.shape[:-1]):
        fail(ValueError, where, f"positions must have shape {tuple(x.shape[:-1])} (x's leading "
                                f"shape); got {tuple(positions.shape)}")
    if np.ndim(inv_freq) != 1 or not 1 <= 2 * np.shape(inv_freq)[0] <= INDEX_HEAD_DIM:
        fail(ValueError, where, f"inv_freq must have shape (rope_dim // 2,), rope_dim <= "
                                f"{INDEX_HEAD_DIM}; got {np.shape(inv_freq)}")
    expected = x.shape[:-1] + weights.wq_b.shape[1:]
    if q_lora is not None and q_lora.shape != expected:
        fail(ValueError, where, f"q_lora must have shape {expected} (x's leading shape + "
                                f"wq_b's input size); got {tuple(q_lora.shape)}")


def index_query(weights, x, q_lora, positions, inv_freq, *, attention_factor=1.0):
    """The indexer's queries of tokens.

    Args:
      weights: IndexerWeights; x: (..., hidden) the layer's input, any float dtype.
      q_lora: (..., q_lora_rank), MLA's q_a_layernorm(q_a_proj(x)) (HF's q_resid).
      positions: int32 of x's leading shape, the tokens' positions in their requests.
      inv_freq: (rope_dim // 2,) RoPE frequencies (HF's rotary embedding's inv_freq, of
        qk_rope_head_dim); attention_factor scales cos and sin (YaRN's, 1.0 for V3.2).

    Returns:
      IndexQuery: values (..., heads, 128) float8_e4m3fn, weights (..., heads) float32.
    """
    _check_projection("index_query", weights, x, positions, inv_freq, q_lora)
    q = _project(q_lora, weights.wq_b).reshape(*x.shape[:-1], weights.num_heads, INDEX_HEAD_DIM)
    values, q_scales = quantize_index_keys(
        _rope_and_rotate(q, positions, inv_freq, attention_factor))
    head_weights = _project(x, weights.weights_proj) * weights.num_heads ** -0.5
    return IndexQuery(values, head_weights * q_scales * INDEX_HEAD_DIM ** -0.5)


def index_keys(weights, x, positions, inv_freq, *, attention_factor=1.0):
    """(..., 128) float32 index keys of tokens x (..., hidden), rotated and ready for
    write_index_keys (which quantizes them); arguments as index_query's."""
    _check_projection("index_keys", weights, x, positions, inv_freq)
    k = _project(x, weights.wk)
    mean = jnp.mean(k, axis=-1, keepdims=True)
    variance = jnp.mean(jnp.square(k - mean), axis=-1, keepdims=True)
    k = (k - mean) * jax.lax.rsqrt(variance + LAYER_NORM_EPS)
    k = k * weights.k_norm_weight.astype(jnp.float32) + weights.k_norm_bias.astype(jnp.float32)
    return _rope_and_rotate(k, positions, inv_freq, attention_factor)


def _row_scores(values, weights, data, pages, visible):
    """index_scores of one row: values (heads, 128), weights (heads,), pages (max_pages,) and
    visible () over data, the cache array."""
    positions = jnp.arange(pages.shape[0] * PAGE_SIZE, dtype=jnp.int32)
    slots = token_slots(pages[None], positions[None])[0]
    readable = (slots >= 0) & (slots < data.shape[0] * PAGE_SIZE)
    keys, key_scales = read_index_keys(data, jnp.where(readable, slots, 0))
    logits = jnp.einsum("hd,cd->hc", values, keys, preferred_element_type=jnp.float32)
    scores = jnp.sum(jax.nn.relu(logits) * weights[:, None], axis=0) * key_scales
    # Unused pages may hold NaN: where no token is read, no score is taken.
    return jnp.where(readable & (positions < visible), scores, -jnp.inf)


def _scores(query, data, block_table, visible):
    row = lambda args: _row_scores(args[0], args[1], data, args[2], args[3])
    return jax.lax.map(row, (*query, block_table, visible), batch_size=ROWS_PER_BLOCK)


def _select_types(avals, *, topk):
    rows, max_pages = avals["block_table"].shape
    return (jax.core.ShapedArray((rows, topk), jnp.int32),
            jax.core.ShapedArray((rows, custom_calls.score_width(max_pages, topk)), jnp.float32))


def _reference_select(named, *, topk):
    """(n, topk) positions of each row's top scores above -inf in ascending order, -1 after
    them, and the (n, max(max_pages * 64, topk)) scores, -inf past the table."""
    scores = _scores(IndexQuery(named["values"], named["weights"]), named["cache"],
                     named["block_table"], named["visible"])
    if scores.shape[1] < topk:  # positions past the table are never visible
        scores = jnp.pad(scores, ((0, 0), (0, topk - scores.shape[1])), constant_values=-jnp.inf)
    # Every NaN ranks above +inf, as the kernel ranks them (abs drops a NaN's sign bit).
    top, positions = jax.lax.top_k(jnp.where(jnp.isnan(scores), jnp.abs(scores), scores), topk)
    last = jnp.iinfo(jnp.int32).max  # -inf marks what a row does not see: never taken
    positions = jnp.sort(jnp.where(jnp.isneginf(top), last, positions), axis=-1)
    return jnp.where(positions < last, positions, -1), scores


def _kernel_select(named, *, topk):
    """(n, topk) positions and (n, max(max_pages * 64, topk)) scores from the custom call on
    one device's rows, in calls of at most SCORES_PER_CALL scores (the scores are a buffer of
    XLA's)."""
    block_table, visible = named["block_table"], named["visible"]
    width = custom_calls.score_width(block_table.shape[1], topk)
    call = lambda rows: custom_calls.INDEX_TOPK(
        values=rows[0], weights=rows[1], cache=named["cache"], block_table=rows[2],
        visible=rows[3], topk=topk)[:2]  # the top-k's scratch dropped
    rows = (named["values"], named["weights"], block_table, visible)
    n, per_call = visible.shape[0], max(1, SCORES_PER_CALL // width)
    if n <= per_call:
        return call(rows)
    calls = -(-n // per_call)  # padding rows see nothing
    rows = [jnp.pad(x, [(0, calls * per_call - n)] + [(0, 0)] * (x.ndim - 1))
            .reshape(calls, per_call, *x.shape[1:]) for x in rows]
    positions, scores = jax.lax.map(call, rows)
    return positions.reshape(-1, topk)[:n], scores.reshape(-1, width)[:n]


SELECTION = logical.LogicalOp(
    "index_topk", factors=SELECT_FACTORS, results=("positions", "scores"), split=("n",),
    abstract_eval=_select_types, reference=_reference_select, kernels=_kernel_select,
    no_gradient="the indexer's selection is discrete, its kernels forward-only",
    fold_vmap="n")


def _positions_and_scores(query, data, block_table, visible, topk, implementation):
    return SELECTION(dict(values=query.values, weights=query.weights, cache=data,
                          block_table=block_table, visible=visible),
                     implementation=implementation, topk=topk)


def _top_positions(query, data, block_table, visible, topk, implementation):
    """(n, topk) int32: each row's top positions in ascending order, -1 after them. Only
    readable positions are taken (before the row's visible count, on a page of the cache): the
    others score -inf."""
    if visible.shape[0] == 0:  # no rows: nothing to call
        return jnp.zeros((0, topk), jnp.int32)
    return _positions_and_scores(query, data, block_table, visible, topk, implementation)[0]


def _select(query, data, block_table, visible, topk, implementation):
    """(n, topk) int32 slots of each row's top tokens in ascending position order, -1 after
    them where fewer than topk tokens are visible on pages of the cache."""
    positions = _top_positions(query, data, block_table, visible, topk, implementation)
    return token_slots(block_table, positions)


def _implementation(where, implementation, query):
    """The indexer's implementation for query; None picks the custom call where it can run it
    (a Hopper GPU, jax_flashmla._cuda built, at most KERNEL_MAX_HEADS heads)."""
    heads = query.values.shape[-2]

    def refusal():
        if heads > KERNEL_MAX_HEADS:
            return ValueError, f"takes at most {KERNEL_MAX_HEADS} heads; query has {heads}"
        return validation.gpu_refusal("jax_flashmla's CUDA kernel")

    return validation.resolve_implementation(
        where, implementation, runs_here=lambda: kernels.own_kernels_available()
        and heads <= KERNEL_MAX_HEADS, refusal=refusal)


def _check_rows(where, query, cache, block_table, rows):
    """Checks query (its leading axes named by rows), the cache and block_table, whose batch is
    query's first axis unless rows is ("tokens",); returns the cache array."""
    data = index_cache_array(cache, where)
    if not isinstance(query, IndexQuery):
        fail(TypeError, where, f"query must be an IndexQuery (index_query's); got "
                               f"{type(query).__name__}")
    values, weights = query
    if values.dtype != jnp.float8_e4m3fn or values.ndim != len(rows) + 2 \
            or values.shape[-1] != INDEX_HEAD_DIM:
        fail(ValueError, where, f"query.values must be float8_e4m3fn of shape "
                                f"{rows + ('heads', INDEX_HEAD_DIM)}; got {values.dtype} "
                                f"{tuple(values.shape)}")
    if weights.dtype != jnp.float32 or weights.shape != values.shape[:-1]:
        fail(ValueError, where, f"query.weights must be float32 of shape "
                                f"{tuple(values.shape[:-1])}; got {weights.dtype} "
                                f"{tuple(weights.shape)}")
    validation.check_rank(where, "block_table", block_table, 2, "(batch, max_pages)")
    validation.check_int32(where, "block_table", block_table)
    batch = None if rows == ("tokens",) else values.shape[0]
    if block_table.shape[1] < 1 or batch not in (None, block_table.shape[0]):
        fail(ValueError, where, f"block_table must have shape ({batch or 'batch'}, max_pages >= "
                                f"1); got {tuple(block_table.shape)}")
    if block_table.shape[1] > MAX_PAGES:  # positions are int32
        fail(ValueError, where, f"block_table may have at most {MAX_PAGES} pages a row, whose "
                                f"positions fit int32; got {block_table.shape[1]}")
    return data


def _check_lengths(where, name, lengths, expected):
    validation.check_int32(where, name, lengths)
    if tuple(lengths.shape) != expected:
        fail(ValueError, where, f"{name} must have shape {expected}; got {tuple(lengths.shape)}")
    return jnp.asarray(lengths)


def _check_topk(where, topk):
    if isinstance(topk, bool) or not isinstance(topk, (int, np.integer)) or topk < 1:
        fail(ValueError, where, f"topk must be a positive Python int; got {topk!r}")


def _visible(seq_lens, later):
    """Tokens a new token sees: seq_lens less the `later` (>= 0) new tokens after it, computed
    without wrapping int32; <= 0 (nothing) where seq_lens is negative."""
    return jnp.maximum(seq_lens, 0) - later


def index_scores(query, cache, block_table, visible, *, implementation=None):
    """The indexer's scores of query rows over their requests' tokens in the cache.

    Args:
      query: IndexQuery of rows: values (n, heads, 128), weights (n, heads).
      cache: IndexKeyCache or its (num_pages, 8448) uint8 array.
      block_table: (n, max_pages) int32, each row's request's pages (negative entries and
        pages past the cache hold no tokens).
      visible: (n,) int32, how many of its request's first tokens each row sees.
      implementation: None picks "custom_call" on a Hopper GPU where jax_flashmla's CUDA
        kernels were built, else "reference" (pure JAX). The two sum the same float32
        products in different orders.

    Returns:
      (n, max_pages * 64) float32: position p of row i its score (module doc); -inf where
      p >= visible[i] or p's page is not in the cache.
    """
    where = "index_scores"
    data = _check_rows(where, query, cache, block_table, ("n",))
    visible = _check_lengths(where, "visible", visible, tuple(query.values.shape[:1]))
    block_table = jnp.asarray(block_table)
    _, scores = _positions_and_scores(query, data, block_table, visible, 1,
                                      _implementation(where, implementation, query))
    return scores[:, :block_table.shape[1] * PAGE_SIZE]


def index_topk(query, cache, block_table, visible, *, topk, implementation=None):
    """Each query row's top positions among its request's tokens in the cache.

    Args:
      query, cache, block_table, visible, implementation: as index_scores'.
      topk: a Python int.

    Returns:
      (n, topk) int32: the positions of row i's min(topk, readable) highest scores in
      ascending order, -1 after them, where readable counts its positions p < visible[i]
      whose page is in the cache and whose score is above -inf; of equal scores the lower
      position is taken (as lax.top_k takes them). Unlike indexer_decode's, these are
      positions, not slots.
    """
    where = "index_topk"
    data = _check_rows(where, query, cache, block_table, ("n",))
    visible = _check_lengths(where, "visible", visible, tuple(query.values.shape[:1]))
    _check_topk(where, topk)
    return _top_positions(query, data, jnp.asarray(block_table), visible, topk,
                          _implementation(where, implementation, query))


def indexer_decode(query, cache, block_table, seq_lens, *, topk=INDEX_TOPK,
                   implementation=None):
    """The tokens each decoding request's new tokens attend to.

    Args:
      query: IndexQuery of the new tokens: values (batch, s_q, heads, 128), weights
        (batch, s_q, heads); s_q is 1, or 2 with a draft token.
      cache: IndexKeyCache or its (num_pages, 8448) uint8 array, the new tokens' keys already
        written.
      block_table: (batch, max_pages) int32; seq_lens: (batch,) int32, each request's tokens
        including the new ones. New token j sees seq_lens - s_q + j + 1 tokens: none where
        that is not positive (any negative seq_lens, down to -2**31, included), at most the
        table's max_pages * 64 where it is larger.
      topk: a Python int, index_topk (2048 in V3.2).
      implementation: None picks "custom_call" (one CUDA kernel scoring the rows from the
        paged cache, one selecting their top positions) on a Hopper GPU where jax_flashmla's
        CUDA kernels were built, else "reference" (pure JAX, scores then lax.top_k). Given
        equal scores they select the same tokens; their scores may differ in the last bits.

    With jax_flashmla.value_checks() on while the call is traced, a negative seq_lens is a
    checkify error naming the request and the value.

    Returns:
      (batch, s_q, topk) int32 slots (page * 64 + offset, sparse_mla_decode's indices) of a
      token's min(topk, visible) selected positions in ascending position order, -1 after
      them (and in place of visible positions whose block-table entry names no page of the
      cache).
    """
    where = "indexer_decode"
    data = _check_rows(where, query, cache, block_table, ("batch", "s_q"))
    batch, s_q = query.values.shape[:2]
    seq_lens = _check_lengths(where, "seq_lens", seq_lens, (batch,))
    _check_topk(where, topk)
    implementation = _implementation(where, implementation, query)
    if checks.enabled():
        checks.lengths(where, seq_lens)
    visible = _visible(seq_lens[:, None], s_q - 1 - jnp.arange(s_q, dtype=jnp.int32))
    rows = IndexQuery(*(x.reshape(batch * s_q, *x.shape[2:]) for x in query))
    block_table = jnp.repeat(jnp.asarray(block_table), s_q, axis=0)
    return _select(rows, data, block_table, visible.reshape(-1), topk,
                   implementation).reshape(batch, s_q, topk)


def indexer_prefill(query, cache, block_table, seq_lens, cu_seqlens, *, topk=INDEX_TOPK,
                    implementation=None):
    """The tokens each new token of a prefill or extend attends to, causally.

    Args:
      query: IndexQuery of a ragged batch's new tokens: values (tokens, heads, 128), weights
        (tokens, heads); request r's at rows [cu_seqlens[r], cu_seqlens[r + 1]).
      cache: IndexKeyCache or its (num_pages, 8448) uint8 array, the new tokens' keys already
        written after each request's cached prefix.
      block_table: (batch, max_pages) int32; seq_lens: (batch,) int32, each request's tokens
        including the new ones; cu_seqlens: (batch + 1,) int32, non-decreasing from 0.
        New token j of request r sees seq_lens[r] - (cu_seqlens[r + 1] - cu_seqlens[r]) + j + 1
        tokens: none where that is not positive (any negative seq_lens included). Rows from
        cu_seqlens[batch] on (padding) see none; where cu_seqlens is not non-decreasing from
        0, neither does a row outside the span of the request a binary search gives it.
      topk, implementation: as indexer_decode's.

    With jax_flashmla.value_checks() on while the call is traced, a negative seq_lens, and
    cu_seqlens not non-decreasing from 0 to at most tokens, are checkify errors naming the
    entry and the value.

    Returns:
      (tokens, topk) int32 slots, as indexer_decode's.
    """
    where = "indexer_prefill"
    data = _check_rows(where, query, cache, block_table, ("tokens",))
    batch = block_table.shape[0]
    seq_lens = _check_lengths(where, "seq_lens", seq_lens, (batch,))
    cu_seqlens = _check_lengths(where, "cu_seqlens", cu_seqlens, (batch + 1,))
    _check_topk(where, topk)
    implementation = _implementation(where, implementation, query)
    tokens = query.values.shape[0]
    if checks.enabled():
        checks.lengths(where, seq_lens)
        checks.cu_seqlens(where, cu_seqlens, tokens)
    row = jnp.arange(tokens, dtype=jnp.int32)
    request = jnp.clip(jnp.searchsorted(cu_seqlens[1:], row, side="right"), 0, batch - 1)
    start, end = cu_seqlens[request], cu_seqlens[request + 1]
    # A row outside its request's [start, end) (cu_seqlens not non-decreasing from 0) sees
    # nothing, as padding does; inside it, end - 1 - row cannot wrap around int32.
    inside = (start <= row) & (row < end) & (row < cu_seqlens[batch])
    visible = jnp.where(inside, _visible(seq_lens[request], end - 1 - row), 0)
    return _select(query, data, jnp.asarray(block_table)[request], visible, topk,
                   implementation)
