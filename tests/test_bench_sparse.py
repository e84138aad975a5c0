"""benchmarks/bench_sparse.py's tiny configuration (on CPU through the sparse reference and the
C++ model of the dense decode): its points and fields, and the report; the report's ratios and
bars from per-repeat times, --unguarded's step and table, and parts merged."""
import json
import statistics
import sys

from helpers import BENCHMARKS, run_tiny_benchmark

sys.path.insert(0, str(BENCHMARKS))
import sparse_report  # noqa: E402


def test_the_tiny_run_writes_its_report(tmp_path):
    prefix = tmp_path / "sparse"
    result = run_tiny_benchmark("bench_sparse.py", prefix)
    # The per-repeat samples are in the whole result beside the JSON, not in it.
    whole = json.loads(prefix.with_suffix(".raw.json").read_text())
    assert all("us_repeats" not in timed for record in result["per_call"]
               for timed in record["impls"].values())
    assert [r["label"] for r in result["per_call"]] == ["call/b2/ctx128/h16/s1",
                                                        "call/b2/ctx128/h16/s2"]
    assert [r["label"] for r in result["step"]] == ["step/b2/ctx128/h16/s1"]
    assert result["not_run"] == [] and result["meta"]["topk"] == 64
    for record in whole["per_call"]:
        assert set(record["impls"]) == {"sparse", "premasked", "dense"}  # no torch here
        assert record["checks"]["premasked_identical"]
        for timed in record["impls"].values():
            assert len(timed["us_repeats"]) == 2
            assert timed["us"] == statistics.median(timed["us_repeats"])
        sparse, dense = (record["impls"][k]["us_repeats"] for k in ("sparse", "dense"))
        assert record["sparse_over_dense"] == statistics.median(
            [a / b for a, b in zip(sparse, dense)])
        assert record["vs_torch"] is None and record["vs_torch_device"] is None
    (step,) = result["step"]
    assert (step["layers"], step["layer_caches"]) == (3, 3)
    assert {"jax_scan_us", "jax_unrolled_us", "compile_s", "jax_scan_queued_us",
            "jax_unrolled_queued_us"} <= set(step)
    assert step["steps_agree"]  # the scanned and unrolled steps' outs, bit for bit
    markdown = prefix.with_suffix(".md").read_text()
    assert "| 2 | 128 | 16 | 2 |" in markdown and "| 2 | 128 | 16 | 1 | 3 | 3 |" in markdown
    assert prefix.with_suffix(".png").stat().st_size > 0


def test_other_head_counts_are_timed_padded_without_torch(tmp_path):
    result = run_tiny_benchmark("bench_sparse.py", tmp_path / "heads", "--call-h-q", "16", "32",
                                "--points", "call/*/s1")
    assert [r["label"] for r in result["per_call"]] == ["call/b2/ctx128/h16/s1",
                                                        "call/b2/ctx128/h32/s1"]
    assert result["step"] == []
    assert all(set(r["impls"]) == {"sparse", "premasked", "dense"} for r in result["per_call"])


def test_the_scanned_and_unguarded_steps_take_their_options_from_the_command_line(tmp_path):
    """Both step options in one run (a run's cost is mostly its start and its compiles):
    --scan-unroll 2 over 3 layers (an iteration and a remainder): recorded, and the
    scanned step's out still the unrolled one's bit for bit. --unguarded on CPU: the reference
    on the raw indices stands in for the custom call (CUDA only); its cost measured, its out
    the protected step's bit for bit, the report's table."""
    prefix = tmp_path / "step"
    result = run_tiny_benchmark("bench_sparse.py", prefix, "--scan-unroll", "2", "--unguarded",
                                "--points", "step/*")
    assert result["meta"]["scan_unroll"] == 2 and result["per_call"] == []
    (step,) = result["step"]
    assert step["steps_agree"]
    assert {"jax_unrolled_unguarded_us", "unguarded_cost"} <= set(step)
    assert step["unguarded_identical"]
    markdown = prefix.with_suffix(".md").read_text()
    assert sparse_report.UNGUARDED_TITLE in markdown and "the sparse reference" in markdown
    assert f"| 2 | 128 | 16 | 1 | 3 | 3 | {step['jax_unrolled_unguarded_us']:.1f} (-) | " \
           f"{step['jax_unrolled_us']:.1f} (-) | {100 * step['unguarded_cost']:+.2f}% | - | " \
           "yes |" in markdown


