"""benchmarks/bench_grid.py's CPU mode, as CI runs it: the tiny grid through the pure-JAX
reference and the C++ model's custom call, and the report it writes (JSON, markdown, PNGs)."""
import json
import math
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "bench_grid.py")
CPU_IMPLS = {"flashmla", "reference", "flashmla_step"}


def _run(out_dir, *flags):
    # The CPU mode on every machine: on the GPU machine the script would run the whole grid.
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, SCRIPT, "--out-dir", str(out_dir), "--name", "grid",
                           *flags], cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(out_dir / "grid.json") as f:
        return json.load(f), proc.stdout


def test_cpu_grid_writes_its_report(tmp_path):
    results, _ = _run(tmp_path, "--s-k", "64")
    meta, points = results["meta"], results["points"]
    assert meta["backend"] == "cpu" and set(meta["impls"]) == CPU_IMPLS
    assert meta["copy"]["ceiling_gbps"] > 0
    # The tiny grid at s_k 64: h_q {16} x s_q {1, 2} x fixed / varlen x bf16 / FP8 cache, every
    # point run.
    assert meta["dtypes"] == ["bfloat16", "float8_e4m3fn"]
    assert len(points) == 8 and not results["not_run"]
    assert {(p["mean_s_k"], p["s_q"], p["varlen"], p["dtype"]) for p in points} == {
        (64, s_q, v, d) for s_q in (1, 2) for v in (False, True) for d in meta["dtypes"]}
    for p in points:
        assert set(p["impls"]) == CPU_IMPLS, p
        # FlashMLA's formulas, and the rates derived from them.
        assert p["flops"] == 2 * p["s_q"] * p["sum_s_k"] * p["h_q"] * 1088
        # The cache and q at 2 bytes (bf16) or 1 (FP8), out at 2.
        element = 1 if p["dtype"] == "float8_e4m3fn" else 2
        rows = p["batch"] * p["s_q"] * p["h_q"]
        assert p["bytes"] == element * (p["sum_s_k"] + rows) * 576 + 2 * rows * 512
        for r in p["impls"].values():  # the JSON keeps 6 significant digits
            assert math.isfinite(r["ms"]) and r["ms"] > 0
            assert r["gbps"] == pytest.approx(p["bytes"] / r["ms"] / 1e6, rel=1e-5)
            assert r["tflops"] == pytest.approx(p["flops"] / r["ms"] / 1e9, rel=1e-5)
            assert r["of_copy"] == pytest.approx(r["gbps"] / meta["copy"]["ceiling_gbps"],
                                                 rel=1e-5)
        # flashmla's per-call time is also fitted over batches of several lengths (no torch on
        # CPU, so no fitted ratio).
        fitted = p["impls"]["flashmla"]
        assert math.isfinite(fitted["ms_fitted"]) and math.isfinite(fitted["per_batch_ms"])
        assert "ms_fitted" not in p["impls"]["reference"]
        step = p["impls"]["flashmla_step"]
        assert step["layers"] == 2 and step["step_ms"] == pytest.approx(2 * step["ms"], rel=1e-5)
        # The C++ model and the reference compute the same attention (bf16 outputs).
        assert p["checks"]["max_abs_diff_vs_reference"] < 2e-2
        if p["varlen"]:
            assert p["sum_s_k"] != p["batch"] * p["mean_s_k"]
    # No GPU timestamps to time by on CPU.
    assert meta["device_time"] is False and "device_ms" not in p["impls"]["flashmla"]
    # The report: a table row per point.
    markdown = (tmp_path / "grid.md").read_text()
    rows = [line for line in markdown.splitlines() if line.startswith("| bf16 |")
            or line.startswith("| fp8 |")]
    assert len(rows) >= len(points), markdown
    for name in ("grid", "grid_fp8"):
        png = (tmp_path / f"{name}.png").read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


# The reference alone at s_k 64, fixed lengths, one query token: one point a dtype.
ONE_POINT = ["--s-k", "64", "--varlen", "false", "--s-q", "1", "--impl", "reference"]


@pytest.fixture(scope="module")
def bf16_resumed(tmp_path_factory):
    """(the report of a bf16 run past its --deadline-s, the report --resume then completed)."""
    out_dir = tmp_path_factory.mktemp("bf16")
    late, _ = _run(out_dir, "--deadline-s", "0", "--dtype", "bfloat16", *ONE_POINT)
    resumed, _ = _run(out_dir, "--resume", "--dtype", "bfloat16", *ONE_POINT)
    return late, resumed


def test_a_deadline_leaves_a_report_that_resume_completes(bf16_resumed):
    """Past --deadline-s no point starts, and the report says which were not run; --resume
    then runs only those, keeping the first run's copy ceiling."""
    late, resumed = bf16_resumed
    assert late["points"] == []
    assert [(p["mean_s_k"], p["s_q"]) for p in late["not_run"]] == [(64, 1)]
    assert [(p["mean_s_k"], p["s_q"]) for p in resumed["points"]] == [(64, 1)]
    assert not resumed["not_run"] and resumed["meta"]["copy"] == late["meta"]["copy"]


