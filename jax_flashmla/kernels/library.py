"""Finding, loading and registering FlashMLA's compiled kernels for the CUDA custom calls.

Discovery, in this order:
  1. JAX_FLASHMLA_KERNEL_LIBRARY: path of a torch-op library registering the sgl_kernel ops;
  2. the sgl_kernel package (sgl-kernel / sglang-kernel): only its flashmla_ops library is
     loaded, not the package;
  3. the flash_mla package (sgl-flash-mla): its flash_mla_legacy ops.
Finding needs no torch; loading imports torch, which happens only when a CUDA lowering of a
jax_flashmla op first runs, never on `import jax_flashmla`.
"""
import dataclasses
import functools
import glob
import importlib
import importlib.util
import os

import jax

KERNEL_LIBRARY_ENV = "JAX_FLASHMLA_KERNEL_LIBRARY"


@dataclasses.dataclass(frozen=True)
class KernelLibrary:
    """Where FlashMLA's ops come from: a library file to load, or a package to import."""

    source: str  # "env", "sgl_kernel" or "flash_mla"
    path: str


@dataclasses.dataclass(frozen=True)
class KernelOps:
    """Qualified torch op names the CUDA handlers call; their schemas are read at run time.
    decode_fp8 and metadata_fp8 (the dense FP8 decode), sparse_decode and sparse_prefill are
    None where the library has none."""

    decode: str
    metadata: str
    library: KernelLibrary
    decode_fp8: str | None = None
    metadata_fp8: str | None = None
    sparse_decode: str | None = None  # DeepSeek-V3.2's sparse ops, where the library has them
    sparse_prefill: str | None = None


def _package_dir(name):
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return list(spec.submodule_search_locations)[0]


def find_kernel_library():
    """Returns the KernelLibrary to use, or None. Imports nothing."""
    path = os.environ.get(KERNEL_LIBRARY_ENV)
    if path:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{KERNEL_LIBRARY_ENV}={path!r} is not a file")
        return KernelLibrary("env", path)
    package = _package_dir("sgl_kernel")
    if package:
        found = sorted(glob.glob(os.path.join(package, "flashmla_ops*.so")))
        found = found or sorted(glob.glob(os.path.join(package, "**", "flashmla_ops*.so"),
                                          recursive=True))
        if found:
            return KernelLibrary("sgl_kernel", found[0])
    package = _package_dir("flash_mla")
    if package:
        return KernelLibrary("flash_mla", package)
    return None


def arguments_by_name(op, values):
    """A FlashMLA torch op's positional arguments, filled by name from its schema (read at run
    time, as the CUDA handlers read it, since the schemas differ between kernel releases): an
    argument missing from values takes its default; KeyError where it has none."""
    args = []
    for arg in op.default._schema.arguments:
        if arg.name in values:
            args.append(values[arg.name])
        elif arg.default_value is not None or arg.type.kind() == "OptionalType":
            args.append(arg.default_value)
        else:
            raise KeyError(f"{op}: no value for {arg.name}")
    return args


def _first_registered(namespace, names):
    import torch

    ops = getattr(torch.ops, namespace)
    for name in names:
        if hasattr(ops, name):
            return f"{namespace}::{name}"
    raise RuntimeError(f"none of torch.ops.{namespace}.{{{', '.join(names)}}} is registered")


def _fp8_ops(namespace):
    """The dense FP8 decode and its scheduler, both or neither."""
    import torch

    ops = getattr(torch.ops, namespace)
    if hasattr(ops, "fwd_kvcache_mla_fp8") and hasattr(ops, "get_mla_decoding_metadata_dense_fp8"):
        return dict(decode_fp8=f"{namespace}::fwd_kvcache_mla_fp8",
                    metadata_fp8=f"{namespace}::get_mla_decoding_metadata_dense_fp8")
    return {}


