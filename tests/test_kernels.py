"""Kernel discovery order, lazy torch import, and the error off Hopper GPUs."""
import os
import subprocess
import sys

import jax
import pytest

from jax_flashmla.kernels import library as kernels


@pytest.fixture
def fake_packages(tmp_path, monkeypatch):
    """Puts fake sgl_kernel and flash_mla packages on sys.path (found, never imported)."""
    for name in ("sgl_kernel", "flash_mla"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text("raise ImportError('must not be imported')\n")
    (tmp_path / "sgl_kernel" / "flashmla_ops.abi3.so").write_bytes(b"")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv(kernels.KERNEL_LIBRARY_ENV, raising=False)
    return tmp_path


def test_environment_variable_comes_first(fake_packages, monkeypatch):
    library = fake_packages / "my_ops.so"
    library.write_bytes(b"")
    monkeypatch.setenv(kernels.KERNEL_LIBRARY_ENV, str(library))
    assert kernels.find_kernel_library() == kernels.KernelLibrary("env", str(library))


def test_environment_variable_must_name_a_file(monkeypatch, tmp_path):
    monkeypatch.setenv(kernels.KERNEL_LIBRARY_ENV, str(tmp_path / "missing.so"))
    with pytest.raises(FileNotFoundError, match="JAX_FLASHMLA_KERNEL_LIBRARY"):
        kernels.find_kernel_library()


def test_sgl_kernel_library_before_flash_mla(fake_packages):
    found = kernels.find_kernel_library()
    assert found == kernels.KernelLibrary(
        "sgl_kernel", str(fake_packages / "sgl_kernel" / "flashmla_ops.abi3.so"))


def test_flash_mla_package_last(fake_packages):
    (fake_packages / "sgl_kernel" / "flashmla_ops.abi3.so").unlink()
    found = kernels.find_kernel_library()
    assert found == kernels.KernelLibrary("flash_mla", str(fake_packages / "flash_mla"))


def test_import_does_not_import_torch():
    code = ("import sys, jax_flashmla, jax.numpy as jnp\n"
            "jax_flashmla.mla_decode(jnp.zeros((1, 1, 16, 576), jnp.bfloat16),"
            " jnp.zeros((1, 64, 1, 576), jnp.bfloat16), jnp.zeros((1, 1), jnp.int32),"
            " jnp.ones((1,), jnp.int32), implementation='custom_call')\n"
            "print('torch' in sys.modules)\n")
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                            check=True)
    assert result.stdout.strip() == "False"


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="checks the error off the GPU")
def test_cuda_targets_need_a_hopper_gpu():
    kernels.ensure_cuda_targets.cache_clear()
    with pytest.raises(RuntimeError, match=r"need a Hopper GPU \(sm 9.x\); JAX sees"):
        kernels.ensure_cuda_targets()


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="checks the choice off the GPU")
def test_auto_selection_off_hopper_is_the_reference():
    assert not kernels.flashmla_available()
