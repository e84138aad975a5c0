"""DeepSeek-V2/V3 multi-head latent attention (MLA) as a Flax NNX layer over a paged latent cache.

Prefill and extend attend through jax_flashmla.mla_prefill (keys and values expanded through
kv_b_proj, as the reference implementations do; extend also over the request's prefix in the
paged cache) and write each token's compressed cache row — the normalised kv_lora_rank-d
latent followed by the rope'd qk_rope_head_dim-d key — into the paged cache.
Decode absorbs the up-projections: the no-rope query goes into the latent space through W_UK,
mla_decode attends over the paged cache, and the latent output goes back through W_UV and
o_proj. Parameter names are HF's, so a checkpoint's attention weights load by name
(jax_flashmla.flax.weights).
"""
import dataclasses
import math

import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np

from jax_flashmla.base import validation
from jax_flashmla.caches.paged import token_slots, write_kv
from jax_flashmla.flax import rope
from jax_flashmla.ops import prefill
from jax_flashmla.ops.decode import default_num_sms, mla_decode


@dataclasses.dataclass(frozen=True)
class MLAConfig:
    """DeepSeek's attention configuration, under the names its published configs use.

    q_lora_rank None means a direct q_proj (DeepSeek-V2-Lite). rope_scaling is the published
    dict ({"type" or "rope_type": "yarn", "factor", "original_max_position_embeddings",
    "beta_fast", "beta_slow", "mscale", "mscale_all_dim"}) or None; it is stored as sorted
    (key, value) pairs so that the config hashes (see `rope_scaling_dict`). rms_norm_eps is the
    epsilon of q_a_layernorm and kv_a_layernorm. The paged decode (mla_decode) needs
    kv_lora_rank 512 and qk_rope_head_dim 64; `check_decode` says so.
    """

    hidden_size: int
    num_heads: int
    q_lora_rank: int | None = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: tuple | None = None
    max_position_embeddings: int = 163840
    rope_interleave: bool = True
    attention_bias: bool = False

    def __post_init__(self):
        for name in ("hidden_size", "num_heads", "kv_lora_rank", "qk_nope_head_dim",
                     "qk_rope_head_dim", "v_head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"MLAConfig: {name} must be a positive int; got {value!r}")
        if self.q_lora_rank is not None and (not isinstance(self.q_lora_rank, int)
                                             or self.q_lora_rank < 1):
            raise ValueError(f"MLAConfig: q_lora_rank must be None or a positive int; "
                             f"got {self.q_lora_rank!r}")
        scaling = self.rope_scaling
        if isinstance(scaling, dict):
            scaling = tuple(sorted(scaling.items())) or None
        elif scaling is not None and not isinstance(scaling, tuple):
            raise TypeError(f"MLAConfig: rope_scaling must be a dict or None; got {type(scaling)}")
        object.__setattr__(self, "rope_scaling", scaling)
        for name in ("rope_theta", "rms_norm_eps"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"MLAConfig: {name} must be a positive finite number; "
                                 f"got {value!r}")
        if rope.rope_type(self.rope_scaling_dict) == "yarn":
            rope.check_yarn(self.rope_scaling_dict)
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"MLAConfig: qk_rope_head_dim must be even; got {self.qk_rope_head_dim}")

    @property
    def rope_scaling_dict(self):
        return dict(self.rope_scaling) if self.rope_scaling else None

    @property
    def qk_head_dim(self):
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self):
        """(qk_nope_head_dim + qk_rope_head_dim) ** -0.5, times mscale ** 2 under YaRN."""
        return rope.softmax_scale(self.qk_head_dim, self.rope_scaling_dict,
                                  self.max_position_embeddings)

    def check_decode(self):
        """Raises ValueError unless the latent cache rows are mla_decode's 512 + 64 = 576."""
        if (self.kv_lora_rank, self.qk_rope_head_dim) != (validation.HEAD_DIM_V,
                                                          validation.HEAD_DIM - validation.HEAD_DIM_V):
            raise ValueError(
                f"config: the paged MLA decode needs kv_lora_rank 512 and qk_rope_head_dim 64 "
                f"(576-wide cache rows); got kv_lora_rank {self.kv_lora_rank}, qk_rope_head_dim "
                f"{self.qk_rope_head_dim}")

    @classmethod
    def from_hf(cls, config):
        """From an HF DeepseekV2/V3 config object or its config.json dict."""
        get = (config.get if isinstance(config, dict)
               else lambda name, default=None: getattr(config, name, default))
        for key in ("hidden_size", "num_attention_heads"):  # no default: a model's own sizes
            if get(key) is None:
                raise ValueError(f"MLAConfig.from_hf: the HF config has no {key!r} (a DeepseekV2/"
                                 f"V3 config or its config.json dict has it)")
        scaling = get("rope_scaling") or get("rope_parameters")
        scaling = dict(scaling) if scaling else None
        theta = get("rope_theta") or (scaling or {}).get("rope_theta") or 10000.0
        if scaling is not None:
            scaling.pop("rope_theta", None)
            if rope.rope_type(scaling) == "default":
                scaling = None
        return cls(hidden_size=get("hidden_size"), num_heads=get("num_attention_heads"),
                   q_lora_rank=get("q_lora_rank"), kv_lora_rank=get("kv_lora_rank", 512),
                   qk_nope_head_dim=get("qk_nope_head_dim", 128),
                   qk_rope_head_dim=get("qk_rope_head_dim", 64),
                   v_head_dim=get("v_head_dim", 128), rms_norm_eps=get("rms_norm_eps", 1e-6),
                   rope_theta=float(theta), rope_scaling=scaling,
                   max_position_embeddings=get("max_position_embeddings", 163840),
                   rope_interleave=bool(get("rope_interleave", True)),
                   attention_bias=bool(get("attention_bias", False)))


