"""Test set-up shared by every test file.

- 8 virtual CPU devices, for the sharding tests (the flag must be set before JAX starts).
- Tests marked `gpu` need a Hopper GPU with FlashMLA's kernels (`gpu(count=2)`: two of them);
  elsewhere they skip, unless JAX_FLASHMLA_REQUIRE_GPU=N, the GPUs the machine has (set on
  the GPU machine), turns the skip of a test needing at most N into a failure.
- On CPU: XLA at -O0, and a compilation cache of the run's own (both below).
- On the GPU machine JAX may take only part of the card, so that torch (which runs FlashMLA's
  ops and the tests' torch-direct comparisons) has room.
"""
import os
import shutil
import tempfile



def _cpu_only():
    """No CUDA plugin for JAX is installed: the machine runs the CPU suite."""
    from importlib import metadata

    return not any((d.metadata["Name"] or "").lower().replace("_", "-").startswith("jax-cuda")
                   for d in metadata.distributions())


def _jaxlib_at_least(version):
    from importlib import metadata

    from packaging.version import Version  # pytest's own dependency

    return Version(metadata.version("jaxlib")) >= Version(version)


_CPU_ONLY = _cpu_only()
_flags = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
if _CPU_ONLY and "xla_backend_optimization_level" not in _flags:
    # The CPU suite's time is mostly XLA compiling; LLVM at -O0 compiles about a fifth faster,
    # and without its expensive passes a tenth faster again (six of the longest files
    # together), computing the same (no fast math either way). Child processes (the
    # benchmarks' tiny runs) inherit it. Not on the GPU machine, whose kernels' speed the GPU
    # tests measure.
    _flags += " --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
    if _jaxlib_at_least("0.10.2"):
        # XLA's older elemental emitters for fusions, instead of its MLIR fusion emitters (the
        # default), take a quarter of the suite's CPU time off again (pytest -n 2: 1044 -> 779 s
        # user+sys), computing the same from jaxlib 0.10.2 on (the whole suite passes, test_fp8's
        # bit-exact e4m3 model too); jaxlib 0.10.0's (the floor's) round 0.4% of float32 ->
        # e4m3 conversions otherwise. The one program they lay out otherwise (a V4KVCache write,
        # copied rather than updated in place) test_v4_cache compiles with the default emitters.
        _flags += " --xla_cpu_use_fusion_emitters=false"
os.environ["XLA_FLAGS"] = _flags.strip()
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")
# Many programs are compiled more than once in a CPU run: by both xdist workers, by the
# benchmarks' tiny runs (child processes), by functions jitted anew around the same body. A
# compilation cache of this run's own, empty at its start as on a clean clone, compiles each
# once (six of the longest files together: 11% less CPU time). The process that starts the run
# (pytest, or xdist's controller) makes it and removes it at the end; its workers and child
# processes inherit the variable. A cache directory already set is left as it is.
_COMPILATION_CACHE = None
if _CPU_ONLY and "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _COMPILATION_CACHE = tempfile.mkdtemp(prefix="jax_flashmla_tests_xla_cache_")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _COMPILATION_CACHE
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"

import pytest  # noqa: E402

REQUIRED_GPUS = int(os.environ.get("JAX_FLASHMLA_REQUIRE_GPU") or 0)


def _gpu_unavailable_reason(count):
    import jax

    from jax_flashmla.kernels import library as kernels

    if not kernels.flashmla_available():
        return ("needs a Hopper GPU as JAX's default backend, FlashMLA's kernels and the CUDA "
                "bridge")
    seen = len([d for d in jax.devices() if d.platform == "gpu"])
    if seen < count:
        return f"needs {count} GPUs; JAX sees {seen}"
    return None


# The files with the longest tests, longest first (CPU, 2 cores): run first, so that pytest -n 2
# ends on short tests with both workers busy rather than one waiting on the other's long one.
SLOW_FIRST = ["test_readme.py", "test_serve_v4.py", "test_chunked_prefill.py",
              "test_bridge_compile.py", "test_bench_multi_gpu.py", "test_bench_sparse.py",
              "test_bench_prefill.py", "test_bench_context.py", "test_long_context_v4.py",
              "test_bench_v4.py", "test_soak_serving.py", "test_bench_grid.py",
              "test_flax_extend.py", "test_flax_v4_mla.py", "test_v4_layer_bad_values.py",
              "test_flax_sparse_mla.py", "test_prefill.py", "test_dcp_processes.py",
              "test_v4_indexer.py", "test_bench_step.py", "test_examples.py", "test_decode.py",
              "test_flax_mla.py"]


def pytest_collection_modifyitems(items):
    # A stable sort by file: each file's tests stay together and in their order.
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


def pytest_runtest_setup(item):
    marker = item.get_closest_marker("gpu")
    if marker is None:
        return
    count = marker.kwargs.get("count", 1)
    reason = _gpu_unavailable_reason(count)
    if reason is None:
        return
    if REQUIRED_GPUS >= count:
        pytest.fail(f"JAX_FLASHMLA_REQUIRE_GPU={REQUIRED_GPUS}, but {reason}")
    pytest.skip(reason)


@pytest.fixture
def on_cpu():
    """Runs the test's computations on the CPU, whatever JAX's default backend."""
    import jax

    with jax.default_device(jax.devices("cpu")[0]):
        yield


def pytest_unconfigure(config):
    if _COMPILATION_CACHE is not None:
        shutil.rmtree(_COMPILATION_CACHE, ignore_errors=True)
