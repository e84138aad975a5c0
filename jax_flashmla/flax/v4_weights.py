"""Imports DeepSeek-V4 attention weights (HF transformers' DeepseekV4Attention names) into a
V4Attention: from a state dict or safetensors, as flax/weights.py does for V2/V3/V3.2.

Names, relative to a layer's attention prefix (e.g. "model.layers.0.self_attn."):
q_a_proj.weight, q_a_norm.weight, q_b_proj.weight, kv_proj.weight, kv_norm.weight,
o_a_proj.weight, o_b_proj.weight, sinks, and in a compressing layer compressor.kv_proj.weight,
compressor.gate_proj.weight, compressor.position_bias, compressor.kv_norm.weight. HF stores a
Linear's weight as (out, in): the nnx.Linear kernels (q_a_proj, q_b_proj, kv_proj, o_b_proj)
take it transposed; the others keep HF's layout.
"""
import os
from collections.abc import Mapping

import jax.numpy as jnp

from jax_flashmla.flax.v4_mla import V4Attention
from jax_flashmla.flax.weights import read_safetensors, to_numpy

LINEARS = ("q_a_proj", "q_b_proj", "kv_proj", "o_b_proj")
NORMS = ("q_a_norm", "kv_norm")
COMPRESSOR = ("kv_proj.weight", "gate_proj.weight", "position_bias", "kv_norm.weight")


def v4_parameter_names(layer):
    """The HF names (no prefix) a V4Attention reads."""
    names = [f"{n}.weight" for n in LINEARS + NORMS] + ["o_a_proj.weight", "sinks"]
    if layer.compressor is not None:
        names += [f"compressor.{n}" for n in COMPRESSOR]
    return names


def _parameter(layer, name):
    """The nnx.Param that HF's `name` loads into, and whether HF's value is its transpose."""
    if name.startswith("compressor."):
        return getattr(layer.compressor, name.split(".")[1]), False
    if name in ("o_a_proj.weight", "sinks"):
        return getattr(layer, name.split(".")[0]), False
    sub = name.split(".")[0]
    return (getattr(layer, sub).kernel, True) if sub in LINEARS else (
        getattr(layer, sub).weight, False)


def load_v4_attention_weights(layer, weights, *, prefix=""):
    """Copies HF DeepSeek-V4 attention weights into a V4Attention, in place.

    Args:
      layer: V4Attention.
      weights: a mapping from HF names to arrays or torch tensors (CPU; extra keys ignored),
        or the path of a safetensors file or (sharded) checkpoint directory, of which only
        this layer's tensors are read (needs the safetensors package).
      prefix: prepended to each name, e.g. "model.layers.3.self_attn.".

    Returns:
      layer. Each parameter keeps its dtype (values are cast). Raises TypeError for another
      layer or weights, KeyError naming a missing tensor, ValueError naming one whose shape
      does not fit.
    """
    if not isinstance(layer, V4Attention):
        raise TypeError(f"load_v4_attention_weights: layer must be a V4Attention; got "
                        f"{type(layer).__name__}")
    names = v4_parameter_names(layer)
    if isinstance(weights, (str, os.PathLike)):
        weights = read_safetensors(os.fspath(weights), [prefix + name for name in names])
    elif not isinstance(weights, Mapping):
        raise TypeError(f"load_v4_attention_weights: weights must be a mapping from HF names "
                        f"to tensors or the path of a safetensors checkpoint; got "
                        f"{type(weights).__name__}")
    for name in names:
        key = prefix + name
        if key not in weights:
            raise KeyError(f"weights has no {key!r} (needed by the V4 attention layer)")
        param, transposed = _parameter(layer, name)
        value = jnp.asarray(to_numpy(weights[key], key))
        seen = tuple(value.shape)
        if transposed:
            value = value.T
        if tuple(value.shape) != tuple(param.shape):
            expected = param.shape[::-1] if transposed else param.shape
            raise ValueError(f"weights[{key!r}] has shape {seen}; the layer's config needs "
                             f"{tuple(expected)}")
        param[...] = value.astype(param.dtype)
    return layer
