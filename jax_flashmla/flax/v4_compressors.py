"""The parameters of DeepSeek-V4's compressors and of CSA's lightning indexer as Flax NNX
modules, named and laid out as HF transformers' (the arithmetic is jax_flashmla.ops.compressor's
and jax_flashmla.ops.v4_indexer's)."""
import flax.nnx as nnx
import jax
import jax.numpy as jnp

from jax_flashmla.ops.compressor import CompressorWeights
from jax_flashmla.ops.v4_indexer import V4IndexerWeights

# HF's (out, in) layout: fan-in is the last axis.
_INIT = jax.nn.initializers.lecun_normal(in_axis=-1, out_axis=-2)


class V4Compressor(nnx.Module):
    """A compressor's parameters, nnx.Params named and laid out as HF's (CompressorWeights'
    fields): kv_proj and gate_proj (width, hidden_size) in param_dtype, position_bias
    (ratio, width) and kv_norm (head_dim,) float32; width head_dim (HCA) or 2 * head_dim
    (overlap: CSA's and its indexer's)."""

    def __init__(self, config, ratio, head_dim, *, overlap, rngs, param_dtype):
        width = 2 * head_dim if overlap else head_dim
        self.kv_proj = nnx.Param(_INIT(rngs.params(), (width, config.hidden_size), param_dtype))
        self.gate_proj = nnx.Param(_INIT(rngs.params(), (width, config.hidden_size),
                                         param_dtype))
        self.position_bias = nnx.Param(jnp.zeros((ratio, width), jnp.float32))
        self.kv_norm = nnx.Param(jnp.ones((head_dim,), jnp.float32))
        self.eps = config.rms_norm_eps

    def compressor_weights(self):
        """The parameters' current values as CompressorWeights."""
        return CompressorWeights(kv_proj=self.kv_proj[...], gate_proj=self.gate_proj[...],
                                 position_bias=self.position_bias[...],
                                 kv_norm=self.kv_norm[...], eps=self.eps)


class V4Indexer(V4Compressor):
    """A CSA layer's lightning indexer (HF's compressor.indexer): its own overlapping compressor
    of index_head_dim (128) dims at the CSA ratio (V4Compressor's parameters), q_b_proj
    (index_n_heads * 128, q_lora_rank) and weights_proj (index_n_heads, hidden_size) (HF's
    scorer.weights_proj), both in HF's (out, in) layout and param_dtype."""

    def __init__(self, config, *, rngs, param_dtype):
        super().__init__(config, config.csa_ratio, config.index_head_dim, overlap=True,
                         rngs=rngs, param_dtype=param_dtype)
        heads = config.index_n_heads
        self.q_b_proj = nnx.Param(_INIT(rngs.params(),
                                        (heads * config.index_head_dim, config.q_lora_rank),
                                        param_dtype))
        self.weights_proj = nnx.Param(_INIT(rngs.params(), (heads, config.hidden_size),
                                            param_dtype))

    def indexer_weights(self):
        """The parameters' current values as V4IndexerWeights."""
        return V4IndexerWeights(wq_b=self.q_b_proj[...], weights_proj=self.weights_proj[...],
                                compressor=self.compressor_weights())
