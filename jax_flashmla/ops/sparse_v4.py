"""DeepSeek-V4's sparse decode: sparse_mla_decode over a V4KVCache (FlashMLA's MODEL1 kernel).

jax_flashmla/reference/v4.py states the semantics: one softmax over the keys a query's indices
name in the main cache (a layer's compressed entries) and in the extra cache (its sliding
window), a sink per head in the denominator. On a Hopper GPU it runs FlashMLA's
sparse_decode_fwd in its MODEL1 form as the custom call jax_flashmla_mla_sparse_decode_v4:
indices outside their cache are made -1 and the lengths clamped to [0, topk] first (the kernel
reads any index below a length), the indices padded with -1 to the kernel's topk block and q's
heads with zeros to 64 or 128. Its split-KV schedule depends on the lengths' values: FlashMLA's
scheduler (the metadata custom call) makes it on the device from each request's combined
length, as the kernel's own would, once per distinct set of lengths in a program (XLA merges
the calls of layers that share their lengths). A main cache of no pages is one page of no
valid key to the kernel; with no keys anywhere the answer is out 0, lse +inf without a kernel.

A logical op (kernels/logical.py): no gradient, vmap folded into the batch, and under jit on
several devices q may be split along batch (indices and lengths follow, caches and sink stay
whole, each device's schedule made for its local batch)."""
import jax
import jax.numpy as jnp

from jax_flashmla.base import validation
from jax_flashmla.base.validation import PAGE_SIZE, fail
from jax_flashmla.caches import v4
from jax_flashmla.kernels import custom_calls, logical, sparse_forms
from jax_flashmla.reference.sparse import valid_indices
from jax_flashmla.reference.v4 import v4_decode_reference

# Shardy factors: b batch, s query tokens, h heads, d q's 512 columns, v out's, n and m the two
# caches' pages, r a page's 65 rows, c a row's 576 bytes, i and j the two topks.
FACTORS = {"q": "b s h d", "kv_cache": "n r c", "indices": "b s i", "topk_length": "b",
           "extra_kv_cache": "m r c", "extra_indices": "b s j", "extra_topk_length": "b",
           "attn_sink": "h", "out": "b s h v", "lse": "b h s"}
NO_GRADIENT = "FlashMLA's sparse kernels are forward-only"


def masked_indices(indices, topk_length, num_pages):
    """indices (batch, s_q, topk) with every entry outside [0, num_pages * 64) made -1, and
    topk_length (batch,) (None: topk) clamped to [0, topk]."""
    topk = indices.shape[-1]
    lengths = (jnp.full(indices.shape[:1], topk, jnp.int32) if topk_length is None
               else jnp.clip(topk_length, 0, topk))
    return jnp.where(valid_indices(indices, num_pages * PAGE_SIZE, None), indices, -1), lengths


def _types(avals, **_):
    batch, s_q, h_q, _ = avals["q"].shape
    return (jax.core.ShapedArray((batch, s_q, h_q, v4.ROW_DIM), jnp.bfloat16),
            jax.core.ShapedArray((batch, h_q, s_q), jnp.float32))


def _reference(named, *, softmax_scale, num_sms):
    extra = {}
    if "extra_kv_cache" in named:
        extra = dict(extra_kv_cache=named["extra_kv_cache"],
                     extra_indices=named["extra_indices"],
                     extra_topk_length=named["extra_topk_length"])
    return v4_decode_reference(named["q"], named["kv_cache"], named["indices"],
                               softmax_scale=softmax_scale, topk_length=named["topk_length"],
                               attn_sink=named.get("attn_sink"), **extra)


def _kernel_indices(indices):
    """indices padded with -1 to the kernel's topk block (a copy only where they are not)."""
    topk = sparse_forms.kernel_topk(indices.shape[-1])
    return jnp.pad(indices, ((0, 0), (0, 0), (0, topk - indices.shape[-1])),
                   constant_values=-1)


