#!/usr/bin/env bash
# The GPU machine's check of jax_flashmla, in one call of the device tool:
#   build (the CUDA bridge against the machine's torch), the whole test suite with GPU skips
#   turned into failures, the flash_mla-package kernel path, and the decode benchmark.
# Expects the kernels fetched by ../shared/tools/fetch-flashmla-ops in .device/kernels
# (carried with the call). Writes logs and JSON under $OUT (or ./device-out).
set -uo pipefail
out=${OUT:-device-out}
mkdir -p "$out"
kernels=.device/kernels
export JAX_FLASHMLA_KERNEL_LIBRARY=$PWD/$kernels/sglang_kernel-0.4.6/flashmla_ops.abi3.so
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee "$out/gpu.txt"

JAX_FLASHMLA_CUDA=ON python3 -m pip install -q --no-build-isolation --no-deps -e . \
  > "$out/build.txt" 2>&1 || { tail -40 "$out/build.txt"; exit 1; }
echo "built: $(ls jax_flashmla/*.so build/*/_cuda*.so 2>/dev/null | tr '\n' ' ')"

JAX_FLASHMLA_REQUIRE_GPU=1 timeout 420 python3 -m pytest -q -rfEs ${PYTEST_ARGS:-tests} \
  2>&1 | tee "$out/pytest.txt" | tail -25

# The third discovery route: the sgl-flash-mla package (flash_mla_legacy ops).
site=/tmp/flash_mla_site
python3 -m pip install -q --no-index --no-deps --target "$site" $kernels/sgl_flash_mla-*.whl
env -u JAX_FLASHMLA_KERNEL_LIBRARY PYTHONPATH=$site JAX_FLASHMLA_REQUIRE_GPU=1 \
  timeout 120 python3 -m pytest -q tests/test_gpu.py 2>&1 | tee "$out/pytest_flash_mla.txt" | tail -5

timeout 300 python3 benchmarks/bench_decode.py --out "$out/bench_decode.json" 2>&1 | tee "$out/bench.txt"
