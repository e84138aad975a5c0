"""Where DeepSeek-V4 attention weights (HF transformers' DeepseekV4Attention names) go in a
V4Attention; flax/weights.py's load_attention_weights loads them, from a state dict or
safetensors, as it loads V2/V3/V3.2's.

Names, relative to a layer's attention prefix (e.g. "model.layers.0.self_attn."):
q_a_proj.weight, q_a_norm.weight, q_b_proj.weight, kv_proj.weight, kv_norm.weight,
o_a_proj.weight, o_b_proj.weight, sinks, and in a compressing layer compressor.kv_proj.weight,
compressor.gate_proj.weight, compressor.position_bias, compressor.kv_norm.weight; a CSA layer's
indexer has the same four under compressor.indexer., and compressor.indexer.q_b_proj.weight,
compressor.indexer.scorer.weights_proj.weight. HF stores a Linear's weight as (out, in): the
nnx.Linear kernels (q_a_proj, q_b_proj, kv_proj, o_b_proj) take it transposed; the others keep
HF's layout. DeepSeek's V4 releases store the same tensors under DeepSeek's own names
(DEEPSEEK_NAMES, relative to "layers.<i>.attn."), which load_attention_weights reads with
names="deepseek".
"""
LINEARS = ("q_a_proj", "q_b_proj", "kv_proj", "o_b_proj")
NORMS = ("q_a_norm", "kv_norm")
COMPRESSOR = ("kv_proj.weight", "gate_proj.weight", "position_bias", "kv_norm.weight")
INDEXER = COMPRESSOR + ("q_b_proj.weight", "scorer.weights_proj.weight")

# HF's names -> DeepSeek's own, in its V4 releases (under "layers.<i>.attn."), which HF's
# loader renames to HF's (transformers' conversion_mapping, "deepseek_v4").
_COMPRESSOR_OWN = dict(zip(COMPRESSOR, ("wkv.weight", "wgate.weight", "ape", "norm.weight")))
DEEPSEEK_NAMES = {
    "q_a_proj.weight": "wq_a.weight", "q_b_proj.weight": "wq_b.weight",
    "kv_proj.weight": "wkv.weight", "o_a_proj.weight": "wo_a.weight",
    "o_b_proj.weight": "wo_b.weight", "q_a_norm.weight": "q_norm.weight",
    "kv_norm.weight": "kv_norm.weight", "sinks": "attn_sink",
    **{f"compressor.{hf}": f"compressor.{own}" for hf, own in _COMPRESSOR_OWN.items()},
    **{f"compressor.indexer.{hf}": f"indexer.compressor.{own}"
       for hf, own in _COMPRESSOR_OWN.items()},
    "compressor.indexer.q_b_proj.weight": "indexer.wq_b.weight",
    "compressor.indexer.scorer.weights_proj.weight": "indexer.weights_proj.weight"}


def v4_parameter_names(layer):
    """The HF names (no prefix) a V4Attention reads."""
    names = [f"{n}.weight" for n in LINEARS + NORMS] + ["o_a_proj.weight", "sinks"]
    if layer.compressor is not None:
        names += [f"compressor.{n}" for n in COMPRESSOR]
    if layer.indexer is not None:
        names += [f"compressor.indexer.{n}" for n in INDEXER]
    return names


def v4_parameter(layer, name):
    """The nnx.Param of a V4Attention that HF's `name` (no prefix) loads into, and whether HF's
    value is its transpose."""
    if name.startswith("compressor.indexer."):
        # V4Indexer's Params are HF's names' first parts, the scorer's weights_proj flattened.
        field = name.removeprefix("compressor.indexer.").removeprefix("scorer.").split(".")[0]
        return getattr(layer.indexer, field), False
    if name.startswith("compressor."):
        return getattr(layer.compressor, name.split(".")[1]), False
    if name in ("o_a_proj.weight", "sinks"):
        return getattr(layer, name.split(".")[0]), False
    sub = name.split(".")[0]
    return (getattr(layer, sub).kernel, True) if sub in LINEARS else (
        getattr(layer, sub).weight, False)

