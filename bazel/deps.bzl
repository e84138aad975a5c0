"""@jax_flashmla_deps: the headers and sources of the Python environment, for the FFI build.

The repository is written by bazel/configure.py, run with $PYTHON_BIN_PATH (or the first
python3 / python on PATH): the interpreter whose jax, nanobind and (optionally) torch the
extension is built against, as CMake's find_package(Python) picks them. It is re-run when the
Bazel server restarts, when one of the variables below changes, and on
`bazel sync --configure`.
"""

def _jax_flashmla_deps_impl(rctx):
    python = rctx.os.environ.get("PYTHON_BIN_PATH") or rctx.which("python3") or rctx.which("python")
    if not python:
        fail("jax_flashmla_deps: no Python found; set PYTHON_BIN_PATH (e.g. --repo_env=PYTHON_BIN_PATH=$(which python))")
    script = rctx.path(Label("//bazel:configure.py"))
    result = rctx.execute([python, script, "--out", rctx.path(".")], timeout = 300)
    if result.return_code != 0:
        fail("jax_flashmla_deps: %s %s failed:\n%s%s" % (python, script, result.stdout, result.stderr))

jax_flashmla_deps = repository_rule(
    implementation = _jax_flashmla_deps_impl,
    environ = ["PYTHON_BIN_PATH", "CUDA_HOME", "CUDA_PATH", "PATH"],
    local = True,
    configure = True,
)
