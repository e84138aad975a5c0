"""The physical ops: JAX primitives whose lowering is the jax_flashmla custom call.

On CUDA the custom call runs FlashMLA's kernels (jax_flashmla/kernels.py finds and loads them,
and registers the CUDA targets, when a CUDA lowering first happens); on CPU it runs the C++
model of FlashMLA in ffi/reference_mla.cc. vmap maps sequentially over the batched axis.

Each custom call's operands are named once here (DECODE_OPERANDS, ...) and in
ffi/operands.h for the C++ handlers. The decode's results are out, lse and FlashMLA's split-KV
accumulators (out_accum, lse_accum), scratch that XLA allocates so that the kernel allocates
nothing itself; bind_decode drops them. For FlashMLA's FP8 decode (q and the cache in
float8_e4m3fn, out bfloat16) the decode primitive lowers to its own target (the FP8 op takes
the scales as tensors): the kernel's block table and lengths are the FP8 guard primitive's,
which hands the kernel requests of length 0 as length 1 (ffi/fp8_guard.h); the descales are
(1,) float32.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import batching, mlir
from jax.interpreters import partial_eval as pe

from jax_flashmla import _cpu, kernels, validation
from jax_flashmla.validation import METADATA_FIELDS

DECODE_TARGET = "jax_flashmla_mla_decode"
DECODE_FP8_TARGET = "jax_flashmla_mla_decode_fp8"
FP8_GUARD_TARGET = "jax_flashmla_fp8_guard"
METADATA_TARGET = "jax_flashmla_mla_metadata"
HOST_QUEUE_PUSH_TARGET = "jax_flashmla_host_queue_push"  # serving/host_queue.py

for _name, _capsule in _cpu.registrations().items():
    jax.ffi.register_ffi_target(_name, _capsule, platform="cpu")

mla_decode_p = Primitive("jax_flashmla_mla_decode")
mla_decode_p.multiple_results = True
mla_metadata_p = Primitive("jax_flashmla_mla_metadata")
mla_metadata_p.multiple_results = True
fp8_guard_p = Primitive("jax_flashmla_fp8_guard")
fp8_guard_p.multiple_results = True
host_queue_push_p = Primitive("jax_flashmla_host_queue_push")
host_queue_push_p.multiple_results = True


def _impl(primitive, *args, **params):
    return jax.jit(functools.partial(primitive.bind, **params))(*args)


mla_decode_p.def_impl(functools.partial(_impl, mla_decode_p))
mla_metadata_p.def_impl(functools.partial(_impl, mla_metadata_p))
fp8_guard_p.def_impl(functools.partial(_impl, fp8_guard_p))
host_queue_push_p.def_impl(functools.partial(_impl, host_queue_push_p))


# Scheduler-row fields FlashMLA writes (the rest are zeroed by the CUDA handler): the bf16
# scheduler 7 (requests, blocks, split, first/last split flags); the FP8 decode's scheduler,
# FlashMLA's original one, 5 (begin request and token, end request and token, begin split).
WRITTEN_METADATA_FIELDS = 7
WRITTEN_METADATA_FIELDS_FP8 = 5


def bind_metadata(seq_lens, *, num_heads_q, num_q_tokens, num_heads_k, num_sm_parts, fp8):
    """The metadata primitive on seq_lens. The FP8 decode's guard gives its kernel a request
    of length 0 as length 1 (ffi/fp8_guard.h: the kernel faults on 0), so its schedule is
    planned over lengths of at least 1."""
    if fp8:
        seq_lens = jnp.maximum(seq_lens, 1)
    return mla_metadata_p.bind(seq_lens, num_heads_q=num_heads_q, num_q_tokens=num_q_tokens,
                               num_heads_k=num_heads_k, num_sm_parts=num_sm_parts, fp8=fp8)


def bind_fp8_guard(block_table, seq_lens):
    """(kernel_block_table, kernel_seq_lens): the FP8 kernel's view of a step's requests,
    length 0 as length 1 over page 0 (ffi/fp8_guard.h). It depends on block_table and seq_lens
    alone: XLA merges the guards of the layers of a step that share them, and
    get_mla_metadata(..., block_table=) computes it once for a step whose layers are a loop."""
    return fp8_guard_p.bind(block_table, seq_lens)


@fp8_guard_p.def_abstract_eval
def _guard_abstract(block_table, seq_lens):
    return (jax.core.ShapedArray(block_table.shape, jnp.int32),
            jax.core.ShapedArray(seq_lens.shape, jnp.int32))


DECODE_OPERANDS = ("q", "kv_cache", "block_table", "seq_lens", "tile_scheduler_metadata",
                   "num_splits")
DECODE_FP8_OPERANDS = ("q", "kv_cache", "kernel_block_table", "kernel_seq_lens", "seq_lens",
                       "tile_scheduler_metadata", "num_splits", "descale_q", "descale_k")


def decode_operands(fp8):
    return DECODE_FP8_OPERANDS if fp8 else DECODE_OPERANDS


def bind_decode(*operands, fp8, softmax_scale, causal, head_dim_v):
    """(out, lse) of the decode primitive on decode_operands(fp8)."""
    out, lse, _, _ = mla_decode_p.bind(*operands, fp8=fp8, softmax_scale=softmax_scale,
                                       causal=causal, head_dim_v=head_dim_v)
    return out, lse


@mla_decode_p.def_abstract_eval
def _decode_abstract(*operands, fp8, softmax_scale, causal, head_dim_v):
    names = decode_operands(fp8)
    if len(operands) != len(names):
        raise TypeError(f"the decode primitive takes {names}; got {len(operands)} operands")
    named = dict(zip(names, operands))
    batch, s_q, h_q, _ = named["q"].shape
    splits = batch + named["tile_scheduler_metadata"].shape[0]
    out_dtype = jnp.bfloat16 if fp8 else named["q"].dtype
    return (jax.core.ShapedArray((batch, s_q, h_q, head_dim_v), out_dtype),
            jax.core.ShapedArray((batch, h_q, s_q), jnp.float32),
            jax.core.ShapedArray((splits, h_q, s_q, head_dim_v), jnp.float32),  # out_accum
            jax.core.ShapedArray((splits, h_q, s_q), jnp.float32))  # lse_accum


@mla_metadata_p.def_abstract_eval
def _metadata_abstract(seq_lens, *, num_heads_q, num_q_tokens, num_heads_k, num_sm_parts, fp8):
    return (jax.core.ShapedArray((num_sm_parts, METADATA_FIELDS), jnp.int32),
            jax.core.ShapedArray((seq_lens.shape[0] + 1,), jnp.int32))


def lse_minor_to_major(s_q):
    """lse (b, h_q, s_q) as FlashMLA lays it out, s_q outside h_q (minor to major: h_q, s_q,
    b), or None for s_q = 1, where that is row-major's bytes."""
    return None if s_q == 1 else (1, 2, 0)


