#!/usr/bin/env bash
# The GPU machine's check of jax_flashmla, for the device tool (kind nvidia-h200-x2 runs the
# two-GPU parts too). Expects the kernels that ../shared/tools/fetch-flashmla-ops puts in
# .device/kernels (carried with the call). Logs and JSON go under $OUT (or ./device-out).
#   bash benchmarks/device_check.sh MODE...  # build once, then each mode in turn:
#     tests      every GPU-relevant test but FP8's, skips failing (= gpu_tests, ~5 min on one
#                H200, + stack_tests + more_tests: run them in separate calls)
#     fp8        the FP8 tests            probe_fp8  which inputs FlashMLA's FP8 kernel takes
#     gpu_bf16   tests/test_gpu.py alone (bf16 against the torch op)
#     fp8_main   the FP8 tests on the kernel library's route only
#     fp8_step   the FP8 tests with the guard's (test_fp8_guard.py), the bf16 op tests and the
#                Flax layer and example (~4 min)
#     decode_quick  test_decode.py but FlashMLA's grid, test_speculative.py, test_transforms.py
#     multi      tests/test_gpu_multi.py (two GPUs visible)
#     decode     bench_decode.py          profile    the GPU timeline of one decode, jax vs torch
#     bench      multi-GPU, FP8, write_kv benchmarks and the served example
#     bench_fp8  the FP8 benchmark alone
#     guard_step an FP8 step's guard merged against one per layer (bench_fp8.py --guard-step)
#     grid       FlashMLA's grid (bench_grid.py); GRID_DEADLINE_S (default 420), GRID_ARGS
#                (e.g. "--dtype bfloat16": ~8 min a cache dtype), GRID_NAME (grid_h200)
#     grid_resume  the points benchmarks/results/$GRID_NAME.json lacks
#     serving    tests/test_serving.py alone       profile_h16  profile_decode, h_q=16, s_k=8192
#     build      nothing but the install; SKIP_INSTALL=1 skips it (for parallel calls)
#     grid_split   two GPUs: the grid mode at once on GPU 0 (mean s_k 1024, 4096) and GPU 1
#                (8192, 16384), each on half the cores, into $GRID_NAME_a.json and _b.json
#                (grid_report.py --merge joins them); GRID_ARGS picks e.g. the dtype
#     hq16       h_q=16's per-call gap to torch: GPU timelines at s_k 4096/8192, and
#                bench_decode under XLA settings that could change it (~3 min)
#     pair       two GPUs: the modes in GPU0_MODES on GPU 0 and those in GPU1_MODES on GPU 1 at
#                once, each on half the cores, logs in gpu0.txt and gpu1.txt
#     timing_split  pair with decode_runs (bench_decode, 3 runs) then trace on GPU 0, the grid
#                mode on GPU 1 (GRID_ARGS, GRID_NAME)
#     batch_edges  probe_batch_edges.py: the per-call ratio over batches of ~12, 50 and 200 ms,
#                jax synced its own way and device-wide (~2 min)
#     xla_floor  probe_batch_edges.py --device-time: decodes and jitted copies against torch's
#                by device time, XLA's idle time between executions included (~1 min)
#     capture    the command-buffer tests (test_gpu_capture.py), the bf16 and FP8 op tests
#     step       bench_step.py; STEP_ARGS (e.g. "--part 0/2"), STEP_NAME (step_h200),
#                STEP_DEADLINE_S (default 540)
#     set:NAME=VALUE  exports NAME=VALUE for the modes after it (e.g. an XLA or jax setting)
#     decode_h16 bench_decode.py at h_q=16 alone, 3 runs
#     client_pair  pair: decode_h16 and trace on GPU 0; the same and gpu_bf16 on GPU 1 with
#                USE_TFRT_GPU_CLIENT=true (XLA's TFRT GPU client; jax 0.11.2's plugin ignores it)
#     trace      trace_executions.py (what the GPU waits for between jitted calls, with XLA's
#                driver calls) at h_q=16, s_k 4096 and 8192, and h_q=128, s_k=16384; an FP8
#                cache at s_k=8192, h_q 16 and 128 (TRACE_POINTS="s_k h_q [--fp8];..." picks)
set -uo pipefail
modes=("${@:-tests}")
out=${OUT:-device-out}
mkdir -p "$out"
kernels=.device/kernels
export JAX_FLASHMLA_KERNEL_LIBRARY=$PWD/$kernels/sglang_kernel-0.4.6/flashmla_ops.abi3.so
export PYTHONUNBUFFERED=1 JAX_FLASHMLA_REQUIRE_GPU=1
ngpu=$(nvidia-smi -L | wc -l)
[ -n "${CUDA_VISIBLE_DEVICES:-}" ] && ngpu=$(tr ',' '\n' <<< "$CUDA_VISIBLE_DEVICES" | wc -l)
[ "$ngpu" -ge 2 ] && export JAX_FLASHMLA_REQUIRE_GPUS=2

nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee "$out/gpu.txt"
# Always (re)install: a warm machine keeps build/ between calls, so this is incremental, and
# it never runs a bridge older than the sources that came with this call.
if [ -z "${SKIP_INSTALL:-}" ]; then
  JAX_FLASHMLA_CUDA=ON python3 -m pip install -q --no-build-isolation --no-deps -e . \
    > "$out/build.txt" 2>&1 || { tail -40 "$out/build.txt"; exit 1; }
fi

# Runs pytest with a time limit, its output in $out/$1; says so when the limit killed it.
pytest_logged() {
  local log=$1 limit=$2
  shift 2
  timeout "$limit" python3 -m pytest -q -rfEs -p no:cacheprovider "$@" > "$out/$log" 2>&1
  [ $? -eq 124 ] && echo "TIMEOUT after ${limit} s" >> "$out/$log"
  tail -15 "$out/$log"
}

# The custom call against the torch op, and FlashMLA's test grid against float64 (~5 min).
gpu_tests() {
  pytest_logged pytest_gpu.txt 400 tests/test_gpu.py tests/test_decode.py
}

# The stack over the custom call (cache, serving, speculative decoding, transforms, two GPUs),
# then the Flax example's GPU test and the third discovery route: the sgl-flash-mla package
# (flash_mla_legacy ops).
stack_tests() {
  pytest_logged pytest_stack.txt 300 tests/test_cache.py tests/test_serving.py \
    tests/test_speculative.py tests/test_transforms.py tests/test_gpu_multi.py
  pytest_logged pytest_flax.txt 150 -m gpu tests/test_flax_mla.py
  on_flash_mla_package timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py \
    2>&1 | tee "$out/pytest_flash_mla.txt" | tail -3
}

# Everything else on the GPU backend but what CI alone runs (HF comparisons, Bazel, the
# bridge's compile check, the benchmark grid's CPU mode) and FP8 (its own mode).
more_tests() {
  pytest_logged pytest_more.txt 300 tests --ignore=tests/test_gpu.py \
    --ignore=tests/test_decode.py --ignore=tests/test_cache.py --ignore=tests/test_serving.py \
    --ignore=tests/test_speculative.py --ignore=tests/test_transforms.py \
    --ignore=tests/test_gpu_multi.py --ignore=tests/test_flax_mla.py \
    --ignore=tests/test_flax_weights.py --ignore=tests/test_bazel_extension.py \
    --ignore=tests/test_bridge_compile.py --ignore=tests/test_bench_grid.py \
    --ignore=tests/test_gpu_fp8.py
}

# FP8 against bf16: time, cache bandwidth and accuracy (b=128, s_k 4096/8192, h_q 16/128).
bench_fp8() {
  timeout 240 python3 benchmarks/bench_fp8.py --out "$out/bench_fp8.json" 2>&1 \
    | tee "$out/bench_fp8.txt"
}

# profile_decode.py at h_q=16 for each s_k given. At s_k=8192 the kernel outlasts the host's
# dispatch even under the profiler, so the timeline shows what XLA adds between jitted calls.
profile_h16() {
  local s_k
  for s_k in "$@"; do
    timeout 150 python3 benchmarks/profile_decode.py --s-k "$s_k" --h-q 16 \
      --out "$out/profile_$s_k.json" > "$out/profile_$s_k.txt" 2>&1
    grep "span" "$out/profile_$s_k.txt"
  done
}

# Runs a command with the sgl-flash-mla package as the only kernel source.
on_flash_mla_package() {
  local site=/tmp/flash_mla_site
  python3 -m pip install -q --no-index --no-deps --upgrade --target "$site" \
    $kernels/sgl_flash_mla-*.whl
  env -u JAX_FLASHMLA_KERNEL_LIBRARY PYTHONPATH=$site "$@"
}

