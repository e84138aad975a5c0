"""Compiles the CUDA bridge to object files against torch's and CUDA's headers, and its one
kernels with nvcc, so that a compile error shows in CI, on a machine without a GPU (torch's CPU
wheel carries the headers)."""
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the repository's build_env.py, which the builds use too
from build_env import (find_cuda_include, find_cupti, find_nvcc, find_torch,  # noqa: E402
                       xla_ffi_include)

FFI_DIR = ROOT / "ffi"
TESTS_CPP = Path(__file__).resolve().parent / "cpp"
# torch_bridge.cc is compiled, with the same flags, into test_torch_bridge_host_side's binary.
CUDA_SOURCES = ["buffer_lending.cc", "cuda_handlers.cc", "cuda_module.cc", "flashmla_handlers.cc",
                "flashmla_module.cc"]


def _missing():
    if find_torch()[0] is None:
        return "torch (its headers) is not installed"
    if find_cuda_include() is None:
        return "the CUDA headers are not installed"
    if shutil.which("c++") is None:
        return "no C++ compiler"
    return None


def _bridge_compile_flags():
    """c++ flags for the bridge's sources, or a skip (a failure in CI) naming what is missing."""
    missing = _missing()
    if missing:
        if os.environ.get("CI"):
            pytest.fail(f"CI must compile the CUDA bridge, but {missing}")
        pytest.skip(missing)
    import nanobind

    torch = find_torch()[0]
    includes = [*torch["include_dirs"], find_cuda_include(), xla_ffi_include(),
                nanobind.include_dir(), sysconfig.get_paths()["include"]]
    return ["-std=c++20", "-fPIC", "-O1", "-Wall", "-Werror",
            f"-D_GLIBCXX_USE_CXX11_ABI={torch['cxx11_abi']}",
            # The CPU wheel lacks this one generated header; it only sets export macros.
            "-DC10_CUDA_NO_CMAKE_CONFIGURE_FILE",
            *[arg for path in includes for arg in ("-isystem", path)], "-I", str(FFI_DIR)]


def _is_gcc():
    macros = subprocess.run(["c++", "-dM", "-E", "-x", "c++", "/dev/null"],
                            capture_output=True, text=True).stdout
    return "__GNUC__" in macros and "__clang__" not in macros


@pytest.fixture(scope="module")
def lending_build(tmp_path_factory):
    """(the compile's result, its directory) of buffer_lending.cc, compiled once for the two
    tests that need it, with g++'s class dump where c++ is g++."""
    flags = _bridge_compile_flags()
    out_dir = tmp_path_factory.mktemp("lending")
    dump = ["-fdump-lang-class"] if _is_gcc() else []
    result = subprocess.run(["c++", *flags, *dump, "-c", str(FFI_DIR / "buffer_lending.cc"),
                             "-o", "out.o"], capture_output=True, text=True, cwd=out_dir)
    return result, out_dir


@pytest.mark.parametrize("source", CUDA_SOURCES)
def test_cuda_bridge_compiles(source, tmp_path, request):
    if source == "buffer_lending.cc":
        result, tmp_path = request.getfixturevalue("lending_build")
    else:
        command = ["c++", *_bridge_compile_flags(), "-c", str(FFI_DIR / source),
                   "-o", str(tmp_path / "out.o")]
        result = subprocess.run(command, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-4000:]
    assert (tmp_path / "out.o").stat().st_size > 0


# The slots of LendingAllocator's vtable that it leaves to a base class, and why: copy_data is
# CUDAPluggableAllocator's device-to-device cudaMemcpy (final there; torch's own allocator
# copies the same way), and CUDAAllocator's recordStream(DataPtr, c10::Stream) converts the
# stream and calls the CUDA-stream overload, which the wrapper has.
LENDING_INHERITS = {
    "torch::cuda::CUDAPluggableAllocator::CUDAPluggableAllocator::copy_data",
    "c10::cuda::CUDACachingAllocator::CUDAAllocator::recordStream",
}


def _vtable(class_dump, cls):
    """The functions in the vtable of `cls`, in slot order, from g++'s -fdump-lang-class."""
    lines = class_dump.splitlines()
    start = lines.index(f"Vtable for {cls}")
    slots = []
    for line in lines[start + 2:]:
        if not line.strip():
            break
        target = line.split("(int (*)(...))", 1)[1]
        if not target.startswith(("0", "(&")):  # the offset to the top, the type info
            slots.append(target)
    return slots


