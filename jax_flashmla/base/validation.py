"""Shapes, dtypes and limits of FlashMLA's MLA decode, checked at trace time.

Every check raises ValueError or TypeError naming the argument, what was seen and what was
expected, so that a bad call fails where it is written, not inside the kernel.
"""
import math

import jax
import numpy as np

HEAD_DIM = 576  # 512-d latent + 64-d rope key per cache row
HEAD_DIM_V = 512  # V is the first 512 columns of each cache row
PAGE_SIZE = 64
METADATA_FIELDS = 8
# Rows of the query tile one SM works on; the scheduler's part count divides SMs by the
# number of such tiles a request needs.
QUERY_TILE_ROWS = 64
# SMs of an H100 SXM / H200, used for traces with no GPU to ask, so that CPU runs see the
# metadata shapes a Hopper GPU would.
DEFAULT_NUM_SMS = 132
SUPPORTED_DTYPES = (np.dtype("bfloat16"), np.dtype("float16"))
# FlashMLA's FP8 KV cache (dense decode on Hopper): the cache and the quantized q in e4m3fn,
# with one float32 scale per tensor; out in bfloat16.
FP8_DTYPE = np.dtype("float8_e4m3fn")


def fail(exc, where, message):
    """Raises exc("where: message"): where names the function, message the argument, the value
    seen and what was expected."""
    raise exc(f"{where}: {message}")




# Every op's implementations: "custom_call", the GPU kernels as XLA custom calls (FlashMLA's,
# jax_flashmla's own, or cuDNN's flash attention for mla_prefill); "reference", pure JAX/XLA.
IMPLEMENTATIONS = ("custom_call", "reference")


def resolve_implementation(where, implementation, *, runs_here, refusal=lambda: None):
    """implementation, checked: None picks "custom_call" where runs_here() says the op's custom
    call can run here (on these arguments), else "reference". refusal() says why an explicit
    "custom_call" cannot: None, or (exception class, what it needs), raised naming where, the
    value and the way out."""
    if implementation is None:
        return "custom_call" if runs_here() else "reference"
    if implementation not in IMPLEMENTATIONS:
        fail(ValueError, where, f"implementation must be None or one of {IMPLEMENTATIONS}; got "
                                f"{implementation!r}")
    refused = refusal() if implementation == "custom_call" else None
    if refused is not None:
        exc, needs = refused
        fail(exc, where, f"implementation='custom_call' {needs}; pass implementation='reference' "
                         "or None")
    return implementation


def gpu_refusal(kernel):
    """A refusal (resolve_implementation) of a CUDA-only custom call off the GPU: kernel names
    its kernel."""
    backend = jax.default_backend()
    if backend == "gpu":
        return None
    return RuntimeError, (f"runs {kernel}, which needs a Hopper GPU; JAX's default backend is "
                          f"{backend}")


def check_rank(where, name, x, rank, layout):
    if not (hasattr(x, "ndim") and hasattr(x, "dtype")):
        fail(TypeError, where, f"{name} must be an array {layout} (a jax or NumPy array); got "
                                f"{type(x).__name__}")
    if x.ndim != rank:
        fail(ValueError, where,
              f"{name} must have rank {rank} {layout}; got shape {tuple(x.shape)}")


def check_int32(where, name, x):
    if x.dtype != np.int32:
        fail(TypeError, where, f"{name} must be int32; got {x.dtype} (convert it with "
                                f"jnp.asarray({name}, jnp.int32) or .astype(np.int32); NumPy "
                                f"makes int64 by default)")


def num_sm_parts(num_sms, num_heads_q, num_q_tokens, where="get_mla_metadata"):
    """Rows of the tile-scheduler metadata FlashMLA uses for this head and query layout (MLA's
    one latent KV head)."""
    rows = num_q_tokens * num_heads_q
    tiles = math.ceil(rows / QUERY_TILE_ROWS)
    parts = num_sms // tiles
    if parts < 1:
        fail(ValueError, where,
              f"num_q_tokens * num_heads_q = {rows} query rows need {tiles} tiles"
              f" of {QUERY_TILE_ROWS}, more than the {num_sms} SMs; split the heads or the"
              " query tokens")
    return parts


