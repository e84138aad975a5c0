"""Compiles the CUDA bridge to object files against torch's and CUDA's headers, and its one
kernel with nvcc, so that a compile error shows in CI, on a machine without a GPU (torch's CPU
wheel carries the headers)."""
import os
import shutil
import subprocess
import sysconfig
from pathlib import Path

import jax
import pytest

FFI_DIR = Path(__file__).resolve().parents[1] / "ffi"
CUDA_SOURCES = ["torch_bridge.cc", "cuda_handlers.cc", "cuda_module.cc"]


def _cuda_include_dir():
    for root in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if root and (Path(root) / "include" / "cuda_runtime_api.h").is_file():
            return Path(root) / "include"
    nvcc = shutil.which("nvcc")
    if nvcc and (Path(nvcc).resolve().parents[1] / "include" / "cuda_runtime_api.h").is_file():
        return Path(nvcc).resolve().parents[1] / "include"
    return None


def _missing():
    try:
        import torch  # noqa: F401
    except ImportError:
        return "torch (its headers) is not installed"
    if _cuda_include_dir() is None:
        return "the CUDA headers are not installed"
    if shutil.which("c++") is None:
        return "no C++ compiler"
    return None


@pytest.mark.parametrize("source", CUDA_SOURCES)
def test_cuda_bridge_compiles(source, tmp_path):
    missing = _missing()
    if missing:
        if os.environ.get("CI"):
            pytest.fail(f"CI must compile the CUDA bridge, but {missing}")
        pytest.skip(missing)
    import nanobind
    import torch
    from torch.utils import cpp_extension

    includes = [*cpp_extension.include_paths(), str(_cuda_include_dir()), jax.ffi.include_dir(),
                nanobind.include_dir(), sysconfig.get_paths()["include"]]
    command = ["c++", "-std=c++20", "-fPIC", "-O1", "-Wall", "-Werror",
               f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
               # The CPU wheel lacks this one generated header; it only sets export macros.
               "-DC10_CUDA_NO_CMAKE_CONFIGURE_FILE",
               *[arg for path in includes for arg in ("-isystem", path)],
               "-I", str(FFI_DIR), "-c", str(FFI_DIR / source), "-o", str(tmp_path / "out.o")]
    result = subprocess.run(command, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-4000:]
    assert (tmp_path / "out.o").stat().st_size > 0


def test_result_copy_kernel_compiles(tmp_path):
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        if os.environ.get("CI"):
            pytest.fail("CI must compile the CUDA bridge's kernel, but nvcc is not on PATH")
        pytest.skip("nvcc is not on PATH")
    command = [nvcc, "-std=c++17", "-O3", "-arch=sm_90", "-Xcompiler", "-fPIC,-Wall,-Werror",
               "-Werror", "all-warnings", "-I", str(FFI_DIR), "-c", str(FFI_DIR / "result_copy.cu"),
               "-o", str(tmp_path / "result_copy.o")]
    result = subprocess.run(command, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-4000:]
    assert (tmp_path / "result_copy.o").stat().st_size > 0
