"""DeepSeek-V3.2's sparse attention: its FP8 cache and the sparse decode and prefill.

    from jax_flashmla.sparse import SparseKVCache, write_sparse_kv, sparse_mla_decode
"""
from jax_flashmla.sparse.cache import (SparseKVCache, dequantize_tokens, quantize_tokens,
                                       write_sparse_kv)
from jax_flashmla.sparse.ops import sparse_mla_decode, sparse_mla_prefill

__all__ = ["SparseKVCache", "dequantize_tokens", "quantize_tokens", "sparse_mla_decode",
           "sparse_mla_prefill", "write_sparse_kv"]