# Extend takes the absorbed form (mla_decode) up to this many new tokens per row where
# FlashMLA's decode takes them: decompressing the prefix costs the expanded form more than
# the attention itself at short chunks (benchmarks/results/prefill_h200.md: the absorbed form
# 3-9x faster at chunks of 64 over prefixes of 4k-120k, 1.2-1.4x at 512 with 16 heads).
ABSORBED_MAX_TOKENS = 512


class RMSNorm(nnx.Module):
    """HF's DeepSeek RMSNorm: normalise in float32, cast back, then scale by `weight`."""

    def __init__(self, dim, *, eps=1e-6, param_dtype=jnp.float32):
        self.weight = nnx.Param(jnp.ones((dim,), param_dtype))
        self.eps = eps

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.weight[...].astype(x.dtype) * x32.astype(x.dtype)


class MLAProjections(nnx.Module):
    """What DeepSeek's attention layers share, the dense one (MultiHeadLatentAttention) and
    V3.2's (SparseMultiHeadLatentAttention): MLA's parameters, its projections and absorbed
    query, and the dense attention of new tokens among themselves (mla_prefill). Submodules
    carry HF's names (q_a_proj, q_a_layernorm, q_b_proj or q_proj, kv_a_proj_with_mqa,
    kv_a_layernorm, kv_b_proj, o_proj); Linear kernels are (in, out). The layers' caches and
    so their prefill, extend and decode differ, each layer has its own.
    """

    def __init__(self, config, *, rngs, dtype=jnp.float32, param_dtype=jnp.float32):
        if not isinstance(config, MLAConfig):
            raise TypeError(f"config must be an MLAConfig; got {type(config).__name__}")
        self.config = config
        self.dtype = dtype
        c, h = config, config.num_heads
        linear = lambda i, o, bias: nnx.Linear(i, o, use_bias=bias, dtype=dtype,  # noqa: E731
                                               param_dtype=param_dtype, rngs=rngs)
        if c.q_lora_rank is None:
            self.q_proj = linear(c.hidden_size, h * c.qk_head_dim, False)
        else:
            self.q_a_proj = linear(c.hidden_size, c.q_lora_rank, c.attention_bias)
            self.q_a_layernorm = RMSNorm(c.q_lora_rank, eps=c.rms_norm_eps, param_dtype=param_dtype)
            self.q_b_proj = linear(c.q_lora_rank, h * c.qk_head_dim, False)
        self.kv_a_proj_with_mqa = linear(c.hidden_size, c.kv_lora_rank + c.qk_rope_head_dim,
                                         c.attention_bias)
        self.kv_a_layernorm = RMSNorm(c.kv_lora_rank, eps=c.rms_norm_eps, param_dtype=param_dtype)
        self.kv_b_proj = linear(c.kv_lora_rank, h * (c.qk_nope_head_dim + c.v_head_dim), False)
        self.o_proj = linear(h * c.v_head_dim, c.hidden_size, c.attention_bias)
        inv_freq, factor = rope.inv_freq_and_attention_factor(
            c.qk_rope_head_dim, c.rope_theta, c.rope_scaling_dict, c.max_position_embeddings)
        self.inv_freq = tuple(float(f) for f in inv_freq)  # static, hashable
        self.attention_factor = factor

    # -- shared projections -------------------------------------------------------------------
    def project(self, hidden_states, positions):
        """hidden_states (b, s, hidden_size), positions (b, s) int32 ->
        q_nope (b, s, h, qk_nope_head_dim), q_pe (b, s, h, qk_rope_head_dim) rope'd,
        latent (b, s, kv_lora_rank) normalised, k_pe (b, s, qk_rope_head_dim) rope'd;
        all in the compute dtype."""
        c = self.config
        if hidden_states.ndim != 3 or hidden_states.shape[-1] != c.hidden_size:
            raise ValueError(f"hidden_states must have shape (batch, seq, {c.hidden_size}); "
                             f"got {tuple(hidden_states.shape)}")
        if positions.shape != hidden_states.shape[:2]:
            raise ValueError(f"positions must have shape {tuple(hidden_states.shape[:2])}; "
                             f"got {tuple(positions.shape)}")
        if not jnp.issubdtype(positions.dtype, jnp.integer):
            raise TypeError(f"positions must be an integer array; got {positions.dtype}")
        b, s, _ = hidden_states.shape
        x = hidden_states.astype(self.dtype)
        if c.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.reshape(b, s, c.num_heads, c.qk_head_dim)
        q_nope, q_pe = q[..., :c.qk_nope_head_dim], q[..., c.qk_nope_head_dim:]
        compressed = self.kv_a_proj_with_mqa(x)
        latent = self.kv_a_layernorm(compressed[..., :c.kv_lora_rank])
        k_pe = compressed[..., c.kv_lora_rank:]
        cos, sin = rope.cos_sin(positions, self.inv_freq, self.attention_factor)
        q_pe = rope.apply_rope(q_pe, cos, sin, interleave=c.rope_interleave)
        k_pe = rope.apply_rope(k_pe[:, :, None, :], cos, sin, interleave=c.rope_interleave)[:, :, 0]
        return q_nope, q_pe, latent, k_pe

    def _kv_b_split(self):
        """W_UK (kv_lora_rank, h, qk_nope_head_dim) and W_UV (kv_lora_rank, h, v_head_dim)."""
        c = self.config
        w = self.kv_b_proj.kernel[...].astype(self.dtype)
        w = w.reshape(c.kv_lora_rank, c.num_heads, c.qk_nope_head_dim + c.v_head_dim)
        return w[..., :c.qk_nope_head_dim], w[..., c.qk_nope_head_dim:]

    def _output(self, attn):
        b, s = attn.shape[:2]
        return self.o_proj(attn.reshape(b, s, -1).astype(self.dtype))

    def _attend(self, q_nope, q_pe, latent, k_pe, *, lengths, implementation, kv_cache=None,
                block_table=None, prefix_lens=None, max_prefix_tokens=0, k_scale=None):
        """mla_prefill over the projected new tokens, then W_O. Row r of the batch is request
        r, its tokens from row r * s of mla_prefill's token axis."""
        b, s = q_nope.shape[:2]
        w_uk, w_uv = self._kv_b_split()
        q = jnp.concatenate([q_nope, q_pe], axis=-1)
        kv = jnp.concatenate([latent, k_pe], axis=-1)
        if lengths is None:
            lengths = jnp.full((b,), s, jnp.int32)
        # A length past the row would reach into the next request's tokens: -1 makes the
        # request empty instead.
        lengths = jnp.where(lengths > s, -1, lengths)
        attn, _ = prefill.mla_prefill(
            q.reshape(b * s, *q.shape[2:]), kv.reshape(b * s, kv.shape[-1]), kv_cache,
            block_table, prefix_lens, lengths, w_uk=w_uk, w_uv=w_uv,
            softmax_scale=self.config.softmax_scale, max_prefix_tokens=max_prefix_tokens,
            query_starts=None if b == 1 else jnp.arange(b, dtype=jnp.int32) * s,
            k_scale=k_scale, implementation=implementation)
        return self._output(attn.reshape(b, s, *attn.shape[1:]))

    def absorbed_query(self, q_nope, q_pe):
        """(b, s, h, kv_lora_rank + qk_rope_head_dim): q_nope @ W_UK, then the rope'd query."""
        w_uk, _ = self._kv_b_split()
        q_latent = jnp.einsum("bshd,chd->bshc", q_nope, w_uk, preferred_element_type=jnp.float32)
        return jnp.concatenate([q_latent.astype(q_pe.dtype), q_pe], axis=-1)


