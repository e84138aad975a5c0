"""benchmarks/bench_v4.py: its tiny configuration (on CPU through the pure-JAX references) and
its report; the step with the indexer selects each CSA layer's top entries; the torch side's
window writer stores the bytes jax_flashmla's writer stores, its entries' slots are
v4_indexer_select's, and its indexer library compiles and loads."""
import sys
import types

import jax.numpy as jnp
import numpy as np
import pytest

from helpers import BENCHMARKS, run_tiny_benchmark
from jax_flashmla.caches.paged import token_slots
from jax_flashmla.caches.v4 import V4KVCache
from jax_flashmla.sparse import write_sparse_kv

sys.path.insert(0, str(BENCHMARKS))


def test_the_tiny_run_writes_its_report(tmp_path):
    prefix = tmp_path / "v4"
    result = run_tiny_benchmark("bench_v4.py", prefix, "--parts", "step", "indexer", "decode",
                                "prefill")
    for part in ("step", "indexer", "decode"):
        assert [r["label"] for r in result[part]] == [f"{part}/b2"]
    assert result["heads"] == result["not_run"] == []
    (prefill,) = result["prefill"]  # no torch and no device time here: jax's wall clock alone
    assert prefill["label"] == "prefill/h16/topk128"
    assert list(prefill["us"]) == list(prefill["host_us"]) == ["jax", "jax_thunks"]
    assert min(prefill["host_us"].values()) > 0
    assert not {"speed_vs_torch", "device_us", "device_time_failed"} & set(prefill)
    assert result["meta"]["layer_types"] == {"heavily_compressed_attention": 3,
                                             "compressed_sparse_attention": 1}
    for record in result["step"] + result["indexer"] + result["decode"]:
        assert record["layers"] == 4 and record["jax_out_finite"]
        assert record["jax_us"] > 0 and record["jax_queued_us"] > 0
        assert "ratio" not in record  # no torch here
    markdown = prefix.with_suffix(".md").read_text()
    assert "## The step with the indexer, µs per layer" in markdown
    assert "## The decodes alone (no window writes" in markdown
    assert "| 16 | 256 | 16 | 128 |" in markdown
    assert prefix.with_suffix(".png").stat().st_size > 0


def test_the_torch_writer_stores_jax_flashmlas_bytes():
    """TorchV4.write (torch ops, captured in the torch step's graph) against write_sparse_kv:
    the same token rows and scale rows, byte for byte, rows of small, large and zero tiles."""
    torch = pytest.importorskip("torch")
    import bench_v4

    rng = np.random.default_rng(0)
    rows = rng.normal(0, 1, (6, 512)) * rng.choice([1e-6, 1.0, 300.0], (6, 1))
    rows[0, :64] = 0  # a tile of zeros: its scale is the floor's
    rows = jnp.asarray(rows, jnp.bfloat16)
    slots = jnp.asarray([0, 63, 64, 100, 190, 255], jnp.int32)
    expected = write_sparse_kv(V4KVCache.create(4), slots, rows).data
    window = torch.zeros((4, 65, 576), dtype=torch.uint8)
    writer = types.SimpleNamespace(torch=torch)
    bench_v4.TorchV4.write(writer, window, torch.from_numpy(np.array(slots)).long(),
                           torch.from_numpy(np.array(rows.astype(jnp.float32))).bfloat16())
    np.testing.assert_array_equal(window.numpy(), np.asarray(expected))


def test_the_indexer_step_reads_each_csa_layers_top_entries():
    """The step with the indexer (pure JAX here) hands its CSA layer the slots of the query's
    top 512 of the context / 4 entries visible, in entry order, by float64 scores of the
    cache's bytes (ties within float32's rounding aside)."""
    import bench_v4

    inp = bench_v4.StepInputs(2, 4096, 16, 4, cache_gb=1, indexer=True)
    step, queue = bench_v4.jax_step(inp)
    _, (out, selected) = step(*inp.arguments())
    queue.pop()
    assert np.isfinite(np.asarray(out, np.float32)).all()
    layer = inp.types.index(bench_v4.CSA)
    data = np.asarray(inp.indexer["keys"][inp.main_of[layer]].data)
    keys = data[:, :8192].view(jnp.float8_e4m3fn).astype(np.float64).reshape(-1, 128)
    key_scales = data[:, 8192:].copy().view(np.float32).reshape(-1).astype(np.float64)
    query = inp.indexer["queries"][layer]
    values = np.asarray(query.values[:, 0]).astype(np.float64)  # (b, 64, 128)
    weights = np.asarray(query.weights[:, 0], np.float64)
    table, entries = np.asarray(inp.indexer["table"]), 4096 // 4
    for request in range(inp.b):
        slots = bench_v4.slots_of(table[request:request + 1], np.arange(entries)[None])[0]
        scores = key_scales[slots] * (np.maximum(values[request] @ keys[slots].T, 0)
                                      * weights[request][:, None]).sum(0)
        picked = np.asarray(selected)[request, 0]
        chosen = np.isin(slots, picked)
        assert chosen.sum() == bench_v4.CSA_TOPK
        np.testing.assert_array_equal(picked, slots[chosen])  # in entry order
        assert scores[chosen].min() >= scores[~chosen].max() - 1e-5 * np.abs(scores).max()


