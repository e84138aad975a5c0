"""mla_decode's logical primitive, over the physical custom calls of custom_calls.py.

One primitive, mla_decode_p, whose operands are named by its `operands` parameter: q, kv_cache,
block_table, seq_lens, then, where given, the metadata's tile_scheduler_metadata and
num_splits, and the FP8 descale_q and descale_k. Its rules:

  - abstract evaluation: out (batch, s_q, h_q, 512) and lse (batch, h_q, s_q);
  - JVP: raises, FlashMLA having no backward pass;
  - batching: one decode per element of the vmapped axis;
  - lowering: the pure-JAX reference inline, or the custom calls wrapped in
    `custom_partitioning` with a Shardy rule generated from the operands' factors. q may be
    split along batch (data-parallel attention) and heads (tensor parallel); the block table
    and lengths follow q's batch split; the cache, the metadata and the scales stay whole.
    Each device runs the kernel on its local batch and heads, with metadata computed for
    them when none is given; a given metadata describes the whole batch and all heads, so a
    split q is refused with it.
"""
import functools

import jax
import jax.numpy as jnp
from jax._src import dispatch
from jax.experimental.custom_partitioning import custom_partitioning
from jax.interpreters import ad, mlir
from jax.sharding import NamedSharding, PartitionSpec as P

from jax_flashmla.base import validation
from jax_flashmla.caches.fp8 import guard_empty_requests
from jax_flashmla.kernels import custom_calls
from jax_flashmla.kernels.custom_calls import FACTORS
from jax_flashmla.reference.dense import mla_decode_reference

RESULTS = ("out", "lse")
SPLIT_FACTORS = {"b", "h"}  # batch and query heads; every other factor stays whole


def _abstract_eval(*avals, operands, softmax_scale, causal, num_sms, implementation):
    q = avals[0]
    batch, s_q, h_q, _ = q.shape
    out_dtype = jnp.bfloat16 if "descale_q" in operands else q.dtype
    return (jax.core.ShapedArray((batch, s_q, h_q, validation.HEAD_DIM_V), out_dtype),
            jax.core.ShapedArray((batch, h_q, s_q), jnp.float32))


mla_decode_p = custom_calls.make_primitive("jax_flashmla_mla_decode_logical", _abstract_eval)


def _no_jvp(primals, tangents, **params):
    raise NotImplementedError(
        "mla_decode is decode-only: FlashMLA has no backward pass, so jax_flashmla defines no "
        "gradient (nor JVP) for it. Differentiate a prefill attention instead, or wrap the "
        "inputs in jax.lax.stop_gradient if no gradient should flow through the decode.")


ad.primitive_jvps[mla_decode_p] = _no_jvp


def _reference(operands, softmax_scale, causal, *values):
    named = dict(zip(operands, values))
    return mla_decode_reference(named["q"], named["kv_cache"], named["block_table"],
                                named["seq_lens"], softmax_scale=softmax_scale, causal=causal,
                                head_dim_v=validation.HEAD_DIM_V,
                                q_scale=named.get("descale_q"), k_scale=named.get("descale_k"))


def _kernels(operands, softmax_scale, causal, num_sms, *values):
    """The custom calls on one device's operands: the metadata's when none is given, then the
    decode."""
    named = dict(zip(operands, values))
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


def _sharding_rule(operands, softmax_scale, causal, num_sms, mesh, operand_types, result_types):
    rule = (", ".join(FACTORS[name] for name in operands) + " -> "
            + ", ".join(FACTORS[name] for name in RESULTS))
    factors = dict.fromkeys(rule.replace(",", " ").replace("->", " ").split())
    return rule, dict(need_replication_factors=tuple(f for f in factors
                                                     if f not in SPLIT_FACTORS))


def _spec(mesh, name, axes):
    return NamedSharding(mesh, P(*(axes.get(f) for f in FACTORS[name].split())))


def _partition(operands, softmax_scale, causal, num_sms, mesh, operand_shapes, result_shape):
    spec = tuple(operand_shapes[0].sharding.spec) + (None,) * 4
    axes = {"b": spec[0], "h": spec[2]}  # mesh axes of q's batch and heads dims
    if "tile_scheduler_metadata" in operands and (axes["b"] or axes["h"]):
        raise ValueError(
            "mla_decode: metadata computed for the whole batch and all heads cannot be used "
            f"with q split along batch ({axes['b']}) or heads ({axes['h']}); pass "
            "metadata=None (computed per device), or call the raw ops inside shard_map")
    operand_shardings = tuple(_spec(mesh, name, axes) for name in operands)
    result_shardings = tuple(_spec(mesh, name, axes) for name in RESULTS)
    local = functools.partial(_kernels, operands, softmax_scale, causal, num_sms)
    return mesh, local, result_shardings, operand_shardings


_partitioned_kernels = custom_partitioning(_kernels, static_argnums=(0, 1, 2, 3))
_partitioned_kernels.def_partition(_partition, sharding_rule=_sharding_rule)


def _lower(ctx, *values, operands, softmax_scale, causal, num_sms, implementation):
    if implementation == "reference":
        fn = functools.partial(_reference, operands, softmax_scale, causal)
    else:
        fn = functools.partial(_partitioned_kernels, operands, softmax_scale, causal, num_sms)
    return mlir.lower_fun(fn, multiple_results=True)(ctx, *values)


mlir.register_lowering(mla_decode_p, _lower)
# custom_partitioning's lowering needs the devices, which jit hands to a lowering only when it
# sees a primitive that asks for them (as TransformerEngine's outer primitives do).
dispatch.prim_requires_devices_during_lowering.add(mla_decode_p)


def mla_decode(operands, *, softmax_scale, causal, num_sms, implementation):
    """(out, lse) of the primitive on `operands`, a dict of arrays by name (module doc)."""
    return tuple(mla_decode_p.bind(*operands.values(), operands=tuple(operands),
                                   softmax_scale=softmax_scale, causal=causal, num_sms=num_sms,
                                   implementation=implementation))
