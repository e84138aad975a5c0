"""benchmarks/bench_v32_decode.py's tiny configuration (on CPU through the pure-JAX indexer, the
sparse reference and the C++ model of the dense decode): its points and fields, and the report;
the report's ratios and bar from per-turn times, and parts merged."""
import json
import statistics
import sys

from helpers import BENCHMARKS, run_tiny_benchmark

sys.path.insert(0, str(BENCHMARKS))
import v32_report  # noqa: E402


def test_the_tiny_run_writes_its_report(tmp_path):
    prefix = tmp_path / "v32"
    result = run_tiny_benchmark("bench_v32_decode.py", prefix)
    assert [r["label"] for r in result["step"]] == ["step/b2/ctx256/h16/s1"]
    assert result["not_run"] == [] and result["failed"] == {}
    assert (result["meta"]["topk"], result["meta"]["index_heads"]) == (64, 64)
    assert "v32_us_repeats" not in result["step"][0]  # in the whole result beside the JSON
    (point,) = json.loads(prefix.with_suffix(".raw.json").read_text())["step"]
    assert (point["layers"], point["dense_caches"], point["v32_caches"]) == (3, 3, 3)
    for name in v32_report.STEPS:
        turns = point[f"{name}_us_repeats"]
        assert len(turns) == 3 and point[f"{name}_us"] == round(statistics.median(turns), 2)
        assert f"{name}_gpu_us" not in point  # no profile on CPU
    assert point["v32_over_dense"] == statistics.median(
        [a / b for a, b in zip(point["v32_us_repeats"], point["dense_us_repeats"])])
    assert point["indexer_share"] == statistics.median(
        [a / b for a, b in zip(point["indexer_only_us_repeats"], point["v32_us_repeats"])])
    assert point["v32_over_dense_gpu"] is None  # no profile on CPU
    assert point["outs_finite"] and point["compile_s"] >= 0
    markdown = prefix.with_suffix(".md").read_text()
    assert "| 2 | 256 | 16 | 1 | 3 | 3, 3 |" in markdown
    assert "The bar (context 131072, b=16): not measured in this run." in markdown
    assert prefix.with_suffix(".png").stat().st_size > 0


def _point(b, context, v32, dense, indexer_only, gpu=None):
    """A record as bench_v32_decode writes it, from per-turn µs per layer; gpu: (v32, dense,
    indexer_only) GPU spans per layer."""
    record = dict(label=f"step/b{b}/ctx{context}/h128/s1", b=b, context=context, h_q=128, s_q=1,
                  topk=2048, index_heads=64, layers=61, dense_caches=3, v32_caches=5,
                  outs_finite=True, point_s=1.0)
    for name, turns in (("v32", v32), ("dense", dense), ("indexer_only", indexer_only)):
        record.update({f"{name}_us_repeats": list(turns), f"{name}_us": statistics.median(turns)})
    if gpu is not None:
        record.update(v32_gpu_us=gpu[0], dense_gpu_us=gpu[1], indexer_only_gpu_us=gpu[2])
    record.update(v32_report.ratios(record))
    return record


def test_the_report_states_the_bar_from_the_runs_times():
    # Per turn 0.35, 0.45, 0.38: the median 0.38 meets the bar; 0.45, 0.5, 0.42: 0.45 does not.
    within = _point(16, 131072, (350.0, 450.0, 380.0), (1000.0,) * 3, (280.0, 360.0, 190.0),
                    gpu=(370.0, 1000.0, 296.0))
    over = _point(16, 131072, (450.0, 500.0, 420.0), (1000.0,) * 3, (400.0,) * 3)
    elsewhere = _point(64, 131072, (100.0,) * 3, (1000.0,) * 3, (50.0,) * 3)
    assert within["v32_over_dense"] == 0.38 and over["v32_over_dense"] == 0.45
    assert within["indexer_share"] == 0.8  # median of 0.8, 0.8, 0.5
    assert within["v32_over_dense_gpu"] == 0.37 and within["indexer_share_gpu"] == 0.8
    assert over["v32_over_dense_gpu"] is None and over["indexer_share_gpu"] is None
    assert [v32_report.bar_met(r) for r in (within, over, elsewhere)] == [True, False, None]
    result = dict(meta=dict(device="H200", jax="x", date="today", layers=61, scan_unroll=4,
                            index_heads=64, topk=2048, sparse_implementation="custom_call",
                            steps=3),
                  step=[within, elsewhere], not_run=["step/b1/ctx8192/h128/s1"],
                  failed={"step/b64/ctx131072/h128/s1": "XlaRuntimeError: RESOURCE_EXHAUSTED"})
    markdown = v32_report.markdown(result)
    assert "V3.2 / dense 0.380 by wall clock (GPU span 0.370) against <= 0.4: met." in markdown
    assert ("| 16 | 131072 | 128 | 1 | 61 | 3, 5 | 380.0 (370.0) | 280.0 (296.0) "
            "| 1000.0 (1000.0) | 0.380 (0.370) | 0.800 (0.800) | yes | yes |") in markdown
    assert "| 0.100 (-) | 0.500 (-) | - | yes |" in markdown
    assert "Not run (deadline): step/b1/ctx8192/h128/s1." in markdown
    assert "- Failed at step/b64/ctx131072/h128/s1: XlaRuntimeError: RESOURCE_EXHAUSTED" \
        in markdown
    assert "against <= 0.4: NOT met." in v32_report.markdown(dict(result, step=[over]))


def test_a_merged_part_replaces_the_points_it_measured_again():
    old = dict(meta=dict(part=0), step=[_point(1, 8192, (3.0,), (2.0,), (1.0,))],
               not_run=["step/b16/ctx8192/h128/s1"],
               failed={"step/b64/ctx8192/h128/s1": "out of memory"})
    new = dict(meta=dict(part=1), step=[_point(1, 8192, (1.0,), (2.0,), (1.0,)),
                                        _point(16, 8192, (1.0,), (1.0,), (1.0,))], not_run=[],
               failed={})
    merged = v32_report.merge([old, new])
    assert [(r["b"], r["v32_us"]) for r in merged["step"]] == [(1, 1.0), (16, 1.0)]
    assert merged["not_run"] == [] and merged["meta"] == dict(part=0)
    assert merged["failed"] == {"step/b64/ctx8192/h128/s1": "out of memory"}
    assert set(merged) == {"meta", "step", "not_run", "failed"}