def test_lending_allocator_forwards_every_allocator_method(lending_build):
    """Every virtual method of torch's CUDA allocator in the installed torch is the wrapper's
    own (ffi/buffer_lending.cc) but LENDING_INHERITS. A method a torch release adds, or one
    whose signature changes, would otherwise run CUDAPluggableAllocator's code, which raises
    for most (an unforwarded getDeviceStats raised in torch.cuda.memory_stats()), or
    CUDAAllocator's default; a method it removes fails the compile (`override`). g++'s class
    dump names the function in each vtable slot."""
    if not _is_gcc():
        if os.environ.get("CI"):
            pytest.fail("CI must dump the allocator's vtable, which needs c++ to be g++")
        pytest.skip("-fdump-lang-class needs c++ to be g++")
    result, out_dir = lending_build
    assert result.returncode == 0, result.stderr[-4000:]
    (dump,) = out_dir.glob("*.class")
    slots = _vtable(dump.read_text(), "jax_flashmla::{anonymous}::LendingAllocator")
    own = "jax_flashmla::{anonymous}::LendingAllocator::"
    assert any(slot == own + "getDeviceStats" for slot in slots), slots
    unforwarded = [slot for slot in slots
                   if not slot.startswith(own) and slot not in LENDING_INHERITS]
    assert not unforwarded, (
        f"torch's CUDA allocator interface changed: LendingAllocator leaves {unforwarded} to a "
        f"base class; forward them in ffi/buffer_lending.cc")


def test_torch_bridge_host_side(tmp_path):
    """tests/cpp/torch_bridge_test.cc, linked with the bridge, a stand-in for buffer lending
    (tests/cpp/no_lending.cc) and torch's CPU libraries: WrapBuffer's tensors, and
    CallTorchOp's errors for ops it cannot call."""
    flags = _bridge_compile_flags()
    lib_dir = find_torch()[0]["library_dir"]
    binary = tmp_path / "torch_bridge_test"
    command = ["c++", *flags, str(TESTS_CPP / "torch_bridge_test.cc"),
               str(FFI_DIR / "torch_bridge.cc"), str(TESTS_CPP / "no_lending.cc"),
               "-o", str(binary), "-L", lib_dir, f"-Wl,-rpath,{lib_dir}", "-ltorch_cpu", "-lc10"]
    result = subprocess.run(command, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-4000:]
    run = subprocess.run([str(binary)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr[-2000:]
    assert run.stdout.splitlines() == [
        "ok wrap device=cuda:1 sizes=[2, 3, 4]", "ok unregistered_op", "ok unqualified_name",
        "ok unknown_argument"], run.stdout


@pytest.mark.parametrize("kernel", ["empty_requests", "host_queue_push", "index_topk"])
def test_bridge_kernels_compile(tmp_path, kernel):
    nvcc = find_nvcc()
    if nvcc is None:
        if os.environ.get("CI"):
            pytest.fail("CI must compile the CUDA bridge's kernels, but nvcc is not found")
        pytest.skip("nvcc is not found")
    command = [nvcc, "-std=c++17", "-O3", "-gencode", "arch=compute_90a,code=sm_90a", "-Xcompiler", "-fPIC,-Wall,-Werror",
               "-Werror", "all-warnings", "-I", str(FFI_DIR), "-c", str(FFI_DIR / f"{kernel}.cu"),
               "-o", str(tmp_path / f"{kernel}.o")]
    result = subprocess.run(command, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-4000:]
    assert (tmp_path / f"{kernel}.o").stat().st_size > 0


def test_driver_call_counter_compiles(tmp_path):
    """tests/cpp/driver_call_counter.c, which the GPU capture tests build on the GPU machine,
    compiles against CUPTI's headers."""
    include, cuda_include = find_cupti()[0], find_cuda_include()
    if include is None or cuda_include is None or shutil.which("gcc") is None:
        missing = f"CUPTI's header ({include}), CUDA's ({cuda_include}) or gcc"
        if os.environ.get("CI"):
            pytest.fail(f"CI must compile the driver-call counter, but one of {missing} is missing")
        pytest.skip(f"one of {missing} is missing")
    result = subprocess.run(["gcc", "-shared", "-fPIC", "-O2", "-Wall", "-Werror", "-I", include,
                             "-I", cuda_include, str(TESTS_CPP / "driver_call_counter.c"),
                             "-o", str(tmp_path / "counter.so")], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-4000:]
