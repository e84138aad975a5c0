"""Flax NNX layers over jax_flashmla: DeepSeek's multi-head latent attention with HF weight import.

    from jax_flashmla.flax import MLAConfig, MultiHeadLatentAttention, load_attention_weights

Needs flax (NNX); imported only from here, never by `import jax_flashmla`.
"""
from jax_flashmla.flax.mla import MLAConfig, MultiHeadLatentAttention, RMSNorm
from jax_flashmla.flax.sparse_mla import (SparseMLAConfig, SparseMultiHeadLatentAttention,
                                          load_sparse_attention_safetensors,
                                          load_sparse_attention_weights)
from jax_flashmla.flax.weights import load_attention_safetensors, load_attention_weights

__all__ = ["MLAConfig", "MultiHeadLatentAttention", "RMSNorm", "SparseMLAConfig",
           "SparseMultiHeadLatentAttention", "load_attention_safetensors",
           "load_attention_weights", "load_sparse_attention_safetensors",
           "load_sparse_attention_weights"]
