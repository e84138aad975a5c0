"""Test set-up shared by every test file.

- 8 virtual CPU devices, for the sharding tests (the flag must be set before JAX starts).
- Tests marked `gpu` need a Hopper GPU with FlashMLA's kernels (`gpu(count=2)`: two of them);
  elsewhere they skip, unless JAX_FLASHMLA_REQUIRE_GPU=N, the GPUs the machine has (set on
  the GPU machine), turns the skip of a test needing at most N into a failure.
- On the GPU machine JAX may take only part of the card, so that torch (which runs FlashMLA's
  ops and the tests' torch-direct comparisons) has room.
"""
import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8").strip()
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
