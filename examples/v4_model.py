"""DeepSeek-V4's attention served as serve_deepseek_mla.py serves MLA (--attention v4).

A small seeded model of V4 attention layers (jax_flashmla.flax.V4Attention: sliding
window, HCA, CSA in turn), each in a decoder layer as the example's (RMSNorm -> attention ->
RMSNorm -> SwiGLU MLP), and V4Server, which gives serve_deepseek_mla.serve's loop its steps.

Each layer keeps one V4LayerCache of the decode rows (caches/v4_layer.py): the window rings,
the compressed entries, a CSA layer's index keys, each in its own arrays of the one page pool,
and each row's compressors' states. Their pages come from one PageAllocator through
jax_flashmla.serving.V4PageTables: a request's ring when it joins a row, its entries'
pages as its tokens complete them, all freed when it finishes; every step writes the tables
into the caches. A chunk of a request's new tokens (a prompt's, a later turn's) runs on its row
alone through each layer's extend (FlashMLA's sparse prefill: it attends to the chunk, the
ring's rows before it and the request's entries); a decode step runs every row through each
layer's decode (idle rows write nothing). Both donate the caches: the pages are written in place.
"""
import dataclasses
import functools

import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np

import jax_flashmla as jf
from jax_flashmla.flax import V4Attention, V4Config
from jax_flashmla.serving import PageAllocator, V4PageTables

# The layers' types in turn: three layers hold one of each.
LAYER_CYCLE = (V4Config.SLIDING, V4Config.HCA, V4Config.CSA)


@dataclasses.dataclass(frozen=True)
class V4ModelConfig:
    vocab_size: int = 512
    layer_types: tuple = LAYER_CYCLE
    intermediate_size: int = 512
    # V4's head (512 = 448 + 64 RoPE dims, the FP8 page's row) at a small width; a window of
    # one page and ratios small enough that short prompts wrap the ring and fill entry pages.
    attention: V4Config = V4Config(
        hidden_size=256, num_heads=4, q_lora_rank=96, o_groups=2, o_lora_rank=64,
        sliding_window=64, csa_ratio=4, hca_ratio=16, index_n_heads=4, index_topk=8,
        max_position_embeddings=65536)

    @property
    def num_layers(self):
        return len(self.layer_types)

    @property
    def ratios(self):
        """The compressor ratios of the layers (none for sliding layers)."""
        return sorted({self.attention.ratio(t) for t in self.layer_types} - {0})


def model_config(num_layers, index_topk=None):
    """A V4ModelConfig of num_layers layers, their types LAYER_CYCLE's in turn; index_topk (the
    CSA indexer's) None keeps V4ModelConfig's."""
    attention = V4ModelConfig.attention
    if index_topk is not None:
        attention = dataclasses.replace(attention, index_topk=index_topk)
    return V4ModelConfig(layer_types=tuple(LAYER_CYCLE[i % len(LAYER_CYCLE)]
                                           for i in range(num_layers)), attention=attention)


def pages_for(cfg, num_tokens):
    """The pages a request of num_tokens tokens holds: its ring and its entries'."""
    return V4PageTables.request_pages(cfg.attention.sliding_window, cfg.ratios, num_tokens)


class V4DecoderLayer(nnx.Module):
    def __init__(self, cfg, layer_type, *, rngs, dtype):
        hidden = cfg.attention.hidden_size
        norm = lambda: nnx.RMSNorm(hidden, dtype=dtype, param_dtype=dtype, rngs=rngs)  # noqa: E731
        self.input_layernorm = norm()
        self.self_attn = V4Attention(cfg.attention, layer_type, rngs=rngs, dtype=dtype,
                                     param_dtype=dtype)
        self.post_attention_layernorm = norm()
        linear = lambda i, o: nnx.Linear(i, o, use_bias=False, dtype=dtype,  # noqa: E731
                                         param_dtype=dtype, rngs=rngs)
        self.gate_proj = linear(hidden, cfg.intermediate_size)
        self.up_proj = linear(hidden, cfg.intermediate_size)
        self.down_proj = linear(cfg.intermediate_size, hidden)

    def __call__(self, x, attend, cache):
        h, cache = attend(self.self_attn, self.input_layernorm(x), cache)
        x = x + h
        h = self.post_attention_layernorm(x)
        return x + self.down_proj(jax.nn.silu(self.gate_proj(h)) * self.up_proj(h)), cache


