"""Imports DeepSeek attention weights from HF parameter names (a state dict or safetensors).

HF stores a Linear weight as (out, in); the NNX layer's kernels are (in, out), so they are
transposed on import. Names, relative to a layer's attention prefix (for example
"model.layers.0.self_attn."): q_a_proj.weight, q_a_layernorm.weight, q_b_proj.weight (or
q_proj.weight without q LoRA), kv_a_proj_with_mqa.weight, kv_a_layernorm.weight,
kv_b_proj.weight, o_proj.weight, and the .bias of q_a_proj, kv_a_proj_with_mqa and o_proj when
attention_bias is set; DeepSeek-V3.2's layer adds its indexer's, indexer.wq_b.weight and so on,
kept in HF's layout; DeepSeek-V4's layer has names of its own (flax/v4_weights.py). FP8
block-quantized checkpoints (DeepSeek's releases: a weight's "<name>_scale_inv" beside it) are
dequantized as they are read (flax/checkpoint.py).
"""
import os
from collections.abc import Mapping

import jax.numpy as jnp

from jax_flashmla.flax import checkpoint
from jax_flashmla.flax.mla import MultiHeadLatentAttention
from jax_flashmla.flax.sparse_mla import SparseMultiHeadLatentAttention
from jax_flashmla.flax.v4_mla import V4Attention
from jax_flashmla.flax.v4_weights import DEEPSEEK_NAMES, v4_parameter, v4_parameter_names
from jax_flashmla.ops.indexer import HF_NAMES

# HF's names of the indexer's weights under a layer's self_attn -> the Indexer's fields.
INDEXER_FIELDS = {f"indexer.{name}": field for field, name in HF_NAMES.items()}
LINEARS = ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
NORMS = ("q_a_layernorm", "kv_a_layernorm")


