"""The examples' command lines (examples/*.py), run as a user runs them, on CPU: an option that
needs a Hopper GPU is refused in one sentence naming it and what to use instead (argparse's
exit status 2, no traceback), and --help lists the suggested command lines of each example's
docstring; decode_loop.py runs to the end. Each example is started once per case, all cases at
once (a few seconds)."""
import functools
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
SERVE = EXAMPLES / "serve_deepseek_mla.py"
# argv -> (the refused option as the error names it, the way out it must suggest)
REFUSED = {
    ("--attention", "v32", "--implementation", "custom_call"):
        ("--implementation custom_call with --attention v32", "--implementation reference"),
    ("--prefill-implementation", "custom_call"):
        ("--prefill-implementation custom_call", "--prefill-implementation reference"),
}
HELP = ("serve_deepseek_mla.py", "decode_loop.py", "dcp_across_processes.py")
LOOP = ("decode_loop.py", ("--custom-call",))  # decode_loop runs in seconds: run it whole


@functools.cache
def runs():
    """{(script, argv): CompletedProcess-like (returncode, stdout, stderr)}: every case started
    at once (JAX on CPU, as on a machine without a GPU), then waited for."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    cases = ([(SERVE.name, argv) for argv in REFUSED] + [(name, ("--help",)) for name in HELP]
             + [LOOP])
    procs = {case: subprocess.Popen([sys.executable, str(EXAMPLES / case[0]), *case[1]],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                    env=env)
             for case in cases}
    done = {}
    for case, proc in procs.items():
        out, err = proc.communicate(timeout=300)
        done[case] = (proc.returncode, out, err)
    return done


@pytest.mark.parametrize("argv", list(REFUSED), ids=" ".join)
def test_a_gpu_only_option_off_the_gpu_is_one_sentence(argv):
    returncode, out, err = runs()[(SERVE.name, argv)]
    assert returncode == 2, (out, err[-3000:])
    assert "Traceback" not in err, err[-3000:]
    option, instead = REFUSED[argv]
    lines = err.strip().splitlines()
    error = lines[-1]
    assert error.startswith(f"{SERVE.name}: error: {option} "), err
    assert "Hopper GPU" in error and instead in error, error
    assert all(line.startswith(("usage:", " ")) for line in lines[:-1]), err  # the usage alone
    assert not re.search(r"[.!?] \S", error), error  # one sentence
    assert out == ""  # nothing served


@pytest.mark.parametrize("script", HELP)
def test_help_lists_the_suggested_command_lines(script):
    returncode, out, err = runs()[(script, ("--help",))]
    assert returncode == 0, err[-3000:]
    docstring = (EXAMPLES / script).read_text().split('"""')[1]
    commands = [line.strip() for line in docstring.splitlines()
                if line.strip().startswith(f"python examples/{script}")]
    assert len(commands) >= 3
    assert "suggested command lines:" in out
    listed = out.split("suggested command lines:")[1]
    for command in commands:
        assert command in listed, (command, out)


def test_the_decode_loop_runs():
    returncode, out, err = runs()[LOOP]
    assert returncode == 0, err[-3000:]
    assert "implementation: FlashMLA's C++ model" in out
    assert "finished; 64 of 64 pages free" in out
