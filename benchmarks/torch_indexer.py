"""jax_flashmla's indexer kernels (ffi/index_topk.h: the scores of query rows over a paged
index-key cache, then each row's top-k positions) called from torch: the torch side of
bench_v4.py's step with the indexer, where neither DeepGEMM's fp8_paged_mqa_logits nor
SGLang's top-k runs. The same kernels as the JAX step's, on the same bytes.

benchmarks/torch_indexer.cu wraps the two launchers in a C ABI; library() compiles it with
ffi/index_topk.cu by nvcc (sm_90a) once per source version into a directory under the system's
temporary one, and loads it with ctypes. Each call launches on torch's current stream, so
torch.cuda.graph captures it. The CUDA runtime is linked statically, as jax_flashmla's _cuda
module links it: the library needs no libcudart of its own, and torch's stream (a driver
stream) and the device's primary context are the process's. StepIndexers runs a decode step's
CSA indexers with them on a step's JAX inputs.
"""
import ctypes
import functools
import hashlib
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
from build_env import find_nvcc  # noqa: E402  (the repository's: where nvcc is looked for)

FFI = os.path.join(ROOT, "ffi")
SOURCES = (os.path.join(HERE, "torch_indexer.cu"), os.path.join(FFI, "index_topk.cu"))
HEADERS = (os.path.join(FFI, "index_topk.h"), os.path.join(FFI, "layouts.h"))
FLAGS = ("-shared", "-Xcompiler", "-fPIC", "-O3", "-std=c++17", "-cudart", "static",
         "-gencode", "arch=compute_90a,code=sm_90a", "-I", FFI)
PAGE = 64  # tokens a page (ffi/layouts.h's kPageTokens)
PAGE_BYTES = 8448  # an index-key page: 64 keys of 128 e4m3 bytes, then their float32 scales
HEAD_DIM = 128
MAX_HEADS = 256  # index_topk.h's kIndexMaxHeads


def build():
    """The path of the compiled library, compiled now unless a build of these sources, flags
    and nvcc is there already. RuntimeError with nvcc's command and output where it fails."""
    nvcc = find_nvcc()
    if nvcc is None:
        raise RuntimeError("torch_indexer: nvcc is not found ($CUDA_HOME, $CUDA_PATH, PATH, "
                           "/usr/local/cuda); it compiles ffi/index_topk.cu for torch")
    digest = hashlib.sha256(" ".join((nvcc, *FLAGS)).encode())
    for path in SOURCES + HEADERS:
        with open(path, "rb") as f:
            digest.update(f.read())
    directory = os.path.join(tempfile.gettempdir(), "jax_flashmla_torch_indexer")
    os.makedirs(directory, exist_ok=True)
    target = os.path.join(directory, f"torch_indexer_{digest.hexdigest()[:16]}.so")
    if os.path.exists(target):
        return target
    partial = f"{target}.{os.getpid()}.tmp"  # renamed when whole: a concurrent build is safe
    command = [nvcc, *FLAGS, *SOURCES, "-o", partial]
    run = subprocess.run(command, capture_output=True, text=True)
    if run.returncode != 0:
        raise RuntimeError(f"torch_indexer: nvcc failed ({run.returncode}):\n  "
                           f"{' '.join(command)}\n{run.stdout}{run.stderr}")
    os.replace(partial, target)
    return target


@functools.lru_cache(maxsize=None)
def library():
    """The loaded library, its functions' argument types set (built on first use)."""
    lib = ctypes.CDLL(build())
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    lib.jax_flashmla_index_scores.argtypes = [pointer, pointer, size, size, pointer, size,
                                              pointer, size, pointer, pointer, size, pointer]
    lib.jax_flashmla_topk_positions.argtypes = [pointer, size, size, size, pointer, pointer,
                                                pointer]
    lib.jax_flashmla_topk_scratch_width.argtypes = [size, size]
    lib.jax_flashmla_topk_scratch_width.restype = size
    lib.jax_flashmla_index_scores.restype = lib.jax_flashmla_topk_positions.restype = ctypes.c_int
    lib.jax_flashmla_error_string.argtypes = [ctypes.c_int]
    lib.jax_flashmla_error_string.restype = ctypes.c_char_p
    return lib


