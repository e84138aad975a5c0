"""HF weight import into the Flax MLA layer: names, prefixes, safetensors, errors (V3.2's layer's
indexer: tests/test_flax_sparse_mla.py)."""
import json

import numpy as np
import pytest

pytest.importorskip("flax")
torch = pytest.importorskip("torch")

import flax.nnx as nnx  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jax_flashmla.flax import (MLAConfig, MultiHeadLatentAttention,  # noqa: E402
                               load_attention_weights)
from jax_flashmla.flax.weights import attention_parameter_names  # noqa: E402
from helpers import fp8_checkpoint  # noqa: E402

PREFIX = "model.layers.1.self_attn."


def config(q_lora_rank=24, attention_bias=False):
    return MLAConfig(hidden_size=32, num_heads=2, q_lora_rank=q_lora_rank, kv_lora_rank=512,
                     qk_nope_head_dim=16, qk_rope_head_dim=64, v_head_dim=8,
                     attention_bias=attention_bias)


def hf_state_dict(cfg, dtype=torch.float32, seed=0):
    """Random tensors under HF's names and (out, in) shapes."""
    g = torch.Generator().manual_seed(seed)
    h, qk = cfg.num_heads, cfg.qk_head_dim
    shapes = {"kv_a_proj_with_mqa.weight": (cfg.kv_lora_rank + cfg.qk_rope_head_dim, cfg.hidden_size),
              "kv_a_layernorm.weight": (cfg.kv_lora_rank,),
              "kv_b_proj.weight": (h * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank),
              "o_proj.weight": (cfg.hidden_size, h * cfg.v_head_dim)}
    if cfg.q_lora_rank is None:
        shapes["q_proj.weight"] = (h * qk, cfg.hidden_size)
    else:
        shapes.update({"q_a_proj.weight": (cfg.q_lora_rank, cfg.hidden_size),
                       "q_a_layernorm.weight": (cfg.q_lora_rank,),
                       "q_b_proj.weight": (h * qk, cfg.q_lora_rank)})
    if cfg.attention_bias:
        shapes["kv_a_proj_with_mqa.bias"] = (cfg.kv_lora_rank + cfg.qk_rope_head_dim,)
        shapes["o_proj.bias"] = (cfg.hidden_size,)
        if cfg.q_lora_rank is not None:
            shapes["q_a_proj.bias"] = (cfg.q_lora_rank,)
    return {PREFIX + k: torch.randn(s, generator=g).to(dtype) for k, s in shapes.items()}


def check_loaded(layer, sd):
    for key, value in sd.items():
        sub, kind = key[len(PREFIX):].split(".")
        module = getattr(layer, sub)
        want = value.float().numpy()
        if kind == "weight" and hasattr(module, "kernel"):
            got, want = module.kernel[...], want.T
        else:
            got = module.bias[...] if kind == "bias" else module.weight[...]
        np.testing.assert_array_equal(np.asarray(got, np.float32), want)


@pytest.mark.parametrize("q_lora_rank,bias", [(24, False), (None, False), (24, True)])
def test_load_state_dict_with_prefix(q_lora_rank, bias):
    cfg = config(q_lora_rank, bias)
    sd = hf_state_dict(cfg)
    assert sorted(PREFIX + n for n in attention_parameter_names(cfg)) == sorted(sd)
    sd["model.layers.1.mlp.gate_proj.weight"] = torch.zeros(3)  # other keys are ignored
    layer = load_attention_weights(MultiHeadLatentAttention(cfg, rngs=nnx.Rngs(0)), sd,
                                   prefix=PREFIX)
    del sd["model.layers.1.mlp.gate_proj.weight"]
    check_loaded(layer, sd)


def test_bf16_tensors_and_bf16_params():
    cfg = config()
    sd = hf_state_dict(cfg, dtype=torch.bfloat16)
    layer = MultiHeadLatentAttention(cfg, rngs=nnx.Rngs(0), param_dtype=jnp.bfloat16)
    load_attention_weights(layer, sd, prefix=PREFIX)
    assert layer.kv_b_proj.kernel.dtype == jnp.bfloat16
    check_loaded(layer, sd)


def test_missing_and_misshapen_tensors():
    cfg = config()
    layer = MultiHeadLatentAttention(cfg, rngs=nnx.Rngs(0))
    sd = hf_state_dict(cfg)
    del sd[PREFIX + "kv_b_proj.weight"]
    with pytest.raises(KeyError, match="kv_b_proj.weight"):
        load_attention_weights(layer, sd, prefix=PREFIX)
    sd = hf_state_dict(cfg)
    sd[PREFIX + "o_proj.weight"] = torch.zeros(5, 7)
    with pytest.raises(ValueError, match="o_proj.weight"):
        load_attention_weights(layer, sd, prefix=PREFIX)
    with pytest.raises(TypeError, match="q_a_proj.weight"):
        load_attention_weights(layer, {**hf_state_dict(cfg), PREFIX + "q_a_proj.weight": "x"},
                               prefix=PREFIX)


def test_neither_a_layer_nor_weights_is_refused():
    cfg = config()
    with pytest.raises(TypeError, match="layer must be a MultiHeadLatentAttention, a "
                                        "SparseMultiHeadLatentAttention or a V4Attention; "
                                        "got Linear"):
        load_attention_weights(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), hf_state_dict(cfg))
    with pytest.raises(TypeError, match="weights must be a mapping from HF names to tensors or "
                                        "the path of a safetensors checkpoint; got list"):
        load_attention_weights(MultiHeadLatentAttention(cfg, rngs=nnx.Rngs(0)), [])