@functools.cache
def load_kernels():
    """Loads FlashMLA's torch ops into this process (imports torch) and names them."""
    library = find_kernel_library()
    if library is None:
        raise RuntimeError(
            "jax_flashmla found no FlashMLA kernels: set "
            f"{KERNEL_LIBRARY_ENV} to a flashmla_ops library, or install sglang-kernel "
            "(module sgl_kernel) or sgl-flash-mla (module flash_mla) built for your torch; "
            "`pip install jax_flashmla[gpu]` installs a matching set")
    import torch

    if library.source == "flash_mla":
        importlib.import_module("flash_mla")
        return KernelOps(
            decode=_first_registered("flash_mla_legacy", ["dense_decode_fwd", "fwd_kvcache_mla"]),
            metadata=_first_registered("flash_mla_legacy", ["get_mla_decoding_metadata"]),
            library=library, **_fp8_ops("flash_mla_legacy"))
    torch.ops.load_library(library.path)
    sparse = {role: f"sgl_kernel::{name}" for role, name in
              (("sparse_decode", "sparse_decode_fwd"), ("sparse_prefill", "sparse_prefill_fwd"))
              if hasattr(torch.ops.sgl_kernel, name)}
    return KernelOps(decode=_first_registered("sgl_kernel", ["fwd_kvcache_mla"]),
                     metadata=_first_registered("sgl_kernel", ["get_mla_decoding_metadata"]),
                     library=library, **_fp8_ops("sgl_kernel"), **sparse)


def _hopper_gpus():
    try:
        gpus = jax.devices("gpu")
    except RuntimeError:
        return []
    return [d for d in gpus if str(getattr(d, "compute_capability", "")).startswith("9.")]


def gpu_sm_count():
    """SMs of the first Hopper GPU, which FlashMLA's scheduler plans for."""
    return int(_hopper_gpus()[0].core_count)


def _register(module):
    # The targets' traits (command-buffer compatible) are compiled into their handlers, where
    # XLA reads them when they are registered.
    for name, capsule in module.registrations().items():
        jax.ffi.register_ffi_target(name, capsule, platform="CUDA")


@functools.cache
def register_cuda_targets():
    """Registers the CUDA targets of jax_flashmla's own kernels (the host queue's push, the
    indexer), which need neither torch nor FlashMLA's kernels; returns their module."""
    try:
        import jax_flashmla._cuda as _cuda
    except ImportError as e:
        raise RuntimeError(
            "jax_flashmla was built without its CUDA targets (jax_flashmla._cuda): reinstall it "
            "where the CUDA toolkit (headers and nvcc) is present, e.g. "
            "`pip install --no-build-isolation -e .`") from e
    _register(_cuda)
    return _cuda


@functools.cache
def ensure_cuda_targets():
    """Loads the kernels and registers every CUDA custom-call target; returns the op names.

    Raises RuntimeError naming what is missing: a Hopper GPU, the kernels, or the CUDA bridge.
    """
    if not _hopper_gpus():
        kinds = [f"{d.device_kind} (sm {getattr(d, 'compute_capability', '?')})"
                 for d in jax.devices()]
        raise RuntimeError(
            f"FlashMLA's decode kernels need a Hopper GPU (sm 9.x); JAX sees {kinds}")
    ops = load_kernels()
    try:
        import jax_flashmla._flashmla as _flashmla
    except ImportError as e:
        raise RuntimeError(
            "jax_flashmla was built without its CUDA bridge (jax_flashmla._flashmla): reinstall "
            "it where a CUDA build of torch and the CUDA toolkit are present, e.g. "
            "`pip install --no-build-isolation -e .`") from e
    _set_up_torch_cuda()
    _register(_flashmla)
    register_cuda_targets()
    return ops


def _set_up_torch_cuda():
    """torch's one-time CUDA work, done here rather than inside a call that XLA may be
    capturing into a CUDA graph: its CUDA state and allocator, and the properties of every
    device (which FlashMLA's ops read on each call)."""
    import torch

    torch.cuda.init()
    for index in range(torch.cuda.device_count()):
        torch.cuda.get_device_properties(index)


@functools.cache
def own_kernels_available():
    """True where implementation=None should pick jax_flashmla's own CUDA kernels (the
    indexer's): the default backend is a Hopper GPU and jax_flashmla._cuda was built."""
    return (jax.default_backend() == "gpu" and bool(_hopper_gpus())
            and importlib.util.find_spec("jax_flashmla._cuda") is not None)


@functools.cache
def flashmla_available():
    """True where implementation=None should pick FlashMLA: the default backend is a Hopper GPU,
    the kernels can be found and the CUDA bridge was built. Imports neither torch nor kernels."""
    if jax.default_backend() != "gpu" or not _hopper_gpus():
        return False
    library = find_kernel_library()
    return (library is not None and importlib.util.find_spec("torch") is not None
            and importlib.util.find_spec("jax_flashmla._flashmla") is not None)
