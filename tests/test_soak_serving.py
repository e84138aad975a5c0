"""benchmarks/soak_serving.py at CPU sizes: 10,000 steps of a serving loop with bad requests
mixed in, every step checked by the soak itself (it raises on the first broken invariant)."""
import json
import os
import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import soak_serving  # noqa: E402


def test_ten_thousand_steps_keep_every_invariant(tmp_path):
    # A process of its own, with XLA's code optimised: its time goes into running 10,000 steps
    # of compiled code, not compiling it (conftest compiles the rest of the suite at -O0).
    flags = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split()
                     if not f.startswith("--xla_backend_optimization_level"))
    subprocess.run([sys.executable, str(BENCHMARKS / "soak_serving.py"), "--tiny", "--steps",
                    "10000", "--out", str(tmp_path / "soak")],
                   env=dict(os.environ, XLA_FLAGS=flags), check=True)
    result = json.loads((tmp_path / "soak.json").read_text())
    assert result["steps"] == 10000 and result["cache_checks"] == 20
    assert result["admitted"] > 500 and result["finished"] > 500
    assert all(result[kind] > 100 for kind in soak_serving.BAD_KINDS), result
    assert (tmp_path / "soak.md").read_text().startswith("# Serving soak")
