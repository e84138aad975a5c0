"""Serve a small DeepSeek-style model with paged MLA, chunked prefill and continuous batching.

    python examples/serve_deepseek_mla.py                      # CPU: the pure-JAX reference
    python examples/serve_deepseek_mla.py --implementation custom_call  # FlashMLA's C++ model
    python examples/serve_deepseek_mla.py --kv-cache-dtype fp8  # an FP8 (e4m3) cache
    python examples/serve_deepseek_mla.py --max-prompt 600 --prefill-chunk 256  # chunked
    python examples/serve_deepseek_mla.py --turns 2             # a second turn over the cache
    python examples/serve_deepseek_mla.py --attention v32 --index-topk 64  # V3.2's sparse MLA
    python examples/serve_deepseek_mla.py --attention v4 --prefill-chunk 50 --turns 2  # V4's layers
    # On a Hopper GPU (the defaults there: FlashMLA's kernels, cuDNN's prefill):
    python examples/serve_deepseek_mla.py --min-prompt 16384 --max-prompt 32768 --turns 2
    python examples/serve_deepseek_mla.py --attention v32 --implementation custom_call
    python examples/serve_deepseek_mla.py --max-prompt 2048 --prefill-implementation custom_call

A few decoder layers (examples/mla_model.py: RMSNorm -> jax_flashmla.flax.
MultiHeadLatentAttention -> RMSNorm -> SwiGLU MLP) with seeded random weights serve requests of
different prompt lengths. Each iteration admits waiting requests while a decode row is free and
the page pool can hold them (PageAllocator.admit), prefills one chunk of one request's new
tokens, runs one decode step over every request that is decoding (one mla_decode per layer, one
shared FlashMLA schedule per step), grows requests a page at a time, and finishes those done,
whose pages the next admissions reuse. Greedy sampling.

Chunked prefill: a request's new tokens go through the layer's extend at most --prefill-chunk
at a time (jax_flashmla.serving.plan_chunks), each chunk attending to the request's tokens
before it, read from the paged cache, and causally to itself (jax_flashmla.mla_prefill; a
chunk of at most 512 tokens in the absorbed form, through mla_decode); the
other requests decode between two chunks, so a long prompt does not stall them. Chunks are
padded and their prefixes bucketed as plan_chunks gives their shapes, so that the prefill
compiles a few shapes. Multi-turn (--turns): when a request's turn ends, its next turn's user
tokens follow the last generated token, and only these (that token and the user's) are
prefilled, over the conversation so far, which stays in the cache: nothing is prefilled twice.

Each decode step's tokens stay on the device as the next step's input; the step also pushes
them to a jax_flashmla.serving.HostQueue, from which the host pops them only after it has
launched the next step (--sync-each-step: before), so that the host's work on a step overlaps
the GPU's on the one before; the tokens are the same either way. A progress line on stderr,
from the first (compiling) call on, counts the prefilled and decoded tokens. On a Hopper GPU
the default implementations are FlashMLA's kernels (decode) and cuDNN's flash attention
(prefill). With an FP8 cache each layer has a k scale (here a constant; a real checkpoint
carries calibrated ones), and the decode is FlashMLA's FP8 one.

With --attention v32 the layers are DeepSeek-V3.2's (jax_flashmla.flax.
SparseMultiHeadLatentAttention): each has two caches, the 656-byte FP8 MLA rows and the
indexer's keys, whose pages the one allocator and block table cover; every new token, in a
chunk (the layer's extend) or a decode step, attends to the --index-topk tokens the indexer
selects among those before it, through FlashMLA's sparse decode (the pure-JAX reference off
the GPU), one schedule per decode step.

With --attention v4 the layers are DeepSeek-V4's (examples/v4_model.py: sliding window, HCA
and CSA layers in turn, jax_flashmla.flax.V4Attention): each request holds a window
ring and the pages of its compressed entries (a CSA layer's index keys at the same pages),
from the one allocator as it joins and as its tokens complete entries; a chunk runs on its
request's row alone through the layers' extend (FlashMLA's sparse prefill), a decode step
through FlashMLA's sparse decode (MODEL1 pages; the references off the GPU) over every row.
"""
import argparse
import collections
import dataclasses
import importlib.util
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jax_flashmla.serving import HostQueue, plan_chunks

