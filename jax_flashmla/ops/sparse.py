"""sparse_mla_decode and sparse_mla_prefill: DeepSeek-V3.2's sparse attention over MLA rows.

jax_flashmla/reference/sparse.py states the semantics. On a Hopper GPU both run FlashMLA's
kernels as custom calls (jax_flashmla_mla_sparse_decode, jax_flashmla_mla_sparse_prefill):
indices past the keys or past topk_length are made -1 first (the kernels read any other; the
decode takes MaskedIndices, made once for several decodes, as they are, and a row of a stack of
them in place: the custom call takes the stack and the row's number), the indices are padded
with -1 to the kernel's topk block, and q's heads are padded with zeros to the kernels' 64 or
128 (the padding heads' results are dropped; they cost what real heads cost). The decode's
split-KV schedule depends on the shapes alone (every request has topk keys to the scheduler):
FlashMLA's scheduler makes it once per shape at trace time, and each program holds it as a
constant, so no caller hands a kernel a schedule and no step computes one.
A cache of no pages (kv of no keys) takes no kernel: every query gets the empty answer.
Elsewhere, or where the kernel library lacks the op, the pure-JAX reference runs.

Each op is a logical op (kernels/logical.py): no gradient, vmap folded into its batch (the
decode) or query tokens (the prefill), and under jit on several devices q may be split along
batch (the decode: the indices follow, the cache and the sink stay whole, and each device's
schedule is made for its local batch) or along query tokens and heads (the prefill: the
indices and the sink follow, kv stays whole)."""
import math

import jax
import jax.numpy as jnp

from jax_flashmla.base import trusted, validation
from jax_flashmla.base.validation import HEAD_DIM, HEAD_DIM_V, PAGE_SIZE, fail
from jax_flashmla.caches.sparse import sparse_cache_array
from jax_flashmla.caches.v4 import ROW_DIM, V4KVCache, v4_cache_array
from jax_flashmla.kernels import custom_calls, logical, sparse_forms
from jax_flashmla.kernels.sparse_forms import KERNEL_PREFILL_TOPK_BLOCK, kernel_schedule
from jax_flashmla.kernels import library as kernels
from jax_flashmla.ops import sparse_v4
from jax_flashmla.ops.decode import default_num_sms
from jax_flashmla.reference import sparse as reference

# Each operand's and result's dims as Shardy factors. The decode's: b batch, s query tokens, h
# heads, d q's 576 columns, n pages, p page size, k KV heads (1), z a token's 656 bytes, l the
# layers of a stack of indices, i topk, v V's 512 columns, e the schedule's fields. The
# prefill's: t query tokens, h, d, v, i as the decode's, and k kv's keys.
DECODE_FACTORS = {"q": "b s h d", "kv_cache": "n p k z", "indices": "l b s i", "attn_sink": "h",
                  "schedule": "e", "out": "b s h v", "lse": "b h s"}
PREFILL_FACTORS = {"q": "t h d", "kv": "k d", "indices": "t i", "attn_sink": "h",
                   "topk_length": "t", "out": "t h v", "lse": "h t"}
NO_GRADIENT = "FlashMLA's sparse kernels are forward-only"
# q's widths: DeepSeek-V3.2's rows, and V4's (its key, also its value).
WIDTHS = {HEAD_DIM: "V3.2: 512 latent + 64 rope", 512: "V4: 448 + 64 rope"}


def _check_common(where, q, indices, rows, topk_length, attn_sink, softmax_scale,
                  widths=(HEAD_DIM,)):
    """q's width (one of `widths`) and heads and the index rows' count `rows`; returns the
    softmax scale (q's width ** -0.5 by default)."""
    if q.shape[-1] not in widths or q.dtype not in (jnp.bfloat16, jnp.float16, jnp.float32):
        named = " or ".join(f"{w} ({WIDTHS[w]})" for w in widths)
        fail(ValueError, where, f"q must be bfloat16, float16 or float32 with a last dimension "
                                f"of {named}; got {q.dtype} {tuple(q.shape)}")
    validation.check_int32(where, "indices", indices)
    if tuple(indices.shape[:-1]) != rows or indices.shape[-1] < 1:
        fail(ValueError, where, f"indices must have shape {rows + ('topk >= 1',)} for q of shape "
                                f"{tuple(q.shape)}; got {tuple(indices.shape)}")
    if topk_length is not None:
        validation.check_int32(where, "topk_length", topk_length)
        if tuple(topk_length.shape) != rows[:1]:
            fail(ValueError, where, f"topk_length must have shape {rows[:1]}; got "
                                    f"{tuple(topk_length.shape)}")
    h_q = q.shape[-2]
    if attn_sink is not None and (tuple(attn_sink.shape) != (h_q,)
                                  or attn_sink.dtype != jnp.float32):
        fail(ValueError, where, f"attn_sink must be float32 of shape ({h_q},), one logit per "
                                f"head; got {attn_sink.dtype} {tuple(attn_sink.shape)}")
    if softmax_scale is None:
        return q.shape[-1] ** -0.5
    validation.check_softmax_scale(where, softmax_scale)
    return float(softmax_scale)


