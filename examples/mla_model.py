"""The MLA model that serve_deepseek_mla.py serves (its default and --attention v32): a few
decoder layers (RMSNorm -> jax_flashmla.flax.MultiHeadLatentAttention, or V3.2's
SparseMultiHeadLatentAttention -> RMSNorm -> SwiGLU MLP) with seeded random weights, its
jitted prefill and decode steps, and PagedServer, which gives serve_deepseek_mla.serve's loop
its steps over one page pool (v4_model.py holds the same for --attention v4)."""
import dataclasses
import functools

import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np

import jax_flashmla as jf
from jax_flashmla import PagedKVCache
from jax_flashmla.flax import (MLAConfig, MultiHeadLatentAttention, SparseMLAConfig,
                               SparseMultiHeadLatentAttention)
from jax_flashmla.serving import PageAllocator
from jax_flashmla.sparse import IndexKeyCache, SparseKVCache

# The FP8 cache's per-layer k scale: this model's rows (RMS-normed latents, rope keys) stay
# well inside +-448 * K_SCALE.
K_SCALE = 0.05
KV_CACHE_DTYPES = {"bfloat16": jnp.bfloat16, "fp8": jnp.float8_e4m3fn}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 512
    num_layers: int = 2
    intermediate_size: int = 512
    # 64k positions (YaRN: 4k trained positions stretched 16 times), room for 32k-token prompts
    # and their later turns.
    attention: MLAConfig = MLAConfig(
        hidden_size=256, num_heads=8, q_lora_rank=96, kv_lora_rank=512, qk_nope_head_dim=64,
        qk_rope_head_dim=64, v_head_dim=64, rope_theta=10000.0, max_position_embeddings=65536,
        rope_scaling={"type": "yarn", "factor": 16.0, "original_max_position_embeddings": 4096,
                      "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0})


def sparse_config(cfg, index_topk):
    """cfg with DeepSeek-V3.2's attention: the same MLA sizes, an indexer of 8 heads keeping
    index_topk tokens per query."""
    mla = {f.name: getattr(cfg.attention, f.name) for f in dataclasses.fields(MLAConfig)}
    return dataclasses.replace(cfg, attention=SparseMLAConfig(**mla, index_n_heads=8,
                                                              index_topk=index_topk))


def is_sparse(cfg):
    return isinstance(cfg.attention, SparseMLAConfig)


class DecoderLayer(nnx.Module):
    def __init__(self, cfg, *, rngs, dtype):
        hidden = cfg.attention.hidden_size
        norm = lambda: nnx.RMSNorm(hidden, dtype=dtype, param_dtype=dtype, rngs=rngs)  # noqa: E731
        self.input_layernorm = norm()
        attention = SparseMultiHeadLatentAttention if is_sparse(cfg) else MultiHeadLatentAttention
        self.self_attn = attention(cfg.attention, rngs=rngs, dtype=dtype, param_dtype=dtype)
        self.post_attention_layernorm = norm()
        linear = lambda i, o: nnx.Linear(i, o, use_bias=False, dtype=dtype,  # noqa: E731
                                         param_dtype=dtype, rngs=rngs)
        self.gate_proj = linear(hidden, cfg.intermediate_size)
        self.up_proj = linear(hidden, cfg.intermediate_size)
        self.down_proj = linear(cfg.intermediate_size, hidden)

    def mlp(self, x):
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class TinyDeepSeek(nnx.Module):
    """Embedding, num_layers MLA decoder layers (dense MLP), final norm, LM head."""

    def __init__(self, cfg, *, rngs, dtype=jnp.bfloat16):
        self.cfg = cfg
        hidden = cfg.attention.hidden_size
        self.embed_tokens = nnx.Embed(cfg.vocab_size, hidden, dtype=dtype, param_dtype=dtype,
                                      rngs=rngs)
        layers = [DecoderLayer(cfg, rngs=rngs, dtype=dtype) for _ in range(cfg.num_layers)]
        self.layers = getattr(nnx, "List", list)(layers)  # nnx.List from flax 0.12 on
        self.norm = nnx.RMSNorm(hidden, dtype=dtype, param_dtype=dtype, rngs=rngs)
        # Logits in float32: bfloat16's would tie often, and greedy picks would hang on rounding.
        self.lm_head = nnx.Linear(hidden, cfg.vocab_size, use_bias=False, dtype=jnp.float32,
                                  param_dtype=dtype, rngs=rngs)

    def _run(self, tokens, attend, caches, k_scales):
        x = self.embed_tokens(tokens)
        new_caches = []
        for layer, kv, k_scale in zip(self.layers, caches, k_scales or (None,) * len(caches)):
            h, kv = attend(layer.self_attn, layer.input_layernorm(x), kv, k_scale)
            x = x + h
            x = x + layer.mlp(layer.post_attention_layernorm(x))
            new_caches.append(kv)
        return self.lm_head(self.norm(x)), tuple(new_caches)

    def extend(self, tokens, positions, block_table, prefix_lens, lengths, caches, k_scales=None,
               *, max_prefix_tokens, implementation=None, decode_implementation=None):
        """New tokens over each request's cached prefix (a prompt's chunk, a turn), their rows
        written into the caches. tokens, positions (b, s) int32 (positions prefix_lens + 0..);
        block_table (b, max_pages) int32, covering the prefix and the new tokens;
        prefix_lens, lengths (b,) int32 (lengths: the real tokens of each row);
        max_prefix_tokens a static bucket >= the prefixes' pages; k_scales as in decode ->
        (logits (b, s, vocab) f32, caches). implementation: mla_prefill's (long chunks);
        decode_implementation: mla_decode's (short ones, which the layer attends in the
        absorbed form), and V3.2's sparse decode's."""
        if is_sparse(self.cfg):  # each layer's caches: (MLA rows, index keys)
            return self._run(tokens, lambda attn, x, kv, _: _split(attn.extend(
                x, positions, *kv, block_table, prefix_lens, lengths=lengths,
                implementation=decode_implementation)), caches, k_scales)
        return self._run(tokens, lambda attn, x, kv, k_scale: attn.extend(
            x, positions, kv, block_table, prefix_lens, max_prefix_tokens=max_prefix_tokens,
            lengths=lengths, k_scale=k_scale, implementation=implementation,
            decode_implementation=decode_implementation), caches, k_scales)

    def decode(self, tokens, positions, block_table, seq_lens, caches, k_scales=None, *,
               implementation=None):
        """tokens, positions (b, 1) int32; one FlashMLA schedule shared by all layers, made for
        the in-range requests (an out-of-range one comes out empty); V3.2's layers' sparse
        decode schedules itself (a constant of the shapes)."""
        if is_sparse(self.cfg):
            return self._run(tokens, lambda attn, x, kv, _: _split(attn.decode(
                x, positions, *kv, block_table, seq_lens, implementation=implementation)),
                caches, k_scales)
        fp8 = k_scales is not None
        metadata = jf.get_mla_metadata(seq_lens, block_table=block_table,
                                       num_pages=caches[0].num_pages,
                                       num_heads_q=self.cfg.attention.num_heads,
                                       implementation=implementation, fp8=fp8)
        return self._run(tokens, lambda attn, x, kv, k_scale: attn.decode(
            x, positions, kv, block_table, seq_lens, metadata=metadata,
            implementation=implementation, k_scale=k_scale), caches, k_scales)


def _split(result):
    """A V3.2 layer's (out, kv_cache, index_cache) as (out, its caches)."""
    return result[0], result[1:]


@functools.cache
def _model(cfg, seed, dtype):
    """(graphdef, state) of the seeded TinyDeepSeek of cfg, built once per process for a
    config, seed and dtype (the state is never donated), so that serve() called again builds
    no model twice."""
    return nnx.split(TinyDeepSeek(cfg, rngs=nnx.Rngs(seed), dtype=dtype))


def build(cfg, num_pages, seed=0, dtype=jnp.bfloat16, kv_cache_dtype=jnp.bfloat16):
    """(graphdef, state, caches, k_scales) of a seeded model, its empty per-layer paged caches
    (V3.2's: a SparseKVCache and an IndexKeyCache per layer) and, for FP8 caches, their
    per-layer k scales (else None)."""
    graphdef, state = _model(cfg, seed, dtype)
    if is_sparse(cfg):
        return graphdef, state, tuple((SparseKVCache.create(num_pages),
                                       IndexKeyCache.create(num_pages))
                                      for _ in range(cfg.num_layers)), None
    caches = tuple(PagedKVCache.create(num_pages, kv_cache_dtype) for _ in range(cfg.num_layers))
    k_scales = None
    if kv_cache_dtype == jnp.float8_e4m3fn:
        k_scales = tuple(jnp.float32(K_SCALE) for _ in range(cfg.num_layers))
    return graphdef, state, caches, k_scales


@functools.partial(jax.jit, donate_argnums=(6,),
                   static_argnames=("graphdef", "max_prefix_tokens", "implementation",
                                    "decode_implementation"))
def prefill_step(state, tokens, positions, block_table, prefix_lens, lengths, caches, k_scales, *,
                 graphdef, max_prefix_tokens, implementation=None, decode_implementation=None):
    """One chunk through TinyDeepSeek.extend (max_prefix_tokens 0: new prompts, no cache read), the
    caches donated -> (the greedy token after each row's last real token, caches): the next
    token when the chunk ends the row's new tokens. Jitted once per process for a model
    structure (graphdef), so that serve() called again compiles no chunk shape twice."""
    logits, caches = nnx.merge(graphdef, state).extend(
        tokens, positions, block_table, prefix_lens, lengths, caches, k_scales,
        max_prefix_tokens=max_prefix_tokens, implementation=implementation,
        decode_implementation=decode_implementation)
    last = jnp.take_along_axis(logits, (lengths - 1)[:, None, None], axis=1)[:, 0]
    return jnp.argmax(last, axis=-1).astype(jnp.int32), caches


def make_steps(graphdef, implementation=None, token_queue=None, prefill_implementation=None):
    """(prefill, decode) over (state, ...), jitted with the caches donated.

    prefill(state, tokens, positions, block_table, prefix_lens, lengths, caches, k_scales, *,
    max_prefix_tokens) is prefill_step with implementation prefill_implementation
    (mla_prefill's) and decode_implementation implementation.
    decode(state, tokens, positions, block_table, seq_lens, caches, k_scales) -> (tokens,
    logits, caches) is one greedy decode step (implementation: mla_decode's); it pushes its
    tokens to token_queue (a jax_flashmla.serving.HostQueue) where one is given."""

    def decode(state, tokens, positions, block_table, seq_lens, caches, k_scales):
        logits, caches = nnx.merge(graphdef, state).decode(
            tokens[:, None], positions[:, None], block_table, seq_lens, caches, k_scales,
            implementation=implementation)
        tokens = jnp.argmax(logits[:, 0], axis=-1).astype(jnp.int32)
        if token_queue is not None:
            token_queue.push(tokens)
        return tokens, logits[:, 0], caches

    prefill = functools.partial(prefill_step, graphdef=graphdef,
                                implementation=prefill_implementation,
                                decode_implementation=implementation)
    return prefill, jax.jit(decode, donate_argnums=(5,))


def pages_for(tokens):
    """Cache pages (64 tokens each) that hold `tokens` tokens."""
    return -(-tokens // 64)

class PagedServer:
    """The MLA (or V3.2) model, its paged caches and steps over one page pool, as serve()'s
    loop drives them (v4_model.V4Server has the same methods): a request holds the pages of
    its tokens, 64 a page, in token order, and one block-table row names them for every
    layer."""

    def __init__(self, cfg, args, num_pages, max_pages, token_queue):
        self.graphdef, self.state, self.caches, self.k_scales = build(
            cfg, num_pages, args.seed, kv_cache_dtype=KV_CACHE_DTYPES[args.kv_cache_dtype])
        self.prefill_step, self.decode_step = make_steps(
            self.graphdef, args.implementation, token_queue, args.prefill_implementation)
        self.allocator = PageAllocator(num_pages)
        self.batch_size, self.max_pages = args.batch, max_pages

    def compile_decode(self):
        # The decode step has one shape, called over and over: through AlternatingStep, as
        # jax_flashmla documents for a decode step (XLA then replays it without recording
        # again).
        rows = jnp.zeros((self.batch_size,), jnp.int32)
        self.decode_step = jf.serving.AlternatingStep(self.decode_step.lower(
            self.state, rows, rows - 1, jnp.full((self.batch_size, self.max_pages), -1,
                                                 jnp.int32),
            rows, self.caches, self.k_scales).compile())

    def pages_for(self, tokens):
        return pages_for(tokens)

    def held(self, request):
        return len(self.allocator.pages(request))

    def admit(self, request, row):
        self.allocator.admit(request, 0)

    def finish(self, request):
        self.allocator.finish(request)

    @staticmethod
    def chunk_shape(chunk):
        """The compiled shape of a plan_chunks chunk, and in words."""
        return ((chunk.padded_length, chunk.max_prefix_tokens),
                f"{chunk.padded_length} tokens over max_prefix_tokens {chunk.max_prefix_tokens}")

    def prefill(self, request, row, tokens, chunk):
        """One chunk (plan_chunks') of the request, tokens (1, padded) on the device -> (its
        greedy next token (1,), pages added)."""
        position, n, s, max_prefix_tokens = chunk
        added = len(self.allocator.grow(request, position + n))
        # The pages of the prefix bucket and the padded chunk: the shape's own width.
        table = self.allocator.block_table([request], pages_for(max_prefix_tokens + s))
        positions = np.arange(position, position + s, dtype=np.int32)[None]
        out, self.caches = self.prefill_step(
            self.state, tokens, jnp.asarray(positions), jnp.asarray(table),
            jnp.asarray([position], np.int32), jnp.asarray([n], np.int32), self.caches,
            self.k_scales, max_prefix_tokens=max_prefix_tokens)
        return out, added

    def decode(self, row_tokens, active, length):
        """One decode step of the rows active, [(row, request)] (length: request -> its tokens
        in the cache), over every row (idle rows: seq_len 0, their writes dropped) -> (each
        row's next token (batch,), pages added)."""
        positions = np.full(self.batch_size, -1, np.int32)
        seq_lens = np.zeros(self.batch_size, np.int32)
        table = np.full((self.batch_size, self.max_pages), -1, np.int32)
        added = 0
        for i, r in active:
            added += len(self.allocator.grow(r, length[r] + 1))
            positions[i], seq_lens[i] = length[r], length[r] + 1
            table[i] = self.allocator.block_table([r], self.max_pages)[0]
        tokens, _, self.caches = self.decode_step(
            self.state, row_tokens, jnp.asarray(positions), jnp.asarray(table),
            jnp.asarray(seq_lens), self.caches, self.k_scales)
        return tokens, added