for mode in "${modes[@]}"; do
  echo "==== $mode"
  case "$mode" in
  tests) gpu_tests; stack_tests; more_tests ;;
  gpu_tests) gpu_tests ;;
  gpu_bf16) pytest_logged pytest_gpu_bf16.txt 200 tests/test_gpu.py ;;
  fp8_main) pytest_logged pytest_fp8_main.txt 200 tests/test_gpu_fp8.py tests/test_fp8.py ;;
  fp8_step)
    pytest_logged pytest_fp8_step.txt 330 tests/test_gpu_fp8.py tests/test_fp8_guard.py \
      tests/test_fp8.py tests/test_gpu.py tests/test_flax_mla.py ;;
  decode_quick)
    pytest_logged pytest_decode_quick.txt 300 tests/test_decode.py -k "not fp32_reference" \
      tests/test_speculative.py tests/test_transforms.py ;;
  multi) pytest_logged pytest_multi.txt 200 tests/test_gpu_multi.py ;;
  capture)
    pytest_logged pytest_capture.txt 300 tests/test_gpu_capture.py tests/test_gpu.py \
      tests/test_gpu_fp8.py ;;
  step)
    timeout $((${STEP_DEADLINE_S:-540} + 60)) python3 benchmarks/bench_step.py \
      --deadline-s "${STEP_DEADLINE_S:-540}" --out "$out/${STEP_NAME:-step_h200}" \
      ${STEP_ARGS:-} 2>&1 | tee "$out/step.txt" | cut -c1-400 | tail -60 ;;
  stack_tests) stack_tests ;;
  more_tests) more_tests ;;
  fp8)
    timeout 200 python3 -m pytest -q -rfEs -p no:cacheprovider tests/test_gpu_fp8.py \
      tests/test_fp8.py 2>&1 | tee "$out/pytest_fp8.txt" | tail -30
    # The sgl-flash-mla package's FP8 ops; -x reports a failure before anything can crash.
    on_flash_mla_package timeout 120 python3 -m pytest -q -x --tb=short -p no:cacheprovider \
      tests/test_gpu_fp8.py 2>&1 | tee "$out/pytest_fp8_flash_mla.txt" | tail -40 ;;
  probe_fp8)
    timeout 300 python3 benchmarks/probe_fp8.py --out "$out/probe_fp8.json" 2>&1 | tail -8 ;;
  profile)
    timeout 200 python3 benchmarks/profile_decode.py --out "$out/profile.json" 2>&1 \
      | tee "$out/profile.txt" ;;
  decode)
    timeout 200 python3 benchmarks/bench_decode.py --out "$out/bench_decode.json" 2>&1 \
      | tee "$out/bench.txt" ;;
  grid|grid_resume)
    # Writes its JSON and markdown after every point. grid_resume runs only the points that
    # the committed benchmarks/results/$GRID_NAME.json lacks.
    name=${GRID_NAME:-grid_h200}
    resume=()
    if [ "$mode" = grid_resume ]; then
      cp "benchmarks/results/$name.json" "$out/" && resume=(--resume)
    fi
    timeout 500 python3 benchmarks/bench_grid.py --deadline-s "${GRID_DEADLINE_S:-420}" \
      --out-dir "$out" --name "$name" "${resume[@]}" ${GRID_ARGS:-} > "$out/grid_log.txt" 2>&1
    tail -c 4000 "$out/grid_log.txt" ;;
  serving) pytest_logged pytest_serving.txt 200 tests/test_serving.py ;;
  profile_h16) profile_h16 8192 ;;
  trace)
    IFS=';' read -ra points <<< "${TRACE_POINTS:-4096 16;8192 16;16384 128;8192 16 --fp8;8192 128 --fp8}"
    for point in "${points[@]}"; do
      read -r s_k h_q flag <<< "$point"
      name="trace_${s_k}_${h_q}${flag:+_fp8}"
      timeout 150 python3 benchmarks/trace_executions.py --s-k "$s_k" --h-q "$h_q" $flag \
        --out "$out/$name.txt" > "$out/${name}_log.txt" 2>&1
      grep -E "^==|Error" "$out/${name}_log.txt"
    done ;;
  timing_split) GPU0_MODES="decode_runs trace" GPU1_MODES=grid bash "$0" pair ;;
  build) ;;  # the install above is all it does
  set:*) export "${mode#set:}" ;;
  decode_h16)
    timeout 200 python3 benchmarks/bench_decode.py --h-q 16 --runs 3 --no-host \
      --out "$out/bench_decode_h16.json" > "$out/bench_h16.txt" 2>&1
    grep -E "^b=128|Error" "$out/bench_h16.txt" ;;
  client_pair)  # the same on both GPUs at once, GPU 1 asking for XLA's TFRT client
    GPU0_MODES="decode_h16 trace" \
      GPU1_MODES="set:USE_TFRT_GPU_CLIENT=true decode_h16 trace gpu_bf16" bash "$0" pair ;;
  grid_split)
    half=$(($(nproc) / 2))
    for gpu in 0 1; do
      part=$([ $gpu = 0 ] && echo "a --s-k 1024 4096" || echo "b --s-k 8192 16384")
      CUDA_VISIBLE_DEVICES=$gpu SKIP_INSTALL=1 OUT="$out/gpu$gpu" \
        GRID_NAME="${GRID_NAME:-grid_h200}_${part%% *}" GRID_ARGS="${GRID_ARGS:-} ${part#* }" \
        taskset -c $((gpu * half))-$((gpu * half + half - 1)) bash "$0" grid \
        > "$out/gpu$gpu.txt" 2>&1 &
    done
    wait
    tail -n 12 "$out"/gpu0.txt "$out"/gpu1.txt ;;
  decode_runs)
    timeout 300 python3 benchmarks/bench_decode.py --runs 3 --out "$out/bench_decode.json" \
      > "$out/bench.txt" 2>&1
    grep -E "^b=128|^one jitted|^host" "$out/bench.txt" ;;
  pair)
    half=$(($(nproc) / 2))
    for gpu in 0 1; do
      modes_var=GPU${gpu}_MODES
      CUDA_VISIBLE_DEVICES=$gpu SKIP_INSTALL=1 OUT="$out/gpu$gpu" \
        taskset -c $((gpu * half))-$((gpu * half + half - 1)) bash "$0" ${!modes_var} \
        > "$out/gpu$gpu.txt" 2>&1 &
    done
    wait
    tail -n 25 "$out"/gpu0.txt "$out"/gpu1.txt ;;
  bench_fp8) bench_fp8 ;;
  batch_edges)
    timeout 300 python3 benchmarks/probe_batch_edges.py --out "$out/batch_edges.json" \
      2>&1 | tee "$out/batch_edges.txt" ;;
  xla_floor)
    timeout 240 python3 benchmarks/probe_batch_edges.py --device-time \
      --out "$out/xla_floor.json" 2>&1 | tee "$out/xla_floor.txt" ;;
  guard_step)
    timeout 240 python3 benchmarks/bench_fp8.py --guard-step --out "$out/guard_step.json" \
      2>&1 | tee "$out/guard_step.txt" ;;
  hq16)
    profile_h16 4096 8192
    for setting in "" XLA_FLAGS=--xla_gpu_enable_command_buffer= \
        XLA_PYTHON_CLIENT_PREALLOCATE=false; do
      echo "== ${setting:-default settings}" | tee -a "$out/hq16.txt"
      env $setting timeout 120 python3 benchmarks/bench_decode.py --h-q 16 --runs 2 --no-host \
        2>&1 | grep -E "b=128|Error" | tee -a "$out/hq16.txt"
    done ;;
  bench)
    [ "$ngpu" -ge 2 ] && timeout 90 python3 benchmarks/bench_multi_gpu.py \
      --out "$out/multi_gpu.json" 2>&1 | tail -12
    bench_fp8
    timeout 90 python3 benchmarks/bench_write_kv.py 2>&1 | tee "$out/write_kv.txt" | tail -8
    timeout 90 python3 examples/serve_deepseek_mla.py --quiet 2>&1 | tee "$out/serve.txt" \
      | tail -4
    timeout 90 python3 examples/serve_deepseek_mla.py --quiet --kv-cache-dtype fp8 2>&1 \
      | tee "$out/serve_fp8.txt" | tail -4 ;;
  *)
    echo "unknown mode $mode"; exit 2 ;;
  esac
done
