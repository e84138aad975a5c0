"""The Flax MLA layer against HF transformers' DeepSeek-V3 attention (CPU torch, random weights).

HF runs each request's whole sequence (prompt + decoded tokens) causally in float32; its
outputs at the prompt positions are the prefill oracle and those after it the decode oracle
(causal attention makes them equal to a step-by-step decode). The layer prefills the padded
batch in float32 into a bf16 paged cache, then decodes one token per step through mla_decode.
"""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("flax")

import flax.nnx as nnx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf  # noqa: E402

from jax_flashmla.caches import paged as cache  # noqa: E402
from jax_flashmla.flax import (MLAConfig, MultiHeadLatentAttention,  # noqa: E402
                               load_attention_weights)

YARN = {"type": "yarn", "factor": 40.0, "original_max_position_embeddings": 64,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
# V2-style YaRN with mscale != mscale_all_dim, so cos/sin carry an attention factor != 1.
YARN_V2 = {"type": "yarn", "factor": 16.0, "original_max_position_embeddings": 32,
           "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.5}


def hf_config(q_lora_rank, rope_scaling=None, rope_interleave=True):
    config = transformers.DeepseekV3Config(
        vocab_size=64, hidden_size=96, num_attention_heads=4, num_key_value_heads=4,
        q_lora_rank=q_lora_rank, kv_lora_rank=512, qk_nope_head_dim=32, qk_rope_head_dim=64,
        v_head_dim=48, rms_norm_eps=1e-6, rope_theta=10000.0, rope_scaling=rope_scaling,
        max_position_embeddings=2560, rope_interleave=rope_interleave, num_hidden_layers=1,
        intermediate_size=64, moe_intermediate_size=32, n_routed_experts=4, first_k_dense_replace=1)
    config._attn_implementation = "eager"
    return config


def hf_attention(config, seed=0):
    torch.manual_seed(seed)
    attn = hf.DeepseekV3Attention(config, layer_idx=0).eval()
    with torch.no_grad():
        for name, p in attn.named_parameters():
            if name.endswith("layernorm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
    return attn


def hf_forward(config, attn, x):
    """x (1, s, hidden) float32 numpy -> (1, s, hidden) numpy, causal over the whole row."""
    s = x.shape[1]
    hidden = torch.from_numpy(x)
    positions = torch.arange(s)[None]
    cos_sin = hf.DeepseekV3RotaryEmbedding(config)(hidden, positions)
    mask = torch.triu(torch.full((s, s), float("-inf")), diagonal=1)[None, None]
    with torch.no_grad():
        out, _ = attn(hidden, position_embeddings=cos_sin, attention_mask=mask)
    return out.numpy()


def flax_layer(config, attn, dtype=jnp.float32):
    layer = MultiHeadLatentAttention(MLAConfig.from_hf(config), rngs=nnx.Rngs(1),
                                     dtype=dtype, param_dtype=jnp.float32)
    return load_attention_weights(layer, attn.state_dict())


def rel_err(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def block_tables(lengths, max_pages, num_pages, seed=0):
    """A block table giving each request distinct, shuffled pages (-1 past its last page)."""
    pages = np.random.default_rng(seed).permutation(num_pages)
    table = np.full((len(lengths), max_pages), -1, np.int32)
    used = 0
    for i, n in enumerate(lengths):
        count = -(-n // 64)
        table[i, :count] = pages[used:used + count]
        used += count
    return jnp.asarray(table)


@pytest.fixture(autouse=True)
def float32_matmuls():
    """True float32 dots (no TF32 on GPUs), so float32 results can meet HF's float32 ones."""
    with jax.default_matmul_precision("highest"):
        yield


CASES = {
    "q_lora": dict(q_lora_rank=48),
    "no_q_lora": dict(q_lora_rank=None),
    "q_lora_yarn": dict(q_lora_rank=48, rope_scaling=YARN),
    "no_q_lora_yarn_v2": dict(q_lora_rank=None, rope_scaling=YARN_V2),
    "rotate_half": dict(q_lora_rank=48, rope_interleave=False),
}


@pytest.mark.parametrize("case", CASES)
def test_prefill_matches_hf_float32(case):
    config = hf_config(**CASES[case])
    attn = hf_attention(config)
    layer = flax_layer(config, attn)
    lengths = [5, 37, 70]
    rng = np.random.default_rng(1)
    xs = [rng.standard_normal((1, n, config.hidden_size)).astype(np.float32) for n in lengths]
    s = max(lengths)
    x = np.zeros((len(lengths), s, config.hidden_size), np.float32)
    for i, (n, xi) in enumerate(zip(lengths, xs)):
        x[i, :n] = xi[0]
    positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (len(lengths), s))
    out, kv = jax.jit(layer.prefill)(  # jitted: eagerly, each op would compile alone
        jnp.asarray(x), positions, lengths=jnp.asarray(lengths, jnp.int32))
    assert kv is None and out.dtype == jnp.float32
    for i, (n, xi) in enumerate(zip(lengths, xs)):
        want = hf_forward(config, attn, xi)[0]
        np.testing.assert_allclose(np.asarray(out[i, :n]), want, rtol=2e-4, atol=2e-4)


def test_softmax_scale_matches_hf():
    for rope_scaling in (None, YARN, YARN_V2):
        config = hf_config(48, rope_scaling)
        attn = hf.DeepseekV3Attention(config, layer_idx=0)
        assert MLAConfig.from_hf(config).softmax_scale == pytest.approx(attn.scaling, rel=1e-12)
    assert MLAConfig.from_hf(hf_config(48, YARN)).softmax_scale != pytest.approx(
        MLAConfig.from_hf(hf_config(48)).softmax_scale)


def run_prefill_then_decode(layer, lengths, inputs, steps, implementation, num_pages=8,
                            k_scale=None):
    """Prefills inputs[:, :length] into a paged bf16 cache (FP8 with k_scale), then decodes
    `steps` tokens one at a time (inputs[:, length + t]); returns (prefill outputs, list of
    (b, hidden) decode outputs)."""
    b = len(lengths)
    max_pages = 3
    table = block_tables([n + steps for n in lengths], max_pages, num_pages)
    kv = cache.PagedKVCache.create(num_pages, jnp.bfloat16 if k_scale is None
                                   else jnp.float8_e4m3fn)
    s = max(lengths)
    positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    valid = positions < jnp.asarray(lengths, jnp.int32)[:, None]
    slots = jnp.where(valid, cache.token_slots(table, positions), cache.INVALID_SLOT)
    prefill = jax.jit(lambda x, kv: layer.prefill(x, positions, kv, slots,
                                                  lengths=jnp.asarray(lengths, jnp.int32),
                                                  k_scale=k_scale))
    out, kv = prefill(jnp.asarray(inputs[:, :s]), kv)

    @jax.jit
    def decode(x, pos, kv):
        return layer.decode(x, pos[:, None], kv, table, pos + 1, implementation=implementation,
                            k_scale=k_scale)

    outs = []
    for t in range(steps):
        pos = jnp.asarray(lengths, jnp.int32) + t
        x = jnp.asarray(inputs[np.arange(b), np.asarray(pos)])[:, None]
        o, kv = decode(x, pos, kv)
        assert isinstance(kv, cache.PagedKVCache)
        outs.append(np.asarray(o[:, 0]))
    return out, outs


@pytest.mark.parametrize("implementation", ["custom_call", "reference"])
@pytest.mark.parametrize("case", ["q_lora", "no_q_lora", "q_lora_yarn"])
def test_paged_decode_matches_hf(case, implementation):
    config = hf_config(**CASES[case])
    attn = hf_attention(config, seed=2)
    layer = flax_layer(config, attn)
    lengths, steps = [3, 30, 62], 4  # the last request crosses a page boundary while decoding
    rng = np.random.default_rng(3)
    total = max(lengths) + steps
    inputs = rng.standard_normal((len(lengths), total, config.hidden_size)).astype(np.float32)
    prefill_out, decode_outs = run_prefill_then_decode(layer, lengths, inputs, steps,
                                                       implementation)
    for i, n in enumerate(lengths):
        want = hf_forward(config, attn, inputs[i:i + 1, :n + steps])[0]
        np.testing.assert_allclose(np.asarray(prefill_out[i, :n]), want[:n], rtol=2e-4, atol=2e-4)
        for t in range(steps):
            err = rel_err(decode_outs[t][i], want[n + t])
            assert err < 2e-2, (i, t, err)


@pytest.mark.parametrize("implementation", ["custom_call", "reference"])
def test_fp8_cache_decode_matches_hf_within_fp8_precision(implementation):
    """An FP8 cache (scale 0.05: these rows stay well inside e4m3's +-448 * scale) keeps e4m3's
    3 mantissa bits: ~6% of the output here, against 0.4% with the bf16 cache."""
    config = hf_config(**CASES["q_lora"])
    attn = hf_attention(config, seed=2)
    layer = flax_layer(config, attn)
    lengths, steps = [3, 30, 62], 4
    inputs = np.random.default_rng(3).standard_normal(
        (len(lengths), max(lengths) + steps, config.hidden_size)).astype(np.float32)
    _, decode_outs = run_prefill_then_decode(layer, lengths, inputs, steps, implementation,
                                             k_scale=jnp.float32(0.05))
    for i, n in enumerate(lengths):
        want = hf_forward(config, attn, inputs[i:i + 1, :n + steps])[0]
        for t in range(steps):
            err = rel_err(decode_outs[t][i], want[n + t])
            assert err < 0.1, (i, t, err)


def test_decode_bf16_layer_matches_hf():
    """A bf16 layer (bf16 compute, as served) stays within bf16 tolerance of float32 HF."""
    config = hf_config(48, YARN)
    attn = hf_attention(config, seed=4)
    layer = flax_layer(config, attn, dtype=jnp.bfloat16)
    lengths, steps = [9, 20], 3
    inputs = np.random.default_rng(5).standard_normal(
        (2, max(lengths) + steps, config.hidden_size)).astype(np.float32)
    prefill_out, decode_outs = run_prefill_then_decode(layer, lengths, inputs, steps, "custom_call")
    assert prefill_out.dtype == jnp.bfloat16
    for i, n in enumerate(lengths):
        want = hf_forward(config, attn, inputs[i:i + 1, :n + steps])[0]
        assert rel_err(prefill_out[i, :n], want[:n]) < 3e-2
        for t in range(steps):
            assert rel_err(decode_outs[t][i], want[n + t]) < 3e-2


def test_decode_rejects_small_latent():
    layer = MultiHeadLatentAttention(MLAConfig(hidden_size=32, num_heads=2, q_lora_rank=None,
                                               kv_lora_rank=64, qk_nope_head_dim=16,
                                               qk_rope_head_dim=16, v_head_dim=16),
                                     rngs=nnx.Rngs(0))
    x = jnp.zeros((1, 4, 32))
    pos = jnp.arange(4, dtype=jnp.int32)[None]
    assert layer.prefill(x, pos)[0].shape == (1, 4, 32)  # dense prefill works at any size
    kv = cache.PagedKVCache.create(1)
    with pytest.raises(ValueError, match="kv_lora_rank 512"):
        layer.decode(x[:, :1], pos[:, :1], kv, jnp.zeros((1, 1), jnp.int32),
                     jnp.ones((1,), jnp.int32))


def test_config_validation():
    with pytest.raises(ValueError, match="num_heads"):
        MLAConfig(hidden_size=8, num_heads=0)
    with pytest.raises(ValueError, match="q_lora_rank"):
        MLAConfig(hidden_size=8, num_heads=1, q_lora_rank=0)
    with pytest.raises(ValueError, match="rope"):
        MLAConfig(hidden_size=8, num_heads=1, rope_scaling={"type": "longrope", "factor": 2.0})
    with pytest.raises(TypeError, match="config"):
        MultiHeadLatentAttention({"hidden_size": 8}, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="rope_theta must be a positive finite number; got 0"):
        MLAConfig(hidden_size=8, num_heads=1, rope_theta=0)
    with pytest.raises(ValueError, match="rms_norm_eps must be a positive finite number"):
        MLAConfig(hidden_size=8, num_heads=1, rms_norm_eps=-1e-6)
    yarn = {"type": "yarn", "original_max_position_embeddings": 4096}
    with pytest.raises(ValueError, match="factor must be a positive finite number; got 0"):
        MLAConfig(hidden_size=8, num_heads=1, rope_scaling={**yarn, "factor": 0})
    with pytest.raises(ValueError, match=r"YaRN needs original_max_position_embeddings .*"
                                         r"\['factor', 'type'\]"):
        MLAConfig(hidden_size=8, num_heads=1, rope_scaling={"type": "yarn", "factor": 40})
    config = MLAConfig.from_hf(hf_config(48, YARN).to_dict())
    assert config.rope_scaling_dict["factor"] == 40.0 and config.q_lora_rank == 48
    hash(config)


# -- the served example (examples/serve_deepseek_mla.py) -----------------------------------------
def load_example():
    import importlib.util
    import pathlib
    import sys

    name = "serve_deepseek_mla"
    if name not in sys.modules:
        path = pathlib.Path(__file__).resolve().parents[1] / "examples" / f"{name}.py"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


@pytest.mark.parametrize("kv_cache_dtype", ["bfloat16", "fp8"])
@pytest.mark.parametrize("implementation", ["reference", "custom_call"])
def test_example_serves_to_completion(implementation, kv_cache_dtype):
    """Every request served, every page given back (serve raises on a leak)."""
    ex = load_example()
    args = ex.parse_args(["--implementation", implementation, "--kv-cache-dtype", kv_cache_dtype,
                          "--layers", "1", "--requests", "5", "--batch", "3", "--max-new", "6",
                          "--max-prompt", "70", "--quiet"])
    report = {}
    outputs = ex.serve(args, report)
    assert len(outputs) == 5 and all(3 <= len(o) <= 6 for o in outputs.values())
    assert report["page_allocations"] > 0 and report["chunks"] >= 5


def test_example_reads_the_same_tokens_after_launching_the_next_step():
    """The example's loop launches each decode step before it reads the last one's tokens:
    the tokens are those of the loop that reads each step's before launching the next."""
    ex = load_example()
    argv = ["--implementation", "custom_call", "--layers", "1", "--requests", "6", "--batch",
            "3", "--max-new", "8", "--max-prompt", "70", "--quiet"]
    overlapped = ex.serve(ex.parse_args(argv))
    assert overlapped == ex.serve(ex.parse_args(argv + ["--sync-each-step"]))
    assert sum(len(o) for o in overlapped.values()) > 6  # decode steps ran, not only prefills


def decode_inputs(ex, num_pages=6, batch=3, seed=0):
    """A seeded example model, random bf16 caches and a decode step's operands (row 2 idle)."""
    cfg = ex.dataclasses.replace(ex.mla_model.ModelConfig(), num_layers=2)
    graphdef, state, _, _ = ex.mla_model.build(cfg, num_pages, seed)
    keys = jax.random.split(jax.random.key(seed), cfg.num_layers)
    make_caches = lambda: tuple(  # noqa: E731
        cache.PagedKVCache(jax.random.normal(k, (num_pages, 64, 1, 576), jnp.bfloat16))
        for k in keys)
    tokens = jnp.asarray([5, 17, 0], jnp.int32)[:batch]
    seq_lens = jnp.asarray([70, 9, 0], jnp.int32)[:batch]
    table = jnp.asarray([[3, 1], [4, -1], [-1, -1]], jnp.int32)[:batch]
    return graphdef, state, make_caches, (tokens, seq_lens - 1, table, seq_lens)


def decode_hlo_and_logits(ex, implementation):
    graphdef, state, make_caches, operands = decode_inputs(ex)
    _, decode = ex.mla_model.make_steps(graphdef, implementation)
    hlo = decode.lower(state, *operands, make_caches(), None).compile().as_text()
    _, logits, _ = decode(state, *operands, make_caches(), None)
    return hlo, np.asarray(logits)


def check_decode_paths(ex, implementation):
    hlo, logits = decode_hlo_and_logits(ex, implementation)
    assert "jax_flashmla_mla_decode" in hlo
    ref_hlo, ref_logits = decode_hlo_and_logits(ex, "reference")
    assert "jax_flashmla_mla_decode" not in ref_hlo
    assert np.all(np.isfinite(logits))
    for row in range(2):  # the active rows; the idle row sees no key in either path
        assert rel_err(logits[row], ref_logits[row]) < 2e-2, row


def test_example_decode_calls_custom_call_cpu():
    """On CPU, implementation="custom_call" compiles to the custom call's C++ target."""
    check_decode_paths(load_example(), "custom_call")


@pytest.mark.gpu
def test_example_decode_calls_flashmla_on_gpu():
    """On a Hopper GPU the default implementation is FlashMLA's kernel, matching the reference."""
    check_decode_paths(load_example(), None)


def test_argument_errors():
    layer = flax_layer(hf_config(48), hf_attention(hf_config(48)))
    x = jnp.zeros((2, 3, 96))
    pos = jnp.zeros((2, 3), jnp.int32)
    with pytest.raises(ValueError, match="hidden_states"):
        layer.prefill(jnp.zeros((2, 3, 95)), pos)
    with pytest.raises(ValueError, match="positions"):
        layer.prefill(x, pos[:, :2])
    with pytest.raises(TypeError, match="positions"):
        layer.prefill(x, pos.astype(jnp.float32))
    with pytest.raises(ValueError, match="slots"):
        layer.prefill(x, pos, cache.PagedKVCache.create(1))
    out, _ = layer.prefill(x, pos, lengths=jnp.asarray([0, 3], jnp.int32))
    assert np.all(np.isfinite(np.asarray(out)))  # an empty row gives no NaN


def test_example_reports_a_pool_too_small_as_an_argument_error(capsys):
    with pytest.raises(SystemExit):
        load_example().parse_args(["--num-pages", "1"])
    assert "--num-pages 1 cannot hold a request of --max-prompt + --max-new" in (
        capsys.readouterr().err)


@pytest.mark.parametrize("implementation", ["custom_call", "reference"])
def test_a_position_past_the_block_table_decodes_empty(implementation):
    """A request whose new token lies past its block table (its length over max_pages * 64)
    writes nothing and attends to nothing: its output is o_proj's of zeros (no bias here), and
    the other requests' outputs are bit for bit those of the step with it idle."""
    config = hf_config(**CASES["q_lora"])
    layer = flax_layer(config, hf_attention(config, seed=2))
    lengths, max_pages, num_pages = [10, 20, 30], 3, 8
    table = block_tables(lengths, max_pages, num_pages)
    kv = cache.PagedKVCache.create(num_pages, jnp.bfloat16)
    x = jnp.asarray(np.random.default_rng(5).standard_normal((3, 1, config.hidden_size)),
                    jnp.float32)

    @jax.jit
    def decode(pos, seq_lens, kv):
        return layer.decode(x, pos[:, None], kv, table, seq_lens, implementation=implementation)

    past = max_pages * 64 + 5
    pos = jnp.asarray([10, past, 30], jnp.int32)
    out, new_kv = decode(pos, pos + 1, kv)
    idle_out, idle_kv = decode(pos, (pos + 1).at[1].set(0), kv)
    assert not np.any(np.asarray(out[1]))
    np.testing.assert_array_equal(np.asarray(out), np.asarray(idle_out))
    np.testing.assert_array_equal(np.asarray(new_kv.data, np.float32),
                                  np.asarray(idle_kv.data, np.float32))