def _implementation(where, implementation, kernel):
    """The implementation to run; None picks the custom call where the kernel library has the
    op `kernel` (a KernelOps field)."""
    return validation.resolve_implementation(
        where, implementation, runs_here=lambda: kernels.flashmla_available()
        and getattr(kernels.load_kernels(), kernel) is not None,
        refusal=lambda: validation.gpu_refusal("FlashMLA's kernel"))


def _no_keys(rows, out_dtype, lse_shape):
    """The answer of queries `rows` (their shape but the head dim) over no keys at all: out 0
    and lse +inf, as for a query with no valid index, without a kernel (which would read)."""
    return (jnp.zeros(rows + (HEAD_DIM_V,), out_dtype),
            jnp.full(lse_shape, jnp.inf, jnp.float32))


def _decode_types(avals, **_):
    batch, s_q, h_q, _ = avals["q"].shape
    return (jax.core.ShapedArray((batch, s_q, h_q, HEAD_DIM_V), jnp.bfloat16),
            jax.core.ShapedArray((batch, h_q, s_q), jnp.float32))


def _reference_decode(named, *, softmax_scale, layer, num_sms):
    return reference.sparse_decode_reference(named["q"], named["kv_cache"],
                                             named["indices"][layer],
                                             softmax_scale=softmax_scale,
                                             attn_sink=named.get("attn_sink"))


def _decode_schedule(avals, *, softmax_scale, layer, num_sms):
    """The schedule of the kernel's decode of these shapes (kernel_schedule): a constant of the
    op's custom-call path (kernels/logical.py), made for each device's local batch."""
    batch, s_q, h_q, _ = avals["q"].shape
    topk = sparse_forms.kernel_topk(avals["indices"].shape[-1])
    return kernel_schedule(batch, sparse_forms.kernel_head_count(h_q), s_q, topk, num_sms)


def _kernel_decode(named, *, softmax_scale, layer, num_sms):
    """The custom call on one device's q (sparse_forms.check_kernel_decode), row `layer` of its
    indices, a stack (layers, batch, s_q, topk), masked, and its schedule (_decode_schedule)."""
    q, data, stack = named["q"], named["kv_cache"], named["indices"]
    h_q = q.shape[2]
    q, sink, with_sink = sparse_forms.kernel_heads(q, named.get("attn_sink"))
    topk = sparse_forms.kernel_topk(stack.shape[-1])
    if topk != stack.shape[-1]:  # a copy of the stack: only where topk is not the kernel's
        stack = jnp.pad(stack, ((0, 0),) * 3 + ((0, topk - stack.shape[-1]),),
                        constant_values=-1)
    out, lse, *_ = custom_calls.SPARSE_DECODE(
        q=q, kv_cache=data, indices=stack, attn_sink=sink,
        schedule=named["schedule"], softmax_scale=softmax_scale, with_sink=with_sink,
        layer=layer)
    return out[:, :, :h_q], lse[:, :h_q]


SPARSE_DECODE = logical.LogicalOp(
    "sparse_mla_decode", factors=DECODE_FACTORS, results=("out", "lse"), split=("b",),
    abstract_eval=_decode_types, reference=_reference_decode, kernels=_kernel_decode,
    no_gradient=NO_GRADIENT, fold_vmap="b", constants={"schedule": _decode_schedule})