def _result_layouts(ctx):
    """out and the accumulators row-major; lse in FlashMLA's layout, so that FlashMLA writes it
    in place and XLA transposes it only where it is read (nowhere, when a model drops it)."""
    lse_layout = lse_minor_to_major(ctx.avals_out[1].shape[2])
    return None if lse_layout is None else [None, lse_layout, None, None]


def _lower_decode(ctx, args, fp8, **attributes):
    target = DECODE_FP8_TARGET if fp8 else DECODE_TARGET
    return jax.ffi.ffi_lowering(target, result_layouts=_result_layouts(ctx))(ctx, *args,
                                                                             **attributes)


def _decode_cpu(ctx, *args, fp8, softmax_scale, causal, head_dim_v):
    return _lower_decode(ctx, args, fp8, softmax_scale=np.float32(softmax_scale),
                         causal=bool(causal))


def _fp8_op(ops, name):
    op = getattr(ops, name)
    if op is None:
        raise RuntimeError(f"mla_decode: the FlashMLA kernels in {ops.library.path} have no dense "
                           "FP8 decode (fwd_kvcache_mla_fp8, get_mla_decoding_metadata_dense_fp8)")
    return op


def _decode_cuda(ctx, *args, fp8, softmax_scale, causal, head_dim_v):
    ops = kernels.ensure_cuda_targets()
    return _lower_decode(ctx, args, fp8, op=_fp8_op(ops, "decode_fp8") if fp8 else ops.decode,
                         softmax_scale=np.float32(softmax_scale), causal=bool(causal))