def scheduled_lengths(topk_length, extra_topk_length):
    """Each request's length as FlashMLA's sparse scheduler counts it: its main length, at
    least 1, and with an extra cache rounded up to a page and the extra length added."""
    lengths = jnp.maximum(topk_length, 1)
    if extra_topk_length is None:
        return lengths
    return -(-lengths // PAGE_SIZE) * PAGE_SIZE + extra_topk_length


def _kernels(named, *, softmax_scale, num_sms):
    """The schedule's and the decode's custom calls on one device's operands."""
    q = named["q"]
    batch, s_q, h_q, _ = q.shape
    q, sink, with_sink = sparse_forms.kernel_heads(q, named.get("attn_sink"))
    with_extra = "extra_kv_cache" in named
    if with_extra:
        extra = (named["extra_kv_cache"], _kernel_indices(named["extra_indices"]),
                 named["extra_topk_length"])
    else:  # the kernel reads none of them
        extra = (jnp.zeros((0, v4.PAGE_ROWS, v4.ROW_BYTES), jnp.uint8),
                 jnp.zeros((batch, s_q, 0), jnp.int32), jnp.zeros((batch,), jnp.int32))
    heads = q.shape[2]
    lengths = scheduled_lengths(named["topk_length"], extra[2] if with_extra else None)
    tile_md, num_splits = custom_calls.schedule(
        lengths, num_heads_q=heads, num_q_tokens=s_q,
        num_sm_parts=validation.num_sm_parts(num_sms, heads, s_q), fp8=False)
    out, lse, *_ = custom_calls.SPARSE_DECODE_V4(
        q=q, kv_cache=named["kv_cache"], indices=_kernel_indices(named["indices"]),
        topk_length=named["topk_length"], extra_kv_cache=extra[0], extra_indices=extra[1],
        extra_topk_length=extra[2], attn_sink=sink,
        schedule=jnp.concatenate([tile_md.reshape(-1), num_splits]),
        softmax_scale=softmax_scale, with_extra=with_extra, with_sink=with_sink)
    return out[:, :, :h_q], lse[:, :h_q]


SPARSE_DECODE_V4 = logical.LogicalOp(
    "sparse_mla_decode", factors=FACTORS, results=("out", "lse"), split=("b",),
    abstract_eval=_types, reference=_reference, kernels=_kernels, no_gradient=NO_GRADIENT,
    fold_vmap="b")


def _check(where, q, indices, topk_length, name):
    """indices (batch, s_q, topk >= 1) int32 for q, and topk_length (batch,) int32 or None."""
    validation.check_int32(where, name, indices)
    rows = tuple(q.shape[:2])
    if indices.ndim != 3 or tuple(indices.shape[:2]) != rows or indices.shape[-1] < 1:
        fail(ValueError, where, f"{name} must have shape {rows + ('topk >= 1',)} for q of shape "
                                f"{tuple(q.shape)}; got {tuple(indices.shape)}")
    length_name = name.replace("indices", "topk_length")
    if topk_length is not None:
        validation.check_int32(where, length_name, topk_length)
        if tuple(topk_length.shape) != rows[:1]:
            fail(ValueError, where, f"{length_name} must have shape {rows[:1]}; got "
                                    f"{tuple(topk_length.shape)}")


def v4_sparse_decode(where, q, data, indices, *, softmax_scale, topk_length, attn_sink,
                     extra_kv_cache, extra_indices, extra_topk_length, implementation, num_sms):
    """sparse_mla_decode's V4 form (its docstring), on the main cache's checked array `data`
    and a resolved implementation."""
    if q.shape[-1] != v4.ROW_DIM:
        fail(ValueError, where, f"q must have a last dimension of {v4.ROW_DIM} over a V4KVCache "
                                f"(448 no-RoPE + 64 RoPE columns); got {tuple(q.shape)}")
    _check(where, q, indices, topk_length, "indices")
    if (extra_kv_cache is None) != (extra_indices is None) or (
            extra_kv_cache is None and extra_topk_length is not None):
        fail(TypeError, where, "extra_kv_cache and extra_indices go together, and "
                               "extra_topk_length with them")
    h_q = q.shape[2]
    if attn_sink is not None and (tuple(attn_sink.shape) != (h_q,)
                                  or attn_sink.dtype != jnp.float32):
        fail(ValueError, where, f"attn_sink must be float32 of shape ({h_q},), one logit per "
                                f"head; got {attn_sink.dtype} {tuple(attn_sink.shape)}")
    scale = v4.ROW_DIM ** -0.5 if softmax_scale is None else softmax_scale
    validation.check_softmax_scale(where, scale)
    indices, lengths = masked_indices(indices, topk_length, data.shape[0])
    operands = dict(q=q, kv_cache=data, indices=indices, topk_length=lengths)
    if extra_kv_cache is not None:
        extra = v4.v4_cache_array(extra_kv_cache, where, "extra_kv_cache")
        _check(where, q, extra_indices, extra_topk_length, "extra_indices")
        if extra.shape[0]:
            operands["extra_kv_cache"] = extra
            (operands["extra_indices"],
             operands["extra_topk_length"]) = masked_indices(extra_indices, extra_topk_length,
                                                             extra.shape[0])
    if data.shape[0] == 0:
        if "extra_kv_cache" not in operands:
            batch, s_q = q.shape[:2]
            return (jnp.zeros((batch, s_q, h_q, v4.ROW_DIM), jnp.bfloat16),
                    jnp.full((batch, h_q, s_q), jnp.inf, jnp.float32))
        # The kernel needs a page to read from: one of no valid key.
        operands["kv_cache"] = jnp.zeros((1, v4.PAGE_ROWS, v4.ROW_BYTES), jnp.uint8)
        operands["indices"] = jnp.full_like(indices, -1)
    if implementation == "custom_call":
        sparse_forms.check_kernel_decode(where, q)
    if attn_sink is not None:
        operands["attn_sink"] = attn_sink
    return SPARSE_DECODE_V4(operands, implementation=implementation,
                            softmax_scale=float(scale), num_sms=num_sms)
