"""DeepSeek-V4's attention configuration: the fields of HF transformers' DeepseekV4Config that
its attention layers read, and their two ropes.

V4 has three attention layer types (V4Config.LAYER_TYPES, HF's config.layer_types strings):
sliding-window only, CSA (compressed sparse: a compressor of ratio 4 whose entries an indexer
selects) and HCA (heavily compressed: a compressor of ratio 128, every entry read). Sliding
layers rope with the "main" rope (plain, rope_theta); CSA and HCA layers, their queries, window
keys and compressed entries alike, with the "compress" rope (compress_rope_theta, YaRN in
V4-Flash, its attention factor 1).
"""
import dataclasses
import math

import numpy as np

from jax_flashmla.caches.v4 import ROPE_DIM, ROW_DIM
from jax_flashmla.flax import rope

@dataclasses.dataclass(frozen=True)
class V4Config:
    """DeepSeek-V4's attention configuration, under HF's DeepseekV4Config names where it has
    them.

    head_dim must be 512 and rope_head_dim 64: a token's K=V row is the FP8 page's row (448
    no-RoPE dims, then 64 RoPE dims; caches/v4.py). num_heads must be a multiple of o_groups
    (the output projection takes heads in o_groups contiguous groups). compress_rope_scaling
    is the compress rope's YaRN dict ({"rope_type": "yarn", "factor", "beta_fast", "beta_slow",
    "original_max_position_embeddings", "attention_factor"}) or None, stored as sorted (key,
    value) pairs so that the config hashes.

    A layer's type is one of HF's strings (DeepseekV4Config.layer_types), also named here:
    V4Config.SLIDING, V4Config.CSA, V4Config.HCA (LAYER_TYPES all three).
    """

    # Class attributes, not fields (no annotation).
    SLIDING = "sliding_attention"
    CSA = "compressed_sparse_attention"
    HCA = "heavily_compressed_attention"
    LAYER_TYPES = (SLIDING, CSA, HCA)

    hidden_size: int
    num_heads: int
    q_lora_rank: int
    head_dim: int = ROW_DIM
    rope_head_dim: int = ROPE_DIM
    o_groups: int = 8
    o_lora_rank: int = 1024
    sliding_window: int = 128
    csa_ratio: int = 4
    hca_ratio: int = 128
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    compress_rope_scaling: tuple | None = None
    max_position_embeddings: int = 1048576

    def __post_init__(self):
        for name in ("hidden_size", "num_heads", "q_lora_rank", "o_groups", "o_lora_rank",
                     "sliding_window", "csa_ratio", "hca_ratio", "index_n_heads",
                     "index_head_dim", "index_topk", "max_position_embeddings"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"V4Config: {name} must be a positive int; got {value!r}")
        if (self.head_dim, self.rope_head_dim) != (ROW_DIM, ROPE_DIM):
            raise ValueError(f"V4Config: head_dim must be {ROW_DIM} and rope_head_dim {ROPE_DIM} "
                             f"(the FP8 cache's row); got {self.head_dim}, {self.rope_head_dim}")
        if self.num_heads % self.o_groups:
            raise ValueError(f"V4Config: num_heads ({self.num_heads}) must be a multiple of "
                             f"o_groups ({self.o_groups})")
        for name in ("rms_norm_eps", "rope_theta", "compress_rope_theta"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"V4Config: {name} must be a positive finite number; "
                                 f"got {value!r}")
        scaling = self.compress_rope_scaling
        if isinstance(scaling, dict):
            scaling = tuple(sorted(scaling.items())) or None
        elif scaling is not None and not isinstance(scaling, tuple):
            raise TypeError(f"V4Config: compress_rope_scaling must be a dict or None; got "
                            f"{type(scaling)}")
        object.__setattr__(self, "compress_rope_scaling", scaling)
        if rope.rope_type(self.compress_rope_scaling_dict) == "yarn":
            rope.check_yarn(self.compress_rope_scaling_dict)

    @property
    def compress_rope_scaling_dict(self):
        return dict(self.compress_rope_scaling) if self.compress_rope_scaling else None

    @property
    def softmax_scale(self):
        """head_dim ** -0.5: V4 applies no YaRN correction to it."""
        return self.head_dim ** -0.5

    def ratio(self, layer_type):
        """The compressor's ratio of a layer type; 0 for a sliding layer (no compressor)."""
        check_layer_type(layer_type)
        return {self.SLIDING: 0, self.CSA: self.csa_ratio, self.HCA: self.hca_ratio}[layer_type]

    def rope(self, layer_type):
        """(inv_freq (rope_head_dim // 2,) float32 numpy, attention factor) of the rope a layer
        type uses: "main" for sliding layers, "compress" for CSA and HCA."""
        if self.ratio(layer_type) == 0:
            return rope.inv_freq_and_attention_factor(self.rope_head_dim, self.rope_theta)
        return compress_rope(self)

    @classmethod
    def from_hf(cls, config):
        """From an HF DeepseekV4Config (its rope_parameters nested {"main", "compress"}, as its
        __post_init__ leaves them)."""
        ropes = config.rope_parameters
        if not (isinstance(ropes, dict) and isinstance(ropes.get("compress"), dict)):
            raise ValueError("V4Config.from_hf: config.rope_parameters must be nested "
                             "{'main': ..., 'compress': ...} (a DeepseekV4Config's); got "
                             f"{ropes!r}")
        compress = {k: v for k, v in ropes["compress"].items()
                    if k not in ("rope_theta", "partial_rotary_factor")}
        rates = config.compress_rates
        return cls(hidden_size=config.hidden_size, num_heads=config.num_attention_heads,
                   q_lora_rank=config.q_lora_rank, head_dim=config.head_dim,
                   rope_head_dim=int(config.head_dim * config.partial_rotary_factor),
                   o_groups=config.o_groups, o_lora_rank=config.o_lora_rank,
                   sliding_window=config.sliding_window, csa_ratio=rates[cls.CSA],
                   hca_ratio=rates[cls.HCA], index_n_heads=config.index_n_heads,
                   index_head_dim=config.index_head_dim, index_topk=config.index_topk,
                   rms_norm_eps=float(config.rms_norm_eps),
                   rope_theta=float(ropes["main"]["rope_theta"]),
                   compress_rope_theta=float(ropes["compress"]["rope_theta"]),
                   compress_rope_scaling=(compress if rope.rope_type(compress) == "yarn"
                                          else None),
                   max_position_embeddings=config.max_position_embeddings)


def compress_rope(config):
    """(inv_freq float32 numpy, attention factor) of the compress rope (CSA and HCA layers and
    their compressors)."""
    inv_freq, factor = rope.inv_freq_and_attention_factor(
        config.rope_head_dim, config.compress_rope_theta, config.compress_rope_scaling_dict,
        config.max_position_embeddings)
    return np.asarray(inv_freq, np.float32), factor


def check_layer_type(layer_type):
    if layer_type not in V4Config.LAYER_TYPES:
        raise ValueError(f"layer_type must be one of {V4Config.LAYER_TYPES}; got {layer_type!r}")