@trusted.library_made(["slots"], ["num_keys"], "mask_indices(indices, kv_cache)")
class MaskedIndices:
    """Sparse indices with every invalid entry already -1, as FlashMLA's kernel reads them:
    sparse_mla_decode takes them as they are, with no mask of its own.

    Made by mask_indices alone (jax_flashmla/base/trusted.py), once for indices several decodes
    share (a step's layers, say). A stack of them slices like its array (masked[layer], or as
    lax.scan's xs). A layer's row of a stack (layers, batch, s_q, topk), masked[layer] with a
    Python int, reaches the GPU's kernel in place: the custom call takes the stack and the row's
    number, where a slice's address would be computed on the host at every execution.

    Attributes:
      slots: (..., topk) int32, each in [-1, num_keys).
      num_keys: the keys they were masked for (static): a cache of at least as many takes them.
    """

    __slots__ = ("slots", "num_keys", "_stack_row")

    def __getitem__(self, key):
        row = self._replace(slots=self.slots[key])
        if isinstance(key, int) and not isinstance(key, bool) and self.slots.ndim == 4:
            # Kept beside the slice (which XLA drops, unused): not a field, so that a row that
            # crosses jit or scan is its slice alone.
            object.__setattr__(row, "_stack_row", (self.slots, key % self.slots.shape[0]))
        return row

    def _in_place(self):
        """(the stack (layers, batch, s_q, topk) the kernel reads, the row it reads)."""
        return getattr(self, "_stack_row", None) or (self.slots[None], 0)


def mask_indices(indices, kv_cache, *, topk_length=None):
    """indices (..., topk) int32 -> MaskedIndices: each entry outside the cache's slots
    [0, num_pages * 64), or from its row's topk_length on, made -1.

    kv_cache is the SparseKVCache (or its array) the indices are for; topk_length is
    (indices.shape[0],) int32 or None, broadcast over the other leading dimensions.
    """
    where = "mask_indices"
    data = sparse_cache_array(kv_cache, where)
    validation.check_int32(where, "indices", indices)
    if indices.ndim < 1 or indices.shape[-1] < 1:
        fail(ValueError, where, f"indices must have shape (..., topk >= 1); got "
                                f"{tuple(indices.shape)}")
    if topk_length is not None:
        validation.check_int32(where, "topk_length", topk_length)
        if indices.ndim < 2 or tuple(topk_length.shape) != tuple(indices.shape[:1]):
            fail(ValueError, where, f"topk_length must have shape {tuple(indices.shape[:1])}, "
                                    f"indices' first dimension; got {tuple(topk_length.shape)}")
    num_keys = data.shape[0] * PAGE_SIZE
    return MaskedIndices._make(_masked(indices, num_keys, topk_length), num_keys)


def _masked(indices, num_keys, topk_length):
    """indices with each invalid entry (reference.valid_indices) made -1."""
    return jnp.where(reference.valid_indices(indices, num_keys, topk_length), indices, -1)


def _check_masked(where, indices, data, topk_length):
    if topk_length is not None:
        fail(ValueError, where, "topk_length goes to mask_indices with MaskedIndices, which "
                                "already hold it; got a topk_length here too")
    if indices.num_keys > data.shape[0] * PAGE_SIZE:
        fail(ValueError, where, f"indices were masked for {indices.num_keys} keys, but the cache "
                                f"holds {data.shape[0] * PAGE_SIZE}")


