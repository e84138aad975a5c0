"""DeepSeek-V3.2's attention as a Flax NNX layer: MLA whose queries attend only to the
index_topk tokens that its lightning indexer selects (DeepSeek Sparse Attention).

The layer has MultiHeadLatentAttention's parameters (HF's names), projections and absorbed
query, both layers being MLAProjections, plus the indexer's parameters under `indexer`. It is
no MultiHeadLatentAttention: its cache is two paged caches sharing slots, the 656-byte FP8
SparseKVCache of the MLA rows and the IndexKeyCache of the indexer's keys, so its prefill,
extend and decode take other arguments and return both caches.
  - decode writes the new tokens into both caches, selects each query's tokens through
    indexer_decode and attends to them with sparse_mla_decode (FlashMLA's sparse kernel on a
    Hopper GPU) with the absorbed query, as MultiHeadLatentAttention.decode absorbs it.
  - prefill writes both caches and attends causally over the prompts' own rows in the compute
    dtype: densely (mla_prefill) when no token can see more than index_topk tokens, the
    indexer then selecting them all (as SGLang does), else through indexer_prefill and
    sparse_mla_prefill.
HF's DeepseekV32Attention computes the same with an unrotated, unquantized indexer: its
selections are these but for FP8 rounding between near-equal scores.
"""
import dataclasses

import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np

from jax_flashmla.base import validation
from jax_flashmla.base.validation import PAGE_SIZE, fail
from jax_flashmla.caches.index_keys import (INDEX_HEAD_DIM, PAGE_BYTES, IndexKeyCache,
                                            write_index_keys)
from jax_flashmla.caches.paged import droppable_slots, token_slots
from jax_flashmla.caches.sparse import TOKEN_BYTES, SparseKVCache, write_sparse_kv
from jax_flashmla.flax.mla import MLAConfig, MLAProjections
from jax_flashmla.ops.indexer import (HF_NAMES, INDEX_TOPK, IndexerWeights, IndexQuery, index_keys,
                                      index_query, indexer_decode, indexer_prefill)
from jax_flashmla.ops.sparse import sparse_mla_decode, sparse_mla_prefill

INDEX_KEYS = ("index_n_heads", "index_head_dim", "index_topk")


@dataclasses.dataclass(frozen=True)
class SparseMLAConfig(MLAConfig):
    """MLAConfig plus DeepSeek-V3.2's indexer: index_n_heads heads of index_head_dim columns
    (128, the index cache's), each query keeping its index_topk best-scored tokens. The indexer
    reads MLA's q_lora (q_a_layernorm's output), so q_lora_rank must be set."""

    index_n_heads: int = 64
    index_head_dim: int = INDEX_HEAD_DIM
    index_topk: int = INDEX_TOPK

    def __post_init__(self):
        super().__post_init__()
        for name in ("index_n_heads", "index_topk"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"SparseMLAConfig: {name} must be a positive int; got {value!r}")
        if self.index_head_dim != INDEX_HEAD_DIM:
            raise ValueError(f"SparseMLAConfig: index_head_dim must be {INDEX_HEAD_DIM} (the "
                             f"index-key cache's width); got {self.index_head_dim!r}")
        if self.q_lora_rank is None:
            raise ValueError("SparseMLAConfig: q_lora_rank must be set (the indexer's queries "
                             "come from MLA's q_lora); got None")

    @classmethod
    def from_hf(cls, config):
        """From an HF DeepseekV32Config object or its config.json dict."""
        base = MLAConfig.from_hf(config)
        get = (config.get if isinstance(config, dict)
               else lambda name, default=None: getattr(config, name, default))
        for key in INDEX_KEYS:
            if get(key) is None:
                raise ValueError(f"SparseMLAConfig.from_hf: the HF config has no {key!r}; a "
                                 f"DeepSeek-V3.2 config has {', '.join(INDEX_KEYS)} (a V2/V3 "
                                 f"one has none: read it with MLAConfig.from_hf)")
        mla = {field.name: getattr(base, field.name) for field in dataclasses.fields(MLAConfig)}
        return cls(**mla, **{key: get(key) for key in INDEX_KEYS})


