"""benchmarks/soak_serving.py at CPU sizes: 2,000 steps of a serving loop with bad requests
mixed in, every step checked by the soak itself (it raises on the first broken invariant)."""
import json
import os
import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import soak_serving  # noqa: E402

# The tiny sizes (5 pages, 4 rows, lives of at most 128 tokens) turn the pool over every few
# dozen steps: 2,000 steps admit and finish about 300 requests and draw each bad kind about
# 100 times, past which more steps repeat the same states. The floors below are the ones the
# 10,000-step soak asserted, per step: a twentieth of the steps admitted and finished, a
# hundredth of them bad rows of each kind; 20 cache checks either way.
STEPS = 2000


def test_two_thousand_steps_keep_every_invariant(tmp_path):
    # A process of its own, with XLA's code optimised: its time goes into running the steps'
    # compiled code, not compiling it (conftest compiles the rest of the suite at -O0).
    flags = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split()
                     if not f.startswith("--xla_backend_optimization_level"))
    subprocess.run([sys.executable, str(BENCHMARKS / "soak_serving.py"), "--tiny", "--steps",
                    str(STEPS), "--cache-check-every", str(STEPS // 20),
                    "--out", str(tmp_path / "soak")],
                   env=dict(os.environ, XLA_FLAGS=flags), check=True)
    result = json.loads((tmp_path / "soak.json").read_text())
    assert result["steps"] == STEPS and result["cache_checks"] == 20
    assert result["admitted"] > STEPS // 20 and result["finished"] > STEPS // 20
    assert all(result[kind] > STEPS // 100 for kind in soak_serving.BAD_KINDS), result
    assert (tmp_path / "soak.md").read_text().startswith("# Serving soak")