def sparse_mla_decode(q, kv_cache, indices, *, softmax_scale=None, topk_length=None,
                      attn_sink=None, extra_kv_cache=None, extra_indices=None,
                      extra_topk_length=None, implementation=None):
    """Sparse MLA decode over DeepSeek-V3.2's or V4's FP8 cache (FlashMLA's sparse_decode_fwd).

    The cache's kind picks the model. V3.2: q (batch, s_q, h_q, 576) over a SparseKVCache.
    V4 (jax_flashmla/ops/sparse_v4.py): q (batch, s_q, h_q, 512) over a V4KVCache, its
    compressed entries, and optionally an extra cache (its sliding window): one softmax over
    the keys both sets of indices name.

    Args:
      q: (batch, s_q, h_q, 576) (V3.2: 512 latent + 64 rope columns) or (batch, s_q, h_q, 512)
        (V4: 448 + 64 rope columns), bfloat16 (float16, float32).
      kv_cache: SparseKVCache or its (num_pages, 64, 1, 656) uint8 array; or V4KVCache or its
        (num_pages, 65, 576) uint8 array.
      indices: (batch, s_q, topk) int32 slots (page * 64 + offset) each query attends to;
        outside [0, num_pages * 64) (e.g. -1) an index is invalid and never read. Or
        MaskedIndices of that shape (mask_indices), taken as they are (a layer's row of a
        stack of them, masked[layer], read in place).
        V4: int32 arrays only.
      softmax_scale: a Python float; defaults to q's width ** -0.5.
      topk_length: (batch,) int32 or None: a request's entries from topk_length on are
        invalid.
      attn_sink: (h_q,) float32 or None: a logit per head added to each softmax's denominator.
      extra_kv_cache, extra_indices, extra_topk_length: V4 only: a second V4KVCache, the
        (batch, s_q, extra_topk) int32 slots each query reads there, their (batch,) lengths
        (or None), as kv_cache, indices and topk_length are.
      implementation: None picks "custom_call" on a Hopper GPU whose FlashMLA kernels and CUDA
        bridge are available, else "reference". "custom_call" is FlashMLA's sparse_decode_fwd
        (CUDA only; bfloat16 q, at most 128 heads, s_q 1 or 2); "reference" is pure JAX.

    Returns:
      out (batch, s_q, h_q, 512) bfloat16; lse (batch, h_q, s_q) float32, natural log over the
      valid keys; a query with no valid index gets out 0 and lse +inf.
    """
    where = "sparse_mla_decode"
    validation.check_rank(where, "q", q, 4, "(batch, s_q, h_q, 576 or 512)")
    if isinstance(kv_cache, V4KVCache) or getattr(kv_cache, "ndim", None) == 3:
        if isinstance(indices, MaskedIndices):
            fail(TypeError, where, "a V4KVCache takes int32 indices, not MaskedIndices")
        if not jnp.issubdtype(q.dtype, jnp.floating):
            fail(TypeError, where, f"q must be floating; got {q.dtype}")
        return sparse_v4.v4_sparse_decode(
            where, q, v4_cache_array(kv_cache, where), indices, softmax_scale=softmax_scale,
            topk_length=topk_length, attn_sink=attn_sink, extra_kv_cache=extra_kv_cache,
            extra_indices=extra_indices, extra_topk_length=extra_topk_length,
            implementation=_implementation(where, implementation, "sparse_decode"),
            num_sms=default_num_sms())
    if extra_kv_cache is not None or extra_indices is not None or extra_topk_length is not None:
        fail(TypeError, where, "extra_kv_cache, extra_indices and extra_topk_length are V4's: "
                               "kv_cache must be a V4KVCache with them")
    data = sparse_cache_array(kv_cache, where)
    masked = indices if isinstance(indices, MaskedIndices) else None
    if masked is not None:
        _check_masked(where, masked, data, topk_length)
        indices = masked.slots
    scale = _check_common(where, q, indices, tuple(q.shape[:2]), topk_length, attn_sink,
                          softmax_scale)
    implementation = _implementation(where, implementation, "sparse_decode")
    if data.shape[0] == 0:
        return _no_keys(q.shape[:-1], jnp.bfloat16, (q.shape[0], q.shape[2], q.shape[1]))
    if implementation == "custom_call":
        sparse_forms.check_kernel_decode(where, q)
    if masked is None:
        # The kernel skips -1 alone: it would read an index past the cache, and it takes no
        # topk_length with this cache format.
        stack, layer = _masked(indices, data.shape[0] * PAGE_SIZE, topk_length)[None], 0
    else:
        stack, layer = masked._in_place()
    operands = dict(q=q, kv_cache=data, indices=stack)
    if attn_sink is not None:
        operands["attn_sink"] = attn_sink
    return SPARSE_DECODE(operands, implementation=implementation, softmax_scale=scale,
                         layer=layer, num_sms=default_num_sms())


def _prefill_types(avals, **_):
    tokens, h_q, _ = avals["q"].shape
    return (jax.core.ShapedArray((tokens, h_q, HEAD_DIM_V), avals["q"].dtype),
            jax.core.ShapedArray((h_q, tokens), jnp.float32))


def _reference_prefill(named, *, softmax_scale):
    return reference.sparse_prefill_reference(named["q"], named["kv"], named["indices"],
                                              softmax_scale=softmax_scale,
                                              attn_sink=named.get("attn_sink"))


