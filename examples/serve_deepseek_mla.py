"""Serve a small DeepSeek-style model with paged MLA decode and continuous batching.

    python examples/serve_deepseek_mla.py                      # CPU: the pure-JAX reference
    python examples/serve_deepseek_mla.py --implementation custom_call  # FlashMLA's C++ model
    python examples/serve_deepseek_mla.py --kv-cache-dtype fp8  # an FP8 (e4m3) cache

A few decoder layers (RMSNorm -> jax_flashmla.flax.MultiHeadLatentAttention -> RMSNorm ->
SwiGLU MLP) with seeded random weights serve requests of different prompt lengths. Each
iteration admits waiting requests while the page pool can hold them (PageAllocator.admit),
prefills each new prompt into its pages, runs one decode step over every active request
(one mla_decode per layer, one shared FlashMLA schedule per step), grows requests a page at a
time, and finishes those done, whose pages the next admissions reuse. Greedy sampling. Each
step's tokens stay on the device as the next step's input; the step also pushes them to a
jax_flashmla.serving.HostQueue, from which the host pops them only after it has launched the
next step (--sync-each-step: before), so that the host's work on a step overlaps the GPU's on
the one before; the tokens are the same either way.
Prints a progress line and the tokens per second. On a Hopper GPU the default implementation
is FlashMLA's kernels. With an FP8 cache each layer has a k scale (here a constant; a real
checkpoint carries calibrated ones), and the decode is FlashMLA's FP8 one.
"""
import argparse
import dataclasses
import sys
import time

import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np

import jax_flashmla as jf
from jax_flashmla import kernels
from jax_flashmla.cache import INVALID_SLOT, PagedKVCache, token_slots
from jax_flashmla.serving import HostQueue, PageAllocator, pages_for_tokens
from jax_flashmla.flax import MLAConfig, MultiHeadLatentAttention, RMSNorm

