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
#     gpu      every test marked gpu but the two-GPU ones (~6 min), or those in GPU_TESTS
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
#     launch   dev/probe_launch.py; LAUNCH_ARGS, LAUNCH_NAME (launch)
#     host     dev/probe_step_host.py; HOST_ARGS, HOST_NAME (host)
#     graph-inspect  dev/probe_launch.py with dev/graph_inspect.c: the CUDA graphs' nodes and
#              the driver's calls per variant; INSPECT_ARGS (probe_launch.py's arguments)
#     driver-trace  dev/probe_launch.py with dev/driver_trace.c LD_PRELOADed: each variant's
#              driver calls per step on a timeline (no CUPTI); LAUNCH_ARGS, LAUNCH_NAME
#              (driver_trace)
#     modules  dev/probe_graph_modules.py with dev/graph_inspect.c: a graph's launch against
#              how many modules its kernels come from; MODULES_ARGS
#     nan      dev/probe_nan.py for FlashMLA and for the reference on the GPU
#     sparse-probe  dev/probe_sparse.py: the sparse kernels' conventions and schedules
#     v32      DeepSeek-V3.2's tests on the GPU: the indexer's kernels, the sparse ops, the layer
#              against HF (tests/test_gpu_indexer.py, test_indexer.py, test_gpu_sparse.py,
#              test_flax_sparse_mla.py). HF's oracle needs transformers >= 5.24; where the
#              machine's is older carry .device/transformers.tar.xz (`tar --exclude=__pycache__
#              -cJf .device/transformers.tar.xz -C <site-packages> transformers`)
#     indexer-probe  dev/probe_indexer_kernels.py: where the indexer's custom call spends its
#              time; INDEXER_PROBE_ARGS
#     sparse-step-probe  dev/probe_sparse_step.py: the sparse step's kernels per layer, jax's
#              steps against the torch graphs, and single calls; SPARSE_STEP_ARGS
#     prefill-overhead  dev/probe_prefill_overhead.py: mla_prefill's parts timed alone, or
#              kernel by kernel with --kernels; OVERHEAD_ARGS
#     decompress-probe  dev/probe_decompress.py: the decompression's cuBLAS forms from torch,
#              and cuDNN's causal alignment; DECOMPRESS_ARGS
#     masks-probe  dev/probe_cudnn_masks.py at 16 and 128 heads: cuDNN's padding masks
#              against the unmasked calls
#     prefill-batch-probe  dev/probe_prefill_batch.py: several requests in one mla_prefill
#              call against a call each; PREFILL_BATCH_ARGS
#     mgpu-probe  dev/probe_mgpu_attention.py: jax's Mosaic GPU attention kernel against cuDNN
#     indexer-ncu  ncu's sections for the indexer's two kernels over one call of
#              probe_indexer_kernels.py --single; INDEXER_PROBE_ARGS
#     host-profile  dev/probe_host_profile.py with dev/host_sampler.c: where the host's CPU time
#              goes while the sparse step runs synced; HOST_PROFILE_ARGS (e.g. "--batches 1 64")
#     sparse-prefill-probe  dev/probe_sparse_prefill_call.py (PREFILL_PROBE_ARGS) with
#              CUDA_LAUNCH_BLOCKING=1; if a signal ends it, again under cuda-gdb (else gdb)
#              for the native stack
#     soak     benchmarks/soak_serving.py at its GPU sizes; SOAK_ARGS (default --steps 10000),
#              SOAK_NAME (soak_h200)
#     xla-flags  the command-buffer flags the installed XLA plugin knows
#     step-after-calls  dev/probe_step_after_calls.py: the synced sparse step fresh, after
#              per-call points, after a cleanup; AFTER_CALLS_ARGS (e.g. "--batches 1")
#     set:NAME=VALUE  exports NAME=VALUE for the modes after it
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

# pytest with a time limit, its output in $out/$1; says so when the limit killed it.
pytest_logged() {
  local log=$1 limit=$2
  shift 2
  timeout "$limit" python3 -m pytest -q -rfEs -p no:cacheprovider "$@" > "$out/$log" 2>&1
  [ $? -eq 124 ] && echo "TIMEOUT after ${limit} s" >> "$out/$log"
  tail -15 "$out/$log"
}

