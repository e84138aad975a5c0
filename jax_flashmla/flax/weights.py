"""Imports DeepSeek attention weights from HF parameter names (a state dict or safetensors).

HF stores a Linear weight as (out, in); the NNX layer's kernels are (in, out), so they are
transposed on import. Names, relative to a layer's attention prefix (for example
"model.layers.0.self_attn."): q_a_proj.weight, q_a_layernorm.weight, q_b_proj.weight (or
q_proj.weight without q LoRA), kv_a_proj_with_mqa.weight, kv_a_layernorm.weight,
kv_b_proj.weight, o_proj.weight, and the .bias of q_a_proj, kv_a_proj_with_mqa and o_proj when
attention_bias is set; DeepSeek-V3.2's layer adds its indexer's, indexer.wq_b.weight and so on,
kept in HF's layout; DeepSeek-V4's layer has names of its own (flax/v4_weights.py). FP8
block-quantised checkpoints (DeepSeek-V3's weight_scale_inv) must be dequantised first.
"""
import json
import os
from collections.abc import Mapping

import jax.numpy as jnp
import numpy as np

from jax_flashmla.flax.mla import MultiHeadLatentAttention
from jax_flashmla.flax.sparse_mla import SparseMultiHeadLatentAttention
from jax_flashmla.flax.v4_mla import V4Attention
from jax_flashmla.flax.v4_weights import v4_parameter, v4_parameter_names
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


def _to_numpy(value, name):
    """numpy / jax / torch tensor -> a numpy or jax array (bfloat16 kept via float32)."""
    if hasattr(value, "detach"):  # torch, without importing it
        value = value.detach().cpu()
        if str(value.dtype) in ("torch.bfloat16", "torch.float16", "torch.float8_e4m3fn"):
            value = value.float()
        return value.numpy()
    if isinstance(value, (np.ndarray, jnp.ndarray)) or hasattr(value, "__array__"):
        return value
    raise TypeError(f"weights[{name!r}] must be an array or a torch tensor; got {type(value)}")


def _shard_files(path, keys):
    """Safetensors files under `path` (a file, or a directory with an index) holding keys."""
    if os.path.isfile(path):
        return {path: list(keys)}
    if not os.path.isdir(path):
        raise ValueError(f"weights must be a .safetensors file or a checkpoint directory (or a "
                         f"mapping of tensors); got the path {path!r}")
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        files = {}
        for key in keys:
            if key not in weight_map:
                raise KeyError(f"{index} has no {key!r} (needed by the attention layer)")
            files.setdefault(os.path.join(path, weight_map[key]), []).append(key)
        return files
    single = os.path.join(path, "model.safetensors")
    if os.path.isfile(single):
        return {single: list(keys)}
    raise ValueError(f"weights: the directory {path!r} holds neither model.safetensors nor its "
                     f"index")


def read_safetensors(path, names):
    """Reads the named tensors (only those) from a safetensors file or checkpoint directory,
    as numpy float32 arrays (bfloat16 and float16 widened). Needs the `safetensors` package."""
    from safetensors import safe_open

    out = {}
    for file, keys in _shard_files(path, names).items():
        with safe_open(file, framework="flax") as f:
            available = set(f.keys())
            for key in keys:
                if key not in available:
                    raise KeyError(f"{file} has no {key!r} (needed by the attention layer)")
                out[key] = np.asarray(f.get_tensor(key).astype(jnp.float32))
    return out


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


def load_attention_weights(layer, weights, *, prefix=""):
    """Copies HF DeepSeek attention weights into a layer, in place.

    Args:
      layer: a MultiHeadLatentAttention, a SparseMultiHeadLatentAttention (its indexer's
        weights too, HF's "<prefix>indexer.wq_b.weight" and so on), or a V4Attention (HF's
        DeepseekV4Attention names, its compressor's and indexer's: flax/v4_weights.py).
      weights: a mapping from HF names to arrays or torch tensors (CPU; extra keys are
        ignored), or the path (str or os.PathLike) of a safetensors file or of a (sharded)
        checkpoint directory, of which only this layer's tensors are read (needs the
        safetensors package).
      prefix: prepended to each name, e.g. "model.layers.3.self_attn.".

    Returns:
      layer. Each parameter keeps its dtype (values are cast). Raises TypeError for another
      layer or weights, KeyError naming a missing tensor and ValueError naming one whose shape
      does not fit.
    """
    return load_parameters("load_attention_weights", "the attention layer", layer,
                           layer_parameter_names(layer), _parameter, weights, prefix)


def load_parameters(where, needed_by, layer, names, parameter, weights, prefix):
    """Loads HF's tensors `names` (each under prefix + name) into layer's parameters, cast to
    their dtypes. parameter(layer, name) gives the nnx.Param a name loads into and whether
    HF's value is its transpose. weights: a mapping from HF names to tensors, or the path of a
    safetensors checkpoint (only the names needed are read). Raises TypeError for other
    weights, KeyError naming a missing tensor (needed by `needed_by`), ValueError naming one
    whose shape does not fit."""
    if isinstance(weights, (str, os.PathLike)):
        weights = read_safetensors(os.fspath(weights), [prefix + name for name in names])
    elif not isinstance(weights, Mapping):
        raise TypeError(f"{where}: weights must be a mapping from HF names to tensors or the "
                        f"path of a safetensors checkpoint; got {type(weights).__name__}")
    for name in names:
        key = prefix + name
        if key not in weights:
            raise KeyError(f"weights has no {key!r} (needed by {needed_by})")
        param, transposed = parameter(layer, name)
        value = jnp.asarray(_to_numpy(weights[key], key))
        seen = tuple(value.shape)
        if transposed:
            value = value.T
        if tuple(value.shape) != tuple(param.shape):
            expected = param.shape[::-1] if transposed else param.shape
            raise ValueError(f"weights[{key!r}] has shape {seen}; the layer's config needs "
                             f"{tuple(expected)}")
        param[...] = value.astype(param.dtype)
    return layer