class Indexer(nnx.Module):
    """The lightning indexer's parameters, each an nnx.Param named as IndexerWeights' field and
    laid out as HF stores it: wq_b (index_n_heads * 128, q_lora_rank), wk (128, hidden_size),
    weights_proj (index_n_heads, hidden_size) — (out, in), unlike MLA's nnx.Linear kernels —
    and k_norm_weight, k_norm_bias (128,). The arithmetic is jax_flashmla.ops.indexer's."""

    def __init__(self, config, *, rngs, param_dtype=jnp.float32):
        heads, dim = config.index_n_heads, config.index_head_dim
        init = jax.nn.initializers.lecun_normal(in_axis=-1, out_axis=-2)
        self.wq_b = nnx.Param(init(rngs.params(), (heads * dim, config.q_lora_rank), param_dtype))
        self.wk = nnx.Param(init(rngs.params(), (dim, config.hidden_size), param_dtype))
        self.k_norm_weight = nnx.Param(jnp.ones((dim,), param_dtype))
        self.k_norm_bias = nnx.Param(jnp.zeros((dim,), param_dtype))
        self.weights_proj = nnx.Param(init(rngs.params(), (heads, config.hidden_size),
                                           param_dtype))

    def weights(self):
        """The parameters' current values as IndexerWeights, for jax_flashmla.ops.indexer."""
        return IndexerWeights(**{field: getattr(self, field)[...] for field in HF_NAMES})


