"""benchmarks/bench_context.py: its tiny configuration (on CPU through the pure-JAX references),
the bytes per token of each layout against the arrays it built, a point skipped for memory,
and the report's growth figures."""
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
    assert {context_report.label(r["family"], r["b"], r["context"])
            for r in result["points"]} == {
        f"{family}/b2/ctx{context}" for family in families for context in (256, 1024)}
    assert result["not_run"] == [] and result["failed"] == {}
    assert result["meta"]["implementation"] == "reference"
    for r in result["points"]:
        assert r["out_finite"] and r["us"] > 0 and "device_us" not in r  # no GPU here
        assert r["bytes_per_token"] == pytest.approx(
            expected_bytes_per_token(r["family"], r["context"]))
        # The arrays built, a copy's bytes over its tokens, are the layout's pages.
        assert r["measured_bytes_per_token"] == pytest.approx(r["pages_bytes_per_token"])
        assert r["heads"] == 16 and 1 <= r["copies"] <= 4
    growth = {(g["family"], g["b"]): g for g in result["growth"]}
    assert set(growth) == {(f, b) for f in families for b in (2, None)}
    assert (growth["dense_bf16", None]["slope"], growth["dense_bf16", None]["trend"]) == (0, "flat")
    assert growth["v4_sliding", None]["slope"] == pytest.approx(-1)  # the window alone
    assert growth["v4_csa", 2]["contexts"] == [256, 1024] and growth["v4_csa", 2]["what"] == "us"
    markdown = prefix.with_suffix(".md").read_text()
    assert "## How each grows" in markdown and "| v4_csa | 2 | 1024 | 16 |" in markdown
    assert "fixed 74,880 B a request (window ring 74,880, compressor states 0)" in markdown
    assert 0 < prefix.with_suffix(".png").stat().st_size <= 60_000


def test_a_point_that_would_not_fit_is_skipped_with_its_reason(monkeypatch):
    import bench_context

    monkeypatch.setattr(bench_context, "free_bytes", lambda: 10**9)
    record = bench_context.run_point("dense_bf16", 1048576, 16, bench_context.GPU, None)
    assert record["skipped"].startswith("needs ~") and record["skipped"].endswith("1.0 free")
    assert record["bytes_per_token"] == 1152 and "us" not in record
    result = dict(meta=dict(device="d", jax="j", date="t", implementation="custom_call",
                            indexer_implementation="custom_call"),
                  points=[record], not_run=[], failed={})
    assert f"- Skipped dense_bf16/b16/ctx1048576: {record['skipped']}." in \
        context_report.markdown(result)


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
