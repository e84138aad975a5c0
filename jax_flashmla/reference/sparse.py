"""Pure-JAX sparse MLA: each query attends to the keys its indices name, and to no other.

The path off Hopper GPUs and the tests' oracle for FlashMLA's sparse kernels. An index is valid
where it names a key (0 <= index < the keys there are) and, with topk_length, stands among its
row's first topk_length entries; invalid ones are never read into the arithmetic (NaN in their
rows changes nothing). A query with no valid index gets out 0 and lse +inf. With attn_sink (one
float32 logit per head) the sink joins each softmax's denominator and takes no value:
out = sum_j exp(s_j) v_j / (sum_j exp(s_j) + exp(sink)); lse stays the log-sum-exp of the keys'
scores. Arithmetic in float32 over the rows as stored (the FP8 cache's dequantized).
"""
import jax.numpy as jnp

from jax_flashmla.base.validation import HEAD_DIM_V
from jax_flashmla.caches.sparse import dequantize_tokens


def valid_indices(indices, num_keys, topk_length):
    """indices (..., topk) -> bool of their shape (module doc); topk_length of shape (...,)'s
    leading dimension, broadcast over the rest, or None."""
    valid = (indices >= 0) & (indices < num_keys)
    if topk_length is not None:
        position = jnp.arange(indices.shape[-1], dtype=jnp.int32)
        lengths = topk_length.reshape(topk_length.shape + (1,) * (indices.ndim - 1))
        valid &= position < lengths
    return valid


def attend(q, rows, valid, *, softmax_scale, attn_sink=None):
    """q (n, h, d), rows (n, topk, d), valid (n, topk) -> out (n, h, 512) float32 (each row's
    first 512 columns: V3.2's latent for d 576, V4's whole row for d 512) and lse
    (n, h) float32."""
    rows = jnp.where(valid[..., None], rows.astype(jnp.float32), 0.0)
    scores = jnp.einsum("nhd,nkd->nhk", q.astype(jnp.float32), rows) * softmax_scale
    scores = jnp.where(valid[:, None, :], scores, -jnp.inf)
    any_valid = jnp.any(valid, axis=-1)[:, None]
    peak = jnp.where(any_valid, jnp.max(scores, axis=-1), 0.0)
    weights = jnp.exp(scores - peak[..., None])
    total = jnp.sum(weights, axis=-1)
    denominator = total
    if attn_sink is not None:
        denominator = total + jnp.exp(attn_sink.astype(jnp.float32)[None, :] - peak)
    out = jnp.einsum("nhk,nkv->nhv", weights, rows[..., :HEAD_DIM_V])
    out = jnp.where(any_valid[..., None], out / denominator[..., None], 0.0)
    lse = jnp.where(any_valid, peak + jnp.log(total), jnp.inf)
    return out, lse


def sparse_decode_reference(q, kv_cache, indices, *, softmax_scale, topk_length=None,
                            attn_sink=None):
    """q (b, s_q, h_q, 576); kv_cache (num_pages, 64, 1, 656) uint8; indices (b, s_q, topk)
    int32 slots -> out (b, s_q, h_q, 512) bfloat16, lse (b, h_q, s_q) float32."""
    batch, s_q, h_q, width = q.shape
    tokens = kv_cache.reshape(-1, kv_cache.shape[-1])
    valid = valid_indices(indices, tokens.shape[0], topk_length)
    rows = dequantize_tokens(tokens[jnp.where(valid, indices, 0)])
    out, lse = attend(q.reshape(batch * s_q, h_q, width), rows.reshape(batch * s_q, -1, width),
                      valid.reshape(batch * s_q, -1), softmax_scale=softmax_scale,
                      attn_sink=attn_sink)
    return (out.reshape(batch, s_q, h_q, HEAD_DIM_V).astype(jnp.bfloat16),
            lse.reshape(batch, s_q, h_q).transpose(0, 2, 1))


def sparse_prefill_reference(q, kv, indices, *, softmax_scale, topk_length=None,
                             attn_sink=None):
    """q (s_q, h_q, d); kv (s_kv, d), d 576 or 512; indices (s_q, topk) int32 rows of kv ->
    out (s_q, h_q, 512) in q's dtype, lse (h_q, s_q) float32."""
    valid = valid_indices(indices, kv.shape[0], topk_length)
    out, lse = attend(q, kv[jnp.where(valid, indices, 0)], valid, softmax_scale=softmax_scale,
                      attn_sink=attn_sink)
    return out.astype(q.dtype), lse.T
