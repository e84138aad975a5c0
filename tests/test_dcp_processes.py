"""examples/dcp_across_processes.py in 2 processes on CPU (jax.distributed, gloo collectives):
decode context parallelism over 4 devices of two processes, as a multi-host deployment runs
it, each process's merged result checked against the whole cache's reference."""
import os
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "dcp_across_processes.py"


def test_dcp_across_two_processes_matches_one_device():
    """Run bare, the example starts its two processes itself; each exits 0 only when its
    merged result matches the reference."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    run = subprocess.run([sys.executable, str(EXAMPLE)], capture_output=True, text=True,
                         env=env, timeout=300)
    assert run.returncode == 0, (run.stdout, run.stderr[-3000:])
