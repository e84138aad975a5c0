"""Test set-up shared by every test file.

- 8 virtual CPU devices, for the sharding tests (the flag must be set before JAX starts).
- Tests marked `gpu` need a Hopper GPU with FlashMLA's kernels (`gpu(count=2)`: two of them);
  elsewhere they skip, unless JAX_FLASHMLA_REQUIRE_GPU=N, the GPUs the machine has (set on
  the GPU machine), turns the skip of a test needing at most N into a failure.
- On the GPU machine JAX may take only part of the card, so that torch (which runs FlashMLA's
  ops and the tests' torch-direct comparisons) has room.
"""
import os



def _cpu_only():
    """No CUDA plugin for JAX is installed: the machine runs the CPU suite."""
    from importlib import metadata

    return not any((d.metadata["Name"] or "").lower().replace("_", "-").startswith("jax-cuda")
                   for d in metadata.distributions())


_flags = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
if _cpu_only() and "xla_backend_optimization_level" not in _flags:
    # The CPU suite's time is mostly XLA compiling; LLVM at -O0 compiles about a fifth faster
    # and computes the same (no fast math either way). Child processes (the benchmarks' tiny
    # runs) inherit it. Not on the GPU machine, whose kernels' speed the GPU tests measure.
    _flags += " --xla_backend_optimization_level=0"
os.environ["XLA_FLAGS"] = _flags.strip()
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")

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
