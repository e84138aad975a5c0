"""benchmarks/bench_multi_gpu.py's tiny configuration on 8 CPU devices: one device, TP and DCP
over all 8, and TP 2 x DCP 4 run the step through the C++ target; TP alone gives one device's
out bit for bit, DCP within the merge's float rounding; the report is written."""
from helpers import run_tiny_benchmark


def test_the_tiny_step_runs_on_each_split_and_reports(tmp_path):
    prefix = tmp_path / "multi"
    records = run_tiny_benchmark("bench_multi_gpu.py", prefix)["records"]
    assert [(r["tp"], r["dcp"]) for r in records] == [(1, 1), (8, 1), (2, 4), (1, 8)]
    for r in records:
        assert r["us_per_layer"] > 0 and r["layers"] == 2
        if r["dcp"] == 1:
            assert r["out_identical"], r
        else:
            assert r["out_max_abs_diff"] < 1e-3, r
    # The row of b 2, s_k 1024, 2 layers, TP 2, DCP 4.
    assert "| 2 | 1024 | 2 | 2 | 4 |" in prefix.with_suffix(".md").read_text()
    assert prefix.with_suffix(".png").stat().st_size > 0
