"""DeepSeek's sparse attention: V3.2's and V4's FP8 caches, one writer for them and for V3.2's
index keys, the sparse decode (both models: the cache's kind picks) and prefill, and V3.2's
indexer.

    from jax_flashmla.sparse import SparseKVCache, write_sparse_kv, sparse_mla_decode
"""
from jax_flashmla.caches.index_keys import IndexKeyCache
from jax_flashmla.caches.sparse import SparseKVCache, write_sparse_kv
from jax_flashmla.caches.v4 import V4KVCache
from jax_flashmla.ops.indexer import (IndexerWeights, index_keys, index_query, indexer_decode,
                                      indexer_prefill)
from jax_flashmla.ops.sparse import mask_indices, sparse_mla_decode, sparse_mla_prefill

__all__ = ["IndexKeyCache", "IndexerWeights", "SparseKVCache", "index_keys", "index_query",
           "indexer_decode", "indexer_prefill", "mask_indices", "sparse_mla_decode",
           "sparse_mla_prefill", "V4KVCache", "write_sparse_kv"]
