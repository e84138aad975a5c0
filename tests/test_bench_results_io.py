"""benchmarks/results_io.py: what every benchmark writes is what benchmarks/results commits (the
JSON without per-repeat samples, kernel names or bench_step's records, floats to 6 significant
digits, compact; the plots at 80 dpi in 32 colours), the whole result beside it under a name git
ignores; and the committed results are already so."""
import json
import math
import subprocess
import sys

import pytest
from PIL import Image

from helpers import BENCHMARKS

sys.path.insert(0, str(BENCHMARKS))
import results_io  # noqa: E402
import step_report  # noqa: E402

RESULTS = BENCHMARKS / "results"


def _a_result():
    """A result with what each benchmark's JSON leaves out, and what it keeps."""
    impl = dict(ms=0.123456789012, repeats_ms=[0.1, 0.2], device_ms=0.1,
                device_repeats_ms=[0.1, 0.2], us_repeats=[1.0], device_us_repeats=[1.0])
    point = dict(impls=dict(flashmla=impl), v32_us_repeats=[3.0], v32_us=3.0,
                 checks=dict(device_time_kernels=dict(flashmla=dict(first="void sm90::...")),
                             equals_torch=True, max_abs_diff=6.103515625e-05))
    step = dict(meta=dict(repeats=5, resumed=["today"], mean_s_k=[64, 128]), points=[point],
                raw=[dict(b=1, jax_scan_us=1.0)], records=[dict(b=1, layout="scan")])
    return step, dict(records=[dict(tp=1, us_per_layer=2.0)])  # bench_multi_gpu's records


def test_the_json_keeps_the_summaries_and_the_whole_result_goes_beside_it(tmp_path):
    result, multi_gpu = _a_result()
    path = str(tmp_path / "r.json")
    results_io.write_json(result, path)
    text = (tmp_path / "r.json").read_text()
    assert text.count("\n") == 1 and ", " not in text and "repeats_ms" not in text
    written = json.loads(text)
    impl = written["points"][0]["impls"]["flashmla"]
    assert impl == dict(ms=0.123457, device_ms=0.1)  # 6 significant digits
    assert set(written["points"][0]) == {"impls", "v32_us", "checks"}
    assert written["points"][0]["checks"] == dict(equals_torch=True, max_abs_diff=6.10352e-05)
    assert math.isnan(results_io.trimmed(float("nan"))[0])
    assert results_io.trimmed([float("inf"), 3, True]) == ([float("inf"), 3, True], False)
    assert written["meta"] == result["meta"]  # an int `repeats` and other lists are kept
    assert "records" not in written and written["raw"] == result["raw"]
    whole = tmp_path / "r.raw.json"
    assert json.loads(whole.read_text()) == json.loads(json.dumps(result))
    # A redraw from the trimmed JSON writes it again as it was and leaves the whole one be.
    results_io.write_json(written, path)
    assert (tmp_path / "r.json").read_text() == text
    assert json.loads(whole.read_text())["records"] == result["records"]
    # Records without "raw" (bench_multi_gpu's) are the result itself: kept, and no side file.
    results_io.write_json(multi_gpu, str(tmp_path / "multi.json"))
    assert json.loads((tmp_path / "multi.json").read_text()) == multi_gpu
    assert not (tmp_path / "multi.raw.json").exists()


def test_the_side_file_is_ignored_by_git():
    ignored = subprocess.run(["git", "check-ignore", "-q", str(RESULTS / "step_h200.raw.json")],
                             cwd=BENCHMARKS, capture_output=True)
    if ignored.returncode == 128:
        pytest.skip("not in a git checkout")
    assert ignored.returncode == 0


def test_a_report_writes_its_plot_at_80_dpi_in_32_colours(tmp_path):
    raw = [dict(b=b, s_k=1024, h_q=16, s_q=1, dtype="bfloat16", layers=3,
                jax_scan_us=10.0 + b, jax_scan_gpu_us=9.0 + b) for b in (1, 2, 4)]
    step_report.write_report(dict(device="cpu", jax="x", raw=raw,
                                  records=[dict(b=1, layout="scan")]), str(tmp_path / "step"))
    assert "records" not in json.loads((tmp_path / "step.json").read_text())
    with Image.open(tmp_path / "step.png") as image:
        # step_report.plot's figure: 4.2 x 3.4 inches a panel, here one.
        assert image.size == (round(4.2 * 80), round(3.4 * 80))
        assert image.mode == "P" and len(image.getcolors(256)) <= results_io.COLOURS == 32


def test_the_committed_results_are_as_the_benchmarks_write_them(tmp_path):
    """Every committed JSON is its own trimmed form, byte for byte; every plot in 32 colours at
    most; results/ under 1 MB."""
    for path in sorted(RESULTS.glob("*.json")):
        result = json.loads(path.read_text())
        assert not results_io.trimmed(result)[1], f"{path.name} holds what write_json leaves out"
        results_io.write_json(result, str(tmp_path / path.name))
        assert (tmp_path / path.name).read_bytes() == path.read_bytes(), path.name
    for path in sorted(RESULTS.glob("*.png")):
        with Image.open(path) as image:
            assert image.mode == "P" and len(image.getcolors(256)) <= results_io.COLOURS, path.name
    assert sum(p.stat().st_size for p in RESULTS.iterdir() if p.is_file()) < 1_000_000