class TinyDeepSeekV4(nnx.Module):
    """Embedding, V4 decoder layers (cfg.layer_types), final norm, LM head (float32 logits, as
    the example's TinyDeepSeek)."""

    def __init__(self, cfg, *, rngs, dtype=jnp.bfloat16):
        hidden = cfg.attention.hidden_size
        self.embed_tokens = nnx.Embed(cfg.vocab_size, hidden, dtype=dtype, param_dtype=dtype,
                                      rngs=rngs)
        layers = [V4DecoderLayer(cfg, t, rngs=rngs, dtype=dtype) for t in cfg.layer_types]
        self.layers = getattr(nnx, "List", list)(layers)  # nnx.List from flax 0.12 on
        self.norm = nnx.RMSNorm(hidden, dtype=dtype, param_dtype=dtype, rngs=rngs)
        self.lm_head = nnx.Linear(hidden, cfg.vocab_size, use_bias=False, dtype=jnp.float32,
                                  param_dtype=dtype, rngs=rngs)

    def _run(self, tokens, attend, caches):
        x = self.embed_tokens(tokens)
        new_caches = []
        for layer, cache in zip(self.layers, caches):
            x, cache = layer(x, attend, cache)
            new_caches.append(cache)
        return self.lm_head(self.norm(x)), tuple(new_caches)

    def extend(self, tokens, caches, lengths):
        """New tokens (b, s) int32 of the caches' requests, right-padded past lengths (b,):
        each layer's extend -> (logits (b, s, vocab) float32, caches)."""
        return self._run(tokens, lambda attn, x, c: attn.extend(x, c, lengths=lengths), caches)

    def decode(self, tokens, caches, active, implementation=None):
        """One token (b, 1) int32 a request, active (b,) bool: each layer's decode ->
        (logits (b, 1, vocab) float32, caches)."""
        return self._run(tokens, lambda attn, x, c: attn.decode(
            x, c, active=active, implementation=implementation), caches)

    def init_caches(self, batch_size, max_tokens):
        """Each layer's V4Attention.init_cache: requests with pages of their own, in order."""
        return tuple(layer.self_attn.init_cache(batch_size, max_tokens) for layer in self.layers)


@functools.cache
def build(cfg, seed=0):
    """(graphdef, state) of the seeded TinyDeepSeekV4 of cfg, built once per process for a
    config and seed (the state is never donated), so that serve() called again builds nothing
    twice."""
    # Under jit: one compilation, not one per initializer op (half the time on a CPU).
    return nnx.split(nnx.jit(lambda: TinyDeepSeekV4(cfg, rngs=nnx.Rngs(seed)))())


def _with_tables(model, caches, tables):
    """The caches with the pages' tables (window_table, {ratio: compressed_table}) written in,
    each layer's entry table its ratio's."""
    window_table, compressed_tables = tables
    return tuple(dataclasses.replace(
        cache, window_table=window_table,
        compressed_table=compressed_tables.get(layer.self_attn.ratio, cache.compressed_table))
        for layer, cache in zip(model.layers, caches))


@functools.partial(jax.jit, donate_argnums=(5,), static_argnames=("graphdef",))
def prefill_step(state, tokens, lengths, row, tables, caches, *, graphdef):
    """One chunk (tokens (1, s), lengths (1,)) of the request in batch row `row` through
    TinyDeepSeekV4.extend on that row alone, the caches donated -> (the greedy token after the
    chunk's last real token (1,), caches)."""
    model = nnx.merge(graphdef, state)
    caches = _with_tables(model, caches, tables)
    logits, rows = model.extend(tokens, tuple(c.batch_row(row) for c in caches), lengths)
    caches = tuple(c.with_batch_row(row, one) for c, one in zip(caches, rows))
    last = jnp.take_along_axis(logits, (lengths - 1)[:, None, None], axis=1)[:, 0]
    return jnp.argmax(last, axis=-1).astype(jnp.int32), caches


@functools.partial(jax.jit, donate_argnums=(0,))
def start_request(caches, row):
    """The caches with batch row `row` a new request's (V4LayerCache.with_new_request)."""
    return tuple(c.with_new_request(row) for c in caches)