def attention_parameter_names(config):
    """The HF names (no prefix) an attention layer of this MLAConfig reads."""
    if config.q_lora_rank is None:
        linears = ["q_proj"]
    else:
        linears = ["q_a_proj", "q_b_proj"]
    linears += ["kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]
    names = [f"{n}.weight" for n in linears]
    names += [f"{n}.weight" for n in NORMS if config.q_lora_rank is not None or n != "q_a_layernorm"]
    if config.attention_bias:
        names += [f"{n}.bias" for n in ("q_a_proj", "kv_a_proj_with_mqa", "o_proj")
                  if n in linears]
    return names


def layer_parameter_names(layer):
    """The HF names (no prefix) a layer reads: attention_parameter_names', for V3.2's layer
    its indexer's too, "indexer.wq_b.weight" and so on; for V4's, v4_parameter_names'."""
    if isinstance(layer, V4Attention):
        return v4_parameter_names(layer)
    if isinstance(layer, SparseMultiHeadLatentAttention):
        return attention_parameter_names(layer.config) + list(INDEXER_FIELDS)
    if isinstance(layer, MultiHeadLatentAttention):
        return attention_parameter_names(layer.config)
    raise TypeError(f"load_attention_weights: layer must be a MultiHeadLatentAttention, a "
                    f"SparseMultiHeadLatentAttention or a V4Attention; got "
                    f"{type(layer).__name__}")


def _parameter(layer, name):
    """The nnx.Param that HF's `name` (no prefix) loads into, and whether HF's value is its
    transpose (a Linear's weight)."""
    if isinstance(layer, V4Attention):
        return v4_parameter(layer, name)
    if name in INDEXER_FIELDS:
        return getattr(layer.indexer, INDEXER_FIELDS[name]), False
    sub, kind = name.split(".")
    target = getattr(layer, sub)
    if sub in LINEARS:
        return (target.kernel, True) if kind == "weight" else (target.bias, False)
    return target.weight, False


def load_attention_weights(layer, weights, *, prefix="", names="hf"):
    """Copies HF DeepSeek attention weights into a layer, in place.

    Args:
      layer: a MultiHeadLatentAttention, a SparseMultiHeadLatentAttention (its indexer's
        weights too, HF's "<prefix>indexer.wq_b.weight" and so on), or a V4Attention (HF's
        DeepseekV4Attention names, its compressor's and indexer's: flax/v4_weights.py).
      weights: a mapping from names to arrays or torch tensors (CPU; extra keys are ignored),
        or the path (str or os.PathLike) of a safetensors file or of a (sharded) checkpoint
        directory, of which only this layer's tensors are read. A float8_e4m3fn weight is
        dequantized by its scales (one float32 or ue8m0 scale per 128 x 128 block, as
        DeepSeek's checkpoints store them).
      prefix: prepended to each name, e.g. "model.layers.3.self_attn." ("layers.3.attn." for
        DeepSeek's names).
      names: "hf", HF transformers' names, a weight's scales "<weight name>_scale_inv"; or
        "deepseek", DeepSeek's own in its V4 releases (a V4Attention only; HF renames them as
        it loads them: "wq_a.weight" for "q_a_proj.weight", "attn_sink" for "sinks", ...,
        v4_weights.DEEPSEEK_NAMES), a weight's scales "<module>.scale".

    Returns:
      layer. Each parameter keeps its dtype (values are cast). Raises TypeError for another
      layer or weights, KeyError naming a missing tensor and ValueError naming one whose shape
      does not fit, or an FP8 weight without its scales.
    """
    needed = layer_parameter_names(layer)
    if names == "hf":
        keys = {name: prefix + name for name in needed}
        scale_key = lambda key: key + "_scale_inv"
    elif names == "deepseek":
        if not isinstance(layer, V4Attention):
            raise ValueError("load_attention_weights: names='deepseek' are DeepSeek-V4's own; "
                             "DeepSeek's V3 and V3.2 releases use HF's names: pass names='hf'")
        keys = {name: prefix + DEEPSEEK_NAMES[name] for name in needed}
        scale_key = lambda key: key.removesuffix(".weight") + ".scale"
    else:
        raise ValueError(f"load_attention_weights: names must be 'hf' or 'deepseek'; got "
                         f"{names!r}")
    return load_parameters("load_attention_weights", "the attention layer", layer, keys,
                           _parameter, weights, scale_key)


def load_parameters(where, needed_by, layer, keys, parameter, weights, scale_key):
    """Loads the tensors keys[name] into the layer's parameters of HF's `name`s, cast to their
    dtypes. parameter(layer, name) gives the nnx.Param a name loads into and whether HF's
    value is its transpose. weights: a mapping from keys to tensors, or the path of a
    safetensors checkpoint (only the keys needed are read, and the FP8 ones' scales); an FP8
    weight is dequantized by weights[scale_key(key)] (checkpoint.tensor). Raises TypeError for
    other weights, KeyError naming a missing tensor (needed by `needed_by`), ValueError naming
    one whose shape does not fit or an FP8 weight without its scales."""
    if isinstance(weights, (str, os.PathLike)):
        weights = checkpoint.read_safetensors(
            os.fspath(weights), keys.values(),
            optional=[scale_key(key) for key in keys.values() if key.endswith(".weight")])
    elif not isinstance(weights, Mapping):
        raise TypeError(f"{where}: weights must be a mapping from HF names to tensors or the "
                        f"path of a safetensors checkpoint; got {type(weights).__name__}")
    for name, key in keys.items():
        if key not in weights:
            raise KeyError(f"weights has no {key!r} (needed by {needed_by})")
        param, transposed = parameter(layer, name)
        value = jnp.asarray(checkpoint.tensor(weights, key, scale_key(key)))
        seen = tuple(value.shape)
        if transposed:
            value = value.T
        if tuple(value.shape) != tuple(param.shape):
            expected = param.shape[::-1] if transposed else param.shape
            raise ValueError(f"weights[{key!r}] has shape {seen}; the layer's config needs "
                             f"{tuple(expected)}")
        param[...] = value.astype(param.dtype)
    return layer
