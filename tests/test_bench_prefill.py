"""benchmarks/bench_prefill.py: its --small mode writes the report with every point, and
mla_prefill's out there matches the einsum prefill's; the full grid's points and where the
einsum is skipped; a deadline that has passed still writes the report."""
import json
import sys

import jax

from helpers import BENCHMARKS

sys.path.insert(0, str(BENCHMARKS))
import bench_prefill  # noqa: E402
import results_io  # noqa: E402

SMALL_LABELS = ["new/T64/S0/h2/bf16", "new/T256/S0/h2/bf16", "extend/T64/S128/h2/bf16",
                "extend/T64/S128/h2/fp8"]


def test_the_small_mode_writes_its_report(tmp_path):
    out = str(tmp_path / "prefill_small")
    results = bench_prefill.main(["--small", "--out", out])
    # The JSON is the result trimmed (results_io); the whole result is beside it.
    with open(out + ".json") as f:
        assert json.load(f) == results_io.trimmed(results)[0]
    with open(out + ".raw.json") as f:
        assert json.load(f) == json.loads(json.dumps(results))
    points = results["points"]
    assert [p["label"] for p in points] == SMALL_LABELS and not results["not_run"]
    assert results["meta"]["flops"] == bench_prefill.FLOPS
    # The einsum always fits in small mode; cuDNN's flash attention runs only on a GPU; the
    # absorbed form (mla_decode with s_q = T) takes the extend points.
    expected = {"mla_prefill", "einsum"} | (set() if jax.default_backend() == "cpu" else {"cudnn"})
    for p in points:
        assert set(p["impls"]) == expected | ({"absorbed"} if p["kind"] == "extend" else set()), p
        for r in p["impls"].values():
            assert {"ms", "tflops", "calls", "executable_bytes", "temp_size_in_bytes"} <= set(r)
            assert r["executable_bytes"] >= r["temp_size_in_bytes"] >= 0
        # mla_prefill against the dense einsum on the same keys: within bf16 tolerance.
        assert p["checks"]["lse_finite"] and p["checks"]["matches_einsum"], p["checks"]
        assert p["checks"]["max_abs_diff_vs_einsum"] <= 2e-2 * max(
            1.0, p["checks"]["max_abs_einsum"])
    table = [line for line in open(out + ".md").read().splitlines() if line.startswith("| ")]
    assert len(table) == 2 + len(SMALL_LABELS)
    assert "absorbed ms" in table[0] and all(line.count("|") == 16 for line in table[1:])
    assert table[-1].startswith("| extend | 64 | 128 | 2 | fp8 |")
    assert (tmp_path / "prefill_small.png").stat().st_size > 0


def test_the_full_grid_and_where_the_einsum_is_skipped():
    points = bench_prefill.grid_points(bench_prefill.GRIDS["full"])
    new = [p for p in points if p.kind == "new"]
    extend = [p for p in points if p.kind == "extend"]
    assert len(new) == 5 * 2 and len(extend) == 4 * 3 * 2 * 2
    assert {p.cache for p in new} == {"bfloat16"}  # FP8 only where a prefix is read
    assert {p.cache for p in extend} == {"bfloat16", bench_prefill.FP8}
    assert all(p.prefix % 64 == 0 for p in points)
    by_label = {p.label: p for p in points}
    assert by_label["new/T1024/S0/h16/bf16"].flops == 1024 ** 2 / 2 * 16 * 2 * 320
    assert by_label["extend/T512/S4096/h128/fp8"].flops == 512 * (4096 + 256) * 128 * 2 * 320
    # h * T * (S + T) float32 scores about three times over, against 40 GB.
    fits = lambda label: by_label[label].einsum_bytes <= 40e9  # noqa: E731
    assert fits("new/T4096/S0/h128/bf16") and not fits("new/T16384/S0/h16/bf16")
    assert fits("extend/T512/S32768/h16/bf16") and not fits("extend/T512/S122880/h128/bf16")


def test_a_passed_deadline_still_writes_the_report(tmp_path):
    out = str(tmp_path / "late")
    results = bench_prefill.main(["--small", "--deadline-s", "0", "--points", "extend/*",
                                  "--out", out])
    assert results["points"] == []
    assert results["not_run"] == SMALL_LABELS[2:]
    with open(out + ".json") as f:
        assert json.load(f)["not_run"] == SMALL_LABELS[2:]


def test_a_padded_prefix_axis(tmp_path):
    """--capacity-pad: mla_prefill reads its prefix from an axis longer than the prefix and
    still matches the einsum on the prefix alone."""
    results = bench_prefill.main(["--small", "--capacity-pad", "256", "--points",
                                  "extend/*/bf16", "--out", str(tmp_path / "padded")])
    (point,) = results["points"]
    assert point["max_prefix_tokens"] == point["prefix"] + 256
    assert results["meta"]["capacity_pad"] == 256
    assert point["checks"]["matches_einsum"], point["checks"]
    assert "S + 256" in (tmp_path / "padded.md").read_text()
