"""benchmarks/bench_context.py: its tiny configuration (on CPU through the pure-JAX references),
the bytes per token of each layout against the arrays it built, a point skipped for memory,
the report's growth figures, and the indexer points: their kernel split from a trace's
activities, their HBM floors and the bar."""
import math
import sys

import pytest

from helpers import BENCHMARKS, run_tiny_benchmark

sys.path.insert(0, str(BENCHMARKS))
import context_report  # noqa: E402

V4_PAGE = 65 * 576  # 64 MODEL1 tokens and their scale row
RING = 2 * V4_PAGE  # the 128-token window, 2 pages a request
# Compressor states a request (bf16 projections, float32 biased gates, an int32 count): HCA's
# window of 128 x 512 kv and gate; CSA's of 4 x 1024 and its overlap (4 x 512, bf16 and
# float32); the CSA indexer's of 4 x 256 and 4 x 128.
HCA_STATE = 2 * 128 * 512 * 2 + 4
CSA_STATE = (2 * 4 * 1024 * 2 + 4 * 512 * (2 + 4) + 4) + (2 * 4 * 256 * 2 + 4 * 128 * (2 + 4) + 4)


def expected_bytes_per_token(family, context):
    """The layer's cache bytes a token of a request (its pages, then its states), by hand."""
    entry_pages = lambda ratio: max(1, math.ceil(context // ratio / 64))
    return dict(dense_bf16=1152, dense_fp8=576, v32=656 + 132,
                v4_hca=(entry_pages(128) * V4_PAGE + RING + HCA_STATE) / context,
                v4_csa=(entry_pages(4) * (V4_PAGE + 64 * 132) + RING + CSA_STATE) / context,
                v4_sliding=RING / context)[family]


def test_the_tiny_run_writes_its_report(tmp_path):
    prefix = tmp_path / "context"
    result = run_tiny_benchmark("bench_context.py", prefix, "--batches", "2")
    families = context_report.READS.keys()
    layers = [r for r in result["points"] if "context" in r]
    assert {context_report.label(r["family"], r["b"], r["context"]) for r in layers} == {
        f"{family}/b2/ctx{context}" for family in families for context in (256, 1024)}
    indexers = [r for r in result["points"] if "entries" in r]
    assert {context_report.indexer_label(r["family"], r["b"], r["entries"])
            for r in indexers} == {f"{family}/b2/entries{entries}" for entries in (256, 1024)
                                   for family in ("v32_indexer", "v4_indexer")}
    for r in indexers:  # every key valid: each row selects its topk (64, 32 tiny)
        assert r["selected_all"] and r["us"] > 0 and "device_us" not in r
        assert r["index_bytes"] == 2 * r["entries"] * 132 and "scoring_us" not in r
    assert result["not_run"] == [] and result["failed"] == {}
    assert result["meta"]["implementation"] == "reference"
    for r in layers:
        assert r["out_finite"] and r["us"] > 0 and "device_us" not in r  # no GPU here
        assert r["bytes_per_token"] == pytest.approx(  # the JSON's 6 significant digits
            expected_bytes_per_token(r["family"], r["context"]), rel=1e-5)
        # The arrays built, a copy's bytes over its tokens, are the layout's pages.
        assert r["measured_bytes_per_token"] == pytest.approx(r["pages_bytes_per_token"], rel=1e-5)
        assert r["heads"] == 16 and 1 <= r["copies"] <= 4
    growth = {(g["family"], g["b"]): g for g in result["growth"]}
    assert set(growth) == {(f, b) for f in families for b in (2, None)}
    assert (growth["dense_bf16", None]["slope"], growth["dense_bf16", None]["trend"]) == (0, "flat")
    assert growth["v4_sliding", None]["slope"] == pytest.approx(-1)  # the window alone
    assert growth["v4_csa", 2]["contexts"] == [256, 1024] and growth["v4_csa", 2]["what"] == "us"
    markdown = prefix.with_suffix(".md").read_text()
    assert "## How each grows" in markdown and "| v4_csa | 2 | 1024 | 16 |" in markdown
    assert "fixed 74,880 B a request (window ring 74,880, compressor states 0)" in markdown
    assert "- No HBM floor: cpu is not in context_report.HBM_BYTES_PER_S" in markdown
    assert "## The indexer points" in markdown and "| v4_indexer | 2 | 1024 | " in markdown
    assert 0 < prefix.with_suffix(".png").stat().st_size <= 60_000


def test_a_point_that_would_not_fit_is_skipped_with_its_reason(monkeypatch):
    import bench_context

    monkeypatch.setattr(bench_context, "free_bytes", lambda: 10**9)
    record = bench_context.run_point("dense_bf16", 1048576, 16, bench_context.GPU, None)
    assert record["skipped"].startswith("needs ~") and record["skipped"].endswith("1.0 free")
    assert record["bytes_per_token"] == 1152 and "us" not in record
    indexer = bench_context.run_indexer_point("v4_indexer", 1048576, 64, bench_context.GPU,
                                              None)
    assert indexer["skipped"].startswith("needs ~11.0 GB") and "us" not in indexer
    result = _indexer_result("d", [record, indexer])
    markdown = context_report.markdown(result)
    assert f"- Skipped dense_bf16/b16/ctx1048576: {record['skipped']}." in markdown
    assert f"- Skipped v4_indexer/b64/entries1048576: {indexer['skipped']}." in markdown


def _point(family, b, context, us, device_us=None):
    return dict(family=family, b=b, context=context, us=us, bytes_per_token=1152.0,
                **({} if device_us is None else dict(device_us=device_us)))


def test_growth_fits_the_two_longest_contexts_on_device_time_where_measured():
    points = [_point("dense_bf16", 16, 8192, 50.0, 40.0),
              _point("dense_bf16", 16, 131072, 400.0, 300.0),
              _point("dense_bf16", 16, 1048576, 3000.0, 2400.0),
              _point("v32", 16, 131072, 200.0), _point("v32", 16, 1048576, 400.0)]
    rows = {(g["family"], g["b"]): g for g in context_report.growth(dict(points=points))}
    dense, v32 = rows["dense_bf16", 16], rows["v32", 16]
    assert dense["what"] == "device_us" and dense["contexts"] == [131072, 1048576]
    assert dense["slope"] == pytest.approx(1) and dense["trend"] == "grows ~linearly"
    assert v32["what"] == "us" and v32["slope"] == pytest.approx(1 / 3, abs=1e-3)
    assert v32["trend"] == "grows sublinearly"
    assert [context_report.trend(s) for s in (1.5, 0.05, -0.5, -1)] == [
        "grows faster than linearly", "flat", "falls",
        "falls ~1/context (a fixed cost spread over more tokens)"]


def test_the_indexer_split_sums_each_kernel_over_the_calls():
    import bench_context
    from device_time import Event

    scoring = "void IndexScoresKernel(unsigned char const*, float const*, int, int)"
    topk = "void TopkPositionsKernel(float const*, long, long, int*)"
    spans = [(0, 10, scoring), (10, 14, topk), (14, 15, "loop_select_fusion"),
             (20, 32, scoring), (32, 38, topk)]  # two calls, µs
    gpu = [Event(start * 1000, end * 1000, name, "l", {}) for start, end, name in spans]
    assert bench_context.kernel_us(gpu, 2, bench_context.INDEXER_KERNELS) == dict(
        scoring_us=11.0, topk_us=5.0)
    # A top-k launched while the scoring runs (a programmatic dependent) counts from its end.
    overlapped = [(0, 10, scoring), (6, 14, topk), (20, 32, scoring), (25, 38, topk)]
    gpu = [Event(start * 1000, end * 1000, name, "l", {}) for start, end, name in overlapped]
    assert bench_context.kernel_us(gpu, 2, bench_context.INDEXER_KERNELS) == dict(
        scoring_us=11.0, topk_us=5.0)
    with pytest.raises(RuntimeError, match="TopkPositionsKernel"):
        bench_context.kernel_us(gpu[:1], 1, bench_context.INDEXER_KERNELS)


def _indexer_point(family, b, entries, device_us, **split):
    return dict(family=family, b=b, entries=entries, copies=1, us=device_us + 5,
                device_us=device_us, index_bytes=b * entries * 132, selected_all=True,
                point_s=1.0, **split)


def _indexer_result(device, points):
    return dict(meta=dict(device=device, jax="j", date="t", implementation="custom_call",
                          indexer_implementation="custom_call", index_heads=64, v32_topk=2048,
                          csa_topk=512), points=points, not_run=[], failed={})


def test_the_indexer_points_against_their_hbm_floor_and_the_bar():
    floor = 16 * 65536 * 132 / 4.8e12 * 1e6  # 28.8 µs on the H200
    points = [_indexer_point("v32_indexer", 16, 65536, 1.5 * floor, scoring_us=30.0,
                             topk_us=10.0),
              _indexer_point("v32_indexer", 64, 65536, 1.2 * 4 * floor),
              _indexer_point("v4_indexer", 16, 65536, 2.0 * floor),
              _indexer_point("v4_indexer", 16, 1024, 9.0 * floor / 64),  # below the bar's size
              _indexer_point("v4_indexer", 64, 65536, 1.6 * 4 * floor)]
    result = _indexer_result("NVIDIA H200", points)
    rows = context_report.floors(result)
    first = rows["v32_indexer/b16/entries65536"]
    assert first["floor_us"] == pytest.approx(floor) and first["ratio"] == pytest.approx(1.5)
    assert first["bar"] is True and rows["v4_indexer/b16/entries65536"]["bar"] is False
    assert rows["v4_indexer/b16/entries1024"]["bar"] is None  # not held to the bar
    assert rows["v4_indexer/b64/entries65536"]["bar"] is True  # 1.6 is within it
    assert context_report.bar_lines(result) == [
        "- indexer_decode (V3.2): bar 1.6× its floor (device time, >= 65536 keys a request, "
        "b >= 16) met: within it at 2 of 2 points, ×1.20 (b=64, 65536 keys) to ×1.50 (b=16, "
        "65536 keys).",
        "- v4_indexer_select (V4): bar 1.6× its floor (device time, >= 65536 keys a request, "
        "b >= 16) NOT met: within it at 1 of 2 points, ×1.60 (b=64, 65536 keys) to ×2.00 (b=16, "
        "65536 keys)."]
    markdown = context_report.markdown(result)
    assert markdown.startswith("# The indexer calls against their HBM floor (NVIDIA H200")
    assert "## The indexer against its HBM floor" in markdown and "## How each" not in markdown
    rest = 1.5 * floor - 40
    assert (f"| v32_indexer | 16 | 65536 | {1.5 * floor + 5:.1f} | {1.5 * floor:.1f} | 30.0 | "
            f"10.0 | {rest:.1f} | {floor:.1f} | 1.50 | yes | yes |") in markdown
    assert "| v4_indexer | 16 | 1024 | " in markdown and "| 9.00 | - | yes |" in markdown
    # The H100's own bandwidth; a device the table does not name gets no floor.
    h100 = context_report.floors(_indexer_result("NVIDIA H100 80GB HBM3", points[:1]))
    assert h100["v32_indexer/b16/entries65536"]["floor_us"] == pytest.approx(floor * 4.8 / 3.35)
    unknown = _indexer_result("NVIDIA A100-SXM4-80GB", points[:1])
    assert context_report.floors(unknown)["v32_indexer/b16/entries65536"]["ratio"] is None
    assert context_report.bar_lines(unknown) == [
        "- No HBM floor: NVIDIA A100-SXM4-80GB is not in context_report.HBM_BYTES_PER_S (peak "
        "bandwidth by device name), so no ratio to it and no bar judged."]
