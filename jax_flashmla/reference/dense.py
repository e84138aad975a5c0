"""Pure-JAX MLA decode over the paged cache: the path off Hopper GPUs and the tests' oracle.

It follows FlashMLA's conventions: V is the first head_dim_v columns of each cache row;
with causal=True query i of s_q sees the first s_k - s_q + i + 1 keys (bottom-right mask);
the LSE is the natural log of the sum of exp(scaled scores); a query that sees no key gets
out 0 and LSE +inf. Keys past a request's length are never read into the arithmetic, so NaN in
unused pages and arbitrary values in unused block-table slots change nothing; a NaN elsewhere
has FlashMLA's effect (mla_decode's docstring), with lse +inf as for a request in one split.
With FlashMLA's FP8 cache, q and the cache are float8_e4m3fn with per-tensor scales; the
reference dequantizes them to float32 (the cache after the gather, so only the pages read)
and returns bfloat16 out, as the FP8 kernel does.
"""
import jax
import jax.numpy as jnp

from jax_flashmla.base.validation import PAGE_SIZE
from jax_flashmla.caches import fp8


def visible_keys(seq_lens, s_q, causal):
    """(batch, s_q) int32: how many leading keys each query token attends to."""
    if not causal:
        return jnp.broadcast_to(seq_lens[:, None], (seq_lens.shape[0], s_q))
    return jnp.clip(seq_lens[:, None] - s_q + 1 + jnp.arange(s_q, dtype=jnp.int32)[None, :],
                    0, seq_lens[:, None])


def mla_decode_reference(q, kv_cache, block_table, seq_lens, *, softmax_scale, causal, head_dim_v,
                         q_scale=None, k_scale=None):
    """Returns (out (b, s_q, h_q, head_dim_v), lse (b, h_q, s_q) float32).

    out has q's dtype, or bfloat16 when q_scale and k_scale (float32 arrays of shape () or (1,))
    are given: then q and kv_cache are float8_e4m3fn standing for their values times them."""
    batch, s_q, _, head_dim = q.shape
    num_pages = kv_cache.shape[0]
    max_tokens = block_table.shape[1] * PAGE_SIZE
    pages = jnp.clip(block_table, 0, num_pages - 1)
    keys = kv_cache[pages].reshape(batch, max_tokens, head_dim)
    out_dtype = q.dtype
    if k_scale is not None:
        q, keys, out_dtype = fp8.dequantize(q, q_scale), fp8.dequantize(keys, k_scale), jnp.bfloat16
    positions = jnp.arange(max_tokens, dtype=jnp.int32)
    in_request = positions[None, :] < seq_lens[:, None]
    keys = jnp.where(in_request[:, :, None], keys, jnp.zeros((), keys.dtype))

    scores = jnp.einsum("bqhd,bkd->bhqk", q, keys, preferred_element_type=jnp.float32,
                        precision=jax.lax.Precision.HIGHEST) * softmax_scale
    visible = positions[None, None, :] < visible_keys(seq_lens, s_q, causal)[:, :, None]
    scores = jnp.where(visible[:, None, :, :], scores, -jnp.inf)
    row_max = jnp.max(scores, axis=-1, keepdims=True)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    weights = jnp.exp(scores - row_max)
    total = jnp.sum(weights, axis=-1)
    values = keys[:, :, :head_dim_v].astype(jnp.float32)
    out = jnp.einsum("bhqk,bkd->bqhd", weights, values, precision=jax.lax.Precision.HIGHEST)
    seen = total > 0
    out = out / jnp.where(seen, total, 1.0).transpose(0, 2, 1)[..., None]
    lse = jnp.where(seen, row_max[..., 0] + jnp.log(jnp.where(seen, total, 1.0)), jnp.inf)
    return out.astype(out_dtype), lse