def _checked(where, error):
    if error != 0:
        text = library().jax_flashmla_error_string(error).decode()
        raise RuntimeError(f"torch_indexer.{where}: CUDA error {error} ({text})")


def _require(where, tensor, name, dtypes, shape):
    """tensor: a contiguous CUDA tensor of one of dtypes and shape (None: any extent)."""
    if (not tensor.is_cuda or not tensor.is_contiguous() or str(tensor.dtype) not in dtypes
            or tensor.dim() != len(shape)
            or any(want not in (None, got) for want, got in zip(shape, tensor.shape))):
        raise ValueError(f"torch_indexer.{where}: {name} must be a contiguous CUDA tensor of "
                         f"{' or '.join(dtypes)} and shape {shape}; got {tensor.dtype} "
                         f"{tuple(tensor.shape)} on {tensor.device} (contiguous: "
                         f"{tensor.is_contiguous()})")


def _stream(torch):
    return ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)


def index_scores(values, weights, cache, block_table, visible, width):
    """(rows, width) float32 scores: LaunchIndexScores on torch's current stream.

    values (rows, heads, 128) float8_e4m3fn (or its uint8 bytes), heads <= 256; weights
    (rows, heads) float32; cache (num_pages, 8448) uint8 (an IndexKeyCache's data);
    block_table (rows, max_pages) and visible (rows,) int32; width >= max_pages * 64. Position
    p of row r its score where p < visible[r] and its page is in the cache, -inf elsewhere."""
    import torch

    where = "index_scores"
    rows, heads = values.shape[0], values.shape[1]
    _require(where, values, "values", ("torch.float8_e4m3fn", "torch.uint8"),
             (rows, heads, HEAD_DIM))
    _require(where, weights, "weights", ("torch.float32",), (rows, heads))
    _require(where, cache, "cache", ("torch.uint8",), (None, PAGE_BYTES))
    _require(where, block_table, "block_table", ("torch.int32",), (rows, None))
    _require(where, visible, "visible", ("torch.int32",), (rows,))
    if not 1 <= heads <= MAX_HEADS or width < block_table.shape[1] * PAGE:
        raise ValueError(f"torch_indexer.{where}: heads must be in [1, {MAX_HEADS}] and width "
                         f">= max_pages * {PAGE}; got {heads}, {width} for max_pages "
                         f"{block_table.shape[1]}")
    scores = torch.empty((rows, width), dtype=torch.float32, device=values.device)
    _checked(where, library().jax_flashmla_index_scores(
        values.data_ptr(), weights.data_ptr(), rows, heads, cache.data_ptr(), cache.shape[0],
        block_table.data_ptr(), block_table.shape[1], visible.data_ptr(), scores.data_ptr(),
        width, _stream(torch)))
    return scores


def topk_positions(scores, k):
    """(rows, k) int32: the positions of each row's k largest scores (rows, width) float32,
    ascending; of equal scores the lower position is taken first; where width < k, every
    position, then -1 (LaunchTopkPositions on torch's current stream)."""
    import torch

    _require("topk_positions", scores, "scores", ("torch.float32",), (None, None))
    rows, width = scores.shape
    positions = torch.empty((rows, k), dtype=torch.int32, device=scores.device)
    scratch = torch.empty((rows, library().jax_flashmla_topk_scratch_width(width, k)),
                          dtype=torch.int32, device=scores.device)
    _checked("topk_positions", library().jax_flashmla_topk_positions(
        scores.data_ptr(), rows, width, k, positions.data_ptr(), scratch.data_ptr(),
        _stream(torch)))
    return positions


