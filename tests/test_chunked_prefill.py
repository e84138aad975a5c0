"""Chunked prefill: serving.plan_chunks and the shapes it gives the chunks, a prompt
prefilled chunk by chunk through the layer's extend against the prompt prefilled at once, and
the served example (examples/serve_deepseek_mla.py) with chunks and with a second turn over the
cache, with DeepSeek-V3's layers and with V3.2's."""
import dataclasses
import io

import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("flax")

from jax_flashmla.caches.paged import PagedKVCache  # noqa: E402
from jax_flashmla.serving import plan_chunks  # noqa: E402
from jax_flashmla.serving.block_table import block_table_from_pages  # noqa: E402
from test_flax_mla import load_example  # noqa: E402




# -- the helpers' contracts -------------------------------------------------------------------

@pytest.mark.parametrize("num_tokens,chunk_size,start",
                         [(150, 48, 0), (128, 64, 0), (1, 64, 0), (64, 64, 0), (65, 64, 0),
                          (0, 64, 0), (37, 16, 100), (32768, 2048, 0), (5, 1, 7)])
def test_plan_chunks_cover_the_tokens_exactly(num_tokens, chunk_size, start):
    chunks = plan_chunks(num_tokens, chunk_size, start=start)
    assert all(isinstance(x, int) for chunk in chunks for x in chunk)
    covered = [t for p, n, _, _ in chunks for t in range(p, p + n)]
    assert covered == list(range(start, start + num_tokens))  # in order, no gap, no overlap
    assert all(c.length == chunk_size for c in chunks[:-1])
    assert all(1 <= c.length <= c.padded_length <= chunk_size for c in chunks)
    assert all(c.position <= c.max_prefix_tokens and c.max_prefix_tokens % 64 == 0
               for c in chunks)
    assert len(chunks) == -(-num_tokens // chunk_size)


def test_plan_chunks_rejects_bad_arguments():
    for args, kwargs in (((-1, 4), {}), ((4, 0), {}), ((4, 2), {"start": -1}), ((4.0, 2), {}),
                         ((True, 2), {}), ((4, 2), {"prefix_step": 0}),
                         ((4, 2), {"prefix_step": 100})):
        with pytest.raises(ValueError, match="plan_chunks"):
            plan_chunks(*args, **kwargs)


def padded_length(num_tokens, chunk_size):
    return plan_chunks(num_tokens, chunk_size)[0].padded_length


def test_a_chunk_pads_to_a_power_of_two_or_to_the_chunk_size():
    # One chunk: the smallest power of two of at least a page, never past the chunk size.
    assert [padded_length(n, 8192) for n in (1, 63, 64, 65, 128, 129, 5000)] == [
        64, 64, 64, 128, 128, 256, 8192]
    assert [padded_length(n, 256) for n in (6, 100, 129, 256)] == [64, 128, 256, 256]
    assert [padded_length(n, 384) for n in (200, 300, 384)] == [256, 384, 384]
    assert padded_length(30, 48) == 48
    # Several chunks: each the chunk size, the last too.
    assert {c.padded_length for c in plan_chunks(150, 64)} == {64}


def prefix_buckets(starts, prefix_step=None):
    return np.array([plan_chunks(1, 64, start=int(p), prefix_step=prefix_step)[0]
                     .max_prefix_tokens for p in starts])


def test_prefix_buckets():
    assert prefix_buckets([0, 1, 63, 64, 65, 128, 129, 5000]).tolist() == [
        0, 64, 64, 64, 128, 128, 256, 8192]
    # Past prefix_step, multiples of it: the padding stays under prefix_step.
    assert prefix_buckets([8192, 8193, 20000, 32768, 32769], 8192).tolist() == [
        8192, 16384, 24576, 32768, 40960]
    assert [c.max_prefix_tokens for c in plan_chunks(150, 48, start=10)] == [64, 64, 128, 256]


def test_prefix_buckets_are_few_and_cover_every_prefix():
    starts = np.arange(0, 65537)
    for step in (None, 8192):
        buckets = prefix_buckets(starts, step)
        assert np.all(buckets >= starts) and np.all(np.diff(buckets) >= 0)
        # 0, then 64 .. 65536 (11), or 64 .. 8192 (8) and 7 multiples of 8192 past it
        assert len(set(buckets.tolist())) == (12 if step is None else 16), step
        if step:
            assert np.all(buckets[starts > step] - starts[starts > step] < step)


# -- chunks against the prompt at once, through the example's model ----------------------------

def prefill_chunks(prefill, state, caches, prompt, chunk, table, max_prefix_tokens):
    """The prompt through the example's jitted prefill (TinyDeepSeek.extend), chunk by chunk,
    each chunk of `chunk` tokens (the last padded to it) with the one static max_prefix_tokens;
    returns (the next token, caches)."""
    for position, n, _, _ in plan_chunks(len(prompt), chunk):
        tokens = np.zeros((1, chunk), np.int32)
        tokens[0, :n] = prompt[position:position + n]
        positions = np.arange(position, position + chunk, dtype=np.int32)[None]
        token, caches = prefill(state, jnp.asarray(tokens), jnp.asarray(positions), table,
                                jnp.asarray([position], np.int32), jnp.asarray([n], np.int32),
                                caches, None, max_prefix_tokens=max_prefix_tokens)
    return token, caches


def greedy_decode(decode, state, token, length, caches, table, steps):
    """steps greedy tokens from the token after a `length`-token cache; also the logits."""
    tokens, logits = [], []
    for _ in range(steps):
        token, step_logits, caches = decode(state, token, jnp.asarray([length], np.int32), table,
                                            jnp.asarray([length + 1], np.int32), caches, None)
        tokens.append(int(token[0]))
        logits.append(np.asarray(step_logits[0]))
        length += 1
    return tokens, np.stack(logits)


def bf16_ulps(a, b):
    """Elementwise distance of two bfloat16 arrays in units in the last place."""
    a, b = (np.asarray(x).view(np.int16).astype(np.int32) for x in (a, b))
    # Sign-magnitude to a monotone integer line.
    a, b = (np.where(x < 0, -32768 - x, x) for x in (a, b))
    return np.abs(a - b)


def test_a_prompt_prefilled_in_chunks_decodes_as_the_prompt_prefilled_at_once():
    """150 tokens in chunks of 48 (boundaries at 48, 96, 144, inside pages: the chunks at 48
    and 96 cross into the next page) through the layer's extend, each chunk over its prefix
    read from the paged bf16 cache, against the prompt at once (extend over no prefix), then
    8 greedy decode steps from each cache.

    Layer 0's rows depend on their token alone (its embedding's projection): they are bit for
    bit the same but for a few elements in 10^5 that the projection's matmul, over 48 rows
    instead of 192, rounds apart (by a bf16 ulp after kv_a_layernorm). Layer 1's
    rows and the logits depend on attention, whose sums the two orders round differently in
    bf16: they agree within that rounding (logits 0.02 apart here). The greedy tokens
    (prefill's, then the decode steps') are the same: this seeded prompt's decode steps have
    no near tie (their top two logits are 0.14 apart or more)."""
    ex = load_example()
    cfg = dataclasses.replace(ex.mla_model.ModelConfig(), num_layers=2)
    num_pages, length, steps = 6, 150, 8
    graphdef, state, _, _ = ex.mla_model.build(cfg, num_pages, seed=1)
    prefill, decode = ex.mla_model.make_steps(graphdef, "reference")
    prompt = np.random.default_rng(7).integers(0, cfg.vocab_size, length).astype(np.int32)
    # Pages out of order, as a pool hands them out: 4 pages, room for max_prefix_tokens 256.
    table = jnp.asarray(block_table_from_pages([[4, 1, 3, 0]], 4))
    runs = {}
    # In chunks of 48, each over max_prefix_tokens 256 (a bucket past every prefix, 0 included);
    # at once: a chunk of 192 over no prefix.
    for chunk, max_prefix_tokens in ((48, 256), (192, 0)):
        caches = tuple(PagedKVCache.create(num_pages, jnp.bfloat16) for _ in range(2))
        token, caches = prefill_chunks(prefill, state, caches, prompt, chunk, table,
                                       max_prefix_tokens)
        rows = [np.asarray(c.data) for c in caches]
        tokens, logits = greedy_decode(decode, state, token, length, caches, table, steps)
        runs[chunk] = [int(token[0])] + tokens, rows, logits
    (tokens, rows, logits), (tokens_once, rows_once, logits_once) = runs[48], runs[192]
    ulps = bf16_ulps(rows[0], rows_once[0])
    assert ulps.max() <= 2 and np.mean(ulps > 0) < 1e-4, (ulps.max(), np.mean(ulps > 0))
    np.testing.assert_allclose(rows[1].astype(np.float32), rows_once[1].astype(np.float32),
                               atol=0.07, rtol=0.02)
    used = np.any(rows[0].astype(np.float32) != 0, axis=(1, 2, 3))
    assert used.tolist() == [False, True, False, True, True, False]  # its pages 4, 1, 3 only
    difference = np.abs(logits - logits_once).max()
    assert difference < 0.1
    top_two = np.sort(logits_once, axis=-1)[:, -2:]
    margin = np.min(top_two[:, 1] - top_two[:, 0])
    assert tokens == tokens_once, (f"greedy tokens differ: logits {difference:.3f} apart, the "
                                   f"top two at least {margin:.3f}")


# -- the served example --------------------------------------------------------------------------

# One page pool for every run, so that the runs share their compiled chunk shapes.
SMALL = ["--implementation", "reference", "--layers", "1", "--requests", "3", "--batch", "2",
         "--min-prompt", "65", "--max-prompt", "110", "--max-new", "4", "--num-pages", "8"]


def test_example_tokens_do_not_depend_on_the_chunk_size():
    """Chunks of 64 (prompts of 65-110 tokens in 2 chunks, a decode step between them) give
    the tokens of chunks of 128 (each prompt at once)."""
    ex = load_example()
    chunked = ex.serve(ex.parse_args(SMALL + ["--prefill-chunk", "64", "--quiet"]))
    assert chunked == ex.serve(ex.parse_args(SMALL + ["--prefill-chunk", "128", "--quiet"]))
    assert len(chunked) == 3 and all(2 <= len(o) <= 4 for o in chunked.values())


def test_example_second_turn_extends_the_cached_conversation():
    """With --turns 2 each request's second turn prefills only its new tokens over the first
    turn's cache; its first turn's tokens are those of the one-turn run."""
    ex = load_example()
    argv = SMALL + ["--prefill-chunk", "64", "--turn-tokens", "20", "--quiet"]
    report = {}
    two = ex.serve(ex.parse_args(argv + ["--turns", "2"]), report)
    turns = ex.make_requests(ex.parse_args(argv + ["--turns", "2"]),
                             ex.mla_model.ModelConfig().vocab_size)
    one = ex.serve(ex.parse_args(argv))
    for r, ((prompt, first), (user, second)) in enumerate(turns):
        assert len(two[r]) == first + second
        assert two[r][:first] == one[r]
        # The second turn started over prompt + the first turn's tokens but its last.
        assert report["prefixes"][r] == [0, len(prompt) + first - 1]
    # Prefilled: each prompt, then each second turn's user tokens and the last reply token.
    assert report["prefilled"] == sum(len(p) + len(u) + 1 for (p, _), (u, _) in turns)


# DeepSeek-V3.2's layers, each token keeping 32 of the tokens before it (the prompts: 65-110).
V32 = SMALL + ["--attention", "v32", "--index-topk", "32", "--quiet"]


def test_v32_example_tokens_do_not_depend_on_the_chunk_size():
    """V3.2's layers read every token through their FP8 caches, chunk or not: chunks of 64
    give the tokens of whole prompts."""
    ex = load_example()
    chunked = ex.serve(ex.parse_args(V32 + ["--prefill-chunk", "64"]))
    assert chunked == ex.serve(ex.parse_args(V32 + ["--prefill-chunk", "128"]))
    assert len(chunked) == 3 and all(2 <= len(o) <= 4 for o in chunked.values())


def test_v32_example_second_turn_extends_the_cached_conversation():
    ex = load_example()
    argv = V32 + ["--prefill-chunk", "64", "--turn-tokens", "20"]
    report = {}
    two = ex.serve(ex.parse_args(argv + ["--turns", "2"]), report)
    one = ex.serve(ex.parse_args(argv))
    turns = ex.make_requests(ex.parse_args(argv + ["--turns", "2"]),
                             ex.mla_model.ModelConfig().vocab_size)
    for r, ((prompt, first), _) in enumerate(turns):
        assert two[r][:first] == one[r]
        assert report["prefixes"][r] == [0, len(prompt) + first - 1]


def test_example_argument_errors(capsys):
    ex = load_example()
    assert ex.parse_args(["--max-prompt", "32768"]).max_prompt == 32768  # the model has room
    for argv, message in ((["--prefill-chunk", "0"], "--prefill-chunk must be >= 1"),
                          (["--max-prompt", "65536"], "exceeds the model's 65536 positions"),
                          (["--turns", "0"], "--turns must be >= 1"),
                          (["--attention", "v32", "--kv-cache-dtype", "fp8"],
                           "--attention v32 has its own FP8 cache"),
                          (["--index-topk", "0"], "--index-topk must be >= 1"),
                          (["--turns", "3", "--num-pages", "2"],
                           "--num-pages 2 cannot hold a request of --max-prompt + --max-new over "
                           "3 turns of up to --turn-tokens = 300 tokens")):
        with pytest.raises(SystemExit):
            ex.parse_args(argv)
        assert message in capsys.readouterr().err, argv


def test_progress_counts_from_the_start():
    """The line is printed when made and counts every token since, the first (compiling)
    update's included."""
    ex = load_example()
    stream = io.StringIO()
    progress = ex.Progress(300, 40, stream=stream, interval=0.0)
    progress.update(prefilled=128, info="compiling")
    progress.update(decoded=3, info="active 2")
    progress.note("a note")
    progress.close()
    lines = stream.getvalue().splitlines()
    assert "prefill 0/300 tok" in lines[0] and "decode 0/40 tok" in lines[0]
    assert "prefill 128/300 tok" in lines[1] and "compiling" in lines[1]
    assert "prefill 128/300 tok" in lines[2] and "decode 3/40 tok" in lines[2]
    assert lines[3] == "a note" and "decode 3/40 tok" in lines[4] and "done" in lines[4]
