"""Flax NNX layers over jax_flashmla: DeepSeek's multi-head latent attention (V2/V3's, V3.2's
sparse one, and V4's of three layer types: sliding window, CSA, HCA) with HF weight import.

    from jax_flashmla.flax import MLAConfig, MultiHeadLatentAttention, load_attention_weights
    from jax_flashmla.flax import V4Attention, V4Config

load_attention_weights loads any of the three layers. Needs flax (NNX); imported only from
here, never by `import jax_flashmla`.
"""
from jax_flashmla.flax.mla import MLAConfig, MultiHeadLatentAttention
from jax_flashmla.flax.sparse_mla import SparseMLAConfig, SparseMultiHeadLatentAttention
from jax_flashmla.flax.v4_config import V4Config
from jax_flashmla.flax.v4_mla import V4Attention
from jax_flashmla.flax.weights import load_attention_weights

__all__ = ["MLAConfig", "MultiHeadLatentAttention", "SparseMLAConfig",
           "SparseMultiHeadLatentAttention", "V4Attention", "V4Config", "load_attention_weights"]
