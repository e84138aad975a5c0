"""Pure-JAX DeepSeek-V4 sparse attention: the path off Hopper GPUs and the tests' oracle for
FlashMLA's MODEL1 kernels.

V4's key is also its value: one 512-d row, so out is 512 wide and q is 512 wide too. A decode
query attends to the keys its indices name in the main cache (a layer's compressed entries)
and, where given, in the extra cache (its sliding window): one softmax over both. Validity,
the sink and the answer for a query with no valid key follow jax_flashmla.reference.sparse: an
index is valid where it names a key and stands among its row's first topk_length entries; no
valid key gives out 0 and lse +inf; the sink joins the denominator only. One difference, as
FlashMLA's MODEL1 kernel has it: a NaN sink makes its head's out NaN for a query with no valid
key too. float32 arithmetic over the dequantized rows.
"""
import jax.numpy as jnp

from jax_flashmla.base.validation import PAGE_SIZE
from jax_flashmla.caches.v4 import ROW_DIM, gather_rows
from jax_flashmla.reference.sparse import attend, valid_indices


def _rows(kv_cache, indices, topk_length):
    """The (b, s_q, topk, 512) rows a cache's indices name, and their validity."""
    valid = valid_indices(indices, kv_cache.shape[0] * PAGE_SIZE, topk_length)
    return gather_rows(kv_cache, jnp.where(valid, indices, 0)), valid


def v4_decode_reference(q, kv_cache, indices, *, softmax_scale, topk_length=None,
                        extra_kv_cache=None, extra_indices=None, extra_topk_length=None,
                        attn_sink=None):
    """q (b, s_q, h_q, 512); kv_cache and extra_kv_cache (num_pages, 65, 576) uint8; indices
    (b, s_q, topk) and extra_indices (b, s_q, extra_topk) int32 slots; topk lengths (b,) ->
    out (b, s_q, h_q, 512) bfloat16, lse (b, h_q, s_q) float32."""
    batch, s_q, h_q, _ = q.shape
    rows, valid = _rows(kv_cache, indices, topk_length)
    if extra_kv_cache is not None:
        extra_rows, extra_valid = _rows(extra_kv_cache, extra_indices, extra_topk_length)
        rows = jnp.concatenate([rows, extra_rows], axis=2)
        valid = jnp.concatenate([valid, extra_valid], axis=2)
    n = batch * s_q
    out, lse = attend(q.reshape(n, h_q, ROW_DIM), rows.reshape(n, -1, ROW_DIM),
                      valid.reshape(n, -1), softmax_scale=softmax_scale, attn_sink=attn_sink)
    if attn_sink is not None:
        out = jnp.where(jnp.isnan(attn_sink)[None, :, None], jnp.nan, out)
    return (out.reshape(batch, s_q, h_q, ROW_DIM).astype(jnp.bfloat16),
            lse.reshape(batch, s_q, h_q).transpose(0, 2, 1))
