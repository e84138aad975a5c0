"""Imports DeepSeek attention weights from HF parameter names (a state dict or safetensors).

HF stores a Linear weight as (out, in); the NNX layer's kernels are (in, out), so they are
transposed on import. Names, relative to a layer's attention prefix (for example
"model.layers.0.self_attn."): q_a_proj.weight, q_a_layernorm.weight, q_b_proj.weight (or
q_proj.weight without q LoRA), kv_a_proj_with_mqa.weight, kv_a_layernorm.weight,
kv_b_proj.weight, o_proj.weight, and the .bias of q_a_proj, kv_a_proj_with_mqa and o_proj when
attention_bias is set. FP8 block-quantised checkpoints (DeepSeek-V3's weight_scale_inv) must be
dequantised first.
"""
import json
import os

import jax.numpy as jnp
import numpy as np

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
    raise TypeError(f"state_dict[{name!r}] must be an array or a torch tensor; got {type(value)}")


def load_attention_weights(module, state_dict, *, prefix=""):
    """Copies HF DeepSeek attention weights into a MultiHeadLatentAttention, in place.

    Args:
      module: a jax_flashmla.flax.MultiHeadLatentAttention.
      state_dict: mapping from HF names to arrays or torch tensors (CPU); extra keys are ignored.
      prefix: prepended to each name, e.g. "model.layers.3.self_attn.".

    Returns:
      module. Each parameter keeps its dtype (values are cast). Raises KeyError naming a
      missing tensor and ValueError naming one whose shape does not fit.
    """
    for name in attention_parameter_names(module.config):
        key = prefix + name
        if key not in state_dict:
            raise KeyError(f"state_dict has no {key!r} (needed by the attention layer)")
        value = _to_numpy(state_dict[key], key)
        sub, kind = name.split(".")
        target = getattr(module, sub)
        if sub in LINEARS and kind == "weight":
            param, value = target.kernel, jnp.asarray(value).T
        elif sub in LINEARS:
            param, value = target.bias, jnp.asarray(value)
        else:
            param, value = target.weight, jnp.asarray(value)
        if tuple(value.shape) != tuple(param.shape):
            expected = param.shape[::-1] if kind == "weight" and sub in LINEARS else param.shape
            raise ValueError(f"state_dict[{key!r}] has shape {tuple(state_dict[key].shape)}; "
                             f"the layer's config needs {tuple(expected)}")
        param[...] = value.astype(param.dtype)
    return module


def _shard_files(path, keys):
    """Safetensors files under `path` (a file, or a directory with an index) holding keys."""
    if os.path.isfile(path):
        return {path: list(keys)}
    if not os.path.isdir(path):
        raise ValueError(f"path must be a .safetensors file or a checkpoint directory; got {path!r}")
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
    raise ValueError(f"path {path!r} holds neither model.safetensors nor its index")


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


def load_attention_safetensors(module, path, *, prefix=""):
    """load_attention_weights from a safetensors file or a (sharded) checkpoint directory,
    reading only this layer's tensors."""
    names = [prefix + n for n in attention_parameter_names(module.config)]
    return load_attention_weights(module, read_safetensors(path, names), prefix=prefix)
