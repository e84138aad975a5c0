"""benchmarks/soak_serving.py at CPU sizes: 10,000 steps of a serving loop with bad requests
mixed in, every step checked by the soak itself (it raises on the first broken invariant)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import soak_serving  # noqa: E402


def test_ten_thousand_steps_keep_every_invariant(tmp_path):
    result = soak_serving.main(["--tiny", "--steps", "10000", "--out", str(tmp_path / "soak")])
    assert result["steps"] == 10000 and result["cache_checks"] == 20
    assert result["admitted"] > 500 and result["finished"] > 500
    assert all(result[kind] > 100 for kind in soak_serving.BAD_KINDS), result
    assert (tmp_path / "soak.md").read_text().startswith("# Serving soak")