class MultiHeadLatentAttention(MLAProjections):
    """DeepSeek's MLA over one paged latent cache: MLAProjections' parameters (HF's names) and
    their prefill, extend and decode.

    Args:
      config: MLAConfig.
      rngs: nnx.Rngs for the initial weights.
      dtype: compute dtype of the projections and the prefill attention.
      param_dtype: dtype of the parameters.
    """

    # -- prefill and extend -------------------------------------------------------------------
    def prefill(self, hidden_states, positions, kv_cache=None, slots=None, *, lengths=None,
                k_scale=None, implementation=None):
        """Causal attention over new prompts; writes their compressed rows into the cache.

        Args:
          hidden_states: (b, s, hidden_size), prompts right-padded to s.
          positions: (b, s) int32 positions of the tokens (0.. for a fresh prompt).
          kv_cache: None, or (num_pages, 64, 1, kv_lora_rank + qk_rope_head_dim) bf16 / fp16 /
            float8_e4m3fn (an array or a PagedKVCache) to write the prompt rows into.
          slots: (b, s) int32 cache slots (page * 64 + offset) of the tokens; out-of-range
            slots (padding) are not written. Required with kv_cache.
          lengths: optional (b,) int32 prompt lengths; tokens past them are padding (out 0
            before o_proj) and are never attended to.
          k_scale: with a float8_e4m3fn cache (and only then), its float32 scale: rows are
            stored quantized with it (jax_flashmla.write_kv's scale).
          implementation: as in jax_flashmla.mla_prefill.

        Returns:
          (out (b, s, hidden_size) in the compute dtype, the updated kv_cache or None).
        """
        if kv_cache is not None and slots is None:
            raise ValueError("slots is required when kv_cache is given")
        q_nope, q_pe, latent, k_pe = self.project(hidden_states, positions)
        out = self._attend(q_nope, q_pe, latent, k_pe, lengths=lengths,
                           implementation=implementation)
        if kv_cache is not None:
            kv_cache = _write(kv_cache, slots, latent, k_pe, k_scale)
        return out, kv_cache

    def extend(self, hidden_states, positions, kv_cache, block_table, prefix_lens, *,
               max_prefix_tokens, lengths=None, slots=None, k_scale=None, form=None,
               implementation=None, decode_implementation=None):
        """New tokens of requests whose first prefix_lens tokens are in the paged cache (a
        prompt's next chunk, a conversation's next turn): writes their rows into the cache and
        attends them to that prefix and causally to themselves.

        Args:
          hidden_states: (b, s, hidden_size) new tokens, right-padded to s.
          positions: (b, s) int32: prefix_lens[:, None] + arange(s) for the real tokens.
          kv_cache: (num_pages, 64, 1, 576) bf16 / fp16 / float8_e4m3fn array or PagedKVCache.
          block_table: (b, max_pages) int32 pages of each request, prefix and new tokens.
          prefix_lens: (b,) int32 tokens already cached per request (0: a new prompt).
          max_prefix_tokens: static int, a multiple of 64, >= the sum over the requests of
            their prefixes rounded up to pages (mla_prefill's bucket; the expanded form reads
            and decompresses that many keys).
          lengths: optional (b,) int32 new tokens per row (default s).
          slots: (b, s) int32 cache slots of the new tokens; by default
            jax_flashmla.token_slots(block_table, positions), with padded tokens not written.
          k_scale: with a float8_e4m3fn cache (and only then), its float32 scale.
          form: "expanded" attends through mla_prefill, keys and values decompressed through
            kv_b_proj; "absorbed" through mla_decode with s_q = s, q absorbed into the latent
            space as decode does (s * num_heads query rows at most 64 per SM of the GPU, a
            bf16 / fp16 compute dtype). None picks "absorbed" where it applies and
            s <= ABSORBED_MAX_TOKENS, else "expanded".
          implementation: the expanded form's, as in jax_flashmla.mla_prefill.
          decode_implementation: the absorbed form's, as in jax_flashmla.mla_decode.

        Returns:
          (out (b, s, hidden_size) in the compute dtype, the updated kv_cache).
        """
        self.config.check_decode()
        q_nope, q_pe, latent, k_pe = self.project(hidden_states, positions)
        b, s = positions.shape
        if lengths is None:
            lengths = jnp.full((b,), s, jnp.int32)
        if slots is None:
            real = jnp.arange(s)[None, :] < lengths[:, None]
            slots = jnp.where(real, token_slots(block_table, positions), -1)
        form = self._extend_form(form, s)
        if form == "expanded":
            out = self._attend(q_nope, q_pe, latent, k_pe, lengths=lengths,
                               kv_cache=getattr(kv_cache, "data", kv_cache),
                               block_table=block_table, prefix_lens=prefix_lens,
                               max_prefix_tokens=max_prefix_tokens, k_scale=k_scale,
                               implementation=implementation)
            return out, _write(kv_cache, slots, latent, k_pe, k_scale)
        kv_cache = _write(kv_cache, slots, latent, k_pe, k_scale)
        attn = self._attend_absorbed(q_nope, q_pe, getattr(kv_cache, "data", kv_cache),
                                     block_table, prefix_lens, lengths, k_scale,
                                     decode_implementation)
        return self._output(attn), kv_cache

    def _extend_form(self, form, s):
        sms = default_num_sms()
        fits = (s * self.config.num_heads <= sms * validation.QUERY_TILE_ROWS
                and np.dtype(self.dtype) in validation.SUPPORTED_DTYPES)
        if form is None:
            return "absorbed" if fits and s <= ABSORBED_MAX_TOKENS else "expanded"
        if form not in ("absorbed", "expanded"):
            raise ValueError(f"form must be None, 'absorbed' or 'expanded'; got {form!r}")
        if form == "absorbed" and not fits:
            raise ValueError(
                f"form='absorbed' needs s * num_heads <= {sms} * 64 query rows (FlashMLA's decode "
                f"schedules one 64-row tile per SM) and a bf16 / fp16 compute dtype; got s = {s}, "
                f"num_heads = {self.config.num_heads}, dtype {np.dtype(self.dtype)}")
        return form

    def _attend_absorbed(self, q_nope, q_pe, cache_data, block_table, prefix_lens, lengths,
                         k_scale, implementation):
        """mla_decode over the cache holding the new rows: its causal mask aligns the queries
        to the end of seq_lens, so each row's tokens are moved to the end of its s_q window and
        back. Returns the attention (b, s, h, v_head_dim) before W_O."""
        s = q_nope.shape[1]
        # A row whose length is outside [0, s], or whose prefix is negative or so long that
        # prefix + s would wrap int32, is empty, as in the expanded form: its decode length 0.
        empty = ((lengths < 0) | (lengths > s) | (prefix_lens < 0)
                 | (prefix_lens > jnp.iinfo(jnp.int32).max - s))
        lengths = jnp.where(empty, 0, lengths)
        seq_lens = jnp.where(empty, 0, prefix_lens + lengths)
        shift = (s - lengths)[:, None]
        index = jnp.arange(s)[None, :]

        def take(x, i):
            return jnp.take_along_axis(x, jnp.clip(i, 0, s - 1)[:, :, None, None], axis=1)

        q = self.absorbed_query(q_nope, q_pe)
        q = take(q, index - shift).astype(cache_data.dtype if k_scale is None else jnp.bfloat16)
        out, _ = mla_decode(q, cache_data, block_table, seq_lens,
                                softmax_scale=self.config.softmax_scale, causal=True,
                                implementation=implementation, k_scale=k_scale)
        out = take(out, index + shift)
        out = jnp.where((index < lengths[:, None])[:, :, None, None], out, 0)
        _, w_uv = self._kv_b_split()
        return jnp.einsum("bshc,chd->bshd", out.astype(self.dtype), w_uv)

    # -- decode -------------------------------------------------------------------------------
    def decode(self, hidden_states, positions, kv_cache, block_table, seq_lens, slots=None, *,
               metadata=None, implementation=None, k_scale=None):
        """Writes the new tokens' rows into the paged cache, then attends through mla_decode.

        Args:
          hidden_states: (b, s_q, hidden_size) new tokens (s_q = 1 for plain decode).
          positions: (b, s_q) int32 positions of the new tokens.
          kv_cache: (num_pages, 64, 1, 576) bfloat16 / float16 / float8_e4m3fn array, or a
            PagedKVCache.
          block_table: (b, max_pages) int32.
          seq_lens: (b,) int32 KV lengths including the new tokens (0 for an idle row). A
            request past its block table (a length over max_pages * 64) writes nothing and
            attends to nothing, as mla_decode decodes an out-of-range request.
          slots: (b, s_q) int32 cache slots of the new tokens; by default
            jax_flashmla.caches.paged.token_slots(block_table, positions).
          metadata: MLAMetadata from get_mla_metadata, shared by the layers of one step (made
            with block_table and num_pages, so that out-of-range requests come out empty).
          implementation: as in jax_flashmla.mla_decode.
          k_scale: with a float8_e4m3fn cache (and only then), its float32 scale: the new rows
            are quantized with it and the decode is FlashMLA's FP8 one (get_mla_metadata's
            fp8=True for a shared metadata).

        Returns:
          (out (b, s_q, hidden_size) in the compute dtype, the updated kv_cache).
        """
        self.config.check_decode()
        q_nope, q_pe, latent, k_pe = self.project(hidden_states, positions)
        if slots is None:
            slots = token_slots(block_table, positions)
        kv_cache = _write(kv_cache, slots, latent, k_pe, k_scale)
        cache_data = getattr(kv_cache, "data", kv_cache)
        # The FP8 decode takes q in bf16 and quantizes it with the cache's scale itself.
        q_dtype = cache_data.dtype if k_scale is None else jnp.bfloat16
        q = self.absorbed_query(q_nope, q_pe).astype(q_dtype)
        out_latent, _ = mla_decode(q, cache_data, block_table, seq_lens, metadata=metadata,
                                       softmax_scale=self.config.softmax_scale, causal=True,
                                       implementation=implementation, k_scale=k_scale)
        _, w_uv = self._kv_b_split()
        attn = jnp.einsum("bshc,chd->bshd", out_latent.astype(self.dtype), w_uv)
        return self._output(attn), kv_cache


def _write(kv_cache, slots, latent, k_pe, scale=None):
    """Writes rows [latent | k_pe] at slots into an array cache or a PagedKVCache."""
    return write_kv(kv_cache, slots, latent=latent, rope=k_pe, scale=scale)
