"""DeepSeek-V3.2's sparse attention: its FP8 cache and the sparse decode and prefill.

    from jax_flashmla.sparse import SparseKVCache, write_sparse_kv, sparse_mla_decode
"""
from jax_flashmla.caches.index_keys import IndexKeyCache, write_index_keys
from jax_flashmla.caches.sparse import SparseKVCache, write_sparse_kv
from jax_flashmla.ops.indexer import (IndexerWeights, index_keys, index_query, indexer_decode,
                                      indexer_prefill)
from jax_flashmla.ops.sparse import mask_indices, sparse_mla_decode, sparse_mla_prefill

__all__ = ["IndexKeyCache", "IndexerWeights", "SparseKVCache", "index_keys", "index_query",
           "indexer_decode", "indexer_prefill", "mask_indices", "sparse_mla_decode",
           "sparse_mla_prefill", "write_index_keys", "write_sparse_kv"]
