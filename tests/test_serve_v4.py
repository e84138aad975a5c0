"""The served example with DeepSeek-V4's attention (examples/serve_deepseek_mla.py --attention
v4, its model and server in examples/v4_model.py) on CPU: requests of different lengths served
with continuous batching, their prompts in chunks that end inside compression windows, decode
steps, then a second turn over each conversation's cache, all through pages of one
PageAllocator, give the tokens of the same turns served a request at a time, each in the same
row with the pool to itself (the same compiled steps: the rows of a decode step do not touch
each other's numbers); the pages go back to the allocator; the page tables' bookkeeping; the
decode's custom_call refused off the GPU in one sentence."""
import importlib.util
import re
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("flax")
import jax.numpy as jnp  # noqa: E402

from jax_flashmla.serving import PageAllocator, V4PageTables, plan_chunks  # noqa: E402

# Four requests of 20-150 tokens, three rows, a pool that holds two at a time: rows and pages
# are reused. Chunks of 50 tokens end mid-window for both ratios (CSA 4, HCA 16); prompts past
# 64 tokens wrap the window ring.
ARGV = ["--attention", "v4", "--requests", "4", "--batch", "3", "--min-prompt", "20",
        "--max-prompt", "150", "--prefill-chunk", "50", "--turns", "2", "--turn-tokens", "20",
        "--max-new", "5", "--quiet"]


def load_example():
    """The example's module, loaded from its path once per process (as test_flax_mla's)."""
    name = "serve_deepseek_mla"
    if name not in sys.modules:
        path = Path(__file__).resolve().parents[1] / "examples" / f"{name}.py"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def alone(ex, args, cfg, turns, num_pages, max_tokens):
    """Each request's generated tokens, its turns served alone by a server of the served run's
    shapes (the same compiled chunk step), in row 0 with the pool to itself, chunked as the
    served run chunks them."""
    server = ex.v4_model.V4Server(cfg, args.batch, num_pages, max_tokens, args.seed)
    server.compile_decode()
    outputs = {}
    for r, request_turns in enumerate(turns):
        server.admit(r, 0)
        out, length = [], 0
        for k, (user, n) in enumerate(request_turns):
            new = user if k == 0 else np.concatenate([out[-1:], user]).astype(np.int32)
            for chunk in plan_chunks(len(new), args.prefill_chunk, start=length):
                tokens = np.zeros((1, chunk.padded_length), np.int32)
                first = chunk.position - length
                tokens[0, :chunk.length] = new[first:first + chunk.length]
                token, _ = server.prefill(r, 0, jnp.asarray(tokens), chunk)
            length += len(new)
            out.append(int(token[0]))
            row_tokens = jnp.zeros((args.batch,), jnp.int32).at[0].set(token[0])
            for _ in range(n - 1):
                row_tokens, _ = server.decode(row_tokens, [(0, r)], {r: length})
                length += 1
                out.append(int(row_tokens[0]))
        server.finish(r)
        outputs[r] = out
    assert server.allocator.num_free == num_pages
    return outputs


def test_served_v4_turns_are_the_requests_run_alone():
    ex = load_example()
    args = ex.parse_args(ARGV)
    report = {}
    served = ex.serve(args, report)  # raises if a page leaked
    cfg = ex.model_config(args)
    assert {"sliding_attention", "heavily_compressed_attention",
            "compressed_sparse_attention"} == set(cfg.layer_types)
    turns = ex.make_requests(args, cfg.vocab_size)
    max_tokens = max(sum(len(u) + n for u, n in t) for t in turns)
    # More requests than the pool holds at once: pages went back and were handed out again.
    assert report["num_pages"] < args.requests * ex.request_pages(args, max_tokens)
    assert report["page_allocations"] > report["num_pages"]
    # A second turn starts inside a CSA window: its extend completes an entry the first began.
    assert any(p % 4 for prefix in report["prefixes"].values() for p in prefix[1:])
    assert served == alone(ex, args, cfg, turns, report["num_pages"], max_tokens)
    assert len({t for out in served.values() for t in out}) > 4  # not one token over and over


def test_page_tables_follow_the_allocator():
    allocator = PageAllocator(8)
    tables = V4PageTables(allocator, batch_size=2, sliding_window=100, ratios=[4, 16],
                          max_tokens=300)
    assert tables.window_table.shape == (2, 2)  # a ring of 128 slots
    assert {r: t.shape for r, t in tables.compressed_tables.items()} == {4: (2, 2), 16: (2, 1)}
    tables.admit("a", 1)
    assert tables.held("a") == 2 and allocator.num_free == 6
    assert tables.grow("a", 3) == 0  # no entry yet
    assert tables.grow("a", 16) == 2  # the first CSA and HCA entries
    assert tables.grow("a", 260) == 1  # CSA entry 64: its second page
    np.testing.assert_array_equal(tables.window_table, [[-1, -1], [0, 1]])
    np.testing.assert_array_equal(tables.compressed_tables[4], [[-1, -1], [2, 4]])
    np.testing.assert_array_equal(tables.compressed_tables[16], [[-1], [3]])
    assert tables.pages_for(260) == tables.held("a") == 5
    tables.admit("b", 0)
    with pytest.raises(PageAllocator.OutOfPagesError):
        tables.grow("b", 260)  # 3 pages wanted, 1 free: none taken
    assert allocator.num_free == 1 and tables.held("b") == 2
    with pytest.raises(ValueError, match="row must be a free row"):
        tables.admit("c", 0)
    with pytest.raises(ValueError, match=r"num_tokens must be an int in \[0, 300\]"):
        tables.grow("b", 301)
    assert tables.finish("a") == 5 and tables.finish("b") == 2
    assert allocator.num_free == 8 and not allocator.requests
    assert (tables.window_table == -1).all()
    assert all((t == -1).all() for t in tables.compressed_tables.values())


def test_v4_custom_call_off_the_gpu_is_one_sentence(capsys):
    ex = load_example()
    if ex.hopper_gpu():
        pytest.skip("on a Hopper GPU the option is served")
    with pytest.raises(SystemExit) as exit_:
        ex.parse_args(["--attention", "v4", "--implementation", "custom_call"])
    assert exit_.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert "error: --implementation custom_call with --attention v4 runs " in error, error
    assert "Hopper GPU" in error and "--implementation reference" in error, error
    assert not re.search(r"[.!?] \S", error), error  # one sentence
