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


def guard_empty_requests(block_table, seq_lens):
    """The block table and lengths FlashMLA's FP8 decode is given (mla_decode's, and the GPU
    tests' calls of the kernel from torch): requests of length 0 as length 1 over page 0. The
    kernel reads block_table[i, -1] for a request of length 0 (its last block index is then
    -1): the row before's last slot, or memory before the table, which faults when it holds no
    page (seen on the H200; vLLM #35969 clamps the same way); the decode's handler gives such
    a request out 0, lse +inf afterwards (ffi/empty_requests.h). Elementwise, so XLA fuses it into
    what computes the table (a layer's page offset in a stacked cache) and merges it across
    layers that share one.

    Returns (block_table with slot 0 of empty requests set to 0, seq_lens raised to at least
    1, the (batch,) mask of the empty requests)."""
    empty = seq_lens == 0
    first_slot = jnp.arange(block_table.shape[1]) == 0
    block_table = jnp.where(empty[:, None] & first_slot[None, :], 0, block_table)
    return block_table, jnp.maximum(seq_lens, 1), empty
