#!/usr/bin/env bash
# The GPU machine's check of jax_flashmla, run from the repository root with the kernels that
# ../shared/tools/fetch-flashmla-ops puts in .device/kernels. Builds the CUDA bridge, then runs
# each mode in turn; logs and results go under $OUT (or ./device-out).
#   bash dev/device_check.sh MODE...
#     build    the install alone (a warm machine keeps build/, so it is incremental)
#     capture  the command-buffer tests, the bf16 and FP8 op tests against torch (~2 min)
#     values   the bad-value tests with FlashMLA as their custom_call: out-of-range requests,
#              NaN semantics, value checks
#     bad-values  tests/test_gpu_bad_values.py: tests/bad_value_cases.py's groups (the sparse
#              ops, the indexer, mla_prefill on cuDNN with bf16 and FP8 caches, the Flax layers'
#              extend) a process each, then all in one process followed by valid sparse and
#              dense decodes against torch; BAD_VALUES_ARGS (pytest's, e.g. "-k one_process")
#     gpu      every test marked gpu but the two-GPU ones, or those in GPU_TESTS
#     prefill  mla_prefill's tests on the GPU: tests/test_gpu_prefill.py, and the CPU suite's
#              prefill tests, which run on cuDNN there
#     readme   tests/test_readme.py: the README's code with FlashMLA and cuDNN beneath it
#     prefill-bench  bench_prefill.py; PREFILL_ARGS, PREFILL_NAME (prefill_h200),
#              PREFILL_DEADLINE_S (default 360)
#     serve    examples/serve_deepseek_mla.py with 32k-token prompts prefilled in chunks and a
#              second turn over each conversation's cache; SERVE_ARGS replace the sizes
#     package  tests/test_gpu.py with the sgl-flash-mla package as the only kernel source
#     multi    tests/test_gpu_multi.py (two GPUs visible)
#     step     bench_step.py; STEP_ARGS (e.g. "--points 16,4096,128,1,bfloat16"), STEP_NAME
#              (step_h200), STEP_DEADLINE_S (default 540)
#     grid     bench_grid.py; GRID_ARGS, GRID_NAME (grid_h200), GRID_DEADLINE_S (default 420)
#     fp8      bench_fp8.py
#     sparse-bench  bench_sparse.py; SPARSE_ARGS (e.g. "--points call/*"), SPARSE_NAME
#              (sparse_h200), SPARSE_DEADLINE_S (default 420)
#     v32-bench  bench_v32_decode.py; V32_ARGS (e.g. "--points step/*/ctx131072/*"), V32_NAME
#              (v32_decode_h200), V32_DEADLINE_S (default 420)
#     v32      DeepSeek-V3.2's tests on the GPU: the indexer's kernels, the sparse ops, the layer
#              against HF (tests/test_gpu_indexer.py, test_indexer.py, test_gpu_sparse.py,
#              test_flax_sparse_mla.py)
#     v4       DeepSeek-V4's tests on the GPU: the cache, the sparse ops, the compressors, the
#              indexer and the layer against HF, serving, their bad values (tests/test_*v4*.py
#              but the benchmark's, or those in V4_TESTS)
#     v4-bench  bench_v4.py (DeepSeek-V4's step, decode by heads, prefill); V4_ARGS, V4_NAME
#              (v4_h200), V4_DEADLINE_S (default 300)
#     context-bench  bench_context.py (one layer's decode time and cache bytes per token at 8k,
#              128k and 1M tokens: dense, V3.2, V4's three layer types; the indexer calls
#              against their HBM floor: CONTEXT_ARGS="--families v32_indexer v4_indexer");
#              CONTEXT_ARGS, CONTEXT_NAME (context_h200), CONTEXT_DEADLINE_S (default 300)
#     soak     benchmarks/soak_serving.py at its GPU sizes; SOAK_ARGS (default --steps 10000),
#              SOAK_NAME (soak_h200)
#     model1-probe  dev/probe_model1.py: FlashMLA's DeepSeek-V4 sparse decode and prefill from
#              torch against a float64 reference (model1_probe.json)
#     long-v4  benchmarks/long_context_v4.py: a 1M-token prompt through V4-Flash-shaped layers
#              (HCA, CSA, sliding) prefilled in chunks, then decoded; LONG_ARGS, LONG_NAME
#              (long_context_v4_h200), LONG_DEADLINE_S (default 420: no chunk starts later;
#              the mode stops at 550 s)
#     xla-flags  the command-buffer flags the installed XLA plugin knows
#     set:NAME=VALUE  exports NAME=VALUE for the modes after it
# HF's oracles need the transformers the test extra pins (5.24); where the machine's differs,
# carry .device/transformers.tar.xz (`tar --exclude=__pycache__ -cJf .device/transformers.tar.xz
# -C <site-packages> transformers`): every mode then imports it.
set -uo pipefail
modes=("${@:-capture}")
out=${OUT:-device-out}
mkdir -p "$out"
kernels=.device/kernels
export JAX_FLASHMLA_KERNEL_LIBRARY=$PWD/$kernels/sglang_kernel-0.4.6/flashmla_ops.abi3.so
export PYTHONUNBUFFERED=1
ngpu=$(nvidia-smi -L | wc -l)
[ -n "${CUDA_VISIBLE_DEVICES:-}" ] && ngpu=$(tr ',' '\n' <<< "$CUDA_VISIBLE_DEVICES" | wc -l)
export JAX_FLASHMLA_REQUIRE_GPU=$ngpu  # a GPU test that skips here is a failure

nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee "$out/gpu.txt"
JAX_FLASHMLA_CUDA=ON python3 -m pip install -q --no-build-isolation --no-deps -e . \
  > "$out/build.txt" 2>&1 || { tail -40 "$out/build.txt"; exit 1; }
if [ -f .device/transformers.tar.xz ]; then
  mkdir -p /tmp/carried && tar xJf .device/transformers.tar.xz -C /tmp/carried
  export PYTHONPATH=/tmp/carried${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -c 'import transformers; print("transformers", transformers.__version__)'

# pytest with a time limit, its output in $out/$1; says so when the limit killed it.
pytest_logged() {
  local log=$1 limit=$2
  shift 2
  timeout "$limit" python3 -m pytest -q -rfEs -p no:cacheprovider "$@" > "$out/$log" 2>&1
  [ $? -eq 124 ] && echo "TIMEOUT after ${limit} s" >> "$out/$log"
  tail -15 "$out/$log"
}

for mode in "${modes[@]}"; do
  echo "==== $mode"
  case "$mode" in
  build) ;;
  capture)
    pytest_logged pytest_capture.txt 300 tests/test_gpu_capture.py tests/test_gpu.py \
      tests/test_gpu_fp8.py ;;
  values)
    pytest_logged pytest_values.txt 300 tests/test_out_of_range.py tests/test_nan.py \
      tests/test_value_checks.py ;;
  bad-values)
    pytest_logged pytest_bad_values.txt 540 -rfEsP tests/test_gpu_bad_values.py \
      ${BAD_VALUES_ARGS:-} ;;  # P: the output of passed tests too, a line per case
  prefill)
    pytest_logged pytest_prefill.txt 400 tests/test_gpu_prefill.py tests/test_prefill.py ;;
  readme) pytest_logged pytest_readme.txt 200 tests/test_readme.py ;;
  prefill-bench)
    timeout $((${PREFILL_DEADLINE_S:-360} + 120)) python3 benchmarks/bench_prefill.py \
      --deadline-s "${PREFILL_DEADLINE_S:-360}" --out "$out/${PREFILL_NAME:-prefill_h200}" \
      ${PREFILL_ARGS:-} 2>&1 | tee "$out/prefill.txt" | cut -c1-300 | tail -60 ;;
  serve)
    timeout 240 python3 examples/serve_deepseek_mla.py ${SERVE_ARGS:---requests 6 --batch 4 \
      --min-prompt 32768 --max-prompt 32768 --max-new 48 --turns 2} > "$out/serve.txt" 2>&1
    echo "exit $?"; tr '\r' '\n' < "$out/serve.txt" | grep -v "^[IW][0-9]" | tail -25 ;;
  gpu)  # four workers share the GPU, each allocating as it goes (~5.5 min on an H100)
    XLA_PYTHON_CLIENT_PREALLOCATE=false pytest_logged pytest_gpu.txt 540 -m gpu -n 4 \
      ${GPU_TESTS:-tests --ignore=tests/test_gpu_multi.py} ;;
  package)
    site=/tmp/flash_mla_site
    python3 -m pip install -q --no-index --no-deps --upgrade --target "$site" \
      $kernels/sgl_flash_mla-*.whl
    env -u JAX_FLASHMLA_KERNEL_LIBRARY PYTHONPATH=$site \
      timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py 2>&1 \
      | tee "$out/pytest_package.txt" | tail -3 ;;
  multi) pytest_logged pytest_multi.txt 200 tests/test_gpu_multi.py ;;
  step)
    timeout $((${STEP_DEADLINE_S:-540} + 60)) python3 benchmarks/bench_step.py \
      --deadline-s "${STEP_DEADLINE_S:-540}" --out "$out/${STEP_NAME:-step_h200}" \
      ${STEP_ARGS:-} 2>&1 | tee "$out/step.txt" | cut -c1-400 | tail -60 ;;
  grid)
    timeout $((${GRID_DEADLINE_S:-420} + 60)) python3 benchmarks/bench_grid.py \
      --deadline-s "${GRID_DEADLINE_S:-420}" --out-dir "$out" --name "${GRID_NAME:-grid_h200}" \
      ${GRID_ARGS:-} 2>&1 | tee "$out/grid.txt" | tail -40 ;;
  sparse-bench)
    timeout $((${SPARSE_DEADLINE_S:-420} + 90)) python3 benchmarks/bench_sparse.py \
      --deadline-s "${SPARSE_DEADLINE_S:-420}" --out "$out/${SPARSE_NAME:-sparse_h200}" \
      ${SPARSE_ARGS:-} 2>&1 | tee "$out/sparse.txt" | cut -c1-400 | tail -60 ;;
  v32-bench)
    timeout $((${V32_DEADLINE_S:-420} + 120)) python3 benchmarks/bench_v32_decode.py \
      --deadline-s "${V32_DEADLINE_S:-420}" --out "$out/${V32_NAME:-v32_decode_h200}" \
      ${V32_ARGS:-} 2>&1 | tee "$out/v32.txt" | cut -c1-400 | tail -40 ;;
  v4-bench)
    timeout $((${V4_DEADLINE_S:-300} + 120)) python3 benchmarks/bench_v4.py \
      --deadline-s "${V4_DEADLINE_S:-300}" --out "$out/${V4_NAME:-v4_h200}" ${V4_ARGS:-} 2>&1 \
      | tee "$out/v4.txt" | grep -v "^[IW][0-9]" | cut -c1-600 | tail -40 ;;
  context-bench)
    timeout $((${CONTEXT_DEADLINE_S:-300} + 120)) python3 benchmarks/bench_context.py \
      --deadline-s "${CONTEXT_DEADLINE_S:-300}" --out "$out/${CONTEXT_NAME:-context_h200}" \
      ${CONTEXT_ARGS:-} 2>&1 | tee "$out/context.txt" | grep -v "^[IW][0-9]" | cut -c1-600 \
      | tail -60 ;;
  fp8)
    timeout 240 python3 benchmarks/bench_fp8.py --out "$out/fp8_h200.json" 2>&1 \
      | tee "$out/fp8.txt" | tail -20 ;;
  v32)
    pytest_logged pytest_v32.txt 400 tests/test_gpu_indexer.py tests/test_indexer.py \
      tests/test_gpu_sparse.py tests/test_flax_sparse_mla.py ;;
  v4)
    XLA_PYTHON_CLIENT_PREALLOCATE=false pytest_logged pytest_v4.txt 500 \
      ${V4_TESTS:-$(ls tests/test_*v4*.py | grep -v test_bench_)} ;;
  soak)
    timeout 540 python3 benchmarks/soak_serving.py ${SOAK_ARGS:---steps 10000} \
      --out "$out/${SOAK_NAME:-soak_h200}" > "$out/soak.txt" 2>&1
    echo "exit $?"; grep -v "^[IW][0-9]" "$out/soak.txt" | cut -c1-2000 | tail -12 ;;
  xla-flags)
    python3 - <<'PY' | tee "$out/xla_flags.txt"
