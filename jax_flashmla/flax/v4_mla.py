"""DeepSeek-V4's attention as a Flax NNX layer, equal to HF transformers' DeepseekV4Attention,
over paged FP8 caches (jax_flashmla.caches.v4_layer.V4LayerCache).

Per token: q = q_b_proj(q_a_norm(q_a_proj(x))) in num_heads heads of 512, each RMS-normed
without weight, then roped; one K=V row kv_norm(kv_proj(x)), roped. RoPE is interleaved (pairs
(x0, x1), ...) on the trailing 64 dims, at the token's position, with the layer type's rope
(V4Config.rope). A query at position p reads, in one softmax with a per-head sink in its
denominator only:
  - its window: the K=V rows at positions p - W + 1 .. p of its request (W = sliding_window);
  - HCA: every compressed entry its request has completed by then, j < (p + 1) // r
    (ops/compressor.py; window tokens are not left out of them);
  - CSA: of those, the top index_topk that its lightning indexer selects
    (jax_flashmla.ops.v4_indexer: its own compressor's entries of 128 dims, scored against the
    query in FP8). Every form selects alike: the new tokens' index keys are stored first, then
    each query scores its request's entries in the index-key cache.
The output's RoPE dims are rotated back (cos, -sin at p), then the grouped output projection
(o_a_proj per contiguous group of heads, o_b_proj) gives (..., hidden_size).

Every call attends through FlashMLA's sparse kernels (on a Hopper GPU; elsewhere, or with
implementation="reference", their pure-JAX references), q and the rows in bf16, the sinks in
the softmax, out in bf16. prefill and extend (new tokens of cached requests) go through
sparse_mla_prefill: one flat bf16 array of the rows a call may read (the new tokens' rows and
completed entries as computed, rounded to bf16; in extend also the rings' rows and the cached
entries, dequantized from FP8) and, for each new token, a row of indices into it, its window
then its entries (flax/v4_chunk.py): memory grows with the tokens times the keys each reads,
not times all keys. decode goes through sparse_mla_decode over the FP8 caches: the compressed
entries as the main cache, the window as the extra one (a sliding layer: the window as the
main cache); a CSA layer's over the entries its indexer selected, the selections being slots
of the compressed cache as they come (caches/v4_layer.py). The cache a call leaves depends on
neither the implementation nor the chunks a request's tokens came in.
Parameter names are HF's (jax_flashmla.flax.load_attention_weights reads a state dict or
safetensors).
"""
import dataclasses

import flax.nnx as nnx
import jax
import jax.numpy as jnp

from jax_flashmla.base.validation import PAGE_SIZE, fail
from jax_flashmla.caches.index_keys import INDEX_HEAD_DIM, IndexKeyCache
from jax_flashmla.caches.sparse import write_sparse_kv
from jax_flashmla.caches.v4 import V4KVCache
from jax_flashmla.caches.v4_layer import V4LayerCache
from jax_flashmla.flax.v4_chunk import chunk_keys
from jax_flashmla.flax.v4_compressors import V4Compressor, V4Indexer
from jax_flashmla.flax.v4_config import V4Config, check_layer_type
from jax_flashmla.ops.compressor import compress, initial_state, visible_entries
from jax_flashmla.ops.sparse import sparse_mla_decode, sparse_mla_prefill
from jax_flashmla.ops.v4_indexer import (v4_index_query, v4_indexer_select,
                                         write_v4_index_keys)


class V4RMSNorm(nnx.Module):
    """HF's DeepseekV4RMSNorm: normalise in float32, times the float32 weight, then x's dtype."""

    def __init__(self, dim, *, eps):
        self.weight = nnx.Param(jnp.ones((dim,), jnp.float32))
        self.eps = eps

    def __call__(self, x):
        return _rms_norm(x, self.weight[...], self.eps)


