"""Imports DeepSeek-V4 attention weights (HF transformers' DeepseekV4Attention names) into a
V4Attention: from a state dict or safetensors, as flax/weights.py does for V2/V3/V3.2.

Names, relative to a layer's attention prefix (e.g. "model.layers.0.self_attn."):
q_a_proj.weight, q_a_norm.weight, q_b_proj.weight, kv_proj.weight, kv_norm.weight,
o_a_proj.weight, o_b_proj.weight, sinks, and in a compressing layer compressor.kv_proj.weight,
compressor.gate_proj.weight, compressor.position_bias, compressor.kv_norm.weight; a CSA layer's
indexer has the same four under compressor.indexer., and compressor.indexer.q_b_proj.weight,
compressor.indexer.scorer.weights_proj.weight. HF stores a Linear's weight as (out, in): the
nnx.Linear kernels (q_a_proj, q_b_proj, kv_proj, o_b_proj) take it transposed; the others keep
HF's layout.
"""
from jax_flashmla.flax.v4_mla import V4Attention
from jax_flashmla.flax.weights import load_parameters

LINEARS = ("q_a_proj", "q_b_proj", "kv_proj", "o_b_proj")
NORMS = ("q_a_norm", "kv_norm")
COMPRESSOR = ("kv_proj.weight", "gate_proj.weight", "position_bias", "kv_norm.weight")
INDEXER = COMPRESSOR + ("q_b_proj.weight", "scorer.weights_proj.weight")


def v4_parameter_names(layer):
    """The HF names (no prefix) a V4Attention reads."""
    names = [f"{n}.weight" for n in LINEARS + NORMS] + ["o_a_proj.weight", "sinks"]
    if layer.compressor is not None:
        names += [f"compressor.{n}" for n in COMPRESSOR]
    if layer.indexer is not None:
        names += [f"compressor.indexer.{n}" for n in INDEXER]
    return names


def _parameter(layer, name):
    """The nnx.Param that HF's `name` loads into, and whether HF's value is its transpose."""
    if name.startswith("compressor.indexer."):
        # V4Indexer's Params are HF's names' first parts, the scorer's weights_proj flattened.
        field = name.removeprefix("compressor.indexer.").removeprefix("scorer.").split(".")[0]
        return getattr(layer.indexer, field), False
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
    return load_parameters("load_v4_attention_weights", "the V4 attention layer", layer,
                           v4_parameter_names(layer), _parameter, weights, prefix)