PREFILL_BUCKET = 64  # prompts are padded to a multiple of this, so prefill compiles few shapes
# The FP8 cache's per-layer k scale: this model's rows (RMS-normed latents, rope keys) stay
# well inside +-448 * K_SCALE.
K_SCALE = 0.05
KV_CACHE_DTYPES = {"bfloat16": jnp.bfloat16, "fp8": jnp.float8_e4m3fn}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 512
    num_layers: int = 2
    intermediate_size: int = 512
    attention: MLAConfig = MLAConfig(
        hidden_size=256, num_heads=8, q_lora_rank=96, kv_lora_rank=512, qk_nope_head_dim=64,
        qk_rope_head_dim=64, v_head_dim=64, rope_theta=10000.0, max_position_embeddings=4096,
        rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024,
                      "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0})


class DecoderLayer(nnx.Module):
    def __init__(self, cfg, *, rngs, dtype):
        hidden = cfg.attention.hidden_size
        self.input_layernorm = RMSNorm(hidden, param_dtype=dtype)
        self.self_attn = MultiHeadLatentAttention(cfg.attention, rngs=rngs, dtype=dtype,
                                                  param_dtype=dtype)
        self.post_attention_layernorm = RMSNorm(hidden, param_dtype=dtype)
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
        self.norm = RMSNorm(hidden, param_dtype=dtype)
        self.lm_head = nnx.Linear(hidden, cfg.vocab_size, use_bias=False, dtype=dtype,
                                  param_dtype=dtype, rngs=rngs)

    def _run(self, tokens, attend, caches, k_scales):
        x = self.embed_tokens(tokens)
        new_caches = []
        for layer, kv, k_scale in zip(self.layers, caches, k_scales or (None,) * len(caches)):
            h, kv = attend(layer.self_attn, layer.input_layernorm(x), kv, k_scale)
            x = x + h
            x = x + layer.mlp(layer.post_attention_layernorm(x))
            new_caches.append(kv)
        return self.lm_head(self.norm(x)).astype(jnp.float32), tuple(new_caches)

    def prefill(self, tokens, positions, slots, lengths, caches, k_scales=None):
        """tokens, positions, slots (b, s) int32; lengths (b,) -> (logits (b, s, vocab) f32,
        caches). k_scales: per-layer float32 scales of FP8 caches, else None."""
        return self._run(tokens, lambda attn, x, kv, k_scale: attn.prefill(
            x, positions, kv, slots, lengths=lengths, k_scale=k_scale), caches, k_scales)

    def decode(self, tokens, positions, block_table, seq_lens, caches, k_scales=None, *,
               implementation=None):
        """tokens, positions (b, 1) int32; one FlashMLA schedule shared by all layers, made for
        the in-range requests (an out-of-range one comes out empty), with FP8 caches also the
        one guard for empty requests, as a lax.scan over layers would need."""
        fp8 = k_scales is not None
        metadata = jf.get_mla_metadata(seq_lens, num_heads_q=self.cfg.attention.num_heads,
                                       implementation=implementation, fp8=fp8,
                                       block_table=block_table, num_pages=caches[0].num_pages)
        return self._run(tokens, lambda attn, x, kv, k_scale: attn.decode(
            x, positions, kv, block_table, seq_lens, metadata=metadata,
            implementation=implementation, k_scale=k_scale), caches, k_scales)


def build(cfg, num_pages, seed=0, dtype=jnp.bfloat16, kv_cache_dtype=jnp.bfloat16):
    """(graphdef, state, caches, k_scales) of a seeded model, its empty per-layer paged caches
    and, for FP8 caches, their per-layer k scales (else None)."""
    model = TinyDeepSeek(cfg, rngs=nnx.Rngs(seed), dtype=dtype)
    graphdef, state = nnx.split(model)
    caches = tuple(PagedKVCache.create(num_pages, kv_cache_dtype) for _ in range(cfg.num_layers))
    k_scales = None
    if kv_cache_dtype == jnp.float8_e4m3fn:
        k_scales = tuple(jnp.float32(K_SCALE) for _ in range(cfg.num_layers))
    return graphdef, state, caches, k_scales


def make_steps(graphdef, implementation=None, token_queue=None):
    """Jitted (prefill, decode) over (state, ...) with the caches donated; decode pushes its
    tokens to token_queue (a jax_flashmla.serving.HostQueue) where one is given."""

    def prefill(state, tokens, positions, slots, lengths, caches, k_scales):
        logits, caches = nnx.merge(graphdef, state).prefill(tokens, positions, slots, lengths,
                                                            caches, k_scales)
        last = jnp.take_along_axis(logits, (lengths - 1)[:, None, None], axis=1)[:, 0]
        return jnp.argmax(last, axis=-1).astype(jnp.int32), caches

    def decode(state, tokens, positions, block_table, seq_lens, caches, k_scales):
        logits, caches = nnx.merge(graphdef, state).decode(
            tokens[:, None], positions[:, None], block_table, seq_lens, caches, k_scales,
            implementation=implementation)
        tokens = jnp.argmax(logits[:, 0], axis=-1).astype(jnp.int32)
        if token_queue is not None:
            token_queue.push(tokens)
        return tokens, logits[:, 0], caches

    prefill = jax.jit(prefill, donate_argnums=(5,))
    decode = jax.jit(decode, donate_argnums=(5,))
    return prefill, decode


class Progress:
    """tqdm when installed, else a \\r line on stderr. Rates and ETAs count from the update
    marked warm (the first decode step's, which like the prefills before it compiled)."""

    def __init__(self, total, enabled=True):
        self.total, self.done, self.first, self.bar = total, 0, None, None
        self.enabled = enabled
        if enabled:
            try:
                from tqdm import tqdm
                self.bar = tqdm(total=total, unit="tok", file=sys.stderr)
            except ImportError:
                pass

    def update(self, n, info, warm=False):
        self.done += n
        if not self.enabled:
            return
        now = time.perf_counter()
        if warm and self.first is None:
            self.first = (now, self.done)
            if self.bar is not None:  # restart its clock, the tokens so far not in its rate
                self.bar.reset(total=self.total)
                self.bar.initial = self.bar.n = self.bar.last_print_n = self.done
        elif self.bar is not None:
            self.bar.update(n)
        if self.bar is not None:
            self.bar.set_postfix_str(info)
            return
        since, before = self.first or (now, self.done)
        rate = f"{(self.done - before) / (now - since):8.1f} tok/s" if now > since else "compiling"
        print(f"\r{self.done}/{self.total} tokens  {rate}  {info}", end="", file=sys.stderr,
              flush=True)

    def close(self):
        if self.bar is not None:
            self.bar.close()
        elif self.enabled:
            print(file=sys.stderr)


def serve(args):
    cfg = dataclasses.replace(ModelConfig(), num_layers=args.layers)
    rng = np.random.default_rng(args.seed)
    prompt_lens = rng.integers(args.min_prompt, args.max_prompt + 1, args.requests)
    new_tokens = rng.integers(max(1, args.max_new // 2), args.max_new + 1, args.requests)
    prompts = [rng.integers(0, cfg.vocab_size, n).astype(np.int32) for n in prompt_lens]
    max_pages = int(pages_for_tokens(int((prompt_lens + new_tokens).max())))
    num_pages = args.num_pages or max(max_pages, max_pages * args.batch * 3 // 4)  # tight: reuse
    impl, impl_words = implementation_in_use(args.implementation)
    if not args.quiet:
        print(f"serving {args.requests} requests through {impl_words}; the first prefill and "
              "decode steps compile (a few seconds)...", file=sys.stderr, flush=True)
    graphdef, state, caches, k_scales = build(cfg, num_pages, args.seed,
                                              kv_cache_dtype=KV_CACHE_DTYPES[args.kv_cache_dtype])
    # The decode step's tokens reach the host through a HostQueue: popped as soon as the GPU
    # wrote them, without waiting for JAX to mark the step's outputs ready and copying them
    # (about 0.2 ms a step on an H200 host). It holds two steps: the one read, the one running.
    token_queue = HostQueue((args.batch,), jnp.int32, depth=2)
    prefill, decode = make_steps(graphdef, args.implementation, token_queue)
    # The decode step has one shape, called over and over: through AlternatingStep, as
    # jax_flashmla documents for a decode step (XLA then replays it without recording again).
    rows = jnp.zeros((args.batch,), jnp.int32)
    decode = jf.AlternatingStep(decode.lower(
        state, rows, rows - 1, jnp.full((args.batch, max_pages), -1, jnp.int32), rows, caches,
        k_scales).compile())
    allocator = PageAllocator(num_pages)

    waiting = list(range(args.requests))
    slots = [None] * args.batch  # request id per decode row
    length, outputs, allocations = {}, {r: [] for r in waiting}, 0
    # Each row's last token stays on the device, the next step's input: the host needs only
    # counts to schedule, so it launches step n+1 before it reads step n's tokens, and XLA's
    # host work for a step overlaps the GPU's work on the one before.
    row_tokens = jnp.zeros((args.batch,), jnp.int32)
    # (device tokens, or None for the token queue's next, [(index into them, request)]) not yet
    # on the host
    unread = []
    progress = Progress(int(new_tokens.sum()), enabled=not args.quiet)
    start = time.perf_counter()
    decode_time, decode_tokens, steps = 0.0, 0, 0

    def read_tokens():
        for tokens, rows in unread:
            tokens = token_queue.pop() if tokens is None else np.asarray(tokens)
            for i, r in rows:
                outputs[r].append(int(tokens[i]))
        unread.clear()

    def done(r):  # the prefill made a request's first token, each decode step one more
        return length[r] - prompt_lens[r] + 1 >= new_tokens[r]

    def reserved():  # pages active requests may still grow into
        return sum(int(pages_for_tokens(prompt_lens[r] + new_tokens[r])) - len(allocator.pages(r))
                   for r in slots if r is not None)

    while waiting or any(r is not None for r in slots):
        # Admit while a row is free and the pool can hold the whole request.
        while waiting and None in slots:
            r = waiting[0]
            n = int(prompt_lens[r])
            if allocator.num_free - reserved() < pages_for_tokens(n + int(new_tokens[r])):
                break
            waiting.pop(0)
            pages = allocator.admit(r, n)
            allocations += len(pages)
            i = slots.index(None)
            slots[i] = r
            s = -(-n // PREFILL_BUCKET) * PREFILL_BUCKET
            tokens = np.zeros((1, s), np.int32)
            tokens[0, :n] = prompts[r]
            positions = np.arange(s, dtype=np.int32)[None]
            table = allocator.block_table([r], max_pages)
            token_slot = np.where(positions < n, token_slots(jnp.asarray(table), jnp.asarray(positions)),
                                  INVALID_SLOT).astype(np.int32)
            first, caches = prefill(state, jnp.asarray(tokens), jnp.asarray(positions),
                                    jnp.asarray(token_slot), jnp.asarray([n], np.int32), caches,
                                    k_scales)
            row_tokens = row_tokens.at[i].set(first[0])
            unread.append((first, [(0, r)]))
            length[r] = n
            progress.update(1, f"active {sum(x is not None for x in slots)} waiting {len(waiting)}")
        # Finish requests whose budget the prefill token used up.
        for i, r in enumerate(slots):
            if r is not None and done(r):
                allocator.finish(r)
                slots[i] = None
        active = [(i, r) for i, r in enumerate(slots) if r is not None]
        if not active:
            continue
        # One decode step over every row (idle rows: seq_len 0, their writes dropped).
        positions = np.full(args.batch, -1, np.int32)
        seq_lens = np.zeros(args.batch, np.int32)
        table = np.full((args.batch, max_pages), -1, np.int32)
        for i, r in active:
            allocations += len(allocator.grow(r, length[r] + 1))
            positions[i], seq_lens[i] = length[r], length[r] + 1
            table[i] = allocator.block_table([r], max_pages)[0]
        t0 = time.perf_counter()
        row_tokens, _, caches = decode(state, row_tokens, jnp.asarray(positions),
                                       jnp.asarray(table), jnp.asarray(seq_lens), caches,
                                       k_scales)
        if args.sync_each_step:
            unread.append((None, active))
            read_tokens()
        else:
            read_tokens()  # the steps before this one: this one runs on meanwhile
            unread.append((None, active))
        if steps > 0:  # the first step includes compilation
            decode_time += time.perf_counter() - t0
            decode_tokens += len(active)
        steps += 1
        for i, r in active:
            length[r] += 1
            if done(r):
                allocator.finish(r)
                slots[i] = None
        progress.update(len(active), f"active {len(active)} waiting {len(waiting)} "
                                     f"pages {allocator.num_used}/{num_pages}", warm=steps == 1)
    read_tokens()
    progress.close()
    elapsed = time.perf_counter() - start
    total = sum(len(o) for o in outputs.values())
    assert allocator.num_free == num_pages and not allocator.requests, "pages leaked"
    print(f"implementation={impl} kv_cache_dtype={args.kv_cache_dtype} layers={cfg.num_layers} "
          f"requests={args.requests} "
          f"batch={args.batch} pages={num_pages} ({allocations} page allocations: freed pages "
          f"reused {max(0, allocations - num_pages)} times, none leaked); the decode ran "
          f"{impl_words}")
    print(f"generated {total} tokens in {elapsed:.2f} s: {total / elapsed:.1f} tok/s overall, "
          f"{decode_tokens / max(decode_time, 1e-9):.1f} tok/s in {steps - 1} timed decode steps")
    for r in range(args.requests):
        shown = " ".join(map(str, outputs[r][:8])) + (" ..." if len(outputs[r]) > 8 else "")
        print(f"  request {r}: prompt {prompt_lens[r]} tokens, {len(outputs[r])} generated: "
              f"{shown}")
    return outputs


def implementation_in_use(implementation):
    """(the implementation's name, what it runs here in words)."""
    name = implementation or ("custom_call" if kernels.flashmla_available() else "reference")
    if name == "reference":
        return name, "the pure-JAX reference"
    on_gpu = kernels.flashmla_available()
    return name, "FlashMLA's kernels" if on_gpu else "FlashMLA's C++ model, no Hopper GPU here"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--implementation", choices=["custom_call", "reference"], default=None,
                   help="mla_decode's path; unset: FlashMLA on a Hopper GPU, else the reference")
    p.add_argument("--kv-cache-dtype", choices=sorted(KV_CACHE_DTYPES), default="bfloat16",
                   help="the paged cache's dtype (fp8: e4m3 with a per-layer scale)")
    p.add_argument("--layers", type=int, default=2, help="decoder layers")
    p.add_argument("--requests", type=int, default=8, help="requests to serve")
    p.add_argument("--batch", type=int, default=4, help="decode rows (max concurrent requests)")
    p.add_argument("--min-prompt", type=int, default=8, help="shortest prompt, in tokens")
    p.add_argument("--max-prompt", type=int, default=100, help="longest prompt, in tokens")
    p.add_argument("--max-new", type=int, default=24, help="max generated tokens per request")
    p.add_argument("--num-pages", type=int, default=0,
                   help="page pool size; 0: tight, about 3/4 of what all rows could hold")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and the requests")
    p.add_argument("--quiet", action="store_true", help="no progress display")
    p.add_argument("--sync-each-step", action="store_true",
                   help="read each decode step's tokens before launching the next (default: "
                        "launch the next step first)")
    args = p.parse_args(argv)
    for name in ("layers", "requests", "batch", "min_prompt", "max_new"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.max_prompt < args.min_prompt:
        p.error("--max-prompt must be >= --min-prompt")
    longest = int(pages_for_tokens(args.max_prompt + args.max_new))
    if args.num_pages < 0 or 0 < args.num_pages < longest:
        p.error(f"--num-pages {args.num_pages} cannot hold a request of --max-prompt + --max-new "
                f"= {args.max_prompt + args.max_new} tokens ({longest} pages of 64)")
    return args


if __name__ == "__main__":
    serve(parse_args())
