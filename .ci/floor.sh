#!/usr/bin/env bash
# The tests at jax's floor (pyproject.toml's jax>=0.10): a fresh virtual environment with
# jax and jaxlib 0.10.0, jax_flashmla installed as the README says, and the tests of the
# custom calls, their validation, out-of-range requests, NaN, AlternatingStep, the host queue and
# the Flax layer.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=$(mktemp -d)/floor
python -m venv "$venv"
"$venv/bin/python" -m pip install -q jax==0.10.0 jaxlib==0.10.0 flax==0.12.8 pytest
"$venv/bin/python" -m pip install -q -e .
"$venv/bin/python" -c "import jax; assert jax.__version__ == '0.10.0', jax.__version__"
"$venv/bin/python" -m pytest -q tests/test_decode.py tests/test_validation.py \
  tests/test_value_checks.py tests/test_bad_metadata.py tests/test_fp8.py tests/test_cache.py \
  tests/test_step.py tests/test_out_of_range.py tests/test_nan.py tests/test_host_queue.py