# The models sit beside this file (examples/mla_model.py, examples/v4_model.py), which runs as
# a script or is loaded from its path: either way its folder is where the import looks.
if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.append(str(Path(__file__).resolve().parent))
import mla_model  # noqa: E402
import v4_model  # noqa: E402

# A chunk's prefix (the static max_prefix_tokens of extend) is bucketed to a power of two up to
# this many tokens, then to a multiple of it: a few compiled shapes, less than this much padding.
PREFIX_STEP = 8192


def model_config(args):
    """The served model's config: mla_model.ModelConfig's of args.layers layers, V3.2's
    attention with --attention v32, V4's layers with --attention v4 (v4_model.model_config)."""
    if args.attention == "v4":
        return v4_model.model_config(args.layers, args.index_topk)
    cfg = dataclasses.replace(mla_model.ModelConfig(), num_layers=args.layers)
    return mla_model.sparse_config(cfg, args.index_topk) if args.attention == "v32" else cfg


def request_pages(args, tokens):
    """The pages a request of `tokens` tokens holds: its tokens' (MLA, V3.2), or its window
    ring's and compressed entries' (V4)."""
    if args.attention == "v4":
        return v4_model.pages_for(model_config(args), tokens)
    return mla_model.pages_for(tokens)




class Progress:
    """A status line on stderr from the start of serving, never reset: the seconds since the
    start, prefilled and decoded tokens of all, their rates over the last RATE_WINDOW_S
    seconds, and what runs now (a compilation, say). On a terminal it is rewritten in place
    (at most 10 times a second); elsewhere (a log) a line is printed every `interval` seconds.
    note() prints a line of its own."""

    RATE_WINDOW_S = 5.0

    def __init__(self, prefill_total, decode_total, *, info="starting", enabled=True,
                 stream=None, interval=None):
        self.prefill_total, self.decode_total = prefill_total, decode_total
        self.prefilled = self.decoded = 0
        self.enabled = enabled
        self.stream = sys.stderr if stream is None else stream
        self.tty = enabled and self.stream.isatty()
        self.interval = interval if interval is not None else (0.1 if self.tty else 2.0)
        self.start = time.perf_counter()
        self.recent = collections.deque([(self.start, 0, 0)])
        self.info, self.shown = info, None
        self._show(force=True)

    def update(self, prefilled=0, decoded=0, info=None, force=False):
        """Counts prefilled and decoded tokens; info: what the line says after the counts."""
        self.prefilled += prefilled
        self.decoded += decoded
        if info is not None:
            self.info = info
        now = time.perf_counter()
        self.recent.append((now, self.prefilled, self.decoded))
        while len(self.recent) > 2 and now - self.recent[1][0] > self.RATE_WINDOW_S:
            self.recent.popleft()
        self._show(force)

    def note(self, message):
        if not self.enabled:
            return
        if self.tty:
            self.stream.write("\r\033[K")
        print(message, file=self.stream, flush=True)
        if self.tty:
            self._show(force=True)

    def line(self):
        now = time.perf_counter()
        since, prefilled, decoded = self.recent[0]
        rates = ("", "")
        if now - since > 0.05:
            rates = (f" ({(self.prefilled - prefilled) / (now - since):.0f} tok/s)",
                     f" ({(self.decoded - decoded) / (now - since):.1f} tok/s)")
        return (f"{now - self.start:7.1f} s  prefill {self.prefilled}/{self.prefill_total} tok"
                f"{rates[0]}  decode {self.decoded}/{self.decode_total} tok{rates[1]}  "
                f"{self.info}")

    def _show(self, force=False):
        if not self.enabled:
            return
        now = time.perf_counter()
        if not force and self.shown is not None and now - self.shown < self.interval:
            return
        self.shown = now
        if self.tty:
            self.stream.write("\r\033[K" + self.line())
            self.stream.flush()
        else:
            print(self.line(), file=self.stream, flush=True)

    def close(self):
        self.info = "done"
        self._show(force=True)
        if self.tty:
            print(file=self.stream, flush=True)


