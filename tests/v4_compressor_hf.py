"""HF transformers' DeepSeek-V4 attention layers (HCA and CSA) driven on CPU as the model
drives them, a request at a time, for the compressor tests: small seeded layers, their
compressors' weights for jax_flashmla, and the compressed entries HF's cache layer holds after
each call."""
import pathlib
import tomllib

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
modeling = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")
import transformers  # noqa: E402
from transformers.cache_utils import DynamicCache  # noqa: E402
from transformers.models.deepseek_v4.configuration_deepseek_v4 import (  # noqa: E402
    DeepseekV4Config)

from jax_flashmla.ops.compressor import CompressorWeights  # noqa: E402

# The oracle is the release the test extra pins (pyproject.toml): another release's V4 is not
# the reference these tests were written against, and its differences would read as ours. So
# they skip, saying why, as they do without transformers.
_TEST_EXTRA = tomllib.loads((pathlib.Path(__file__).parents[1] / "pyproject.toml").read_text())[
    "project"]["optional-dependencies"]["test"]
ORACLE = next(r for r in _TEST_EXTRA if r.startswith("transformers==")).split("==")[1]
if transformers.__version__ != ORACLE:
    pytest.skip(f"the V4 tests' oracle is HF transformers {ORACLE} (the test extra's pin); "
                f"found {transformers.__version__}", allow_module_level=True)

HCA, CSA = 0, 1  # the layers' indices
HIDDEN = 32
TORCH_DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}
# The parameters HF keeps in float32 whatever the model's dtype (_keep_in_fp32_modules_strict).
FLOAT32_PARAMETERS = ("position_bias", "kv_norm", "q_a_norm", "sinks")


def seed_weights(layers, dtype, std, unit_normal=("position_bias",)):
    """HF's attention layers given seeded weights, then cast to dtype (FLOAT32_PARAMETERS kept
    float32): norms ~N(1, 0.2), parameters named in unit_normal ~N(0, 1) (HF initialises
    position_bias to zeros: too easy), every other ~N(0, std(p))."""
    for layer in layers:
        with torch.no_grad():
            for name, p in layer.named_parameters():
                if name.endswith("norm.weight"):
                    p.normal_(1.0, 0.2)
                elif name.endswith(unit_normal):
                    p.normal_(0.0, 1.0)
                else:
                    p.normal_(0.0, std(p))
        layer.to(dtype)
        for name, p in layer.named_parameters():
            if name.removesuffix(".weight").split(".")[-1] in FLOAT32_PARAMETERS:
                p.data = p.data.float()


def config(hca_ratio=16):
    """A small V4 config: layer 0 HCA, layer 1 CSA (ratio 4); head_dim 64 with a 16-d rope,
    the indexer's 32 wide; the compress rope V4-Flash's (theta 160000, YaRN factor 16)."""
    cfg = DeepseekV4Config(
        hidden_size=HIDDEN, num_attention_heads=2, head_dim=64, q_lora_rank=16,
        num_hidden_layers=2, layer_types=["heavily_compressed_attention",
                                          "compressed_sparse_attention"],
        compress_rates={"compressed_sparse_attention": 4,
                        "heavily_compressed_attention": hca_ratio},
        index_n_heads=2, index_head_dim=32, index_topk=8, o_groups=2, o_lora_rank=8,
        sliding_window=8, partial_rotary_factor=0.25, max_position_embeddings=1 << 20,
        rope_parameters={"rope_type": "yarn", "factor": 16.0, "beta_fast": 32, "beta_slow": 1,
                         "original_max_position_embeddings": 65536})
    cfg._attn_implementation = "eager"
    return cfg


class HFLayers:
    """HF's HCA and CSA attention layers of one config with seeded weights, in dtype."""

    def __init__(self, cfg, dtype="float32", seed=0):
        torch.manual_seed(seed)
        self.cfg = cfg
        self.dtype = TORCH_DTYPES[dtype]
        self.layers = [modeling.DeepseekV4Attention(cfg, i) for i in (HCA, CSA)]
        self.rotary = modeling.DeepseekV4RotaryEmbedding(cfg)
        seed_weights(self.layers, self.dtype, lambda p: HIDDEN ** -0.5)
        self.inv_freq = self.layers[HCA].compressor.rotary_emb.compress_inv_freq.float().numpy()

    def weights(self, layer, indexer=False):
        """The compressor's (or the CSA indexer's compressor's) CompressorWeights, in the
        dtypes HF holds them."""
        module = self.layers[layer].compressor
        module = module.indexer if indexer else module
        tensors = {name: _jax(t) for name, t in module.state_dict().items()}
        return CompressorWeights.from_state_dict(tensors, self.cfg.rms_norm_eps)

    def state(self, request, layer, indexer=False):
        """HF's compressor state of a request: (buffered kv, buffered gate, overlap kv,
        overlap gate), each (n, width) float64 or None."""
        cache = request["cache"].layers[layer]
        name = "indexer" if indexer else "compressor"
        kept = (cache.buffer_kv[name], cache.buffer_gate[name],
                getattr(cache, "overlap_kv", {}).get(name),
                getattr(cache, "overlap_gate", {}).get(name))
        return tuple(None if t is None else t[0].double().numpy() for t in kept)

    def request(self):
        """A request's HF state: a fresh cache and its position."""
        return {"cache": DynamicCache(config=self.cfg), "position": 0}

    def feed(self, request, x):
        """Runs both layers on a request's new tokens x (n, hidden) as DeepseekV4Model does
        (positions after those fed before). Returns {(layer, indexer): the cumulative entries
        (count, dim) float64} from HF's cache layers."""
        n = x.shape[0]
        positions = torch.arange(n)[None] + request["position"]
        hidden = torch.as_tensor(np.asarray(x, np.float32)).to(self.dtype)[None]
        ropes = {kind: self.rotary(hidden, positions, layer_type=kind)
                 for kind in ("main", "compress")}
        with torch.no_grad():
            for layer in self.layers:
                layer(hidden, ropes, positions, None, cache=request["cache"])
        request["position"] += n
        out = {}
        for layer, indexer in ((HCA, False), (CSA, False), (CSA, True)):
            kept = request["cache"].layers[layer].compressed_kv["indexer" if indexer
                                                                else "compressor"]
            out[layer, indexer] = (np.zeros((0,)) if kept is None
                                   else kept[0].double().numpy())
        return out


def _jax(tensor):
    """A torch tensor as a JAX array of its dtype (bfloat16 through float32, exactly)."""
    if tensor.dtype == torch.bfloat16:
        return jnp.asarray(tensor.float().numpy(), jnp.bfloat16)
    return jnp.asarray(tensor.numpy())