def check_num_sms(where, num_sms):
    if not isinstance(num_sms, (int, np.integer)) or isinstance(num_sms, bool) or num_sms < 1:
        fail(ValueError, where, f"num_sms must be a positive int (the GPU's SM count); got "
                                 f"{num_sms!r}")


def check_softmax_scale(where, softmax_scale):
    """A static, finite number: it is compiled into the kernel's call."""
    if not isinstance(softmax_scale, (int, float, np.integer, np.floating)) or isinstance(
            softmax_scale, bool):
        fail(TypeError, where, f"softmax_scale must be a Python float (static: it is compiled "
                                f"into the kernel's call, not traced); got "
                                f"{type(softmax_scale).__name__}")
    if not math.isfinite(softmax_scale):
        fail(ValueError, where, f"softmax_scale must be finite; got {softmax_scale!r}")


def check_scale(where, name, scale):
    """A per-tensor FP8 scale: a float32 array of shape () or (1,), positive and finite where
    its value is known at trace time. An array, not a Python number, so that a jitted step
    traces it and serves any scale with one compilation."""
    if not (hasattr(scale, "dtype") and hasattr(scale, "shape")):
        fail(TypeError, where,
              f"{name} must be a float32 array of shape () or (1,) (an array, so that one "
              f"compiled step serves any scale); got {type(scale).__name__}")
    if scale.dtype != np.float32:
        fail(TypeError, where, f"{name} must be float32; got {scale.dtype}")
    if tuple(scale.shape) not in ((), (1,)):
        fail(ValueError, where, f"{name} must have shape () or (1,) (one scale per tensor); "
                                 f"got {tuple(scale.shape)}")
    if not isinstance(scale, jax.core.Tracer):  # known now: a traced one is value_checks()'
        value = float(np.asarray(scale).reshape(()))
        if not (math.isfinite(value) and value > 0):
            fail(ValueError, where, f"{name} must be positive and finite (an FP8 value e "
                                     f"stands for e * {name}); got {value!r}")


def check_metadata_args(seq_lens, num_heads_q, num_q_tokens):
    where = "get_mla_metadata"
    check_rank(where, "seq_lens", seq_lens, 1, "(batch,)")
    check_int32(where, "seq_lens", seq_lens)
    for name, value in (("num_heads_q", num_heads_q), ("num_q_tokens", num_q_tokens)):
        if not isinstance(value, (int, np.integer)) or value < 1:
            fail(ValueError, where, f"{name} must be a positive Python int; got {value!r}")


def _check_dtypes(where, q, kv_cache, k_scale):
    cache_fp8 = np.dtype(kv_cache.dtype) == FP8_DTYPE
    if np.dtype(q.dtype) == FP8_DTYPE and not cache_fp8:
        fail(TypeError, where, f"q may be float8_e4m3fn only with a float8_e4m3fn kv_cache (q "
                                f"quantized with k_scale); kv_cache is {kv_cache.dtype}")
    if np.dtype(q.dtype) not in SUPPORTED_DTYPES + (FP8_DTYPE,):
        fail(TypeError, where, f"q must be bfloat16 or float16 (or float8_e4m3fn with a "
                                f"float8_e4m3fn kv_cache); got {q.dtype}")
    if cache_fp8:
        if k_scale is None:
            fail(TypeError, where, "a float8_e4m3fn kv_cache needs k_scale, its float32 scale of "
                                    "shape () or (1,)")
        check_scale(where, "k_scale", k_scale)
        return
    if kv_cache.dtype != q.dtype:
        fail(TypeError, where, f"kv_cache must have q's dtype {q.dtype}; got {kv_cache.dtype}")
    if k_scale is not None:
        fail(TypeError, where, f"k_scale is only for a float8_e4m3fn kv_cache; kv_cache is "
                                f"{kv_cache.dtype}")


