"""DeepSeek-V3.2's sparse attention: its FP8 cache and the sparse decode and prefill.

    from jax_flashmla.sparse import SparseKVCache, write_sparse_kv, sparse_mla_decode
"""
from jax_flashmla.caches.sparse import (SparseKVCache, dequantize_tokens, quantize_tokens,
                                        write_sparse_kv)
from jax_flashmla.caches.index_keys import (IndexKeyCache, dequantize_index_keys,
                                            quantize_index_keys, write_index_keys)
from jax_flashmla.ops.indexer import (IndexerWeights, IndexQuery, index_keys, index_query,
                                      index_scores, indexer_decode, indexer_prefill)
from jax_flashmla.ops.sparse import (MaskedIndices, mask_indices, sparse_mla_decode,
                                     sparse_mla_prefill)

__all__ = ["IndexKeyCache", "IndexQuery", "IndexerWeights", "MaskedIndices", "SparseKVCache",
           "dequantize_index_keys", "dequantize_tokens", "index_keys", "index_query",
           "index_scores", "indexer_decode", "indexer_prefill", "mask_indices",
           "quantize_index_keys", "quantize_tokens", "sparse_mla_decode", "sparse_mla_prefill",
           "write_index_keys", "write_sparse_kv"]
