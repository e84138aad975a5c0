"""HF transformers' DeepSeek-V4 attention layers driven on CPU as DeepseekV4Model drives them,
a request at a time, for the V4 layer tests: small seeded layers of each type (sliding, HCA,
CSA) at V4's real head (512 = 448 + 64 RoPE dims, the FP8 page's row) and window (128), the
sliding-window causal mask and both ropes built per call as the model builds them, and each
call's output. The CSA layer's indexer is watched: each call's exact scores and selections are
kept, and a call may be handed the selections to use instead of HF's own (so that outputs can
be compared where FP8 scores tie differently)."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
modeling = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")
from transformers.cache_utils import DynamicCache  # noqa: E402
from transformers.masking_utils import create_sliding_window_causal_mask  # noqa: E402
from transformers.models.deepseek_v4.configuration_deepseek_v4 import (  # noqa: E402
    DeepseekV4Config)
from v4_compressor_hf import seed_weights  # noqa: E402

SLIDING, HCA, CSA = 0, 1, 2  # the layers' indices
LAYER_TYPES = ["sliding_attention", "heavily_compressed_attention", "compressed_sparse_attention"]
HIDDEN = 32
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def config(hca_ratio=16):
    """A small V4 config at V4's head: 4 heads of 512 (64 RoPE dims) in 2 output groups,
    q_lora_rank 16, an indexer of 4 heads of 128 keeping 8 entries; layers sliding, HCA
    (ratio hca_ratio), CSA (ratio 4); the compress rope V4-Flash's (theta 160000, YaRN factor
    16), the main one theta 10000."""
    cfg = DeepseekV4Config(
        hidden_size=HIDDEN, num_attention_heads=4, head_dim=512, q_lora_rank=16,
        num_hidden_layers=3, layer_types=LAYER_TYPES,
        compress_rates={"compressed_sparse_attention": 4,
                        "heavily_compressed_attention": hca_ratio},
        index_n_heads=4, index_head_dim=128, index_topk=8, o_groups=2, o_lora_rank=8,
        sliding_window=128, partial_rotary_factor=64 / 512,
        max_position_embeddings=1 << 20,
        rope_parameters={"rope_type": "yarn", "factor": 16.0, "beta_fast": 32, "beta_slow": 1,
                         "original_max_position_embeddings": 65536})
    cfg._attn_implementation = "eager"  # the masks reach only the eager attention
    return cfg


class HFLayers:
    """HF's three attention layers of one config with seeded weights, in dtype."""

    def __init__(self, cfg, dtype="float32", seed=0):
        torch.manual_seed(seed)
        self.cfg = cfg
        self.dtype = TORCH_DTYPES[dtype]
        self.layers = [modeling.DeepseekV4Attention(cfg, i) for i in range(len(LAYER_TYPES))]
        self.rotary = modeling.DeepseekV4RotaryEmbedding(cfg)
        seed_weights(self.layers, self.dtype, lambda p: p.shape[-1] ** -0.5,
                     unit_normal=("position_bias", "sinks"))
        indexer = self.layers[CSA].compressor.indexer
        indexer.scorer.register_forward_hook(self._keep_scores)
        indexer.register_forward_hook(self._select)
        self.indexer_call = {}  # the CSA indexer's last: "scores" (S, T) float64, "selected"
        self.forced = None

    def _keep_scores(self, module, args, scores):
        self.indexer_call = {"scores": scores[0].double().numpy()}

    def _select(self, module, args, selected):
        """Keeps HF's selections (1, S, k) (-1: masked) and returns the forced ones, if any:
        forced (S, >= k) int entries, -1 after them, cut to HF's k."""
        self.indexer_call["selected"] = selected[0].numpy()
        if self.forced is None:
            return None
        return torch.as_tensor(np.array(self.forced)[:, :selected.shape[-1]],
                               dtype=selected.dtype)[None]

    def state_dict(self, layer):
        """The layer's parameters under HF's names (prefix "self_attn."), torch tensors."""
        return {f"self_attn.{name}": t for name, t in self.layers[layer].state_dict().items()}

    def request(self):
        """A request's HF state: a fresh cache and its position."""
        return {"cache": DynamicCache(config=self.cfg), "position": 0}

    def feed(self, request, x, selected=None, layer=None):
        """Runs the layers on a request's new tokens x (n, hidden) as DeepseekV4Model does:
        positions after those fed before, the model's sliding-window causal mask and ropes.
        selected: optional (n, >= k) entries the CSA layer's tokens attend to instead of its
        indexer's choice (HF's k: min(index_topk, its entries)). layer: run only the sliding
        layer and this one (default all three; a request must be fed the same layers every
        call). Returns {layer: its output (n, hidden) float64}; the CSA indexer's call is
        indexer_call."""
        n = x.shape[0]
        positions = torch.arange(n)[None] + request["position"]
        hidden = torch.as_tensor(np.asarray(x, np.float32)).to(self.dtype)[None]
        mask = create_sliding_window_causal_mask(config=self.cfg, inputs_embeds=hidden,
                                                 attention_mask=None, cache=request["cache"],
                                                 position_ids=positions)
        ropes = {kind: self.rotary(hidden, positions, layer_type=kind)
                 for kind in ("main", "compress")}
        out = {}
        self.forced = selected
        with torch.no_grad():
            # The sliding one first: the mask reads the first sliding cache layer.
            for index in range(len(LAYER_TYPES)) if layer is None else sorted({SLIDING, layer}):
                y, _ = self.layers[index](hidden, ropes, positions, mask, cache=request["cache"])
                out[index] = y[0].double().numpy()
        request["position"] += n
        return out
