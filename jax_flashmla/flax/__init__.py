"""Flax NNX layers over jax_flashmla: DeepSeek's multi-head latent attention (V2/V3's, and
V3.2's sparse one) with HF weight import.

    from jax_flashmla.flax import MLAConfig, MultiHeadLatentAttention, load_attention_weights

Needs flax (NNX); imported only from here, never by `import jax_flashmla`.
"""
from jax_flashmla.flax.mla import MLAConfig, MultiHeadLatentAttention
from jax_flashmla.flax.sparse_mla import SparseMLAConfig, SparseMultiHeadLatentAttention
from jax_flashmla.flax.weights import load_attention_weights

__all__ = ["MLAConfig", "MultiHeadLatentAttention", "SparseMLAConfig",
           "SparseMultiHeadLatentAttention", "load_attention_weights"]