def test_the_torch_entry_slots_are_v4_indexer_selects():
    """torch_indexer.entry_slots: each entry's slot through the table as token_slots gives it,
    -1 at or past visible and on pages outside the cache (negative or past its end)."""
    torch = pytest.importorskip("torch")
    import torch_indexer

    rng = np.random.default_rng(0)
    table = rng.permutation(12).astype(np.int32).reshape(3, 4) - 1  # pages -1 .. 10
    num_pages, visible = 9, np.asarray([256, 100, 0], np.int32)  # pages 9, 10 past the end
    entries = np.tile(np.arange(256, dtype=np.int32), (3, 1))
    expected = np.array(token_slots(jnp.asarray(table), jnp.asarray(entries)))
    expected[(entries >= visible[:, None]) | (expected >= num_pages * 64)] = -1
    got = torch_indexer.entry_slots(torch.from_numpy(table), torch.from_numpy(visible),
                                    num_pages)
    assert got.dtype == torch.int32
    np.testing.assert_array_equal(got.numpy(), expected)


def test_the_torch_indexer_library_builds_and_loads(tmp_path):
    """benchmarks/torch_indexer.cu with ffi/index_topk.cu compiled by nvcc (no GPU needed), its
    C functions loaded; a tensor off the GPU refused with a message before any launch; its
    TopkScratchWidth (which the handler checks the index_topk call's scratch result against)
    is custom_calls.topk_scratch_width at widths cut into pieces once, twice and not at all.
    One test, so that one process compiles it."""
    torch = pytest.importorskip("torch")
    import torch_indexer
    from jax_flashmla.kernels.custom_calls import topk_scratch_width

    if torch_indexer.find_nvcc() is None:
        pytest.skip("nvcc is not found")
    lib = torch_indexer.library()
    assert lib.jax_flashmla_error_string(0) == b"no error"
    assert callable(lib.jax_flashmla_index_scores) and callable(lib.jax_flashmla_topk_positions)
    scores = torch.zeros((2, 64), dtype=torch.float32)
    with pytest.raises(ValueError, match="scores must be a contiguous CUDA tensor"):
        torch_indexer.topk_positions(scores, 8)
    widths = (1, 2048, 32768, 32769, 70000, 300000, 1048576, 2**24 + 3)
    for width in widths:
        for k in (1, 100, 512, 2048, 2049, 4096):
            assert topk_scratch_width(width, k) == lib.jax_flashmla_topk_scratch_width(width, k)
    assert topk_scratch_width(1048576, 512) == 2 * 64 * 512  # one pass: 64 pieces' 512
    assert topk_scratch_width(300000, 2048) == 2 * (38912 + 6144)  # two passes


def test_the_summary_states_the_indexer_step_against_the_bars():
    import v4_report

    record = lambda b, ratio: dict(
        label=f"indexer/b{b}", b=b, jax_us=10.0, torch_graph_us=10.0 / ratio, ratio=ratio,
        bar=1.15 if b == 1 else 1.05, queued_ratio=1.0, torch_best="torch_graph",
        torch_graph_out_identical=True, torch_graph_selection_identical=True)
    result = dict(step=[], indexer=[record(1, 1.1), record(16, 1.06)], decode=[], heads=[],
                  prefill=[], not_run=[])
    lines = v4_report.summary_lines(result)
    assert lines[0] == ("- The step with the indexer against the bars (1.15 at b = 1, 1.05 at "
                        "b >= 16): b=1 1.1 (met), b=16 1.06 (not met).")
    assert lines[2].endswith("out identical: yes; selection identical: yes.")


def test_the_prefill_report_sets_device_time_beside_the_wall_clock():
    """A prefill point with host and device time shows jax's call without command buffers,
    both sides' host µs to issue a call, their device µs and its ratio in the table and the
    summary, and each side's kernels; one whose device time failed says why; one without (CPU)
    leaves the cells empty."""
    import v4_report

    point = lambda topk, **extra: dict(tokens=64, keys=256, h_q=64, topk=topk,
                                       us=dict(jax=12.0, jax_thunks=10.2, torch=10.0), bar=0.95,
                                       speed_vs_torch=[0.8333, 0.8, 0.9], **extra)
    result = dict(step=[], indexer=[], decode=[], heads=[], not_run=[], prefill=[
        point(384, host_us=dict(jax=11.9, torch=2.5), device_us=dict(jax=10.5, torch=10.0),
              device_speed_vs_torch=0.9524,
              kernels_us=dict(jax={"sparse_attn_fwd": 10.1, "loop_fusion": 0.3},
                              torch={"sparse_attn_fwd": 10.0})),
        point(640, device_time_failed="RuntimeError: no GPU activity"), point(128)])
    table = v4_report.prefill_table(result)
    assert table[2].endswith("| 0.95 | 10.2 | 11.9, 2.5 | 10.5, 10.0 | 0.9524 |")
    assert table[3].endswith("| 0.95 | 10.2 |  |  |  |") and table[4] == table[3].replace(
        "| 640 |", "| 128 |")
    assert v4_report.prefill_kernel_lines(result) == [
        "- h_q 64, topk 384, jax: `sparse_attn_fwd` 10.1; `loop_fusion` 0.3",
        "- h_q 64, topk 384, torch: `sparse_attn_fwd` 10.0",
        "- h_q 64, topk 640: no device time (RuntimeError: no GPU activity)"]
    assert ("- Prefill h_q 64 topk 384: 0.8333x torch's speed (bar 0.95: not met); without "
            "command buffers 0.9804x; device time 0.9524x.") in v4_report.summary_lines(result)