import glob, os, re, jax_plugins
names = set()
for d in jax_plugins.__path__:
    for so in glob.glob(os.path.join(d, "**", "*.so*"), recursive=True):
        names |= set(re.findall(rb"xla_(?:gpu_)?(?:command_buffer|cmd_buffer|graph)[a-z_]*"
                                rb"|ALWAYS_UPDATE|SKIP_TEMP|SKIP_PROFILED|NEVER_UPDATE",
                                open(so, "rb").read()))
print("\n".join(sorted(n.decode() for n in names)))
PY
    ;;
  model1-probe)
    timeout 200 python3 dev/probe_model1.py "$JAX_FLASHMLA_KERNEL_LIBRARY" \
      "$out/model1_probe.json" > "$out/model1_probe.txt" 2>&1
    echo "exit $?"; cut -c1-300 "$out/model1_probe.txt" | tail -12 ;;
  long-v4)
    timeout 550 python3 benchmarks/long_context_v4.py \
      --deadline-s "${LONG_DEADLINE_S:-420}" --out "$out/${LONG_NAME:-long_context_v4_h200}" \
      ${LONG_ARGS:-} > "$out/long_v4.txt" 2>&1
    echo "exit $?"; grep -v "^[IW][0-9]" "$out/long_v4.txt" | cut -c1-400 | tail -30 ;;
  set:*) export "${mode#set:}" ;;
  *) echo "unknown mode $mode"; exit 2 ;;
  esac
done
