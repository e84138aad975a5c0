"""DeepSeek's rotary position embedding: plain RoPE and YaRN, with its softmax-scale correction.

Follows DeepSeek's reference code and HF transformers' DeepSeek-V2/V3 attention:
- the rotary part of each query / key head (qk_rope_head_dim wide) is rotated by
  `inv_freq` (qk_rope_head_dim / 2 frequencies), cos and sin scaled by YaRN's
  attention factor;
- with `interleave=True` (DeepSeek's published weights, HF's `rope_interleave`) the pairs are
  (x0, x1), (x2, x3), ... and the result is laid out de-interleaved, [rotated evens | rotated
  odds], exactly as HF returns it; queries and keys use the same layout, so their dot product is
  the interleaved one. With `interleave=False` the pairs are (x_i, x_{i + d/2}) (rotate_half).
"""
import math

import jax.numpy as jnp
import numpy as np

ROPE_TYPES = ("default", "yarn")


def rope_type(rope_scaling):
    """'default' or 'yarn' for a published `rope_scaling` dict (keys 'type' or 'rope_type')."""
    if not rope_scaling:
        return "default"
    kind = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise ValueError(f"rope_scaling: rope type must be one of {ROPE_TYPES}; got {kind!r}")
    return kind


def check_yarn(rope_scaling):
    """Raises ValueError naming a YaRN key that is missing or out of range."""
    original = rope_scaling.get("original_max_position_embeddings")
    if original is None:
        raise ValueError("rope_scaling: YaRN needs original_max_position_embeddings (the "
                         f"context length before scaling); got the keys {sorted(rope_scaling)}")
    if not isinstance(original, int) or original < 1:
        raise ValueError(f"rope_scaling: original_max_position_embeddings must be a positive "
                         f"int; got {original!r}")
    # factor and the betas must be positive; the mscales may be 0 (no correction).
    for key, least in (("factor", "positive"), ("beta_fast", "positive"),
                       ("beta_slow", "positive"), ("mscale", "non-negative"),
                       ("mscale_all_dim", "non-negative")):
        value = rope_scaling.get(key)
        if value is None:
            continue
        number = isinstance(value, (int, float)) and math.isfinite(value)
        if not number or value < 0 or (value == 0 and least == "positive"):
            raise ValueError(f"rope_scaling: {key} must be a {least} finite number; "
                             f"got {value!r}")


def yarn_get_mscale(scale=1.0, mscale=1.0):
    """YaRN's magnitude correction 0.1 * mscale * ln(scale) + 1 (1 for scale <= 1)."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def _yarn_factor(rope_scaling, max_position_embeddings):
    factor = rope_scaling.get("factor")
    if factor is None:
        factor = max_position_embeddings / rope_scaling["original_max_position_embeddings"]
    return float(factor)


def softmax_scale(qk_head_dim, rope_scaling=None, max_position_embeddings=None):
    """DeepSeek's softmax scale: qk_head_dim ** -0.5, times mscale ** 2 under YaRN, where
    mscale = 0.1 * mscale_all_dim * ln(factor) + 1 (no correction when mscale_all_dim is 0)."""
    scale = qk_head_dim ** -0.5
    if rope_type(rope_scaling) != "default":
        mscale_all_dim = rope_scaling.get("mscale_all_dim", 0)
        if mscale_all_dim:
            mscale = yarn_get_mscale(_yarn_factor(rope_scaling, max_position_embeddings),
                                     mscale_all_dim)
            scale = scale * mscale * mscale
    return float(scale)


def inv_freq_and_attention_factor(dim, theta, rope_scaling=None, max_position_embeddings=None):
    """Returns (inv_freq (dim // 2,) float32 numpy, attention factor scaling cos and sin)."""
    if dim % 2:
        raise ValueError(f"qk_rope_head_dim must be even; got {dim}")
    exponents = np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)
    pos_freqs = np.float32(theta) ** exponents
    if rope_type(rope_scaling) == "default":
        return (1.0 / pos_freqs).astype(np.float32), 1.0
    factor = _yarn_factor(rope_scaling, max_position_embeddings)
    original = rope_scaling["original_max_position_embeddings"]
    mscale, mscale_all_dim = rope_scaling.get("mscale"), rope_scaling.get("mscale_all_dim")
    attention_factor = rope_scaling.get("attention_factor")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all_dim)
        else:
            attention_factor = yarn_get_mscale(factor)
    beta_fast = rope_scaling.get("beta_fast") or 32
    beta_slow = rope_scaling.get("beta_slow") or 1

    def correction_dim(rotations):
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope_scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    extrapolation = (1 - ramp).astype(np.float32)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq.astype(np.float32), float(attention_factor)


def cos_sin(positions, inv_freq, attention_factor=1.0):
    """(cos, sin), each positions.shape + (dim // 2,) float32, for int positions."""
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)
    return jnp.cos(freqs) * attention_factor, jnp.sin(freqs) * attention_factor


def apply_rope(x, cos, sin, *, interleave=True):
    """Rotates x (..., seq, heads, dim) by cos / sin (..., seq, dim // 2); returns x's dtype.

    cos and sin are cast to x's dtype first, as HF does.
    """
    cos = cos.astype(x.dtype)[..., None, :]
    sin = sin.astype(x.dtype)[..., None, :]
    if interleave:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