class V4Attention(nnx.Module):
    """One DeepSeek-V4 attention layer of a layer type (module doc), HF's module tree:
    q_a_proj, q_a_norm, q_b_proj, kv_proj, kv_norm, o_b_proj (nnx.Linear, kernels (in, out)),
    o_a_proj (an nnx.Param in HF's (o_groups * o_lora_rank, num_heads * 512 / o_groups)
    layout), sinks ((num_heads,) float32), compressor (V4Compressor) in CSA and HCA layers,
    and indexer (V4Indexer, HF's compressor.indexer) in CSA layers.

    Args:
      config: V4Config (a CSA layer's index_head_dim must be 128, the index-key cache's).
      layer_type: HF's string, "sliding_attention", "compressed_sparse_attention" or
        "heavily_compressed_attention" (V4Config.SLIDING, CSA, HCA).
      rngs: nnx.Rngs for the initial weights.
      dtype: compute dtype of the projections (HF's model dtype).
      param_dtype: dtype of the projections' parameters (the norms, sinks and position bias
        are float32, as HF keeps them).
    """

    def __init__(self, config, layer_type, *, rngs, dtype=jnp.float32, param_dtype=jnp.float32):
        if not isinstance(config, V4Config):
            raise TypeError(f"config must be a V4Config; got {type(config).__name__}")
        check_layer_type(layer_type)
        if layer_type == V4Config.CSA and config.index_head_dim != INDEX_HEAD_DIM:
            raise ValueError(f"V4Attention: a {V4Config.CSA} layer needs config.index_head_dim "
                             f"{INDEX_HEAD_DIM} (the index-key cache's width); got "
                             f"{config.index_head_dim}")
        self.config, self.layer_type, self.dtype = config, layer_type, dtype
        c, h = config, config.num_heads
        linear = lambda i, o: nnx.Linear(i, o, use_bias=False, dtype=dtype,  # noqa: E731
                                         param_dtype=param_dtype, rngs=rngs)
        self.q_a_proj = linear(c.hidden_size, c.q_lora_rank)
        self.q_a_norm = V4RMSNorm(c.q_lora_rank, eps=c.rms_norm_eps)
        self.q_b_proj = linear(c.q_lora_rank, h * c.head_dim)
        self.kv_proj = linear(c.hidden_size, c.head_dim)
        self.kv_norm = V4RMSNorm(c.head_dim, eps=c.rms_norm_eps)
        init = jax.nn.initializers.lecun_normal(in_axis=-1, out_axis=-2)
        self.o_a_proj = nnx.Param(init(rngs.params(), (c.o_groups * c.o_lora_rank,
                                                       h * c.head_dim // c.o_groups),
                                       param_dtype))
        self.o_b_proj = linear(c.o_groups * c.o_lora_rank, c.hidden_size)
        self.sinks = nnx.Param(jnp.zeros((h,), jnp.float32))
        self.ratio = c.ratio(layer_type)
        self.compressor = (None if layer_type == c.SLIDING else
                           V4Compressor(c, self.ratio, c.head_dim, overlap=layer_type == c.CSA,
                                        rngs=rngs, param_dtype=param_dtype))
        self.indexer = (V4Indexer(c, rngs=rngs, param_dtype=param_dtype) if layer_type == c.CSA
                        else None)
        inv_freq, factor = c.rope(layer_type)
        self.inv_freq = tuple(float(f) for f in inv_freq)  # static, hashable
        self.attention_factor = float(factor)

    # -- cache ---------------------------------------------------------------------------------
    def init_cache(self, batch_size, max_tokens):
        """A V4LayerCache of batch_size new requests, each given its own pages in order: a ring
        of ceil(sliding_window / 64) pages and, in an HCA or CSA layer, pages for the entries of
        max_tokens tokens (in a CSA layer, as many index-key pages, the same table)."""
        ring_pages = -(-self.config.sliding_window // PAGE_SIZE)
        window_table = jnp.arange(batch_size * ring_pages, dtype=jnp.int32).reshape(
            batch_size, ring_pages)
        cache = dict(window=V4KVCache.create(batch_size * ring_pages), window_table=window_table,
                     num_tokens=jnp.zeros((batch_size,), jnp.int32))
        if self.compressor is not None:
            entry_pages = max(1, -(-(max_tokens // self.ratio) // PAGE_SIZE))
            cache.update(
                compressed=V4KVCache.create(batch_size * entry_pages),
                compressed_table=jnp.arange(batch_size * entry_pages, dtype=jnp.int32).reshape(
                    batch_size, entry_pages),
                compressor=initial_state(self.compressor.compressor_weights(), batch_size,
                                         self.dtype))
        if self.indexer is not None:
            cache.update(index_keys=IndexKeyCache.create(batch_size * entry_pages),
                         index_compressor=initial_state(self.indexer.compressor_weights(),
                                                        batch_size, self.dtype))
        return V4LayerCache(**cache)

    # -- projections ---------------------------------------------------------------------------
    def _cos_sin(self, positions):
        """cos, sin (b, s, 32), rounded to the compute dtype as HF's rotary embedding does."""
        freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(self.inv_freq, jnp.float32)
        return ((jnp.cos(freqs) * self.attention_factor).astype(self.dtype),
                (jnp.sin(freqs) * self.attention_factor).astype(self.dtype))

    def project(self, hidden_states, positions):
        """hidden_states (b, s, hidden_size), positions (b, s) int32 -> q (b, s, num_heads,
        512) and kv (b, s, 512), normed and roped, in the compute dtype."""
        c = self.config
        if hidden_states.ndim != 3 or hidden_states.shape[-1] != c.hidden_size:
            raise ValueError(f"hidden_states must have shape (batch, seq, {c.hidden_size}); "
                             f"got {tuple(hidden_states.shape)}")
        b, s, _ = hidden_states.shape
        x = hidden_states.astype(self.dtype)
        q = self.q_b_proj(self._q_residual(x)).reshape(b, s, c.num_heads, c.head_dim)
        scale = jax.lax.rsqrt(jnp.mean(jnp.square(q.astype(jnp.float32)), -1, keepdims=True)
                              + c.rms_norm_eps)
        q = q * scale.astype(q.dtype)
        cos, sin = self._cos_sin(positions)
        q = _rope(q, cos[:, :, None], sin[:, :, None])
        kv = _rope(self.kv_norm(self.kv_proj(x)), cos, sin)
        return q, kv

    def _q_residual(self, x):
        """HF's q_residual: the normed q-latent, which the indexer reads too."""
        return self.q_a_norm(self.q_a_proj(x))

    def _output(self, attn, positions):
        """attn (b, s, num_heads, 512) -> (b, s, hidden_size): RoPE dims rotated back at the
        queries' positions, then the grouped output projection."""
        c = self.config
        b, s = attn.shape[:2]
        cos, sin = self._cos_sin(positions)
        attn = _rope(attn.astype(self.dtype), cos[:, :, None], -sin[:, :, None])
        grouped = attn.reshape(b, s, c.o_groups, -1)
        w = self.o_a_proj[...].astype(self.dtype).reshape(c.o_groups, c.o_lora_rank, -1)
        mixed = jnp.einsum("bsgi,goi->bsgo", grouped, w)
        return self.o_b_proj(mixed.reshape(b, s, -1))

    def _compress(self, weights, state, hidden_states, lengths):
        """A compressor (the layer's or its indexer's) on new tokens: (CompressedEntries, the
        new CompressorState)."""
        # A compressing layer's rope is its compressors' and its indexer's (the compress rope).
        return compress(weights, state, hidden_states.astype(self.dtype), lengths,
                        jnp.asarray(self.inv_freq, jnp.float32), self.attention_factor)

    # -- the indexer (CSA) ---------------------------------------------------------------------
    def select_entries(self, hidden_states, cache, *, lengths=None, implementation=None):
        """A CSA layer's selections for new tokens, as prefill, extend and decode make them:
        the tokens are fed to the indexer's compressor and its completed entries' keys stored,
        then each token's top index_topk visible entries are selected.

        Args:
          hidden_states, cache, lengths: as extend's (a decode step: s 1, lengths 1 for an
            active request, 0 for an idle one).
          implementation: the indexer's, as in jax_flashmla.ops.indexer.index_topk.

        Returns:
          (V4Selection (b, s, index_topk): entries, ascending, -1 after them, and their slots
          in cache.compressed; the cache with the indexer's keys and state updated, the rest
          as it was).
        """
        if self.indexer is None:
            raise ValueError(f"V4Attention.select_entries: layer_type must be {V4Config.CSA!r} "
                             f"(only it has an indexer); got {self.layer_type!r}")
        b, s = _check_tokens("V4Attention.select_entries", hidden_states, cache)
        lengths = _checked_lengths(lengths, b, s)
        return self._select(hidden_states, cache, lengths, implementation)

    def _select(self, hidden_states, cache, lengths, implementation):
        """select_entries' work, lengths already in [0, s]; implementation: index_topk's."""
        weights = self.indexer.indexer_weights()
        entries, state = self._compress(weights.compressor, cache.index_compressor,
                                        hidden_states, lengths)
        # Each entry's key at its slot in the compressed cache (one table for both).
        index_keys = write_v4_index_keys(cache.index_keys, cache.compressed_table, entries)
        start = cache.num_tokens
        x = hidden_states.astype(self.dtype)
        positions = start[:, None] + jnp.arange(x.shape[1], dtype=jnp.int32)
        query = v4_index_query(weights, x, self._q_residual(x), positions,
                               jnp.asarray(self.inv_freq, jnp.float32), self.attention_factor)
        selection = v4_indexer_select(query, index_keys, cache.compressed_table, start, lengths,
                                      ratio=self.ratio, topk=self.config.index_topk,
                                      implementation=implementation)
        return selection, dataclasses.replace(cache, index_keys=index_keys,
                                              index_compressor=state)

    # -- prefill and extend --------------------------------------------------------------------
    def prefill(self, hidden_states, cache, *, lengths=None, implementation=None):
        """Causal attention over new prompts (module doc) through sparse_mla_prefill, over the
        prompts' rows and entries as computed, rounded to bf16; stores their windows' rows,
        their entries and their compressors' states in the cache (a CSA layer: its indexer's
        keys too). Reads from the cache only what it has just stored (a CSA layer's indexer
        scores the prompts' index keys there).

        Args:
          hidden_states: (b, s, hidden_size), prompts right-padded to s.
          cache: V4LayerCache of b new requests (num_tokens 0, compressors at initial_state),
            e.g. init_cache's.
          lengths: optional (b,) int32 prompt lengths (default s); tokens past them are padding
            (their attention 0 before the output projection, never stored or read). A length
            outside [0, s] makes its row empty.
          implementation: as in jax_flashmla.sparse.sparse_mla_prefill (None: FlashMLA's
            kernel on a Hopper GPU, else the pure-JAX reference); a CSA layer's indexer selects
            with the same (jax_flashmla.ops.indexer.index_topk's).

        Returns:
          (out (b, s, hidden_size) in the compute dtype, the updated V4LayerCache); under
          jax.jit donating the cache, written in place. The cache is the same whatever the
          implementation, and whatever the chunks a request's tokens come in (extend).
          Memory: the keys' rows and (b * s, W + K) int32 indices (W the window; K the entries
          a token may read: HCA's a request's table holds (prefill: at most the call's own),
          CSA's index_topk); the reference also gathers (b * s, W + K, 512) float32 rows.
        """
        return self._chunk("V4Attention.prefill", hidden_states, cache, lengths, False,
                           implementation)

    def extend(self, hidden_states, cache, *, lengths=None, implementation=None):
        """New tokens of requests whose first cache.num_tokens tokens went through this layer
        before (a prompt's next chunk, a conversation's next turn): they attend through
        sparse_mla_prefill to their windows, reaching back into the ring (FP8 rows, dequantized),
        and to their requests' compressed entries, the cached ones (FP8, dequantized) and those
        they complete (as computed), in a CSA layer those its indexer selects; the rows they
        compute are rounded to bf16. Then they are stored as prefill stores them.

        Args:
          hidden_states: (b, s, hidden_size) new tokens, right-padded to s; a request's are
            at positions num_tokens, num_tokens + 1, ...
          cache: V4LayerCache of the b requests (a new request: num_tokens 0).
          lengths: optional (b,) int32 new tokens a request (default s), as prefill's.
          implementation: as prefill's.

        Returns:
          (out (b, s, hidden_size) in the compute dtype, the updated V4LayerCache), as
          prefill's. Beside its rows, each call dequantizes every entry its requests' tables
          hold (jax_flashmla/flax/v4_chunk.py).
        """
        return self._chunk("V4Attention.extend", hidden_states, cache, lengths, True,
                           implementation)

    def _chunk(self, where, hidden_states, cache, lengths, read_cache, implementation):
        """prefill (read_cache False: the requests are new) and extend (True)."""
        b, s = _check_tokens(where, hidden_states, cache)
        lengths = _checked_lengths(lengths, b, s)
        start = cache.num_tokens
        offsets = jnp.arange(s, dtype=jnp.int32)
        positions = start[:, None] + offsets
        real = offsets < lengths[:, None]
        q, kv = self.project(hidden_states, positions)
        replaced, entries, picked = {}, None, None
        if self.compressor is not None:
            entries, replaced["compressor"] = self._compress(
                self.compressor.compressor_weights(), cache.compressor, hidden_states, lengths)
            if self.indexer is None:  # HCA: every entry the query has seen, in the table
                span = cache.entry_capacity
                if not read_cache:  # only the call's own entries
                    span = min(span, entries.entry_ids.shape[1])
                ids = jnp.arange(span, dtype=jnp.int32)
                picked = jnp.where(ids < visible_entries(positions, self.ratio)[..., None],
                                   ids, -1)
            else:  # CSA: the entries its indexer selected
                selection, cache = self._select(hidden_states, cache, lengths, implementation)
                picked = selection.entries
            replaced["compressed"] = write_sparse_kv(
                cache.compressed, cache.entry_slots(entries.entry_ids), entries.entries)
        keys = chunk_keys(kv, positions, real, cache, window=self.config.sliding_window,
                          read_cache=read_cache, entries=entries, picked=picked)
        # FlashMLA's sparse prefill computes in bf16: q, like the rows, is handed over in it.
        attn, _ = sparse_mla_prefill(
            q.reshape(b * s, *q.shape[2:]).astype(jnp.bfloat16), keys.rows, keys.indices,
            softmax_scale=self.config.softmax_scale, topk_length=keys.topk_length,
            attn_sink=self.sinks[...], implementation=implementation)
        attn = jnp.where(real[:, :, None, None], attn.reshape(q.shape), 0)
        # The ring keeps each request's last ring_size tokens, one a slot.
        kept = real & (offsets[None] >= lengths[:, None] - cache.ring_size)
        ring_rows = write_sparse_kv(cache.window,
                                    cache.window_slots(jnp.where(kept, positions, -1)), kv)
        cache = dataclasses.replace(cache, window=ring_rows, num_tokens=start + lengths,
                                    **replaced)
        return self._output(attn, positions), cache

    # -- decode --------------------------------------------------------------------------------
    def decode(self, hidden_states, cache, *, active=None, implementation=None):
        """One new token a request, at position cache.num_tokens: stored in the window (and fed
        to the compressor, its completed entry stored; in a CSA layer to the indexer too, which
        then selects the token's entries), then attended through sparse_mla_decode over the FP8
        caches.

        Args:
          hidden_states: (b, 1, hidden_size), each request's new token.
          cache: V4LayerCache of the b requests.
          active: optional (b,) bool (default all True): an idle row (False) stores nothing,
            feeds nothing to its compressor, keeps its num_tokens and gets out 0.
          implementation: as in jax_flashmla.sparse.sparse_mla_decode; a CSA layer's indexer
            selects with the same (jax_flashmla.ops.indexer.index_topk's).

        Returns:
          (out (b, 1, hidden_size) in the compute dtype, the updated V4LayerCache); under
          jax.jit donating the cache, written in place.
        """
        b, s = _check_tokens("V4Attention.decode", hidden_states, cache)
        if s != 1:
            fail(ValueError, "V4Attention.decode", f"hidden_states must hold one token a "
                                                   f"request; got shape {hidden_states.shape}")
        fed = (jnp.ones((b,), jnp.int32) if active is None
               else jnp.asarray(active, jnp.bool_).astype(jnp.int32))
        position = cache.num_tokens
        q, kv = self.project(hidden_states, position[:, None])
        window = write_sparse_kv(cache.window,
                                 cache.window_slots(jnp.where(fed > 0, position, -1)[:, None]),
                                 kv)
        # The window newest first: positions p, p - 1, ..., p - W + 1 (those >= 0 valid).
        recent = position[:, None] - jnp.arange(self.config.sliding_window, dtype=jnp.int32)
        window_indices = cache.window_slots(recent)[:, None]
        window_length = jnp.minimum(position + 1, self.config.sliding_window) * fed
        # FlashMLA's sparse decode takes q in bf16.
        q = q.astype(jnp.bfloat16)
        common = dict(attn_sink=self.sinks[...], softmax_scale=self.config.softmax_scale,
                      implementation=implementation)
        replaced = {}
        if self.compressor is None:
            attn, _ = sparse_mla_decode(q, window, window_indices, topk_length=window_length,
                                        **common)
        else:
            entries, replaced["compressor"] = self._compress(
                self.compressor.compressor_weights(), cache.compressor, hidden_states, fed)
            compressed = write_sparse_kv(cache.compressed, cache.entry_slots(entries.entry_ids),
                                         entries.entries)
            if self.indexer is None:  # HCA: every entry seen
                entry_ids = jnp.broadcast_to(jnp.arange(cache.entry_capacity, dtype=jnp.int32),
                                             (b, cache.entry_capacity))
                indices = cache.entry_slots(entry_ids)[:, None]
                length = visible_entries(position, self.ratio) * fed
            else:  # CSA: the selected entries, first in their rows
                selection, cache = self._select(hidden_states, cache, fed, implementation)
                indices = selection.slots
                length = jnp.sum(selection.entries[:, 0] >= 0, axis=-1, dtype=jnp.int32)
            attn, _ = sparse_mla_decode(
                q, compressed, indices, topk_length=length, extra_kv_cache=window,
                extra_indices=window_indices, extra_topk_length=window_length, **common)
            replaced["compressed"] = compressed
        cache = dataclasses.replace(cache, window=window, num_tokens=position + fed, **replaced)
        return self._output(attn, position[:, None]), cache


def _rms_norm(x, weight, eps):
    h = x.astype(jnp.float32)
    h = h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + eps)
    return (weight * h).astype(x.dtype)


def _rope(x, cos, sin):
    """HF's apply_rotary_pos_emb: interleaved pairs of x's trailing 2 * cos.shape[-1] dims
    rotated in float32 by cos, sin (broadcasting to x's leading axes), back to x's dtype."""
    cos = jnp.repeat(cos, 2, axis=-1).astype(jnp.float32)
    sin = jnp.repeat(sin, 2, axis=-1).astype(jnp.float32)
    rope_dim = cos.shape[-1]
    rope = x[..., -rope_dim:]
    pairs = rope.reshape(*rope.shape[:-1], rope_dim // 2, 2)
    turned = jnp.stack([-pairs[..., 1], pairs[..., 0]], axis=-1).reshape(rope.shape)
    rotated = rope.astype(jnp.float32) * cos + turned.astype(jnp.float32) * sin
    return jnp.concatenate([x[..., :-rope_dim], rotated.astype(x.dtype)], axis=-1)


def _checked_lengths(lengths, b, s):
    """(b,) int32 lengths (default s), each outside [0, s] made 0."""
    if lengths is None:
        return jnp.full((b,), s, jnp.int32)
    return jnp.where((lengths < 0) | (lengths > s), 0, lengths).astype(jnp.int32)


def _check_tokens(where, hidden_states, cache):
    """(b, s) of hidden_states, which must fit the cache's batch."""
    if not isinstance(cache, V4LayerCache):
        fail(TypeError, where, f"cache must be a V4LayerCache; got {type(cache).__name__}")
    if hidden_states.ndim != 3 or hidden_states.shape[0] != cache.num_tokens.shape[0]:
        fail(ValueError, where, f"hidden_states must have shape ({cache.num_tokens.shape[0]}, "
                                f"s, hidden_size) for the cache's batch; got "
                                f"{tuple(hidden_states.shape)}")
    return hidden_states.shape[:2]


