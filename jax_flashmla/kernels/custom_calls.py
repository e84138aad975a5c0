"""The physical ops: jax_flashmla's XLA custom calls, each stated once.

A CustomCall names its target, its operands and results (with their Shardy factors in FACTORS)
in the order of ffi/operands.h, its result types and its attributes on each platform; its
primitive, abstract evaluation, CPU and CUDA lowerings and sequential batching are generated
from that. On CUDA a call runs FlashMLA's kernels (through jax_flashmla._flashmla, which
kernels.py loads with torch when a decode is first lowered for CUDA) or our small ones
(jax_flashmla._cuda, no torch); on CPU the C++ model of FlashMLA (ffi/reference_mla.cc). The
targets are those the compiled modules' registrations() return.

The decode's results are out, lse and FlashMLA's split-KV accumulators (out_accum, lse_accum),
scratch that XLA allocates so that the kernel allocates nothing itself. FlashMLA's FP8 decode
(q and the cache in float8_e4m3fn, out bfloat16) is its own call: it takes the scales as (1,)
float32 buffers, and reads copies of the block table and lengths that hand the kernel
requests of length 0 as length 1 (fp8.guard_empty_requests), which it faults on.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import batching, mlir
from jax.interpreters import partial_eval as pe

import jax_flashmla._cpu as _cpu
from jax_flashmla.base import validation
from jax_flashmla.kernels import library as kernels

# Each operand's and result's dims as Shardy factors: b batch, s query tokens, h query heads,
# d head dim (576), v V dim (512), n pages, p page size, k KV heads (1), m block-table width,
# x SM parts, y metadata fields, c batch + 1, a batch + SM parts, e and f the FP8 scales.
FACTORS = {
    "q": "b s h d", "kv_cache": "n p k d", "block_table": "b m", "seq_lens": "b",
    "tile_scheduler_metadata": "x y", "num_splits": "c", "descale_q": "e", "descale_k": "f",
    "kernel_block_table": "b m", "kernel_seq_lens": "b",
    "out": "b s h v", "lse": "b h s", "out_accum": "a h s v", "lse_accum": "a h s",
}

CPU_TARGETS = _cpu.registrations()
for _name, _capsule in CPU_TARGETS.items():
    jax.ffi.register_ffi_target(_name, _capsule, platform="cpu")


@functools.lru_cache(maxsize=4096)
def _jitted_bind(primitive, params):
    """The primitive bound with these params (sorted (name, value) pairs), jitted: one jitted
    function per primitive and params, so that an eager call traces and compiles once per
    shapes rather than on every call (as JAX's own primitives)."""
    return jax.jit(functools.partial(primitive.bind, **dict(params)))


def _impl(primitive, *args, **params):
    return _jitted_bind(primitive, tuple(sorted(params.items())))(*args)


def batch_sequentially(primitive, args, dims, **params):
    """A vmap rule: one call per element of the mapped axis (FlashMLA has no batch-of-batches
    form), unmapped operands passed through, not broadcast."""
    mapped = [i for i, d in enumerate(dims) if d is not None]
    moved = [jnp.moveaxis(args[i], dims[i], 0) for i in mapped]

    def one(xs):
        full = list(args)
        for i, x in zip(mapped, xs):
            full[i] = x
        return primitive.bind(*full, **params)

    outs = jax.lax.map(one, moved)
    return outs, (0,) * len(outs)


def make_primitive(name, abstract_eval):
    """A primitive of several results, evaluated eagerly through jit, vmapped sequentially."""
    primitive = Primitive(name)
    primitive.multiple_results = True
    primitive.def_impl(functools.partial(_impl, primitive))
    primitive.def_abstract_eval(abstract_eval)
    batching.primitive_batchers[primitive] = functools.partial(batch_sequentially, primitive)
    return primitive


class CustomCall:
    """One custom call: `call(**operands, **params)` binds its primitive, operands by name.

    result_types(**operand_avals, **params) gives the results' ShapedArrays; attributes(platform,
    **params) the FFI attributes of the lowering on "cpu" or "cuda"; result_layouts(avals_out)
    their layouts (None: row-major)."""

    def __init__(self, target, operands, results, result_types, attributes,
                 result_layouts=lambda avals_out: None, has_side_effect=False,
                 platforms=("cpu", "cuda")):
        if "cpu" in platforms and target not in CPU_TARGETS:
            raise AssertionError(f"{target} is not among the C++ module's targets")
        self.target, self.operands, self.results = target, operands, results
        self._attributes, self._result_layouts = attributes, result_layouts
        self._has_side_effect = has_side_effect
        self.primitive = make_primitive(target, self._abstract_eval)
        self._result_types = result_types
        for platform in platforms:
            mlir.register_lowering(self.primitive, functools.partial(self._lower, platform),
                                   platform=platform)

    def __call__(self, **named):
        values = [named.pop(name) for name in self.operands]
        return self.primitive.bind(*values, **named)

    def _abstract_eval(self, *avals, **params):
        types = self._result_types(**dict(zip(self.operands, avals)), **params)
        assert len(types) == len(self.results), (self.target, self.results, types)
        return types

    def _lower(self, platform, ctx, *values, **params):
        if platform == "cuda":
            kernels.register_cuda_targets()
        lowering = jax.ffi.ffi_lowering(self.target,
                                        result_layouts=self._result_layouts(ctx.avals_out),
                                        has_side_effect=self._has_side_effect)
        return lowering(ctx, *values, **self._attributes(platform, **params))


def _i32(*shape):
    return jax.core.ShapedArray(shape, jnp.int32)


def _f32(*shape):
    return jax.core.ShapedArray(shape, jnp.float32)


FP8_OPS = "dense FP8 decode (fwd_kvcache_mla_fp8, get_mla_decoding_metadata_dense_fp8)"


def _kernel_op(ops, name, what=FP8_OPS):
    """The op `name` of KernelOps, or RuntimeError saying the library lacks `what`."""
    op = getattr(ops, name)
    if op is None:
        raise RuntimeError(f"the FlashMLA kernels in {ops.library.path} have no {what}")
    return op


# Scheduler-row fields FlashMLA writes (the CUDA handler zeroes the rest): the bf16 scheduler
# 7 (requests, blocks, split, first/last split flags); the FP8 decode's scheduler, FlashMLA's
# original one, 5 (begin request and token, end request and token, begin split).
WRITTEN_METADATA_FIELDS = {False: 7, True: 5}


def _metadata_attributes(platform, *, num_heads_q, num_q_tokens, num_sm_parts, fp8):
    if platform == "cpu":
        return {}  # the C++ model's decode reads its own scheduler's rows, bf16 and FP8 alike
    # FlashMLA's scheduler plans for the GPU's own SM count, whatever num_sms said at trace
    # time. Its bf16 and FP8 schedulers share the formula (FlashMLA's dense FP8 source);
    # should a release differ, the handler refuses the result's shape at run time.
    expected = validation.num_sm_parts(kernels.gpu_sm_count(), num_heads_q, num_q_tokens)
    if num_sm_parts != expected:
        validation.fail(
            ValueError, "get_mla_metadata",
            f"num_sms made {num_sm_parts} SM parts, but FlashMLA on this GPU "
            f"({kernels.gpu_sm_count()} SMs) makes {expected}; leave num_sms unset on GPUs")
    ops = kernels.ensure_cuda_targets()
    return dict(op=_kernel_op(ops, "metadata_fp8") if fp8 else ops.metadata,
                num_q_tokens_per_head_k=np.int64(num_q_tokens * num_heads_q),
                num_heads_k=np.int64(1), num_heads_q=np.int64(num_heads_q),
                written_fields=np.int64(WRITTEN_METADATA_FIELDS[fp8]))


# Trusts: seq_lens in [0, max_pages * 64] (FlashMLA's scheduler sums their blocks in int32),
# and that the decode it plans for is given these lengths. Guaranteed by: ops.safe_seq_lens
# (get_mla_metadata, and decode_primitive._kernels on lengths already made safe); schedule()
# raises the FP8 decode's lengths to 1; sparse.ops.kernel_schedule passes topk, a static shape.
METADATA = CustomCall(
    "jax_flashmla_mla_metadata", ("seq_lens",), ("tile_scheduler_metadata", "num_splits"),
    lambda seq_lens, *, num_sm_parts, **_: (_i32(num_sm_parts, validation.METADATA_FIELDS),
                                            _i32(seq_lens.shape[0] + 1)),
    _metadata_attributes)


def _decode_types(q, tile_scheduler_metadata, fp8, **_):
    batch, s_q, h_q, _ = q.shape
    splits = batch + tile_scheduler_metadata.shape[0]
    v = validation.HEAD_DIM_V
    return (jax.core.ShapedArray((batch, s_q, h_q, v), jnp.bfloat16 if fp8 else q.dtype),
            _f32(batch, h_q, s_q), _f32(splits, h_q, s_q, v), _f32(splits, h_q, s_q))


def lse_minor_to_major(s_q):
    """lse (b, h_q, s_q) as FlashMLA lays it out, s_q outside h_q (minor to major: h_q, s_q,
    b), or None for s_q = 1, where that is row-major's bytes."""
    return None if s_q == 1 else (1, 2, 0)


def _decode_layouts(avals_out):
    """out and the accumulators row-major; lse in FlashMLA's layout, so that FlashMLA writes it
    in place and XLA transposes it only where it is read (nowhere, when a model drops it)."""
    lse_layout = lse_minor_to_major(avals_out[1].shape[2])
    return None if lse_layout is None else [None, lse_layout] + [None] * (len(avals_out) - 2)


def _decode_attributes(fp8, platform, *, softmax_scale, causal):
    attributes = dict(softmax_scale=np.float32(softmax_scale), causal=bool(causal))
    if platform == "cuda":
        ops = kernels.ensure_cuda_targets()
        attributes["op"] = _kernel_op(ops, "decode_fp8") if fp8 else ops.decode
    return attributes


# DECODE and DECODE_FP8 trust, on CUDA (the C++ model checks the same and errs instead):
# - seq_lens in [0, max_pages * 64], and each request's first ceil(seq_lens / 64) block-table
#   entries in [0, num_pages). Guaranteed by: ops.safe_seq_lens (no metadata: bad requests made
#   length 0), or get_mla_metadata's safe lengths carried in MLAMetadata.seq_lens and decoded
#   as they are, the table's entries outside the cache read as page 0
#   (ops._under_carried_lengths).
# - tile_scheduler_metadata and num_splits: METADATA's plan for exactly those lengths.
#   Guaranteed by: decode_primitive._kernels (none given); a given MLAMetadata's plan is
#   trusted as get_mla_metadata made it, which alone makes one (jax_flashmla/base/trusted.py;
#   value_checks() plans it again).
_DECODE_RESULTS = ("out", "lse", "out_accum", "lse_accum")
DECODE = CustomCall(
    "jax_flashmla_mla_decode",
    ("q", "kv_cache", "block_table", "seq_lens", "tile_scheduler_metadata", "num_splits"),
    _DECODE_RESULTS, functools.partial(_decode_types, fp8=False),
    functools.partial(_decode_attributes, False), _decode_layouts)

# DECODE_FP8 trusts besides: kernel_seq_lens >= 1 and slot 0 of kernel_block_table a page
# where a request is empty (the kernel faults on length 0), and a plan over those raised
# lengths. Guaranteed by: fp8.guard_empty_requests and schedule(fp8=True), both in
# decode_primitive._kernels. Its handler's empty-requests kernel (ffi/empty_requests.h)
# reads seq_lens only to find the requests of length 0: any value is safe there. descale_q and
# descale_k are any float (arithmetic, not addresses; checks.scale under value_checks()).
DECODE_FP8 = CustomCall(
    "jax_flashmla_mla_decode_fp8",
    ("q", "kv_cache", "kernel_block_table", "kernel_seq_lens", "seq_lens",
     "tile_scheduler_metadata", "num_splits", "descale_q", "descale_k"),
    _DECODE_RESULTS, functools.partial(_decode_types, fp8=True),
    functools.partial(_decode_attributes, True), _decode_layouts)


def _sparse_decode_types(q, schedule, **_):
    batch, s_q, h_q, _ = q.shape
    splits = batch + (schedule.shape[0] - batch - 1) // validation.METADATA_FIELDS
    v = validation.HEAD_DIM_V
    return (jax.core.ShapedArray((batch, s_q, h_q, v), jnp.bfloat16), _f32(batch, h_q, s_q),
            _f32(splits, h_q, s_q, v), _f32(splits, h_q, s_q))


def _sparse_attributes(name, what, platform, *, softmax_scale, with_sink, layer=None,
                       with_topk_length=None):
    """The sparse calls' attributes; `layer` the V3.2 decode's alone, `with_topk_length` the
    prefill's."""
    attributes = dict(softmax_scale=np.float32(softmax_scale), with_sink=bool(with_sink),
                      op=_kernel_op(kernels.ensure_cuda_targets(), name, what))
    if layer is not None:
        attributes["layer"] = np.int64(layer)
    if with_topk_length is not None:
        attributes["with_topk_length"] = bool(with_topk_length)
    return attributes


# DeepSeek-V3.2's sparse decode over the 656-byte token cache (jax_flashmla.sparse): CUDA only
# (off the GPU, jax_flashmla.sparse runs its pure-JAX reference). Its indices are a stack
# (layers, batch, s_q, topk) of which it reads row `layer` (static) in place; its schedule is
# METADATA's over requests of topk keys as one int32 array, the scheduler's rows (parts, 8)
# then num_splits (batch + 1) (jax_flashmla/ops/sparse.py); the results after out and lse are
# the split-KV accumulators, scratch.
# Trusts: every entry of row `layer` of indices in [-1, num_pages * 64) (the kernel skips -1
# alone). Guaranteed by: sparse.ops._masked on raw indices (the row read, at each call), or
# MaskedIndices, which only mask_indices, slicing and pytree unflattening (jit, scan) make,
# their num_keys checked against the cache (sparse.ops._unmasked). `layer` in [0, layers):
# sparse.ops._stack_row, and the handler. Its schedule: FlashMLA's scheduler over batch
# requests of the kernel's topk keys at the kernel's heads, s_q and this GPU's SMs, made from
# the static shapes at trace time and held as a constant (sparse.ops.kernel_schedule): no caller
# hands one in.
# A cache of no pages never reaches it (sparse.ops._no_keys). attn_sink: any float, a logit.
SPARSE_DECODE = CustomCall(
    "jax_flashmla_mla_sparse_decode",
    ("q", "kv_cache", "indices", "attn_sink", "schedule"), _DECODE_RESULTS,
    _sparse_decode_types,
    functools.partial(_sparse_attributes, "sparse_decode", "sparse decode (sparse_decode_fwd)"),
    _decode_layouts, platforms=("cuda",))


def _sparse_decode_v4_attributes(platform, *, softmax_scale, with_extra, with_sink):
    return dict(_sparse_attributes("sparse_decode", "sparse decode (sparse_decode_fwd)", platform,
                                   softmax_scale=softmax_scale, with_sink=with_sink),
                with_extra=bool(with_extra))


# DeepSeek-V4's sparse decode (FlashMLA's MODEL1 kernel, which sparse_decode_fwd picks for a q
# of 512): q (batch, s_q, h_q, 512) bf16 over the (num_pages, 65, 576) byte cache of
# caches/v4.py (the handler hands the kernel its (num_pages, 64, 1, 584) view) with indices
# (batch, s_q, topk) and topk_length (batch,), and with with_extra an extra (window) cache in
# the same forms; without, the extra operands are empty. CUDA only. Its schedule is METADATA's
# over each request's combined lengths (ops/sparse_v4.py), rows then num_splits as for V3.2.
# Trusts: indices and extra_indices in [-1, their cache's num_pages * 64); topk_length in
# [0, topk] and extra_topk_length in [0, extra_topk] (the kernel reads that many indices); at
# least one page in each cache given; the schedule made over these lengths. Guaranteed by:
# ops/sparse_v4.py, which masks the indices and clamps the lengths at each call, answers a
# cache of no pages without a kernel, and makes the schedule from the clamped lengths.
SPARSE_DECODE_V4 = CustomCall(
    "jax_flashmla_mla_sparse_decode_v4",
    ("q", "kv_cache", "indices", "topk_length", "extra_kv_cache", "extra_indices",
     "extra_topk_length", "attn_sink", "schedule"), _DECODE_RESULTS, _sparse_decode_types,
    _sparse_decode_v4_attributes, _decode_layouts, platforms=("cuda",))


def _sparse_prefill_types(q, **_):
    tokens, h_q, _ = q.shape
    return (jax.core.ShapedArray((tokens, h_q, validation.HEAD_DIM_V), jnp.bfloat16),
            _f32(tokens, h_q), _f32(tokens, h_q))


# Its sparse prefill on bf16 rows, CUDA only as well: q (tokens, h_q, 576 or 512), kv (keys, 1,
# q's width), indices (tokens, 1, topk); with with_topk_length (512 wide only: the kernel
# FlashMLA has for it) topk_length (tokens,), from which on the kernel skips a row's indices.
# The results are in the order the op allocates them: out, lse in base 2, and the largest
# logits (scratch to jax_flashmla.sparse, which drops them).
# Trusts: every index in [-1, keys), at least one key, and each topk_length in [0, topk].
# Guaranteed by: sparse.ops._masked at each call (no pre-masked form), sparse.ops._no_keys for
# kv of no keys, the lengths clamped in sparse.ops.sparse_mla_prefill; topk padded to 128 and
# heads to 64 or 128 in sparse.ops._kernel_prefill. attn_sink: any float, a logit.
SPARSE_PREFILL = CustomCall(
    "jax_flashmla_mla_sparse_prefill", ("q", "kv", "indices", "attn_sink", "topk_length"),
    ("out", "lse_base2", "max_logits"), _sparse_prefill_types,
    functools.partial(_sparse_attributes, "sparse_prefill", "sparse prefill (sparse_prefill_fwd)"),
    platforms=("cuda",))

# DeepSeek-V3.2's indexer (ffi/index_topk.h): each query row's scores over its request's tokens
# in the index-key cache, and the positions of its top k in ascending order. CUDA only (off
# the GPU, jax_flashmla.ops.indexer runs its pure-JAX reference). The scores are a result
# so that XLA allocates them: the selection reads them, and tests compare them. So is the
# top-k's scratch (topk_scratch_width int32 a row), which callers drop.
# Trusts no operand value: the scoring kernel reads only pages in [0, num_pages) and clamps a
# negative visible to 0; shapes are checked again by its handler (ffi/cuda_handlers.cc).
# Guaranteed by: ffi/index_topk.cu itself; indexer._visible computes visible without int32
# wrap, and indexer._check_rows keeps a row's positions within int32.
INDEX_TOPK = CustomCall(
    "jax_flashmla_index_topk", ("values", "weights", "cache", "block_table", "visible"),
    ("positions", "scores", "scratch"),
    lambda values, block_table, *, topk, **_: _index_topk_results(
        values.shape[0], score_width(block_table.shape[1], topk), topk),
    lambda platform, *, topk: {}, platforms=("cuda",))

# The top-k's pieces (ffi/index_topk.cu's kTopkPiece): a block's scores.
TOPK_PIECE = 16384


def score_width(max_pages, topk):
    """INDEX_TOPK's scores a row: every position of a block table max_pages wide, at least topk."""
    return max(max_pages * validation.PAGE_SIZE, topk)


def _index_topk_results(rows, width, topk):
    return _i32(rows, topk), _f32(rows, width), _i32(rows, topk_scratch_width(width, topk))


def topk_scratch_width(width, topk):
    """ffi/index_topk.h's TopkScratchWidth of rows of width scores, which its handler checks
    the scratch against."""
    def candidates(n):  # each piece's topk best, once cutting leaves at most an eighth
        if n <= 2 * TOPK_PIECE or 8 * topk > TOPK_PIECE:
            return 0
        pieces = -(-n // TOPK_PIECE)
        return (pieces - 1) * topk + min(n - (pieces - 1) * TOPK_PIECE, topk)

    first = candidates(width)
    return 2 * (first + candidates(first))


# The host queue's push (serving/host_queue.py): no results, kept by its DCE rule in jaxprs
# and by has_side_effect in XLA. It declares no JAX effect: an executable with effects is run
# through JAX's slower Python dispatch, with a runtime token, at every call.
# Trusts no payload value (bytes copied as they are); queue_id must name a live queue of this
# device whose slots hold the payload. Guaranteed by: the handler's QueueForPush
# (ffi/host_queue.h), which errs otherwise; HostQueue.push checks shape and dtype.
HOST_QUEUE_PUSH = CustomCall(
    "jax_flashmla_host_queue_push", ("payload",), (), lambda payload, *, queue_id: [],
    lambda platform, *, queue_id: dict(queue_id=np.uint64(queue_id)), has_side_effect=True)
pe.dce_rules[HOST_QUEUE_PUSH.primitive] = lambda used, eqn: ([True] * len(eqn.invars), eqn)


def schedule(seq_lens, *, num_heads_q, num_q_tokens, num_sm_parts, fp8):
    """(tile_scheduler_metadata, num_splits) for seq_lens. The FP8 decode gives its kernel a
    request of length 0 as length 1 (fp8.guard_empty_requests: the kernel faults on 0), so its
    schedule is planned over lengths of at least 1."""
    if fp8:
        seq_lens = jnp.maximum(seq_lens, 1)
    return METADATA(seq_lens=seq_lens, num_heads_q=num_heads_q, num_q_tokens=num_q_tokens,
                    num_sm_parts=num_sm_parts, fp8=fp8)