def _metadata_cpu(ctx, seq_lens, *, num_heads_q, num_q_tokens, num_heads_k, num_sm_parts, fp8):
    # The C++ model's decode reads its own scheduler's rows, for bf16 and FP8 alike.
    return jax.ffi.ffi_lowering(METADATA_TARGET)(ctx, seq_lens)


def _metadata_cuda(ctx, seq_lens, *, num_heads_q, num_q_tokens, num_heads_k, num_sm_parts, fp8):
    ops = kernels.ensure_cuda_targets()
    # FlashMLA's scheduler plans for the GPU's own SM count, whatever num_sms said at trace time.
    # Its bf16 and FP8 schedulers share the formula (FlashMLA's dense FP8 source); should a
    # release differ, the handler refuses the result's shape at run time.
    expected = validation.num_sm_parts(kernels.gpu_sm_count(), num_heads_q, num_q_tokens,
                                       num_heads_k)
    if num_sm_parts != expected:
        raise ValueError(
            f"get_mla_metadata: traced for {num_sm_parts} SM parts, but FlashMLA on this GPU "
            f"({kernels.gpu_sm_count()} SMs) makes {expected}; leave num_sms unset on GPUs")
    return jax.ffi.ffi_lowering(METADATA_TARGET)(
        ctx, seq_lens, op=_fp8_op(ops, "metadata_fp8") if fp8 else ops.metadata,
        num_q_tokens_per_head_k=np.int64(num_q_tokens * num_heads_q // num_heads_k),
        num_heads_k=np.int64(num_heads_k), num_heads_q=np.int64(num_heads_q),
        written_fields=np.int64(WRITTEN_METADATA_FIELDS_FP8 if fp8 else WRITTEN_METADATA_FIELDS))


def _guard_cuda(ctx, block_table, seq_lens):
    kernels.ensure_cuda_targets()
    return jax.ffi.ffi_lowering(FP8_GUARD_TARGET)(ctx, block_table, seq_lens)


# The host queue's push (serving/host_queue.py): no results, kept by its DCE rule in jaxprs
# and by has_side_effect in XLA. It declares no JAX effect: an executable with effects is run
# through JAX's slower Python dispatch, with a runtime token, at every call.
def bind_host_queue_push(x, *, queue_id):
    return host_queue_push_p.bind(x, queue_id=queue_id)


host_queue_push_p.def_abstract_eval(lambda x, *, queue_id: [])
pe.dce_rules[host_queue_push_p] = lambda used_outputs, eqn: ([True] * len(eqn.invars), eqn)
mlir.register_lowering(host_queue_push_p, lambda ctx, x, *, queue_id: jax.ffi.ffi_lowering(
    HOST_QUEUE_PUSH_TARGET, has_side_effect=True)(ctx, x, queue_id=np.uint64(queue_id)))
mlir.register_lowering(fp8_guard_p, jax.ffi.ffi_lowering(FP8_GUARD_TARGET), platform="cpu")
mlir.register_lowering(fp8_guard_p, _guard_cuda, platform="cuda")
mlir.register_lowering(mla_decode_p, _decode_cpu, platform="cpu")
mlir.register_lowering(mla_decode_p, _decode_cuda, platform="cuda")
mlir.register_lowering(mla_metadata_p, _metadata_cpu, platform="cpu")
mlir.register_lowering(mla_metadata_p, _metadata_cuda, platform="cuda")


def _batch_sequentially(primitive, args, dims, **params):
    """vmap rule of the metadata and the FP8 guard (get_mla_metadata under vmap): one custom
    call per element of the mapped axis, FlashMLA having no batch-of-batches form, with
    unmapped operands passed through, not broadcast. The decode is vmapped before it is bound
    (sharding.py's custom_vmap), so its primitive never is."""
    mapped = [i for i, d in enumerate(dims) if d is not None]
    moved = [jnp.moveaxis(args[i], dims[i], 0) for i in mapped]

    def one(xs):
        full = list(args)
        for i, x in zip(mapped, xs):
            full[i] = x
        return primitive.bind(*full, **params)

    outs = jax.lax.map(one, moved)
    return outs, (0,) * len(outs)


batching.primitive_batchers[mla_metadata_p] = functools.partial(_batch_sequentially, mla_metadata_p)
batching.primitive_batchers[fp8_guard_p] = functools.partial(_batch_sequentially, fp8_guard_p)
