"""examples/dcp_across_processes.py in 2 processes on CPU (jax.distributed, gloo collectives):
decode context parallelism over 4 devices of two processes, as a multi-host deployment runs
it, each process's merged result checked against the whole cache's reference."""
import os
import socket
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "dcp_across_processes.py"


def _free_port():
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def test_dcp_across_two_processes_matches_one_device():
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    coordinator = f"localhost:{_free_port()}"
    runs = [subprocess.Popen([sys.executable, str(EXAMPLE), "--process-id", str(i),
                              "--num-processes", "2", "--coordinator", coordinator],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
            for i in range(2)]
    try:
        for i, run in enumerate(runs):
            out, err = run.communicate(timeout=300)
            assert run.returncode == 0, (i, out, err[-3000:])
            assert f"process {i} of 2: 4 devices" in out and ": match" in out, out
    finally:  # a process whose peer failed would wait for it
        for run in runs:
            run.kill()
