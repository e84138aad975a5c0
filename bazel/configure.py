"""Writes the Bazel repository @jax_flashmla_deps: what the FFI extension builds against, found
in the Python environment, as the CMake build finds it (see CMakeLists.txt).

    python bazel/configure.py --out DIR

Bazel runs this itself (bazel/deps.bzl, a repository rule) with $PYTHON_BIN_PATH, or the
first python3 / python on PATH; run by hand, DIR can be passed to Bazel with
--override_repository=jax_flashmla_deps=DIR. DIR gets symlinks to the installed files and a
BUILD file with these targets:

  :xla_ffi_headers  jaxlib's XLA FFI headers (jax.ffi.include_dir())
  :python_headers   the interpreter's headers (sysconfig's include path)
  :nanobind         nanobind's core compiled from the pip package's sources (NB_STATIC)
  :torch_headers    torch's C++ headers (torch.utils.cpp_extension.include_paths())
  :torch_libs       torch_cpu, torch_cuda, c10 and c10_cuda (a CUDA build of torch only)
  :cuda_headers     the CUDA toolkit's headers ($CUDA_HOME, $CUDA_PATH, nvcc's or /usr/local/cuda)
  :cuda_runtime     the CUDA runtime's shared library from the same place

and defs.bzl with what was found (NVCC: the compiler's path, for the bridge's one kernel). A
target whose inputs are missing is kept but marked incompatible, so that `bazel build //...`
skips what depends on it.
"""
import argparse
import glob
import os
import sys
import sysconfig

# The repository's build_env.py: where the build's inputs are looked for, as CMake looks.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.realpath(__file__))))
from build_env import (find_cuda_include, find_cudart, find_nvcc, find_torch,  # noqa: E402
                       xla_ffi_include)

# nanobind's core: src/*.cpp less the unity build, the split-mode backend and (on an interpreter
# that is not free-threaded) the free-threading support, as nanobind_build_library compiles it.
NANOBIND_SKIPPED_SOURCES = {"nb_combined.cpp", "nb_backend.cpp", "nb_ft.cpp"}
TORCH_LIBS = ("torch_cpu", "torch_cuda", "c10", "c10_cuda")
INCOMPATIBLE = '    target_compatible_with = ["@platforms//:incompatible"],\n'


def _link(out, name, target):
    path = os.path.join(out, name)
    if os.path.lexists(path):
        os.remove(path)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    os.symlink(os.path.realpath(target), path)
    return name


def _starlark(value):
    if isinstance(value, bool):
        return "True" if value else "False"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_starlark(v) for v in value) + "]"
    if isinstance(value, int):
        return str(value)
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'


def _cc_library(name, compatible=True, **attrs):
    lines = [f"cc_library(\n    name = {_starlark(name)},\n"]
    for key, value in attrs.items():
        if isinstance(value, str) and value.startswith(("glob(", "select(")):
            lines.append(f"    {key} = {value},\n")
        else:
            lines.append(f"    {key} = {_starlark(value)},\n")
    if not compatible:
        lines.append(INCOMPATIBLE)
    lines.append('    visibility = ["//visibility:public"],\n)\n')
    return "".join(lines)


def _headers_glob(*dirs):
    patterns = [f"{d}/**/*.h" for d in dirs] + [f"{d}/**/*.hpp" for d in dirs] + [
        f"{d}/**/*.cuh" for d in dirs] + [f"{d}/**/*.inc" for d in dirs]
    return "glob(" + _starlark(patterns) + ")"


def _all_files_glob(*dirs):
    # Some C++ headers have no extension (CUDA's cccl, torch's); Bazel checks every inclusion.
    return "glob(" + _starlark([f"{d}/**" for d in dirs]) + ")"