def _kernel_prefill(named, *, softmax_scale):
    """The custom call on one device's q (tokens, h_q, 576 or 512) (sparse_forms.check_kernel_heads
    once cast to bfloat16), kv and masked indices (tokens, topk)."""
    q, kv, indices = named["q"], named["kv"], named["indices"]
    dtype, h_q = q.dtype, q.shape[1]
    q, sink, with_sink = sparse_forms.kernel_heads(q.astype(jnp.bfloat16),
                                                   named.get("attn_sink"))
    topk = indices.shape[-1]
    padded = sparse_forms.kernel_topk(topk, KERNEL_PREFILL_TOPK_BLOCK)
    indices = jnp.pad(indices, ((0, 0), (0, padded - topk)), constant_values=-1)
    with_topk_length = "topk_length" in named
    topk_length = named["topk_length"] if with_topk_length else jnp.zeros((0,), jnp.int32)
    out, lse_base2, _ = custom_calls.SPARSE_PREFILL(
        q=q, kv=kv.astype(jnp.bfloat16)[:, None, :], indices=indices[:, None, :],
        attn_sink=sink, topk_length=topk_length, softmax_scale=softmax_scale,
        with_sink=with_sink, with_topk_length=with_topk_length)
    return out[:, :h_q].astype(dtype), (lse_base2[:, :h_q] * math.log(2)).T


SPARSE_PREFILL = logical.LogicalOp(
    "sparse_mla_prefill", factors=PREFILL_FACTORS, results=("out", "lse"), split=("t", "h"),
    abstract_eval=_prefill_types, reference=_reference_prefill, kernels=_kernel_prefill,
    no_gradient=NO_GRADIENT, fold_vmap="t")


def sparse_mla_prefill(q, kv, indices, *, softmax_scale=None, topk_length=None,
                       attn_sink=None, implementation=None):
    """Sparse MLA prefill over MLA rows (FlashMLA's sparse_prefill_fwd), DeepSeek-V3.2's or V4's.

    Args:
      q: (tokens, h_q, 576) (V3.2) or (tokens, h_q, 512) (V4), bfloat16 (float16, float32).
      kv: (keys, q's width) rows of q's dtype family: V3.2's 512-d latent (also V) then the
        64-d rope key; V4's 512-d row, key and value both.
      indices: (tokens, topk) int32 rows of kv each query attends to; outside [0, keys) an
        index is invalid and never read.
      softmax_scale, attn_sink: as in sparse_mla_decode (the scale defaults to q's width **
        -0.5); topk_length: (tokens,) int32 or None: a row's indices from its length on are
        invalid (V4's kernel is also handed the lengths, clamped to [0, topk], and leaves
        their blocks unread).
      implementation: as in sparse_mla_decode; "custom_call" is FlashMLA's sparse_prefill_fwd
        (CUDA only; at most 128 heads; it computes in bfloat16, q and kv cast to it and out
        back to q's dtype); "reference" is pure JAX, which gathers (tokens, topk, width)
        float32 rows at once.

    Returns:
      out (tokens, h_q, 512) in q's dtype; lse (h_q, tokens) float32, natural log.
    """
    where = "sparse_mla_prefill"
    validation.check_rank(where, "q", q, 3, "(tokens, h_q, 576 or 512)")
    validation.check_rank(where, "kv", kv, 2, "(keys, q's width)")
    scale = _check_common(where, q, indices, tuple(q.shape[:1]), topk_length, attn_sink,
                          softmax_scale, widths=tuple(WIDTHS))
    if kv.shape[-1] != q.shape[-1] or not jnp.issubdtype(kv.dtype, jnp.floating):
        fail(ValueError, where, f"kv must be floating with q's last dimension, {q.shape[-1]}; "
                                f"got {kv.dtype} {tuple(kv.shape)}")
    implementation = _implementation(where, implementation, "sparse_prefill")
    if kv.shape[0] == 0:
        return _no_keys(q.shape[:-1], q.dtype, (q.shape[1], q.shape[0]))
    if implementation == "custom_call":
        sparse_forms.check_kernel_heads(where, q.astype(jnp.bfloat16))
    # As in the decode: the kernel skips -1 alone.
    operands = dict(q=q, kv=kv, indices=_masked(indices, kv.shape[0], topk_length))
    if attn_sink is not None:
        operands["attn_sink"] = attn_sink
    if topk_length is not None and q.shape[-1] == ROW_DIM:
        # V4's kernel also skips a row's indices from its length on, whole blocks unread.
        operands["topk_length"] = jnp.clip(topk_length, 0, indices.shape[-1])
    return SPARSE_PREFILL(operands, implementation=implementation, softmax_scale=scale)