def make_requests(args, vocab_size):
    """Per request, its turns: [(new user tokens int32, tokens to generate)]; turn 0's user
    tokens are the prompt."""
    rng = np.random.default_rng(args.seed)
    prompt_lens = rng.integers(args.min_prompt, args.max_prompt + 1, args.requests)
    new_tokens = rng.integers(max(1, args.max_new // 2), args.max_new + 1, args.requests)
    prompts = [rng.integers(0, vocab_size, n).astype(np.int32) for n in prompt_lens]
    turns = [[(p, int(n))] for p, n in zip(prompts, new_tokens)]
    for _ in range(1, args.turns):
        for r in range(args.requests):
            n = rng.integers(max(1, args.turn_tokens // 2), args.turn_tokens + 1)
            turns[r].append((rng.integers(0, vocab_size, n).astype(np.int32),
                             int(rng.integers(max(1, args.max_new // 2), args.max_new + 1))))
    return turns


def serve(args, report=None):
    """Serves the requests of make_requests(args); returns each request's generated tokens,
    {request: [tokens of every turn]}. A dict given as report gets what the run did:
    prefilled (tokens), chunks, chunk_shapes, prefixes ({request: [cached tokens each turn
    started over]}), page_allocations and num_pages (the pool's). Raises AssertionError if
    a page is leaked."""
    cfg = model_config(args)
    turns = make_requests(args, cfg.vocab_size)
    # A request's cache holds every turn's user tokens and every generated token but the last.
    total = [sum(len(u) + n for u, n in t) for t in turns]
    longest = request_pages(args, max(total))
    num_pages = args.num_pages or max(longest, longest * args.batch * 3 // 4)  # tight: reuse
    chunk = args.prefill_chunk
    impl, impl_words = implementation_in_use(args.implementation)
    # Each turn but the first also prefills the last generated token of the turn before.
    prefill_total = sum(len(u) + (k > 0) for t in turns for k, (u, _) in enumerate(t))
    if not args.quiet:
        print(f"serving {args.requests} requests ({args.turns} turn(s) each, prompts of "
              f"{args.min_prompt}-{args.max_prompt} tokens prefilled in chunks of up to {chunk}) "
              f"through {impl_words}; the decode step and each new chunk shape compile once "
              "(seconds each)", file=sys.stderr, flush=True)
    progress = Progress(prefill_total, sum(n - 1 for t in turns for _, n in t),
                        info="building the model", enabled=not args.quiet)
    # The decode step's tokens reach the host through a HostQueue: popped as soon as the GPU
    # wrote them, without waiting for JAX to mark the step's outputs ready and copying them
    # (about 0.2 ms a step on an H200 host). It holds two steps: the one read, the one running.
    token_queue = HostQueue((args.batch,), jnp.int32, depth=2)
    if args.attention == "v4":
        server = v4_model.V4Server(cfg, args.batch, num_pages, max(total), args.seed,
                                   args.implementation, token_queue)
    else:
        server = mla_model.PagedServer(cfg, args, num_pages, mla_model.pages_for(max(total)),
                                       token_queue)
    progress.update(info="compiling the decode step", force=True)
    server.compile_decode()
    allocator = server.allocator

    waiting = list(range(args.requests))
    slots = [None] * args.batch  # request id per decode row
    # Per admitted request: its tokens in the cache (the next token's position), its turn, the
    # chunks of the turn's new tokens still to prefill (None once decoding) and how many
    # tokens the turn generated.
    length, turn, chunks, generated = {}, {}, {}, {}
    turn_tokens = {}  # the turn's new tokens (np.int32), the first from the device after turn 0
    carried = {}  # request -> (1,) device array: the last token of its turn before
    prefixes = {r: [] for r in waiting}  # cached tokens each turn started from
    prefilling = collections.deque()  # requests with chunks to prefill, oldest first
    outputs, allocations = {r: [] for r in waiting}, 0
    shapes, num_chunks = set(), 0
    # Each row's last token stays on the device, the next step's input: the host needs only
    # counts to schedule, so it launches step n+1 before it reads step n's tokens, and XLA's
    # host work for a step overlaps the GPU's work on the one before.
    row_tokens = jnp.zeros((args.batch,), jnp.int32)
    # (device tokens, or None for the token queue's next, [(index into them, request)]) not yet
    # on the host
    unread = []
    start = time.perf_counter()
    decode_time, decode_tokens, steps, timed, chunk_before = 0.0, 0, 0, 0, False

    def read_tokens():
        for tokens, rows in unread:
            tokens = token_queue.pop() if tokens is None else np.asarray(tokens)
            for i, r in rows:
                outputs[r].append(int(tokens[i]))
        unread.clear()

    def start_turn(r, k):
        user, _ = turns[r][k]
        turn[r], generated[r] = k, 0
        # Later turns begin with the turn before's last token, not yet in the cache.
        turn_tokens[r] = user if k == 0 else np.concatenate([np.zeros(1, np.int32), user])
        chunks[r] = collections.deque(plan_chunks(len(turn_tokens[r]), chunk, start=length[r],
                                                  prefix_step=PREFIX_STEP))
        prefixes[r].append(length[r])
        prefilling.append(r)

    def end_turn(i, r):
        """The request's turn is done: its next turn queues for prefill, or it finishes."""
        if turn[r] + 1 < len(turns[r]):
            carried[r] = row_tokens[i:i + 1]
            start_turn(r, turn[r] + 1)
            progress.note(f"request {r} turn {turn[r] + 1}: prefilling only its "
                          f"{len(turn_tokens[r])} new tokens over a cached prefix of {length[r]} "
                          "tokens (the turns before, not prefilled again)")
        else:
            server.finish(r)
            slots[i] = None

    def status():
        active = sum(r is not None for r in slots)
        return (f"active {active} (prefilling {len(prefilling)}) waiting {len(waiting)} "
                f"pages {allocator.num_used}/{num_pages}")

    def reserved():  # pages active requests may still grow into
        return sum(server.pages_for(total[r]) - server.held(r) for r in slots if r is not None)

    while waiting or any(r is not None for r in slots):
        # Admit while a row is free and the pool can hold the whole request, all its turns.
        while waiting and None in slots:
            r = waiting[0]
            if allocator.num_free - reserved() < server.pages_for(total[r]):
                break
            waiting.pop(0)
            row = slots.index(None)
            server.admit(r, row)
            slots[row] = r
            length[r] = 0
            start_turn(r, 0)
        # One chunk of the oldest request with new tokens to prefill.
        chunk_now = bool(prefilling)
        if prefilling:
            r = prefilling[0]
            i = slots.index(r)
            planned = chunks[r].popleft()
            position, n, s, _ = planned
            first = position - prefixes[r][-1]
            tokens = np.zeros((1, s), np.int32)
            tokens[0, :n] = turn_tokens[r][first:first + n]
            tokens = jnp.asarray(tokens)
            if first == 0 and r in carried:  # the turn before's last token, on the device
                tokens = tokens.at[0, :1].set(carried.pop(r))
            shape, words = server.chunk_shape(planned)
            if shape not in shapes:
                shapes.add(shape)
                progress.update(info=f"a new chunk shape, compiled once: {words}", force=True)
            out, added = server.prefill(r, i, tokens, planned)
            allocations += added
            num_chunks += 1
            length[r] = position + n
            if not chunks[r]:  # the turn's last chunk: its first generated token
                prefilling.popleft()
                row_tokens = row_tokens.at[i].set(out[0])
                unread.append((out, [(0, r)]))
                chunks[r] = None
                generated[r] = 1
                if generated[r] >= turns[r][turn[r]][1]:
                    end_turn(i, r)
            progress.update(prefilled=n, info=status())
        active = [(i, r) for i, r in enumerate(slots) if r is not None and chunks[r] is None]
        if active:
            # One decode step over every row (idle rows write nothing).
            t0 = time.perf_counter()
            row_tokens, added = server.decode(row_tokens, active, length)
            allocations += added
            if args.sync_each_step:
                unread.append((None, active))
                read_tokens()
            else:
                read_tokens()  # the steps before this one: this one runs on meanwhile
                unread.append((None, active))
            # Timed: the steps after the first with no prefill chunk just before them (the
            # host's page bookkeeping for the step included).
            if steps > 0 and not chunk_now and not chunk_before:
                decode_time += time.perf_counter() - t0
                decode_tokens += len(active)
                timed += 1
            steps += 1
            for i, r in active:
                length[r] += 1
                generated[r] += 1
                if generated[r] >= turns[r][turn[r]][1]:
                    end_turn(i, r)
            progress.update(decoded=len(active), info=status())
        chunk_before = chunk_now
    read_tokens()
    progress.close()
    elapsed = time.perf_counter() - start
    out_total = sum(len(o) for o in outputs.values())
    assert allocator.num_free == num_pages and not allocator.requests, "pages leaked"
    if report is not None:
        report.update(prefilled=progress.prefilled, chunks=num_chunks, chunk_shapes=len(shapes),
                      prefixes={r: list(prefixes[r]) for r in range(args.requests)},
                      page_allocations=allocations, num_pages=num_pages)
    cache_kind = {"v32": "v32 (FP8 rows + index keys)",
                  "v4": "v4 (FP8 window rings + compressed entries + index keys)"}.get(
        args.attention, args.kv_cache_dtype)
    print(f"implementation={impl} attention={args.attention} kv_cache={cache_kind} "
          f"layers={cfg.num_layers} "
          f"requests={args.requests} "
          f"batch={args.batch} pages={num_pages} ({allocations} page allocations: freed pages "
          f"reused {max(0, allocations - num_pages)} times, none leaked); the decode ran "
          f"{impl_words}")
    print(f"prefilled {progress.prefilled} tokens in {num_chunks} chunks of at most {chunk}, each "
          f"over its request's cached prefix ({len(shapes)} chunk shapes)")
    print(f"generated {out_total} tokens in {elapsed:.2f} s: {out_total / elapsed:.1f} tok/s "
          f"overall, {decode_tokens / max(decode_time, 1e-9):.1f} tok/s in {timed} timed decode "
          f"steps (of {steps}: those after the first with no prefill chunk around them)")
    for r in range(args.requests):
        done = 0
        for k, (user, n) in enumerate(turns[r]):
            tokens = outputs[r][done:done + n]
            done += n
            shown = " ".join(map(str, tokens[:8])) + (" ..." if len(tokens) > 8 else "")
            head = (f"  request {r}: prompt {len(user)} tokens" if k == 0 else
                    f"    turn {k + 1}: {len(user)} user tokens (+ the last reply token) over a "
                    f"cached prefix of {prefixes[r][k]} tokens, not prefilled again")
            print(f"{head}, {len(tokens)} generated: {shown}")
    return outputs


def hopper_gpu():
    """Whether JAX's default backend is a Hopper GPU (sm 9.x), where FlashMLA's kernels and
    cuDNN's prefill run."""
    return jax.default_backend() == "gpu" and any(
        str(getattr(d, "compute_capability", "")).startswith("9.") for d in jax.devices())


def flashmla_here():
    """Whether implementation=None picks FlashMLA's kernels here: a Hopper GPU, and
    jax_flashmla built with its bridge to them."""
    return hopper_gpu() and importlib.util.find_spec("jax_flashmla._flashmla") is not None


def implementation_in_use(implementation):
    """(the implementation's name, what it runs here in words)."""
    name = implementation or ("custom_call" if flashmla_here() else "reference")
    if name == "reference":
        return name, "the pure-JAX reference"
    return name, ("FlashMLA's kernels" if hopper_gpu()
                  else "FlashMLA's C++ model, no Hopper GPU here")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Each option's default, and the epilog's command lines as they are written."""


# --help ends with the command lines of this docstring.
COMMAND_LINES = "suggested command lines:\n" + __doc__.split("\n\n")[1] + "\n"


def refuse_gpu_only_options(p, args):
    """Off a Hopper GPU, an option that needs one is an argument error of one sentence, not a
    traceback from inside the first step."""
    if hopper_gpu():
        return
    backend = jax.default_backend()
    if backend == "gpu":
        backend = f"a {jax.devices()[0].device_kind}"
    here = f"JAX's default backend here is {backend}"
    if args.prefill_implementation == "custom_call":
        p.error(f"--prefill-implementation custom_call runs cuDNN's flash attention, which "
                f"needs a Hopper GPU, and {here}: pass --prefill-implementation reference or "
                "leave it unset")
    if args.implementation == "custom_call" and args.attention in ("v32", "v4"):
        p.error(f"--implementation custom_call with --attention {args.attention} runs "
                f"FlashMLA's sparse kernels and the indexer's CUDA kernels, which need a Hopper "
                f"GPU, and {here}: pass --implementation reference or leave it unset")
    if args.implementation == "custom_call" and jax.default_backend() != "cpu":
        p.error(f"--implementation custom_call runs FlashMLA's kernels, which need a Hopper "
                f"GPU, and {here}: pass --implementation reference or leave it unset")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=COMMAND_LINES,
                                formatter_class=HelpFormatter)
    p.add_argument("--implementation", choices=["custom_call", "reference"], default=None,
                   help="mla_decode's path; unset: FlashMLA on a Hopper GPU, else the reference")
    p.add_argument("--prefill-implementation", choices=["custom_call", "reference"], default=None,
                   help="mla_prefill's path; unset: cuDNN on a Hopper GPU, else pure JAX")
    p.add_argument("--kv-cache-dtype", choices=sorted(mla_model.KV_CACHE_DTYPES),
                   default="bfloat16",
                   help="the paged cache's dtype (fp8: e4m3 with a per-layer scale)")
    p.add_argument("--attention", choices=["mla", "v32", "v4"], default="mla",
                   help="the layers' attention: DeepSeek-V3's dense MLA, V3.2's indexer + "
                        "sparse MLA over its own FP8 cache, or V4's sliding, HCA and CSA "
                        "layers in turn over their window rings and compressed entries")
    p.add_argument("--index-topk", type=int, default=None,
                   help="the tokens (v32) or compressed entries (v4's CSA layers) each query "
                        "attends to; unset: 2048 (v32), v4_model's 8 (v4)")
    p.add_argument("--layers", type=int, default=None,
                   help="decoder layers; unset: 2, or 3 with --attention v4 (one of each type)")
    p.add_argument("--requests", type=int, default=8, help="requests to serve")
    p.add_argument("--batch", type=int, default=4, help="decode rows (max concurrent requests)")
    p.add_argument("--min-prompt", type=int, default=8, help="shortest prompt, in tokens")
    p.add_argument("--max-prompt", type=int, default=100, help="longest prompt, in tokens")
    p.add_argument("--max-new", type=int, default=24,
                   help="max generated tokens per request and turn")
    p.add_argument("--prefill-chunk", type=int, default=2048,
                   help="most tokens prefilled at a time; decode steps of the other requests "
                        "run between two chunks")
    p.add_argument("--turns", type=int, default=1,
                   help="turns per request: each after the first adds user tokens to the "
                        "conversation, prefilled over its cache")
    p.add_argument("--turn-tokens", type=int, default=64,
                   help="most user tokens of a turn after the first")
    p.add_argument("--num-pages", type=int, default=0,
                   help="page pool size; 0: tight, about 3/4 of what all rows could hold")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and the requests")
    p.add_argument("--quiet", action="store_true", help="no progress display")
    p.add_argument("--sync-each-step", action="store_true",
                   help="read each decode step's tokens before launching the next (default: "
                        "launch the next step first)")
    args = p.parse_args(argv)
    refuse_gpu_only_options(p, args)
    if args.attention != "mla" and args.kv_cache_dtype != "bfloat16":
        p.error(f"--kv-cache-dtype is the dense MLA's: --attention {args.attention} has its own "
                "FP8 caches")
    if args.attention == "v4" and args.prefill_implementation is not None:
        p.error("--prefill-implementation is mla_prefill's: --attention v4 prefills through "
                "its layers' extend (sparse_mla_prefill)")
    if args.layers is None:
        args.layers = 3 if args.attention == "v4" else 2
    if args.index_topk is None and args.attention == "v32":
        args.index_topk = 2048
    for name in ("layers", "requests", "batch", "min_prompt", "max_new", "prefill_chunk", "turns",
                 "turn_tokens", "index_topk"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.max_prompt < args.min_prompt:
        p.error("--max-prompt must be >= --min-prompt")
    tokens = args.max_prompt + args.max_new
    what = "--max-prompt + --max-new"
    if args.turns > 1:
        tokens += (args.turns - 1) * (args.turn_tokens + args.max_new)
        what += f" over {args.turns} turns of up to --turn-tokens"
    positions = model_config(args).attention.max_position_embeddings
    if tokens > positions:
        p.error(f"a request of {what} = {tokens} tokens exceeds the model's "
                f"{positions} positions")
    longest = request_pages(args, tokens)
    if args.num_pages < 0 or 0 < args.num_pages < longest:
        p.error(f"--num-pages {args.num_pages} cannot hold a request of {what} = {tokens} "
                f"tokens ({longest} pages of 64)")
    return args


if __name__ == "__main__":
    serve(parse_args())
