"""On the GPU machine: tests/bad_value_cases.py's groups on FlashMLA's kernels, jax_flashmla's
own and cuDNN, each group in a process of its own (an illegal address poisons the CUDA context
of its process: the other groups still run), then every group in one process followed by valid
sparse and dense decodes bit-identical to FlashMLA's ops from torch (no case left the context
poisoned)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bad_value_cases import GROUPS, ILLEGAL_ADDRESS

pytestmark = pytest.mark.gpu
CASES = Path(__file__).resolve().parent / "bad_value_cases.py"


def _run_cases(*args, timeout):
    """bad_value_cases.py with args in a child process; fails with its output unless it
    exits 0."""
    # This process holds part of the GPU already: the child's JAX takes memory as it goes.
    env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")
    try:
        run = subprocess.run([sys.executable, str(CASES), *args], capture_output=True,
                             text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"bad_value_cases.py {' '.join(args)} ran past {timeout} s:\n"
                    f"{_text(e.stdout)[-6000:]}\n{_text(e.stderr)[-3000:]}")
    output = f"{run.stdout[-8000:]}\n--- stderr ---\n{run.stderr[-4000:]}"
    if any(marker in run.stdout + run.stderr for marker in ILLEGAL_ADDRESS):
        pytest.fail(f"illegal address: the CUDA context was poisoned\n{output}")
    assert run.returncode == 0, f"exit {run.returncode}\n{output}"
    print(run.stdout)  # a line per case, for the record


def _text(captured):
    return captured.decode(errors="replace") if isinstance(captured, bytes) else captured or ""


@pytest.mark.parametrize("group", list(GROUPS))
def test_a_group_in_a_process_of_its_own(group):
    _run_cases(group, timeout=240)


def test_every_group_in_one_process_then_a_valid_call():
    _run_cases(*GROUPS, "--then-valid-call", timeout=420)
