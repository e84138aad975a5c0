"""Test set-up shared by every test file.

- 8 virtual CPU devices, for the sharding tests (the flag must be set before JAX starts).
- Tests marked `gpu` need a Hopper GPU with FlashMLA's kernels; elsewhere they skip, unless
  JAX_FLASHMLA_REQUIRE_GPU=1 (set on the GPU machine), which turns such a skip into a failure.
- On the GPU machine JAX may take only part of the card, so that torch (which runs FlashMLA's
  ops and the tests' torch-direct comparisons) has room.
"""
import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")

import pytest  # noqa: E402

REQUIRE_GPU = os.environ.get("JAX_FLASHMLA_REQUIRE_GPU") == "1"


def _gpu_unavailable_reason():
    from jax_flashmla import kernels

    if kernels.flashmla_available():
        return None
    return "needs a Hopper GPU as JAX's default backend, FlashMLA's kernels and the CUDA bridge"


def pytest_runtest_setup(item):
    if "gpu" not in item.keywords:
        return
    reason = _gpu_unavailable_reason()
    if reason is None:
        return
    if REQUIRE_GPU:
        pytest.fail(f"JAX_FLASHMLA_REQUIRE_GPU=1 but the GPU path is unavailable: {reason}")
    pytest.skip(reason)