def _call(b, sparse, torch, dense=(400.0, 400.0, 400.0), premasked=None):
    timed = (("sparse", sparse), ("torch", torch), ("dense", dense), ("premasked", premasked))
    impls = {name: dict(us=statistics.median(times), us_repeats=list(times),
                        device_us=statistics.median(times), device_us_repeats=list(times))
             for name, times in timed if times is not None}
    record = dict(label=f"call/b{b}/ctx8192/h128/s1", b=b, context=8192, h_q=128, s_q=1,
                  topk=2048, impls=impls, skipped={},
                  checks=dict(out_identical=True, lse_identical=True))
    record.update(sparse_report.call_ratios(record))
    return record


def _step(b, graph_us, scan_us, unrolled_us):
    return dict(label=f"step/b{b}/ctx32768/h128/s1", b=b, context=32768, h_q=128, s_q=1,
                layers=61, layer_caches=61, skipped={}, jax_scan_us=scan_us,
                jax_unrolled_us=unrolled_us, torch_graph_us=graph_us,
                jax_scan_out_identical=True, jax_unrolled_out_identical=True)


def test_the_report_states_the_bars_from_the_runs_times():
    # Per repeat 1.02, 1.01, 1.04: the median 1.02 meets the per-call bar at b=128.
    # The bar is the call's on MaskedIndices; the raw call's ratio and its mask are beside it.
    within = _call(128, (105.0, 106.0, 104.0), (100.0, 100.0, 100.0),
                   premasked=(102.0, 101.0, 104.0))
    over = _call(128, (105.0, 106.0, 104.0), (100.0, 100.0, 100.0),
                 premasked=(104.0, 105.0, 103.0))
    small = _call(1, (30.0, 30.0, 30.0), (20.0, 20.0, 20.0), premasked=(25.0, 25.0, 25.0))
    assert within["premasked_vs_torch_device"] == within["premasked_vs_torch"] == 1.02
    assert within["vs_torch_device"] == 1.05
    assert within["sparse_over_dense_device"] == 105.0 / 400.0
    assert [sparse_report.call_bar_met(r) for r in (within, over, small)] == [True, False, None]
    assert sparse_report.call_bar_met(within, "vs_torch_device") is False
    assert sparse_report.mask_us(within) == 105.0 - 102.0
    # The graph's step: 30 µs x 61 layers < 2 ms (bar 1.15), 40 x 61 >= 2 ms (bar 1.05).
    short, long = _step(1, 30.0, 34.0, 33.0), _step(128, 40.0, 43.0, 41.0)
    long.update(jax_scan_queued_us=40.0, jax_unrolled_queued_us=39.0, torch_graph_queued_us=40.0)
    assert sparse_report.step_ratios(long) == dict(jax_scan=43.0 / 40.0, jax_unrolled=41.0 / 40.0)
    assert [sparse_report.step_bar_met(r) for r in (short, long)] == [True, False]
    result = dict(meta=dict(device="H200", jax="x", date="today", implementation="custom_call",
                            topk=2048, softmax_scale=192 ** -0.5, rotations=4, layers=61),
                  per_call=[within, over, small], step=[short, long], not_run=[])
    markdown = sparse_report.markdown(result)
    assert "premasked / torch: median 1.030, range 1.020–1.040 (2 points); within 1.03 at 1 of " \
           "2 points" in markdown
    assert "sparse / torch: median 1.050, range 1.050–1.050 (2 points); within 1.03 at 0 of 2 " \
           "points; the mask median 2.0 µs, range 1.0–3.0 a call" in markdown
    assert "both jax steps within their bar at 1 of 2 points" in markdown
    assert "| 128 | 8192 | 128 | 1 | 105.0 (105.0) | 100.0 (100.0) | 1.050 (1.050) | " \
           "102.0 (102.0) | 1.020 (1.020) | yes | 3.0 | 400.0 (400.0) |" in markdown
    assert "premasked / torch by device time, all points: median 1.040" in markdown
    assert "| 1.133 | 1.100 | 1.15 | yes | yes |" in markdown
    assert "| 1.075 | 1.025 | 1.05 | NO | yes |" in markdown
    assert "| 128 | 40.0 | 39.0 | 40.0 | - | 1.000 | 0.975 |" in markdown  # queued
    assert "Step queued (steps launched before one sync), jax_flashmla / torch graph: " \
           "median 0.988" in markdown
    assert sparse_report.UNGUARDED_TITLE not in markdown  # run without --unguarded