def configure(out):
    os.makedirs(out, exist_ok=True)
    notes = [f"python: {sys.executable} ({sys.version.split()[0]})"]
    build = [
        '# Written by bazel/configure.py: do not edit; re-run it (or `bazel sync --configure`).\n',
        'package(default_visibility = ["//visibility:public"])\n\n',
        'config_setting(\n    name = "opt",\n    values = {"compilation_mode": "opt"},\n)\n\n',
    ]

    import jax

    xla = _link(out, "xla_ffi/include", xla_ffi_include())
    notes.append(f"jax {jax.__version__}: XLA FFI headers in {xla_ffi_include()}")
    build.append(_cc_library("xla_ffi_headers", hdrs=_headers_glob(xla), includes=[xla]))

    py_include = sysconfig.get_paths()["include"]
    py = _link(out, "python/include", py_include)
    build.append(_cc_library("python_headers", hdrs=_headers_glob(py), includes=[py]))

    import nanobind

    nb_root = os.path.dirname(nanobind.include_dir())
    nb = _link(out, "nanobind", nb_root)
    free_threaded = bool(sysconfig.get_config_var("Py_GIL_DISABLED"))
    sources = sorted(os.path.basename(p) for p in glob.glob(os.path.join(nb_root, "src", "*.cpp")))
    sources = [s for s in sources if s not in NANOBIND_SKIPPED_SOURCES
               or (s == "nb_ft.cpp" and free_threaded)]
    notes.append(f"nanobind {nanobind.__version__} in {nb_root}: {len(sources)} sources")
    build.append(_cc_library(
        "nanobind",
        srcs=[f"{nb}/src/{s}" for s in sources] + [
            os.path.relpath(p, out) for p in sorted(glob.glob(os.path.join(out, nb, "src", "*.h")))],
        hdrs=_headers_glob(f"{nb}/include", f"{nb}/ext/robin_map/include"),
        includes=[f"{nb}/include", f"{nb}/ext/robin_map/include"],
        copts=["-std=c++17", "-fvisibility=hidden", "-fno-strict-aliasing"],
        local_defines='select({":opt": ["NB_BUILD", "NB_COMPACT_ASSERTIONS"], '
                      '"//conditions:default": ["NB_BUILD"]})',
        defines=["NB_FREE_THREADED"] if free_threaded else [],
        deps=[":python_headers"],
        linkstatic=True,
    ))

    torch, why_not_torch = find_torch()
    cuda_include = find_cuda_include()
    torch_cuda = bool(torch and torch["cuda"])
    if torch:
        notes.append(f"torch {torch['version']} (CUDA {torch['cuda']}) in {torch['library_dir']}")
        # torch/include holds the other include dirs (torch/csrc/api/include): link it once.
        root = torch["include_dirs"][0]
        includes = [_link(out, "torch/include", root)]
        for i, extra in enumerate(torch["include_dirs"][1:]):
            rel = os.path.relpath(extra, root)
            includes.append(os.path.join(includes[0], rel) if not rel.startswith("..")
                            else _link(out, f"torch/include{i + 1}", extra))
        # A CPU wheel lacks the CMake-generated c10/cuda/impl/cuda_cmake_macros.h; c10 then
        # reads its macros from this definition instead (headers-only use: nothing links).
        macros = os.path.join(root, "c10", "cuda", "impl", "cuda_cmake_macros.h")
        outer = [i for i in includes if not any(i.startswith(j + "/") for j in includes)]
        build.append(_cc_library(
            "torch_headers", hdrs=_all_files_glob(*outer), includes=includes,
            defines=[] if os.path.isfile(macros) else ["C10_CUDA_NO_CMAKE_CONFIGURE_FILE"]))
        libs = {name: os.path.join(torch["library_dir"], f"lib{name}.so") for name in TORCH_LIBS}
        missing = [name for name, path in libs.items() if not os.path.isfile(path)]
        if missing:
            notes.append(f"torch's {', '.join(missing)} missing: :torch_libs is incompatible")
        lib_dir = _link(out, "torch/lib", torch["library_dir"])
        for name in TORCH_LIBS:
            if name not in missing:
                build.append(f'cc_import(\n    name = "lib{name}",\n'
                             f'    shared_library = "{lib_dir}/lib{name}.so",\n)\n')
        build.append(_cc_library(
            "torch_libs", compatible=not missing,
            deps=[] if missing else [f":lib{name}" for name in TORCH_LIBS],
            # The module is loaded after torch, whose libraries are then in the process;
            # the rpath makes ldd and direct loads work, as in the CMake build.
            linkopts=[f"-Wl,-rpath,{os.path.realpath(torch['library_dir'])}"]))
    else:
        notes.append(why_not_torch)
        build.append(_cc_library("torch_headers", compatible=False))
        build.append(_cc_library("torch_libs", compatible=False))
    if cuda_include:
        notes.append(f"CUDA headers in {cuda_include}")
        cuda = _link(out, "cuda/include", cuda_include)
        build.append(_cc_library("cuda_headers", hdrs=_all_files_glob(cuda), includes=[cuda]))
    else:
        notes.append("no CUDA toolkit headers found")
        build.append(_cc_library("cuda_headers", compatible=False))
    nvcc, cudart = find_nvcc(), find_cudart()
    notes.append(f"nvcc: {nvcc}" if nvcc else "no nvcc found")
    if cudart:
        notes.append(f"CUDA runtime: {cudart}")
        build.append(f'cc_import(\n    name = "libcudart",\n'
                     f'    shared_library = "{_link(out, "cuda/lib/libcudart.so", cudart)}",\n)\n')
    else:
        notes.append("no libcudart.so found: :cuda_runtime is incompatible")
    build.append(_cc_library("cuda_runtime", compatible=cudart is not None,
                             deps=[":libcudart"] if cudart else []))

    with open(os.path.join(out, "BUILD.bazel"), "w") as f:
        f.write("\n".join(build))
    with open(os.path.join(out, "WORKSPACE"), "w") as f:
        f.write('workspace(name = "jax_flashmla_deps")\n')
    with open(os.path.join(out, "defs.bzl"), "w") as f:
        f.write('"""What bazel/configure.py found. Written by it: do not edit."""\n\n')
        for key, value in [
            ("PYTHON", sys.executable),
            ("PYTHON_EXT_SUFFIX", sysconfig.get_config_var("EXT_SUFFIX")),
            ("TORCH_FOUND", torch is not None),
            ("TORCH_CUDA", torch_cuda),
            ("TORCH_CXX11_ABI", torch["cxx11_abi"] if torch else 1),
            ("CUDA_HEADERS_FOUND", cuda_include is not None),
            ("NVCC", nvcc or ""),
            ("NOTES", notes),
        ]:
            f.write(f"{key} = {_starlark(value)}\n")
    return notes


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="directory of the repository to write")
    args = parser.parse_args()
    for note in configure(os.path.abspath(args.out)):
        print("jax_flashmla_deps:", note, file=sys.stderr)


if __name__ == "__main__":
    main()
