"""benchmarks/bench_step.py's tiny configuration on CPU: every layout runs through the C++
target, their outs agree bit for bit, and the report is written."""
import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_step.py"


def test_the_tiny_step_runs_and_reports(tmp_path):
    prefix = tmp_path / "step"
    run = subprocess.run([sys.executable, str(BENCH), "--tiny", "--out", str(prefix)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(prefix.with_suffix(".json").read_text())
    assert [(r["dtype"], r["s_q"]) for r in result["raw"]] == [("bfloat16", 1),
                                                               ("float8_e4m3fn", 2)]
    assert all(r["layouts_agree"] for r in result["raw"])
    layouts = [r["layout"] for r in result["records"]]
    assert layouts == ["scan", "unrolled", "per_layer", "scan_alternating",
                       "unrolled_alternating"] * 2
    for record in result["records"]:
        assert {"b", "s_k", "h_q", "s_q", "dtype", "layout", "layers", "jax_us"} <= set(record)
        assert record["jax_us"] > 0
    assert "| 2 | 128 | 16 | 2 | fp8 | 3 |" in prefix.with_suffix(".md").read_text()
    assert prefix.with_suffix(".png").stat().st_size > 0