class SparseMultiHeadLatentAttention(MLAProjections):
    """DeepSeek-V3.2's attention: MultiHeadLatentAttention's submodules and `indexer` (Indexer),
    HF's module tree. Needs kv_lora_rank 512 and qk_rope_head_dim 64 (the sparse cache's rows).

    Args:
      config: SparseMLAConfig.
      rngs, dtype, param_dtype: as MultiHeadLatentAttention's.
    """

    def __init__(self, config, *, rngs, dtype=jnp.float32, param_dtype=jnp.float32):
        if not isinstance(config, SparseMLAConfig):
            raise TypeError(f"config must be a SparseMLAConfig; got {type(config).__name__}")
        config.check_decode()
        super().__init__(config, rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.indexer = Indexer(config, rngs=rngs, param_dtype=param_dtype)

    def index_query(self, hidden_states, positions):
        """The indexer's IndexQuery of tokens hidden_states (b, s, hidden_size) at int32
        positions (b, s): values (b, s, index_n_heads, 128) float8_e4m3fn, weights
        (b, s, index_n_heads) float32."""
        x = hidden_states.astype(self.dtype)
        q_lora = self.q_a_layernorm(self.q_a_proj(x))
        return index_query(self.indexer.weights(), x, q_lora, positions, self._inv_freq(),
                           attention_factor=self.attention_factor)

    def _inv_freq(self):
        return np.asarray(self.inv_freq, np.float32)

    def _write(self, kv_cache, index_cache, slots, hidden_states, positions, latent, k_pe):
        """Both caches with the tokens' MLA rows and index keys stored at slots."""
        kv_cache = write_sparse_kv(kv_cache, slots, jnp.concatenate([latent, k_pe], axis=-1))
        keys = index_keys(self.indexer.weights(), hidden_states.astype(self.dtype), positions,
                          self._inv_freq(), attention_factor=self.attention_factor)
        return kv_cache, write_index_keys(index_cache, slots, keys)

    def _write_rows(self, hidden_states, positions, kv_cache, index_cache, block_table, lengths):
        """Projects new tokens (b, s) and writes the real ones, each row's first `lengths` (all
        s when None; none for a length outside [0, s]), into both caches at their positions'
        slots. Returns (project's four arrays, real (b, s) bool, slots (b, s) int32, -1 for
        padding, kv_cache, index_cache)."""
        projected = self.project(hidden_states, positions)
        positions = positions.astype(jnp.int32)
        b, s = positions.shape
        if lengths is None:
            lengths = jnp.full((b,), s, jnp.int32)
        lengths = jnp.where((lengths < 0) | (lengths > s), 0, lengths)
        real = jnp.arange(s)[None, :] < lengths[:, None]
        slots = jnp.where(real, token_slots(block_table, positions), -1)
        kv_cache, index_cache = self._write(kv_cache, index_cache, slots, hidden_states,
                                            positions, *projected[2:])
        return projected, real, slots, kv_cache, index_cache

    def _flat_index_query(self, hidden_states, positions):
        """index_query of tokens (b, s) as one ragged batch of b * s rows, row r's at r * s."""
        b, s = np.shape(positions)
        return IndexQuery(*(x.reshape(b * s, *x.shape[2:])
                            for x in self.index_query(hidden_states, positions.astype(jnp.int32))))

    def _latent_output(self, out_latent):
        """Attention (b, s, h, kv_lora_rank) in the latent space -> (b, s, hidden_size) through
        W_UV and o_proj."""
        _, w_uv = self._kv_b_split()
        return self._output(jnp.einsum("bshc,chd->bshd", out_latent.astype(self.dtype), w_uv))

    def decode(self, hidden_states, positions, kv_cache, index_cache, block_table, seq_lens,
               slots=None, *, implementation=None):
        """Writes the new tokens into both caches, then each attends to the index_topk tokens
        the indexer selects among those its request has up to and including it.

        Args:
          hidden_states: (b, s_q, hidden_size) new tokens (s_q = 1, or 2 with a draft token).
          positions: (b, s_q) int32 positions of the new tokens.
          kv_cache: SparseKVCache or its (num_pages, 64, 1, 656) uint8 array.
          index_cache: IndexKeyCache or its (num_pages, 8448) uint8 array, of kv_cache's pages.
          block_table: (b, max_pages) int32.
          seq_lens: (b,) int32 tokens of each request including the new ones (0 for an idle
            row, which attends to nothing: give it slots -1 so that it writes nothing either).
          slots: (b, s_q) int32 cache slots of the new tokens, by default
            token_slots(block_table, positions); the indexer reads the keys through block_table,
            so a slot must be its token's there (or -1, not written).
          implementation: as in sparse_mla_decode, for the indexer too.

        Returns:
          (out (b, s_q, hidden_size) in the compute dtype, kv_cache, index_cache), the caches
          of the kinds given; under jax.jit donating them, written in place.
        """
        where = "SparseMultiHeadLatentAttention.decode"
        _check_caches(where, kv_cache, index_cache)
        _check_batch_args(where, np.shape(positions), block_table, seq_lens=seq_lens, slots=slots)
        q_nope, q_pe, latent, k_pe = self.project(hidden_states, positions)
        positions = positions.astype(jnp.int32)
        if slots is None:
            slots = token_slots(block_table, positions)
        kv_cache, index_cache = self._write(kv_cache, index_cache, slots, hidden_states,
                                            positions, latent, k_pe)
        indices = indexer_decode(self.index_query(hidden_states, positions), index_cache,
                                 block_table, seq_lens, topk=self.config.index_topk,
                                 implementation=implementation)
        # FlashMLA's sparse decode takes q in bf16.
        q = self.absorbed_query(q_nope, q_pe).astype(jnp.bfloat16)
        out_latent, _ = sparse_mla_decode(q, kv_cache, indices,
                                          softmax_scale=self.config.softmax_scale,
                                          implementation=implementation)
        return self._latent_output(out_latent), kv_cache, index_cache

    def prefill(self, hidden_states, positions, kv_cache, index_cache, block_table, *,
                lengths=None, implementation=None):
        """Causal attention over new prompts, each token over the index_topk tokens the indexer
        selects among the prompt's up to itself; writes both caches.

        s <= index_topk takes mla_prefill's dense attention (every visible token would be
        selected). Longer prompts go through indexer_prefill and sparse_mla_prefill (FlashMLA's
        kernel in bfloat16 on a Hopper GPU; elsewhere the reference, which gathers
        (b * s, index_topk, 576) float32 rows at once).

        Args:
          hidden_states: (b, s, hidden_size), prompts right-padded to s.
          positions: (b, s) int32, 0.. along each row (fresh prompts, no cached prefix).
          kv_cache, index_cache, block_table: as decode's; each token is written at
            token_slots(block_table, positions), padding nowhere.
          lengths: optional (b,) int32 prompt lengths (default s); tokens past them are padding
            (their attention 0 before o_proj). A length outside [0, s] makes its row empty.
          implementation: the dense attention's, as in jax_flashmla.mla_prefill.

        Returns:
          (out (b, s, hidden_size) in the compute dtype, kv_cache, index_cache), as decode's.
        """
        where = "SparseMultiHeadLatentAttention.prefill"
        num_pages = _check_caches(where, kv_cache, index_cache)
        _check_batch_args(where, np.shape(positions), block_table, lengths=lengths)
        (q_nope, q_pe, latent, k_pe), real, slots, kv_cache, index_cache = self._write_rows(
            hidden_states, positions, kv_cache, index_cache, block_table, lengths)
        b, s = real.shape
        if s <= self.config.index_topk:
            out = self._attend(q_nope, q_pe, latent, k_pe, lengths=real.sum(1, dtype=jnp.int32),
                               implementation=implementation)
            return out, kv_cache, index_cache
        query = self._flat_index_query(hidden_states, positions)
        # Row r's tokens are rows [r s, r s + s); token j sees its prompt's first j + 1 tokens
        # (a padding token's selection goes with its output).
        chosen = indexer_prefill(query, index_cache, block_table, jnp.full((b,), s, jnp.int32),
                                 jnp.arange(b + 1, dtype=jnp.int32) * s,
                                 topk=self.config.index_topk)
        # The prompts' rows are attended as computed, not through the FP8 cache: each selected
        # slot becomes the row of the token just written there.
        row_of_slot = jnp.full((num_pages * PAGE_SIZE,), -1, jnp.int32).at[
            droppable_slots(slots, num_pages)].set(jnp.arange(b * s, dtype=jnp.int32),
                                                   mode="drop")
        indices = jnp.where(chosen >= 0, row_of_slot[jnp.maximum(chosen, 0)], -1)
        q = self.absorbed_query(q_nope, q_pe)
        kv = jnp.concatenate([latent, k_pe], axis=-1).reshape(b * s, -1)
        out_latent, _ = sparse_mla_prefill(q.reshape(b * s, *q.shape[2:]), kv, indices,
                                           softmax_scale=self.config.softmax_scale)
        out_latent = out_latent.reshape(b, s, self.config.num_heads, -1)
        out_latent = jnp.where(real[:, :, None, None], out_latent, 0)
        return self._latent_output(out_latent), kv_cache, index_cache

    def extend(self, hidden_states, positions, kv_cache, index_cache, block_table, prefix_lens,
               *, lengths=None, implementation=None):
        """New tokens of requests whose first prefix_lens tokens are in both caches (a prompt's
        next chunk, a conversation's next turn): writes them into both caches, then each
        attends to the index_topk tokens the indexer selects among its request's prefix and
        new tokens up to itself, read from the FP8 cache by the sparse decode with each new
        token as a query of its own (the kernel takes 1 or 2 query tokens per request).

        Args:
          hidden_states: (b, s, hidden_size) new tokens, right-padded to s.
          positions: (b, s) int32: prefix_lens[:, None] + arange(s) for the real tokens.
          kv_cache, index_cache, block_table: as decode's, each request's prefix in both caches.
          prefix_lens: (b,) int32 tokens already cached per request (0: a new prompt).
          lengths: optional (b,) int32 new tokens per request (default s); tokens past them
            are padding: they write nothing and attend to nothing (their attention 0 before
            o_proj). A length outside [0, s] makes its row empty.
          implementation: as in sparse_mla_decode, for the indexer too.

        Returns:
          (out (b, s, hidden_size) in the compute dtype, kv_cache, index_cache), as decode's.
        """
        where = "SparseMultiHeadLatentAttention.extend"
        _check_caches(where, kv_cache, index_cache)
        _check_batch_args(where, np.shape(positions), block_table, prefix_lens=prefix_lens,
                          lengths=lengths)
        (q_nope, q_pe, _, _), real, _, kv_cache, index_cache = self._write_rows(
            hidden_states, positions, kv_cache, index_cache, block_table, lengths)
        b, s = real.shape
        query = self._flat_index_query(hidden_states, positions)
        # Row r's tokens are rows [r s, r s + s); token j sees prefix_lens[r] + j + 1 tokens.
        chosen = indexer_prefill(query, index_cache, block_table, prefix_lens + s,
                                 jnp.arange(b + 1, dtype=jnp.int32) * s,
                                 topk=self.config.index_topk, implementation=implementation)
        chosen = jnp.where(real.reshape(b * s, 1), chosen, -1)  # padding attends to nothing
        q = self.absorbed_query(q_nope, q_pe).astype(jnp.bfloat16)  # the sparse decode's dtype
        out_latent, _ = sparse_mla_decode(q.reshape(b * s, 1, *q.shape[2:]), kv_cache,
                                          chosen[:, None, :],
                                          softmax_scale=self.config.softmax_scale,
                                          implementation=implementation)
        return (self._latent_output(out_latent.reshape(b, s, *out_latent.shape[2:])),
                kv_cache, index_cache)


def _check_caches(where, kv_cache, index_cache):
    """Checks both caches' kinds and that they have the same pages; returns num_pages."""
    arrays = []
    for name, cache, kind, page in (
            ("kv_cache", kv_cache, "a SparseKVCache", (PAGE_SIZE, 1, TOKEN_BYTES)),
            ("index_cache", index_cache, "an IndexKeyCache", (PAGE_BYTES,))):
        data = cache.data if isinstance(cache, (SparseKVCache, IndexKeyCache)) else cache
        if not (hasattr(data, "shape") and hasattr(data, "dtype")) or data.dtype != jnp.uint8 \
                or tuple(data.shape[1:]) != page or data.shape[0] < 1:
            seen = (f"{data.dtype} {tuple(data.shape)}" if hasattr(data, "shape")
                    else type(data).__name__)
            fail(ValueError, where, f"{name} must be {kind} or a (num_pages, "
                                     f"{', '.join(map(str, page))}) uint8 array; got {seen}")
        arrays.append(data)
    kv, index = arrays
    if kv.shape[0] != index.shape[0]:
        fail(ValueError, where, f"kv_cache and index_cache share slots, so they must have the "
                                 f"same num_pages; got {kv.shape[0]} and {index.shape[0]}")
    return kv.shape[0]


def _check_batch_args(where, tokens_shape, block_table, **optional):
    """block_table (batch, max_pages) int32 and the given ones of seq_lens, prefix_lens,
    lengths (batch,) and slots (batch, s) int32, for tokens of tokens_shape (batch, s)
    (project checks those)."""
    batch = tokens_shape[0] if tokens_shape else None
    validation.check_rank(where, "block_table", block_table, 2, "(batch, max_pages)")
    validation.check_int32(where, "block_table", block_table)
    if block_table.shape[0] != batch:
        fail(ValueError, where, f"block_table must have shape ({batch}, max_pages) for "
                                 f"hidden_states' batch {batch}; got {tuple(block_table.shape)}")
    shapes = {"seq_lens": (batch,), "lengths": (batch,), "slots": tuple(tokens_shape)}
    shapes["prefix_lens"] = shapes["seq_lens"]
    for name, value in optional.items():
        if value is None:
            continue
        validation.check_rank(where, name, value, len(shapes[name]), str(shapes[name]))
        validation.check_int32(where, name, value)
        if tuple(value.shape) != shapes[name]:
            fail(ValueError, where, f"{name} must have shape {shapes[name]}; got "
                                     f"{tuple(value.shape)}")
