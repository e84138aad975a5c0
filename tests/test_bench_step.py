"""benchmarks/bench_step.py's tiny configuration on CPU: every layout runs through the C++
target, their outs agree bit for bit, and the report is written."""
import sys

from helpers import BENCHMARKS, run_tiny_benchmark


def test_the_tiny_step_runs_and_reports(tmp_path):
    prefix = tmp_path / "step"
    result = run_tiny_benchmark("bench_step.py", prefix)
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


def test_the_in_range_metadata_step_computes_the_same():
    """--in-range-metadata: the step's metadata made with its block table and a layer's pages
    (all requests in range here) gives every layout the out of the plain step."""
    import numpy as np
    import pytest

    sys.path.insert(0, str(BENCHMARKS))
    import bench_step

    outs = []
    for in_range in (False, True):
        p = bench_step.Point(2, 128, 16, 1, "bfloat16", 3, 1, in_range_metadata=in_range)
        assert (bench_step._metadata(p, p.tables()).seq_lens is not None) == in_range
        steps = bench_step.jax_steps(p)
        compiled = steps["unrolled"][0].lower(p.stacked_cache(), p.rows, p.rope, p.q0,
                                              p.tables()).compile()
        outs.append(np.asarray(compiled(p.stacked_cache(), p.rows, p.rope, p.q0,
                                        p.tables())[1], np.float32))
    np.testing.assert_array_equal(outs[0], outs[1])
    with pytest.raises(ValueError, match="--in-range-metadata is for bf16 points"):
        bench_step.Point(2, 128, 16, 1, bench_step.FP8, 3, 1, in_range_metadata=True)