def test_safetensors_file_and_sharded_directory(tmp_path):
    st = pytest.importorskip("safetensors.torch")
    cfg = config()
    sd = hf_state_dict(cfg, dtype=torch.bfloat16)
    st.save_file(sd, str(tmp_path / "model.safetensors"))
    layer = load_attention_weights(MultiHeadLatentAttention(cfg, rngs=nnx.Rngs(0)),
                                   str(tmp_path / "model.safetensors"), prefix=PREFIX)
    check_loaded(layer, sd)

    shard_dir = tmp_path / "sharded"
    shard_dir.mkdir()
    keys = sorted(sd)
    shards = {"model-00001-of-00002.safetensors": keys[:3],
              "model-00002-of-00002.safetensors": keys[3:]}
    for name, ks in shards.items():
        st.save_file({k: sd[k] for k in ks}, str(shard_dir / name))
    weight_map = {k: name for name, ks in shards.items() for k in ks}
    (shard_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    layer = load_attention_weights(MultiHeadLatentAttention(cfg, rngs=nnx.Rngs(1)), shard_dir,
                                   prefix=PREFIX)
    check_loaded(layer, sd)
    with pytest.raises(ValueError, match="weights must be a .safetensors file or a checkpoint "
                                         "directory .*; got the path .*nowhere"):
        load_attention_weights(layer, str(tmp_path / "nowhere"), prefix=PREFIX)


def test_from_hf_names_a_missing_key():
    with pytest.raises(ValueError, match="the HF config has no 'num_attention_heads'"):
        MLAConfig.from_hf({"hidden_size": 64})
    with pytest.raises(ValueError, match="the HF config has no 'hidden_size'"):
        MLAConfig.from_hf({"num_attention_heads": 4})


@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.float8_e8m0fnu],
                         ids=["float32", "ue8m0"])
def test_fp8_weights_are_dequantized_by_their_block_scales(scale_dtype, tmp_path):
    """DeepSeek's FP8 checkpoints (V3's float32 scales, V4's ue8m0), as a state dict and as a
    sharded safetensors checkpoint whose scales sit in another shard: each weight is its e4m3
    values times its block's scale, exactly (float32 parameters)."""
    cfg = config()
    sd, want = fp8_checkpoint(hf_state_dict(cfg), scale_dtype)
    loaded = {"state dict": load_attention_weights(MultiHeadLatentAttention(
        cfg, rngs=nnx.Rngs(0)), sd, prefix=PREFIX)}
    st = pytest.importorskip("safetensors.torch")
    scales = sorted(k for k in sd if k.endswith("_scale_inv"))
    shards = {"model-00001-of-00002.safetensors": sorted(set(sd) - set(scales)),
              "model-00002-of-00002.safetensors": scales}
    for name, keys in shards.items():
        st.save_file({k: sd[k] for k in keys}, str(tmp_path / name))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {k: name for name, keys in shards.items() for k in keys}}))
    loaded["sharded"] = load_attention_weights(MultiHeadLatentAttention(cfg, rngs=nnx.Rngs(1)),
                                               tmp_path, prefix=PREFIX)
    for layer in loaded.values():
        for key, w in want.items():
            sub = key[len(PREFIX):].split(".")[0]
            np.testing.assert_array_equal(np.asarray(getattr(layer, sub).kernel[...]),
                                          w.numpy().T.astype(np.float32))
        np.testing.assert_array_equal(np.asarray(layer.kv_a_layernorm.weight[...]),
                                      sd[PREFIX + "kv_a_layernorm.weight"].numpy())


def test_an_fp8_weight_without_its_scales_or_with_misshapen_ones_is_refused():
    cfg = config()
    sd, _ = fp8_checkpoint(hf_state_dict(cfg), torch.float32)
    layer = MultiHeadLatentAttention(cfg, rngs=nnx.Rngs(0))
    key = PREFIX + "kv_b_proj.weight"
    with pytest.raises(ValueError, match=f"weights\\['{key}'\\] is float8_e4m3fn, a "
                                         "block-quantized checkpoint's weight, but weights has "
                                         f"no '{key}_scale_inv' to dequantize it by"):
        load_attention_weights(layer, {k: v for k, v in sd.items() if k != key + "_scale_inv"},
                               prefix=PREFIX)
    with pytest.raises(ValueError, match=r"kv_b_proj.weight_scale_inv'\] has shape \(2, 4\); "
                                         r"the float8_e4m3fn weight '.*kv_b_proj.weight' of "
                                         r"shape \(48, 512\) needs one scale per 128 x 128 "
                                         r"block, \(1, 4\)"):
        load_attention_weights(layer, {**sd, key + "_scale_inv": torch.ones(2, 4)},
                               prefix=PREFIX)


def test_deepseeks_own_names_are_v4s_only():
    layer = MultiHeadLatentAttention(config(), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="names='deepseek' are DeepSeek-V4's own; DeepSeek's V3 "
                                         "and V3.2 releases use HF's names: pass names='hf'"):
        load_attention_weights(layer, hf_state_dict(config()), prefix=PREFIX, names="deepseek")


def test_a_truncated_safetensors_file_is_refused(tmp_path):
    st = pytest.importorskip("safetensors.torch")
    cfg = config()
    path = tmp_path / "model.safetensors"
    st.save_file(hf_state_dict(cfg), str(path))
    path.write_bytes(path.read_bytes()[:-100])  # the last tensor loses its last 25 floats
    with pytest.raises(ValueError, match=r"should span \d+ bytes; its header gives \d+ and the "
                                         r"file holds \d+ of them"):
        load_attention_weights(MultiHeadLatentAttention(cfg, rngs=nnx.Rngs(0)), path,
                               prefix=PREFIX)