def check_decode_args(q, kv_cache, block_table, seq_lens, k_scale=None):
    """Checks the operands of mla_decode; returns (batch, s_q, h_q)."""
    where = "mla_decode"
    check_rank(where, "q", q, 4, "(batch, s_q, h_q, 576)")
    check_rank(where, "kv_cache", kv_cache, 4, "(num_pages, 64, 1, 576)")
    check_rank(where, "block_table", block_table, 2, "(batch, max_pages)")
    check_rank(where, "seq_lens", seq_lens, 1, "(batch,)")
    batch, s_q, h_q, head_dim = q.shape
    if head_dim != HEAD_DIM:
        fail(ValueError, where, f"q must have head dim {HEAD_DIM} (512 latent + 64 rope); "
                                 f"got shape {tuple(q.shape)}")
    if kv_cache.shape[1:] != (PAGE_SIZE, 1, HEAD_DIM):
        fail(ValueError, where,
              f"kv_cache must have shape (num_pages, {PAGE_SIZE}, 1, {HEAD_DIM}) (page size "
              f"{PAGE_SIZE}, one latent KV head); got {tuple(kv_cache.shape)}")
    _check_dtypes(where, q, kv_cache, k_scale)
    check_int32(where, "block_table", block_table)
    check_int32(where, "seq_lens", seq_lens)
    if block_table.shape[0] != batch or block_table.shape[1] < 1:
        fail(ValueError, where, f"block_table must have shape ({batch}, max_pages >= 1) for q's "
                                 f"batch {batch}; got {tuple(block_table.shape)}")
    if kv_cache.shape[0] < 1:
        fail(ValueError, where, f"kv_cache must hold at least one page; got shape "
                                 f"{tuple(kv_cache.shape)}")
    if seq_lens.shape != (batch,):
        fail(ValueError, where,
              f"seq_lens must have shape ({batch},); got {tuple(seq_lens.shape)}")
    if s_q < 1 or h_q < 1 or batch < 1:
        fail(ValueError, where, f"q must have batch, s_q and h_q >= 1; got shape {tuple(q.shape)}")
    return batch, s_q, h_q


def check_metadata_block_table(block_table, seq_lens, num_pages):
    where = "get_mla_metadata"
    for name, value in (("block_table", block_table), ("num_pages", num_pages)):
        if value is None:
            fail(ValueError, where, f"{name} must be given (the step's block table and the pages "
                                     f"it may name, so that out-of-range requests are scheduled "
                                     f"empty); got None")
    if isinstance(num_pages, bool) or not isinstance(num_pages, (int, np.integer)) or num_pages < 1:
        fail(ValueError, where, f"num_pages must be a positive int (the cache's first "
                                 f"dimension); got {num_pages!r}")
    check_rank(where, "block_table", block_table, 2, "(batch, max_pages)")
    check_int32(where, "block_table", block_table)
    batch = seq_lens.shape[0]
    if block_table.shape[0] != batch or block_table.shape[1] < 1:
        fail(ValueError, where, f"block_table must have shape ({batch}, max_pages >= 1) for "
                                 f"seq_lens of shape ({batch},); got {tuple(block_table.shape)}")


def check_metadata_matches(metadata, batch, s_q, h_q, fp8):
    where = "mla_decode"
    if metadata.fp8 != fp8:
        # The FP8 kernel reads its own scheduler's rows (another layout): never mix the two.
        fail(ValueError, where,
              f"metadata was computed with fp8={metadata.fp8}, but the kv_cache is "
              f"{'' if fp8 else 'not '}float8_e4m3fn; call get_mla_metadata(..., fp8={fp8})")
    if (metadata.num_heads_q, metadata.num_q_tokens) != (h_q, s_q):
        fail(ValueError, where,
              f"metadata was computed for num_heads_q={metadata.num_heads_q}, "
              f"num_q_tokens={metadata.num_q_tokens}; q has h_q={h_q}, s_q={s_q}")
    if metadata.seq_lens.shape != (batch,):
        fail(ValueError, where, f"metadata.seq_lens must have shape ({batch},) for batch {batch}; "
                                 f"got {tuple(metadata.seq_lens.shape)}")
    if metadata.tile_scheduler_metadata is None:  # made for the reference: lengths alone
        return
    if metadata.num_splits.shape != (batch + 1,):
        fail(ValueError, where, f"metadata.num_splits must have shape ({batch + 1},) for batch "
                                 f"{batch}; got {tuple(metadata.num_splits.shape)}")
    md = metadata.tile_scheduler_metadata
    if md.ndim != 2 or md.shape[1] != METADATA_FIELDS:
        fail(ValueError, where, f"metadata.tile_scheduler_metadata must have shape (num_sm_parts, "
                                 f"{METADATA_FIELDS}); got {tuple(md.shape)}")
