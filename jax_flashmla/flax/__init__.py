"""Flax NNX layers over jax_flashmla: DeepSeek's multi-head latent attention with HF weight import.

    from jax_flashmla.flax import MLAConfig, MultiHeadLatentAttention, load_attention_weights

Needs flax (NNX); imported only from here, never by `import jax_flashmla`.
"""
from jax_flashmla.flax.mla import MLAConfig, MultiHeadLatentAttention, RMSNorm
from jax_flashmla.flax.rope import softmax_scale, yarn_get_mscale
from jax_flashmla.flax.weights import (attention_parameter_names, load_attention_safetensors,
                                       load_attention_weights, read_safetensors)

__all__ = ["MLAConfig", "MultiHeadLatentAttention", "RMSNorm", "attention_parameter_names",
           "load_attention_safetensors", "load_attention_weights", "read_safetensors",
           "softmax_scale", "yarn_get_mscale"]
