"""mla_decode's logical op (kernels/logical.py), over the physical custom calls of
custom_calls.py.

One primitive, jax_flashmla_mla_decode_logical, whose operands are q, kv_cache, block_table,
seq_lens, then, where given, the metadata's tile_scheduler_metadata and num_splits, and the
FP8 descale_q and descale_k. Its rules, as the builder makes them:

  - abstract evaluation: out (batch, s_q, h_q, 512) and lse (batch, h_q, s_q);
  - JVP: raises, FlashMLA having no backward pass;
  - batching: one decode per element of the vmapped axis;
  - lowering: the pure-JAX reference inline, or the custom calls wrapped in
    `custom_partitioning`. q may be split along batch (data-parallel attention) and heads
    (tensor parallel); the block table and lengths follow q's batch split; the cache, the
    metadata and the scales stay whole. Each device runs the kernel on its local batch and
    heads, with metadata computed for them when none is given; a given metadata describes the
    whole batch and all heads, so a split q is refused with it.
"""
import jax
import jax.numpy as jnp

from jax_flashmla.base import validation
from jax_flashmla.caches.fp8 import guard_empty_requests
from jax_flashmla.kernels import custom_calls, logical
from jax_flashmla.reference.dense import mla_decode_reference


def _abstract_eval(avals, *, softmax_scale, causal, num_sms):
    batch, s_q, h_q, _ = avals["q"].shape
    out_dtype = jnp.bfloat16 if "descale_q" in avals else avals["q"].dtype
    return (jax.core.ShapedArray((batch, s_q, h_q, validation.HEAD_DIM_V), out_dtype),
            jax.core.ShapedArray((batch, h_q, s_q), jnp.float32))


def _reference(named, *, softmax_scale, causal, num_sms):
    return mla_decode_reference(named["q"], named["kv_cache"], named["block_table"],
                                named["seq_lens"], softmax_scale=softmax_scale, causal=causal,
                                head_dim_v=validation.HEAD_DIM_V,
                                q_scale=named.get("descale_q"), k_scale=named.get("descale_k"))


def _kernels(named, *, softmax_scale, causal, num_sms):
    """The custom calls on one device's operands: the metadata's when none is given, then the
    decode."""
    fp8 = "descale_q" in named
    if "tile_scheduler_metadata" not in named:
        _, s_q, h_q, _ = named["q"].shape
        named["tile_scheduler_metadata"], named["num_splits"] = custom_calls.schedule(
            named["seq_lens"], num_heads_q=h_q, num_q_tokens=s_q,
            num_sm_parts=validation.num_sm_parts(num_sms, h_q, s_q), fp8=fp8)
    if fp8:
        named["kernel_block_table"], named["kernel_seq_lens"], _ = guard_empty_requests(
            named["block_table"], named["seq_lens"])
    call = custom_calls.DECODE_FP8 if fp8 else custom_calls.DECODE
    out, lse, _, _ = call(**{name: named[name] for name in call.operands},
                          softmax_scale=softmax_scale, causal=causal)
    return out, lse


def _check_split(operands, axes, **_):
    if "tile_scheduler_metadata" in operands and (axes["b"] or axes["h"]):
        validation.fail(
            ValueError, "mla_decode",
            f"metadata computed for the whole batch and all heads cannot be used with q split "
            f"along batch ({axes['b']}) or heads ({axes['h']}); pass metadata=None (computed "
            "per device), or call the raw ops inside shard_map")


MLA_DECODE = logical.LogicalOp(
    "mla_decode", factors=custom_calls.FACTORS, results=("out", "lse"),
    split=("b", "h"), abstract_eval=_abstract_eval, reference=_reference, kernels=_kernels,
    no_gradient="it is decode-only; differentiate a prefill attention instead",
    check_split=_check_split)


def mla_decode(operands, *, softmax_scale, causal, num_sms, implementation):
    """(out, lse) of the op on `operands`, a dict of arrays by name (module doc)."""
    return MLA_DECODE(operands, softmax_scale=softmax_scale, causal=causal, num_sms=num_sms,
                      implementation=implementation)