def test_the_report_states_the_cost_of_the_protections_against_its_bars():
    """+1.5% at b=1 (bar +2%), +1.2% at b=128 (bar +1%), b=16 without a bar; b=1's outs
    differing."""
    steps = [dict(_step(b, 30.0, 31.0, unrolled), jax_unrolled_gpu_us=unrolled - 0.5,
                  jax_unrolled_unguarded_us=bare, jax_unrolled_unguarded_gpu_us=bare - 0.5,
                  unguarded_cost=cost, unguarded_identical=identical)
             for b, unrolled, bare, cost, identical in ((1, 20.3, 20.0, 0.015, False),
                                                        (16, 40.0, 40.0, 0.0, True),
                                                        (128, 194.3, 192.0, 0.012, True))]
    assert [sparse_report.protection_bar_met(r) for r in steps] == [True, None, False]
    result = dict(meta=dict(device="H200", jax="x", date="today", implementation="custom_call",
                            topk=2048, softmax_scale=192 ** -0.5, rotations=4, layers=61),
                  per_call=[], step=steps, not_run=[])
    markdown = sparse_report.markdown(result)
    assert "with FlashMLA's custom call in place of `sparse_mla_decode`" in markdown
    assert "Bar: +2% at b=1 over 61 layers, +1% at b=128 over 61 layers." in markdown
    assert "| 1 | 32768 | 128 | 1 | 61 | 61 | 20.0 (19.5) | 20.3 (19.8) | +1.50% | yes | NO |" \
        in markdown
    assert "| 16 | 32768 | 128 | 1 | 61 | 61 | 40.0 (39.5) | 40.0 (39.5) | +0.00% | - | yes |" \
        in markdown
    assert "| 128 | 32768 | 128 | 1 | 61 | 61 | 192.0 (191.5) | 194.3 (193.8) | +1.20% | NO " \
           "| yes |" in markdown
    assert "- Out-of-range protection in the step (the unrolled step's cost over the same step " \
           "of bare decodes): +1.50% at b=1, +0.00% at b=16, +1.20% at b=128; within its bar " \
           "at 1 of 2 points; outs the same bit for bit at 2 of 3 points." in markdown


def test_a_merged_part_replaces_the_points_it_measured_again():
    old = dict(meta={}, per_call=[_call(1, (3.0,), (2.0,))], step=[],
               not_run=["step/b1/ctx32768/h128/s1"])
    new = dict(meta={}, per_call=[_call(1, (1.0,), (2.0,)), _call(16, (1.0,), (1.0,))],
               step=[_step(1, 30.0, 31.0, 31.0)], not_run=[])
    merged = sparse_report.merge([old, new])
    assert [(r["b"], r["impls"]["sparse"]["us"]) for r in merged["per_call"]] == [(1, 1.0),
                                                                                  (16, 1.0)]
    assert len(merged["step"]) == 1 and merged["not_run"] == []
