#!/usr/bin/env bash
# Builds the FFI extension with Bazel (BUILD.bazel) and runs the CPU decode through it
# (tests/test_bazel_extension.py). Installs Debian's Bazel 4.2.3 when it is missing.
#
#   .ci/bazel.sh        from anywhere; uses the python on PATH (or $PYTHON), which must have
#                       jax, nanobind and pytest (and, for the CUDA bridge, torch) installed
#
# Environment: PYTHON (default python3/python), BAZEL_JOBS (default 2), JAX_FLASHMLA_BAZEL_CUDA=0
# to leave out the compile check of the CUDA bridge.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS

# Bazel: Debian's bazel-bootstrap (4.2.3, builds offline) and its @platforms (bazel-platforms).
# Run as bazel-4, so that another Bazel on PATH (bazelisk, a newer release) is not picked up.
if ! command -v bazel-4 >/dev/null || [ ! -f /usr/share/bazel/tools/platforms/WORKSPACE ]; then
  SUDO=()
  if [ "$(id -u)" != 0 ]; then SUDO=(sudo); fi
  "${SUDO[@]}" apt-get update -qq
  "${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive \
    apt-get install -y -qq bazel-bootstrap bazel-platforms >/dev/null
fi

PYTHON=${PYTHON:-$(command -v python3 || command -v python)}
# The interpreter itself, not a shim (pyenv's would pick a version by the current directory).
PYTHON=$("$PYTHON" -c 'import sys; print(sys.executable)')

# One server for these commands (same startup options), gone after 5 idle minutes.
BAZEL=(bazel-4 --max_idle_secs=300)
FLAGS=(--config=debian --jobs="${BAZEL_JOBS:-2}" --repo_env=PYTHON_BIN_PATH="$PYTHON"
       --color=no --curses=no --show_progress_rate_limit=30)

echo "== bazel build: CPU handlers, the _cpu module, the py_library" \
  "(bazel-bootstrap $(dpkg-query -W -f '${Version}' bazel-bootstrap))"
"${BAZEL[@]}" build "${FLAGS[@]}" //:cpu_handlers //:_cpu //:jax_flashmla

# What bazel/configure.py found (@jax_flashmla_deps//:defs.bzl is also valid Python).
DEFS="$("${BAZEL[@]}" info "${FLAGS[@]}" output_base 2>/dev/null)/external/jax_flashmla_deps/defs.bzl"
CUDA_TARGETS=$("$PYTHON" - "$DEFS" <<'PY'
import sys
found = {}
exec(open(sys.argv[1]).read(), found)
for note in found["NOTES"]:
    print("   ", note, file=sys.stderr)
targets = []
if found["TORCH_FOUND"] and found["CUDA_HEADERS_FOUND"] and found["NVCC"]:
    targets += ["//:bridge_kernels", "//:cuda_handlers", "//:flashmla_handlers",
                "//:flashmla_module"]  # compile only
    if found["TORCH_CUDA"]:
        targets += ["//:_cuda", "//:_flashmla", "//:jax_flashmla"]  # link against CUDA's libraries
print(" ".join(targets))
PY
)

if [ "${JAX_FLASHMLA_BAZEL_CUDA:-1}" = 0 ]; then
  echo "== CUDA bridge: left out (JAX_FLASHMLA_BAZEL_CUDA=0)"
elif [ -z "$CUDA_TARGETS" ]; then
  echo "== CUDA bridge: left out (needs torch, the CUDA toolkit's headers and nvcc; see above)"
else
  echo "== bazel build --config=cuda $CUDA_TARGETS"
  # shellcheck disable=SC2086
  "${BAZEL[@]}" build "${FLAGS[@]}" --config=cuda $CUDA_TARGETS
fi

BIN=$("${BAZEL[@]}" info "${FLAGS[@]}" bazel-bin 2>/dev/null)
echo "== pytest tests/test_bazel_extension.py with $BIN/jax_flashmla/_cpu.so"
JAX_FLASHMLA_BAZEL_EXT="$BIN/jax_flashmla/_cpu.so" JAX_FLASHMLA_REQUIRE_BAZEL=1 \
  "$PYTHON" -m pytest -q -p no:cacheprovider tests/test_bazel_extension.py

echo "== .ci/bazel.sh passed in $((SECONDS - start)) s"