# dev/graph_inspect.c as /tmp/graph_inspect.so, against the CUPTI headers of the toolkit or
# of the nvidia wheels.
build_graph_inspect() {
  local site cupti_h
  site=$(python3 -c 'import site; print(site.getsitepackages()[0])')
  cupti_h=$(find /usr/local/cuda*/ "$site/nvidia" -name cupti.h 2>/dev/null | head -1)
  gcc -shared -fPIC -O2 -I/usr/local/cuda/include -I"$(dirname "$cupti_h")" \
    dev/graph_inspect.c -o /tmp/graph_inspect.so 2>&1 | tail -20
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
  gpu) pytest_logged pytest_gpu.txt 540 -m gpu ${GPU_TESTS:-tests --ignore=tests/test_gpu_multi.py} ;;
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
  fp8)
    timeout 240 python3 benchmarks/bench_fp8.py --out "$out/fp8_h200.json" 2>&1 \
      | tee "$out/fp8.txt" | tail -20 ;;
  launch)
    timeout 420 python3 dev/probe_launch.py --out "$out/${LAUNCH_NAME:-launch}.json" \
      ${LAUNCH_ARGS:-} 2>&1 | tee "$out/${LAUNCH_NAME:-launch}.txt" | cut -c1-1500 | tail -6 ;;
  host)
    timeout 420 python3 dev/probe_step_host.py --out "$out/${HOST_NAME:-host}.json" \
      ${HOST_ARGS:-} 2>&1 | tee "$out/${HOST_NAME:-host}.txt" | cut -c1-1500 | tail -8 ;;
  graph-inspect)
    build_graph_inspect
    timeout 300 python3 dev/probe_launch.py --graph-inspect /tmp/graph_inspect.so \
      ${INSPECT_ARGS:-} > "$out/graph_inspect.txt" 2>&1
    grep -v "^[IW][0-9]" "$out/graph_inspect.txt" | cut -c1-1500 | tail -40 ;;
  driver-trace)
    gcc -shared -fPIC -O2 dev/driver_trace.c -o /tmp/driver_trace.so -ldl 2>&1 | tail -20
    LD_PRELOAD=/tmp/driver_trace.so timeout 420 python3 dev/probe_launch.py \
      --driver-trace /tmp/driver_trace.so --out "$out/${LAUNCH_NAME:-driver_trace}.json" \
      ${LAUNCH_ARGS:-} > "$out/${LAUNCH_NAME:-driver_trace}.txt" 2>&1
    grep -v "^[IW][0-9]" "$out/${LAUNCH_NAME:-driver_trace}.txt" | cut -c1-6000 | tail -8 ;;
  modules)
    build_graph_inspect
    timeout 300 python3 dev/probe_graph_modules.py --graph-inspect /tmp/graph_inspect.so \
      ${MODULES_ARGS:-} > "$out/graph_modules.txt" 2>&1
    grep -v "^[IW][0-9]" "$out/graph_modules.txt" | cut -c1-1500 | tail -30 ;;
  nan)
    for impl in custom_call reference; do
      timeout 200 python3 dev/probe_nan.py --implementation $impl --out "$out/nan_$impl.json" \
        > "$out/nan_$impl.txt" 2>&1 || tail -20 "$out/nan_$impl.txt"
    done
    grep -v "same=True" "$out/nan_custom_call.txt" | cut -c1-200 | head -70 ;;
  v32)
    hf=()
    if [ -f .device/transformers.tar.xz ]; then
      mkdir -p /tmp/carried && tar xJf .device/transformers.tar.xz -C /tmp/carried
      hf=(env PYTHONPATH=/tmp/carried)
    fi
    "${hf[@]}" python3 -c 'import transformers; print("transformers", transformers.__version__)'
    log=pytest_v32.txt
    "${hf[@]}" timeout 400 python3 -m pytest -q -rfEs -p no:cacheprovider \
      tests/test_gpu_indexer.py tests/test_indexer.py tests/test_gpu_sparse.py \
      tests/test_flax_sparse_mla.py > "$out/$log" 2>&1
    tail -15 "$out/$log" ;;
  indexer-probe)
    timeout 200 python3 dev/probe_indexer_kernels.py --out "$out/probe_indexer.json" \
      ${INDEXER_PROBE_ARGS:-} 2>&1 | grep -v "^[IW][0-9]" | tail -12 ;;
  prefill-overhead)
    timeout 400 python3 dev/probe_prefill_overhead.py ${OVERHEAD_ARGS:-} 2>&1 \
      | grep -v "^[IW][0-9]" | cut -c1-200 | tail -60 ;;
  prefill-batch-probe)
    timeout 330 python3 dev/probe_prefill_batch.py --deadline-s 240 \
      --out "$out/probe_prefill_batch.json" ${PREFILL_BATCH_ARGS:-} 2>&1 \
      | grep -v "^[IW][0-9]" | tail -20 ;;
  masks-probe)
    for heads in 16 128; do
      timeout 200 python3 dev/probe_cudnn_masks.py --heads $heads \
        --out "$out/probe_cudnn_masks_h$heads.json" 2>&1 | grep -v "^[IW][0-9]" | tail -12
    done ;;
  mgpu-probe)
    timeout 300 python3 dev/probe_mgpu_attention.py --out "$out/probe_mgpu_attention.json" \
      2>&1 | grep -v "^[IW][0-9]" | tail -14 ;;
  decompress-probe)
    timeout 200 python3 dev/probe_decompress.py --out "$out/probe_decompress.json" \
      ${DECOMPRESS_ARGS:-} 2>&1 | grep -v "^[IW][0-9]" | cut -c1-200 | tail -40 ;;
  sparse-step-probe)
    timeout 400 python3 dev/probe_sparse_step.py --out "$out/probe_sparse_step.json" \
      ${SPARSE_STEP_ARGS:-} 2>&1 | grep -v "^[IW][0-9]" | cut -c1-200 | tail -120 ;;
  step-after-calls)
    timeout 420 python3 dev/probe_step_after_calls.py --out "$out/step_after_calls.json" \
      ${AFTER_CALLS_ARGS:-} 2>&1 | grep -v "^[IW][0-9]" | grep "phase\|rror" | cut -c1-400 ;;
  host-profile)
    gcc -shared -fPIC -O2 dev/host_sampler.c -o /tmp/host_sampler.so 2>&1 | tail -20
    timeout 400 python3 dev/probe_host_profile.py --sampler /tmp/host_sampler.so \
      --out "$out/host_profile.json" ${HOST_PROFILE_ARGS:-} 2>&1 | grep -v "^[IW][0-9]" \
      | cut -c1-240 | tee "$out/host_profile.txt" | tail -150 ;;
  indexer-ncu)
    ncu=$(PATH="$PATH:/usr/local/cuda/bin" command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu | head -1)
    sections=(SpeedOfLight LaunchStats Occupancy WarpStateStats SchedulerStats
              MemoryWorkloadAnalysis ComputeWorkloadAnalysis SourceCounters)
    XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 300 "$ncu" --clock-control none \
      -k regex:'IndexScores|TopkPositions' -c 2 "${sections[@]/#/--section=}" \
      python3 dev/probe_indexer_kernels.py --single ${INDEXER_PROBE_ARGS:-} \
      > "$out/indexer_ncu.txt" 2>&1
    echo "exit $?"; grep -v "^[IW][0-9]" "$out/indexer_ncu.txt" | cut -c1-300 | tail -150
    # Per SASS instruction (warp stall samples among them) of the top-k kernel, as CSV.
    XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 300 "$ncu" --clock-control none \
      -k regex:TopkPositions -c 1 --section SourceCounters --section WarpStateStats \
      --warp-sampling-interval 0 \
      --page source --print-source sass --csv \
      python3 dev/probe_indexer_kernels.py --single ${INDEXER_PROBE_ARGS:-} \
      > "$out/indexer_ncu_topk_sass.csv" 2>&1 ;;
  sparse-probe)
    timeout 300 python3 dev/probe_sparse.py --out "$out/probe_sparse.json" > "$out/probe_sparse.txt" 2>&1
    echo "exit $?"; grep -v "^[IW][0-9]" "$out/probe_sparse.txt" | cut -c1-1200 | tail -30 ;;
  sparse-prefill-probe)
    log="$out/sparse_prefill_probe.txt"
    # The interpreter's own file: a debugger cannot run a wrapper script in its place.
    probe=("$(python3 -c 'import sys; print(sys.executable)')" dev/probe_sparse_prefill_call.py
           ${PREFILL_PROBE_ARGS:-})
    CUDA_LAUNCH_BLOCKING=1 PYTHONFAULTHANDLER=1 timeout 300 "${probe[@]}" > "$log" 2>&1
    rc=$?
    echo "exit $rc" >> "$log"
    if [ "$rc" -gt 128 ]; then  # a signal (124 is the time limit)
      debugger=$(PATH="$PATH:/usr/local/cuda/bin" bash -c 'command -v cuda-gdb || command -v gdb')
      echo "==== again under ${debugger:-no debugger found}" >> "$log"
      [ -n "$debugger" ] && CUDA_LAUNCH_BLOCKING=1 timeout 420 "$debugger" -batch -ex run \
        -ex bt --args "${probe[@]}" >> "$log" 2>&1
    fi
    grep -v "^[IW][0-9]" "$log" | cut -c1-1500 | tail -80 ;;
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
  set:*) export "${mode#set:}" ;;
  *) echo "unknown mode $mode"; exit 2 ;;
  esac
done