def test_resume_refuses_a_report_timed_otherwise(bf16_resumed, tmp_path):
    late = bf16_resumed[0]
    other = dict(late, meta=dict(late["meta"], timing="one after another"))
    (tmp_path / "grid.json").write_text(json.dumps(other))
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, SCRIPT, "--out-dir", str(tmp_path), "--name", "grid",
                           "--resume", "--dtype", "bfloat16", *ONE_POINT], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode != 0 and "run the whole grid instead of --resume" in proc.stderr


def test_parts_run_apart_merge_into_one_report(bf16_resumed, tmp_path):
    """Two parts of a grid (e.g. one per GPU of a machine, run at once) join into
    one report with grid_report.py --merge; a point in both parts, or parts run otherwise,
    is refused."""
    fp8, _ = _run(tmp_path, "--dtype", "float8_e4m3fn", *ONE_POINT)
    parts = []
    for dtype, results in (("bfloat16", bf16_resumed[1]), ("float8_e4m3fn", fp8)):
        path = tmp_path / f"{dtype}.json"
        path.write_text(json.dumps(results))
        parts.append(path)
    merged_path = tmp_path / "merged.json"
    report = os.path.join(ROOT, "benchmarks", "grid_report.py")
    proc = subprocess.run([sys.executable, report, "--merge", str(merged_path), *map(str, parts)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    merged = json.loads(merged_path.read_text())
    assert merged["meta"]["dtypes"] == ["bfloat16", "float8_e4m3fn"]
    assert len(merged["points"]) == 2
    assert [part["dtypes"] for part in merged["meta"]["parts"]] == [["bfloat16"],
                                                                   ["float8_e4m3fn"]]
    assert merged["meta"]["copy"]["ceiling_gbps"] == max(
        part["copy"]["ceiling_gbps"] for part in merged["meta"]["parts"])
    assert (tmp_path / "merged.md").exists() and (tmp_path / "merged_fp8.png").exists()

    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import grid_report
    finally:
        sys.path.pop(0)
    first = json.loads(parts[0].read_text())
    with pytest.raises(ValueError, match="in two parts"):
        grid_report.merge([first, first])
    other = json.loads(parts[1].read_text())
    other["meta"]["repeats"] += 1
    with pytest.raises(ValueError, match="repeats"):
        grid_report.merge([first, other])

    # A GPU run's device time (bench_grid's --device-time), in the table and the summary.
    timed = json.loads(parts[0].read_text())
    timed["meta"]["device_time"] = dict(batches=15, calls=24)
    for point in timed["points"]:  # these parts ran the reference alone
        point["impls"]["flashmla"] = dict(point["impls"]["reference"], vs_torch_device=1.0126)
    grid_report.write_markdown(timed, str(tmp_path / "timed.md"))
    assert "| 1.013 |" in (tmp_path / "timed.md").read_text()  # the device ratio, tabled


def test_fit_separates_the_cost_per_call_from_the_cost_per_batch(monkeypatch):
    """timing.fit_in_turns on a fake clock: each batch costs 30 units once and 2 per call."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import timing
    finally:
        sys.path.pop(0)
    assert timing.line_fit([1, 2, 4], [3, 5, 9]) == pytest.approx((2.0, 1.0))
    clock = [0.0]
    pending = []

    def call():
        pending.append(2.0)
        return None

    def sync(_):
        clock[0] += 30.0 + sum(pending)
        pending.clear()

    monkeypatch.setattr(timing.time, "perf_counter", lambda: clock[0])
    fits = timing.fit_in_turns(dict(fake=(call, sync, 20, 2)), repeats=3, warmup=1)
    per_decode, per_batch = fits["fake"]
    assert per_decode == pytest.approx([1.0] * 3)  # 2 per call, 2 decodes per call
    assert per_batch == pytest.approx([30.0] * 3)


def test_the_steps_layers_share_one_kernel_table_as_a_models_do():
    """bench_grid's step: every layer over its own FP8 cache and the one block table, so that
    XLA computes the FP8 kernel's table (empty requests as length 1) once, as in a model."""
    import jax
    import jax.numpy as jnp

    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import bench_grid
        import workload
    finally:
        sys.path.pop(0)
    from helpers import fp8_kernel_tables

    with jax.default_device(jax.devices("cpu")[0]):
        work = workload.Workload(2, 128, True, 1, 3, seed=0)
        caches = work.layer_caches("float8_e4m3fn", 3)
        assert len({int(c.unsafe_buffer_pointer()) for c in caches}) == 3
        # Layer j's cache is the first one's pages rolled: the same rows in another order.
        assert jnp.array_equal(caches[1], jnp.roll(caches[0], work.kv.shape[0] // 3, axis=0))
        qs = [jnp.zeros((2, 1, 16, 576), jnp.float8_e4m3fn)] * 3
        hlo = bench_grid.decode_step.lower(qs, caches, work.block_tables[0], work.seq_lens,
                                           work.k_scale).compile().as_text()
    tables = fp8_kernel_tables(hlo)
    assert len(tables) == 3 and len({name for name, _ in tables}) == 1
