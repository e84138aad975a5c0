"""What the FFI extension builds against, found in the Python environment: jaxlib's XLA FFI
headers, torch's C++ headers and libraries, the CUDA toolkit's headers, nvcc and runtime (and
CUPTI, for the GPU tests' driver-call counter). The one place these are looked for: CMakeLists.txt runs it, bazel/configure.py and the tests import it.

    python build_env.py torch-cmake   # CMake's list: torch's include dirs joined by '|', its
                                      # library dir, _GLIBCXX_USE_CXX11_ABI; exits non-zero
                                      # when torch is missing or a CPU-only build
"""
import os
import shutil
import sys


def xla_ffi_include():
    import jax
    return jax.ffi.include_dir()


def find_torch():
    """(what the CUDA bridge needs from the installed torch, or None; why not)."""
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError as e:
        return None, f"torch is not importable ({e})"
    return {
        "version": torch.__version__,
        "include_dirs": cpp_extension.include_paths(),
        "library_dir": cpp_extension.library_paths()[0],
        "cxx11_abi": int(torch._C._GLIBCXX_USE_CXX11_ABI),
        "cuda": torch.version.cuda,
    }, None


def _cuda_roots():
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
    candidates.append("/usr/local/cuda")
    return [root for root in candidates if root]


def find_cuda_include():
    """The CUDA toolkit's include dir ($CUDA_HOME, $CUDA_PATH, nvcc's, /usr/local/cuda), or None."""
    for root in _cuda_roots():
        include = os.path.join(root, "include")
        if os.path.isfile(os.path.join(include, "cuda_runtime_api.h")):
            return include
    return None


def find_nvcc():
    for root in _cuda_roots():
        if os.access(os.path.join(root, "bin", "nvcc"), os.X_OK):
            return os.path.join(root, "bin", "nvcc")
    return shutil.which("nvcc")


def find_cudart():
    """The CUDA runtime's shared library (the bridge's kernels share torch's runtime)."""
    for root in _cuda_roots():
        for lib in ("lib64", "lib", os.path.join("targets", "x86_64-linux", "lib")):
            path = os.path.join(root, lib, "libcudart.so")
            if os.path.isfile(path):
                return path
    return None


def find_cupti():
    """(CUPTI's include dir, its shared library): the toolkit's, else the nvidia wheels' that
    jax's CUDA plugin installs; None for either one not found."""
    import glob
    import site
    roots = _cuda_roots()
    headers = [os.path.join(root, sub) for root in roots
               for sub in ("include", os.path.join("extras", "CUPTI", "include"))]
    libraries = [os.path.join(root, sub, "libcupti.so") for root in roots
                 for sub in ("lib64", os.path.join("extras", "CUPTI", "lib64"))]
    for packages in site.getsitepackages():
        headers += sorted(glob.glob(f"{packages}/nvidia/**/include", recursive=True))
        libraries += sorted(glob.glob(f"{packages}/nvidia/**/libcupti.so*", recursive=True))
    include = next((h for h in headers if os.path.isfile(os.path.join(h, "cupti.h"))), None)
    library = next((lib for lib in libraries if os.path.isfile(lib)), None)
    return include, library


def _torch_cmake():
    torch, why_not = find_torch()
    if torch is None:
        sys.exit(why_not)
    if torch["cuda"] is None:
        sys.exit("torch is a CPU-only build")
    print(";".join(["|".join(torch["include_dirs"]), torch["library_dir"],
                    str(torch["cxx11_abi"])]), end="")


if __name__ == "__main__":
    if sys.argv[1:] != ["torch-cmake"]:
        sys.exit(__doc__)
    _torch_cmake()
