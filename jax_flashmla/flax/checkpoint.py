"""Reads HF DeepSeek checkpoints: safetensors files, sharded or not, and DeepSeek's FP8 Linear
weights, dequantized.

DeepSeek's released checkpoints (V3, V3.2, V4) store most Linear weights in float8_e4m3fn with
one scale per block of 128 x 128 (config.json's quantization_config.weight_block_size) beside
them (HF's name "<weight name>_scale_inv", DeepSeek's own "<module>.scale"): float32 in V3's,
ue8m0 (float8_e8m0fnu, a power of two) in V4's. HF's FP8 layers multiply each block by its
scale; so does tensor() here, in float32, where the product is exact (a 4-bit significand
times a float32), before the layer casts it to its parameter dtype. Weights without a scale
(V4-Flash's compressor and indexer projections, bf16) are read as they are.

safetensors files are read by their header here, not by the safetensors package: its numpy
and jax readers cannot make float8 arrays (numpy has no float8 type); ml_dtypes' can.
"""
import json
import math
import os
import struct

import ml_dtypes
import numpy as np

FP8_BLOCK = 128  # DeepSeek's quantization_config.weight_block_size, [128, 128]

# safetensors' names of the dtypes a DeepSeek attention layer's tensors come in.
SAFETENSORS_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16,
                      "BF16": ml_dtypes.bfloat16, "F8_E4M3": ml_dtypes.float8_e4m3fn,
                      "F8_E8M0": ml_dtypes.float8_e8m0fnu}


def _dtype_name(value):
    """A tensor's dtype as numpy, jax and torch (without the "torch.") name it."""
    return str(getattr(value, "dtype", "")).removeprefix("torch.")


def to_numpy(value, name):
    """numpy / jax / torch tensor -> a numpy or jax array (torch's bfloat16, float16 and
    float8 widened to float32)."""
    if hasattr(value, "detach"):  # torch, without importing it
        value = value.detach().cpu()
        if _dtype_name(value) in ("bfloat16", "float16", "float8_e4m3fn", "float8_e8m0fnu"):
            value = value.float()
        return value.numpy()
    if hasattr(value, "__array__"):  # numpy, jax and the like
        return value
    raise TypeError(f"weights[{name!r}] must be an array or a torch tensor; got {type(value)}")


def dequantized(name, weight, scale_name, scale):
    """weight (out, in), e4m3 values, times its blocks' scales (ceil(out / 128),
    ceil(in / 128)): float32. name, scale_name: theirs, for errors."""
    weight = np.asarray(weight, np.float32)
    scale = np.asarray(scale, np.float32)
    blocks = tuple(-(-n // FP8_BLOCK) for n in weight.shape)
    if weight.ndim != 2 or scale.shape != blocks:
        raise ValueError(f"weights[{scale_name!r}] has shape {scale.shape}; the float8_e4m3fn "
                         f"weight {name!r} of shape {weight.shape} needs one scale per "
                         f"{FP8_BLOCK} x {FP8_BLOCK} block, {blocks}")
    full = np.repeat(np.repeat(scale, FP8_BLOCK, 0), FP8_BLOCK, 1)
    return weight * full[:weight.shape[0], :weight.shape[1]]


def tensor(weights, key, scale_key):
    """weights[key] as a numpy or jax array; a float8_e4m3fn one dequantized by
    weights[scale_key] (dequantized), a ValueError where that is missing."""
    value = weights[key]
    if _dtype_name(value) != "float8_e4m3fn":
        return to_numpy(value, key)
    if scale_key not in weights:
        raise ValueError(f"weights[{key!r}] is float8_e4m3fn, a block-quantized checkpoint's "
                         f"weight, but weights has no {scale_key!r} to dequantize it by")
    return dequantized(key, to_numpy(value, key), scale_key,
                       to_numpy(weights[scale_key], scale_key))


def _shard_files(path, keys, optional):
    """Safetensors files under `path` (a file, or a directory with an index) holding keys; the
    `optional` ones a sharded checkpoint's index lacks are left out."""
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
                if key in optional:
                    continue
                raise KeyError(f"{index} has no {key!r} (needed by the attention layer)")
            files.setdefault(os.path.join(path, weight_map[key]), []).append(key)
        return files
    single = os.path.join(path, "model.safetensors")
    if os.path.isfile(single):
        return {single: list(keys)}
    raise ValueError(f"weights: the directory {path!r} holds neither model.safetensors nor its "
                     f"index")


def _read_file(file, keys, optional):
    """keys' tensors from one safetensors file (an 8-byte little-endian header size, the JSON
    header of each tensor's dtype, shape and byte range, then the bytes), as stored."""
    out = {}
    with open(file, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
        for key in keys:
            if key not in header:
                if key in optional:
                    continue
                raise KeyError(f"{file} has no {key!r} (needed by the attention layer)")
            entry = header[key]
            if entry["dtype"] not in SAFETENSORS_DTYPES:
                raise ValueError(f"{file}: {key!r} is {entry['dtype']}; an attention layer's "
                                 f"tensors are one of {', '.join(SAFETENSORS_DTYPES)}")
            dtype, shape = np.dtype(SAFETENSORS_DTYPES[entry["dtype"]]), entry["shape"]
            begin, end = entry["data_offsets"]
            f.seek(8 + size + begin)
            data = f.read(end - begin)
            if len(data) != end - begin or end - begin != dtype.itemsize * math.prod(shape):
                raise ValueError(f"{file}: {key!r} ({entry['dtype']} {shape}) should span "
                                 f"{dtype.itemsize * math.prod(shape)} bytes; its header "
                                 f"gives {end - begin} and the file holds {len(data)} of them")
            out[key] = np.frombuffer(data, dtype).reshape(shape)
    return out


def read_safetensors(path, names, optional=()):
    """The named tensors (only those) of a safetensors file or checkpoint directory, as stored
    (numpy arrays, ml_dtypes' for bfloat16 and float8); of the `optional` names, those the
    checkpoint has."""
    optional = set(optional)
    out = {}
    for file, keys in _shard_files(path, list(names) + sorted(optional), optional).items():
        out.update(_read_file(file, keys, optional))
    return out