def entry_slots(block_table, visible, num_pages):
    """(rows, max_pages * 64) int32: entry e of row r at its slot through block_table (rows,
    max_pages) int32, page * 64 + offset; -1 where e >= visible[r] ((rows,) int32) or its page
    lies outside [0, num_pages): the slots v4_indexer_select gives its picks (such entries
    score -inf). Torch ops, on any device; made once a step for the CSA layers sharing a table,
    as a torch server keeps a request-to-slot map, so that a layer's picks take one gather."""
    import torch

    rows, max_pages = block_table.shape
    entries = torch.arange(max_pages * PAGE, dtype=torch.int32, device=block_table.device)
    # expand, not repeat_interleave: some torch releases sync the device in it (no capture).
    pages = block_table[:, :, None].expand(rows, max_pages, PAGE).reshape(rows, -1)
    keep = (entries < visible[:, None]) & (pages >= 0) & (pages < num_pages)
    return (pages * PAGE + entries % PAGE).where(keep, -1)


def select_slots(values, weights, cache, block_table, visible, slots, topk):
    """(rows, topk) int32: the slots of each row's top topk visible entries in entry order,
    -1 for picks that entry_slots marks (a row seeing fewer than topk entries, pages off the
    cache), as v4_indexer_select's for one new token a request: index_scores (width
    max_pages * 64), topk_positions, then slots (entry_slots') gathered. Arguments as
    index_scores'; topk <= max_pages * 64. (v4_indexer_select also selects nothing for a row
    whose visible exceeds max_pages * 64: visible is taken as given here.)"""
    max_pages = block_table.shape[1]
    if topk > max_pages * PAGE:  # then a pick could fall past the table
        raise ValueError(f"torch_indexer.select_slots: topk {topk} exceeds the table's "
                         f"{max_pages * PAGE} entries")
    scores = index_scores(values, weights, cache, block_table, visible, max_pages * PAGE)
    return slots.gather(1, topk_positions(scores, topk).long())


class StepIndexers:
    """The CSA layers' indexers of a decode step (one new token a request) from torch, over JAX
    arrays: torch views of their buffers, the arrays made here held as long as this lives (a
    CUDA graph reading a JAX array must hold it; bench_v4.TorchV4.steps' note).

    view: a JAX array -> a torch tensor over its buffer (torch_side.TorchSide.view); queries:
    per layer an IndexQuery (values (b, 1, heads, 128) float8_e4m3fn, weights (b, 1, heads)
    float32) or None; keys: per cache its IndexKeyCache or None (every one of num_pages pages);
    table: (b, max_pages) int32, every cache's block table; start: (b,) int32, the tokens each
    request had before the new one; ratio: the compressor's (4); topk: the picks a layer."""

    def __init__(self, view, queries, keys, table, start, ratio, topk):
        import jax
        import jax.numpy as jnp

        b = table.shape[0]
        # The e4m3 values as bytes (DLPack carries no float8): arrays of ours, so held here.
        self.held = jax.block_until_ready([
            None if q is None else jax.lax.bitcast_convert_type(q.values, jnp.uint8)
            for q in queries])
        self.values = [None if v is None else view(v).view(b, v.shape[2], HEAD_DIM)
                       for v in self.held]
        self.weights = [None if q is None else view(q.weights).view(b, q.weights.shape[2])
                        for q in queries]
        self.keys = [None if k is None else view(k.data) for k in keys]
        self.table, self.start = view(table), view(start)
        self.num_pages = next(k.shape[0] for k in self.keys if k is not None)
        self.ratio, self.topk = ratio, topk

    def per_step(self):
        """(visible, slots), made once a step in torch ops: visible (b,) int32, the entries the
        new token at position start sees ((start + 1) // ratio, as v4_indexer's
        visible_entries counts them); slots, entry_slots' through the shared table."""
        visible = (self.start + 1).div(self.ratio, rounding_mode="floor")
        return visible, entry_slots(self.table, visible, self.num_pages)

    def select(self, layer, cache, made):
        """(b, topk) int32: layer's picks (select_slots) from its query over cache's index keys;
        made: per_step()'s."""
        return select_slots(self.values[layer], self.weights[layer], self.keys[cache],
                            self.table, *made, topk=self.topk)
