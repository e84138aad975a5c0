"""FP8 (e4m3) values with a per-tensor scale: how q and new cache rows are quantized.

A float8_e4m3fn element e with scale s stands for e * s. Quantizing follows SGLang's
scaled_fp8_quant (static per-tensor scale): x times 1/s in float32, clamped to +-448, then
rounded to the nearest e4m3 value (ties to even). The clamp is what saturates: e4m3fn has no
infinity, so an unclamped value past the largest finite one would become NaN.
"""
import jax.numpy as jnp

FP8_DTYPE = jnp.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn


def quantize(x, scale):
    """x (any float dtype) -> float8_e4m3fn of x / scale, saturating at +-448.

    scale: float32 of shape () or (1,), a traced array (validation.check_scale)."""
    inverse = 1.0 / scale.reshape(())  # the kernel SGLang uses multiplies by the reciprocal
    scaled = x.astype(jnp.float32) * inverse
    return jnp.clip(scaled, -FP8_MAX, FP8_MAX).astype(FP8_DTYPE)


def dequantize(x, scale):
    """float8_e4m3fn x -> float32 x * scale."""
    return x.astype(jnp.float32) * scale.reshape(())
