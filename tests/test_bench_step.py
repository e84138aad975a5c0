"""benchmarks/bench_step.py's tiny configuration on CPU: every layout runs through the C++
target, their outs agree bit for bit, and the report is written."""
import json
import sys

from helpers import BENCHMARKS, run_tiny_benchmark


def test_the_tiny_step_runs_and_reports(tmp_path):
    sys.path.insert(0, str(BENCHMARKS))
    import bench_step

    prefix = tmp_path / "step"
    result = run_tiny_benchmark("bench_step.py", prefix)
    assert [(r["dtype"], r["s_q"]) for r in result["raw"]] == [("bfloat16", 1),
                                                               ("float8_e4m3fn", 2)]
    assert all(r["layouts_agree"] for r in result["raw"])
    # The JSON holds "raw" alone; the whole result beside it has the records it rebuilds.
    whole = json.loads(prefix.with_suffix(".raw.json").read_text())
    assert "records" not in result and whole["records"] == bench_step.records_by_layout(
        whole["raw"])
    records = bench_step.records_by_layout(result["raw"])
    layouts = [r["layout"] for r in records]
    assert layouts == ["scan", "unrolled", "per_layer", "scan_alternating",
                       "unrolled_alternating"] * 2
    for record in records:
        assert {"b", "s_k", "h_q", "s_q", "dtype", "layout", "layers", "jax_us"} <= set(record)
        assert record["jax_us"] > 0
    queued = [r for r in records if "jax_queued_us" in r]
    assert [r["layout"] for r in queued] == ["scan_alternating", "unrolled_alternating"] * 2
    assert all(r["jax_queued_us"] > 0 for r in queued)
    assert "| 2 | 128 | 16 | 2 | fp8 | 3 |" in prefix.with_suffix(".md").read_text()
    assert prefix.with_suffix(".png").stat().st_size > 0


def test_the_queued_section_compares_the_steps_with_the_graph_queued():
    sys.path.insert(0, str(BENCHMARKS))
    import step_report

    raw = dict(b=1, s_k=1024, h_q=16, s_q=1, dtype="bfloat16", layers=10,
               torch_graph_us=20.0, torch_graph_queued_us=19.0,
               jax_scan_alternating_us=25.0, jax_scan_alternating_queued_us=17.0,
               jax_unrolled_alternating_us=24.0, jax_unrolled_alternating_queued_us=15.2)
    section = step_report.markdown(dict(device="cpu", jax="x", raw=[raw], records=[]))
    section = section.split(step_report.QUEUED_TITLE)[1]
    # The queued µs per layer, the unrolled step's over the graph's, and per step what a sync
    # after each step adds: (wall - queued) * layers.
    assert "| 1 | 1024 | 16 | 1 | bf16 | 10 | 19.0 | 17.0 | 15.2 | 0.800 | 10 | 80 | 88 |" in section


def test_the_safety_variants_run_beside_the_plain_step(tmp_path):
    """--unguarded adds the unrolled step of bare decodes on the raw lengths, --value-checks
    the unrolled step under value_checks() (all requests in range here): their outs are the
    plain step's, and the report compares their times."""
    import pytest

    sys.path.insert(0, str(BENCHMARKS))
    import bench_step
    import step_report

    p = bench_step.Point(2, 128, 16, 1, "bfloat16", 3, 1, unguarded=True, value_checks=True)
    assert bench_step._metadata(p, p.tables()).seq_lens is not None
    assert len(bench_step._metadata(p, p.tables(), unguarded=True)) == 2  # the schedule alone
    raw = bench_step.run_point(p, 2, None)
    assert raw["layouts_agree"] and raw["jax_unrolled_unguarded_alternating_us"] > 0
    assert raw["jax_unrolled_checked_us"] > 0
    assert raw["unrolled_checked_cost"] > -1 and raw["unrolled_alternating_cost"] > -1
    layouts = [r["layout"] for r in bench_step.records_by_layout([raw])]
    assert layouts[-3:] == ["unrolled_unguarded", "unrolled_unguarded_alternating",
                            "unrolled_checked"]
    result = dict(device="cpu", jax="x", raw=[raw], records=[])
    section = step_report.markdown(result).split(step_report.SAFETY_TITLE)[1]
    assert "| 2 | 128 | 16 | 1 | 3 | range checks |" in section
    assert "| 2 | 128 | 16 | 1 | 3 | value_checks() |" in section
    # Two points over two s_k and two h_q: the two panels without a point are left empty.
    step_report.plot(dict(result, raw=[raw, dict(raw, s_k=4096, h_q=128)]),
                     str(tmp_path / "two_points.png"))
    with pytest.raises(ValueError, match="--unguarded and --value-checks are for bf16"):
        bench_step.Point(2, 128, 16, 1, bench_step.FP8, 3, 1, value_checks=True)


def test_a_merged_part_replaces_the_points_it_measured_again():
    sys.path.insert(0, str(BENCHMARKS))
    import step_report

    point = dict(b=1, s_k=64, h_q=16, s_q=1, dtype="bfloat16")
    old = dict(records=[dict(point, layout="scan", jax_us=2.0)], raw=[dict(point, jax_scan_us=2.0)])
    other = dict(point, b=2)
    new = dict(records=[dict(point, layout="scan", jax_us=1.0), dict(other, layout="scan")],
               raw=[dict(point, jax_scan_us=1.0), other])
    merged = step_report.merge([old, new])
    assert [r["jax_scan_us"] for r in merged["raw"] if r["b"] == 1] == [1.0]
    assert [r["jax_us"] for r in merged["records"] if r["b"] == 1] == [1.0]
    assert len(merged["raw"]) == 2 and len(merged["records"]) == 2


def test_the_default_caches_fit_an_80_gb_card_and_stay_30_gib_on_larger_ones():
    sys.path.insert(0, str(BENCHMARKS))
    import jax
    import bench_step

    def card(gib):
        return type("Card", (), dict(memory_stats=lambda self: {"bytes_limit": gib * 2**30}))()

    # JAX's default limit, 75% of an 80 GB card's 79.2 GiB and of a 139.8 GiB one's
    assert bench_step.default_cache_gb(card(0.75 * 79.2)) == 0.75 * 79.2 / 3
    assert bench_step.default_cache_gb(card(0.75 * 139.8)) == 30.0
    assert bench_step.default_cache_gb(jax.devices("cpu")[0]) == 30.0  # reports no limit