class V4Server:
    """The V4 model, its caches and steps over one page pool, as serve_deepseek_mla.serve's
    loop drives them (its PagedServer's methods).

    Args:
      cfg: V4ModelConfig.
      batch_size: the decode rows.
      num_pages: the pool's pages (each layer's window, entry and index-key arrays hold as
        many).
      max_tokens: the most tokens a request holds (sizes the entry tables).
      seed: the weights'.
      implementation: the decode's (sparse_mla_decode's and the indexer's).
      token_queue: a HostQueue each decode step pushes its tokens to, or None.
    """

    def __init__(self, cfg, batch_size, num_pages, max_tokens, seed=0, implementation=None,
                 token_queue=None):
        self.batch_size = batch_size
        self.graphdef, self.state = build(cfg, seed)
        model = nnx.merge(self.graphdef, self.state)
        self.allocator = PageAllocator(num_pages)
        self.tables = V4PageTables(self.allocator, batch_size, cfg.attention.sliding_window,
                                   cfg.ratios, max_tokens)
        # Every layer's arrays span the pool; the tables say whose pages are whose.
        caches = model.init_caches(batch_size, max_tokens)
        self.caches = tuple(_pool_sized(c, num_pages) for c in caches)
        self.implementation, self.token_queue = implementation, token_queue
        self.decode_step = None

    def compile_decode(self):
        """Compiles the decode step (one shape, called over and over: an AlternatingStep)."""
        def decode(state, tokens, active, tables, caches):
            model = nnx.merge(self.graphdef, state)
            logits, caches = model.decode(tokens[:, None], _with_tables(model, caches, tables),
                                          active, self.implementation)
            tokens = jnp.argmax(logits[:, 0], axis=-1).astype(jnp.int32)
            if self.token_queue is not None:
                self.token_queue.push(tokens)
            return tokens, caches

        rows = jnp.zeros((self.batch_size,), jnp.int32)
        self.decode_step = jf.serving.AlternatingStep(
            jax.jit(decode, donate_argnums=(4,)).lower(
                self.state, rows, rows > 0, self._tables(), self.caches).compile())

    def pages_for(self, num_tokens):
        return self.tables.pages_for(num_tokens)

    def held(self, request):
        return self.tables.held(request)

    def admit(self, request, row):
        self.tables.admit(request, row)
        self.caches = start_request(self.caches, jnp.int32(row))

    def finish(self, request):
        self.tables.finish(request)

    @staticmethod
    def chunk_shape(chunk):
        """The compiled shape of a chunk, and in words: its padded tokens alone (extend
        reads every ring slot and entry of the request, whatever its prefix)."""
        return chunk.padded_length, f"{chunk.padded_length} tokens"

    def prefill(self, request, row, tokens, chunk):
        """One chunk (plan_chunks') of the request in `row`, tokens (1, padded) on the
        device -> (its greedy next token (1,), pages added)."""
        added = self.tables.grow(request, chunk.position + chunk.length)
        out, self.caches = prefill_step(self.state, tokens,
                                        jnp.asarray([chunk.length], jnp.int32), jnp.int32(row),
                                        self._tables(), self.caches, graphdef=self.graphdef)
        return out, added

    def decode(self, row_tokens, active, length):
        """One decode step of the rows active, [(row, request)] (length: request -> its tokens
        in the cache), over every row -> (each row's next token (batch,), pages added)."""
        added = sum(self.tables.grow(r, length[r] + 1) for _, r in active)
        mask = np.zeros(self.batch_size, bool)
        mask[[i for i, _ in active]] = True
        tokens, self.caches = self.decode_step(self.state, row_tokens, jnp.asarray(mask),
                                               self._tables(), self.caches)
        return tokens, added

    def _tables(self):
        """The tables as a step's arguments: copies, which the host never changes (on a CPU,
        JAX may read a NumPy array's memory after the call has returned, by when the host may
        have changed it for a later step: the tokens varied from run to run)."""
        return (jnp.asarray(self.tables.window_table.copy()),
                {r: jnp.asarray(t.copy()) for r, t in self.tables.compressed_tables.items()})


def _pool_sized(cache, num_pages):
    """A V4LayerCache of init_cache's rows with its window, entry and index-key arrays of
    num_pages pages each (empty), for pages from the pool."""
    return dataclasses.replace(cache, **{
        name: type(getattr(cache, name)).create(num_pages)
        for name in ("window", "compressed", "index_keys") if getattr(cache, name) is not None})
