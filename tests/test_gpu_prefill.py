"""On the GPU machine: mla_prefill through cuDNN at DeepSeek's head sizes (q/k 192, v 128)."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flashmla as jf
from prefill_cases import call, make_case
from test_prefill import BAD, GAPS, RAGGED, check_against_oracle, check_bad_value

pytestmark = pytest.mark.gpu

SCALE = 96 ** -0.5  # the oracle tests' scale (test_prefill.SCALE)
DEEPSEEK = dict(heads=16, nope=128, v_dim=128)


CASES = {"packed": dict(**RAGGED), "gaps": dict(**RAGGED, gaps=GAPS),
         "one request": dict(prefix_lens=[1500], query_lens=[300]),
         "one request, every row held": dict(prefix_lens=[1536], query_lens=[300], tail=0),
         "one request off row 0": dict(prefix_lens=[700], query_lens=[90], gaps=[11])}


@pytest.mark.parametrize("fp8_cache", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("layout", CASES)
def test_cudnn_matches_float64_oracle(layout, fp8_cache):
    """Several requests go through cuDNN's packed layout, one through its plain layout: with
    padding masks, or without where it holds every query and key row."""
    case = make_case(np.random.default_rng(0), **CASES[layout], fp8_cache=fp8_cache, **DEEPSEEK)
    out, lse = call(jf.mla_prefill, case, softmax_scale=SCALE, implementation="custom_call")
    check_against_oracle(case, out, lse)
    xla_out, xla_lse = call(jf.mla_prefill, case, softmax_scale=SCALE, implementation="reference")
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(xla_out, np.float32),
                               atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("fp8_cache", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("prefix", [1000, 4200, 8192])
def test_one_prefix_on_a_longer_axis_on_cudnn(prefix, fp8_cache):
    """One request's prefix on an axis of 8192 keys (a bucketed max_prefix_tokens): short of
    the axis, in the parts it fills (unmasked) and a masked last part of 2048 keys (1000: the
    last part alone; 4200: 4096 keys, then the last); filling it, in one unmasked call."""
    case = make_case(np.random.default_rng(4), [prefix], [300], tail=0, fp8_cache=fp8_cache,
                     **DEEPSEEK) | dict(max_prefix_tokens=8192)
    check_against_oracle(case, *call(jf.mla_prefill, case, softmax_scale=SCALE,
                                     implementation="custom_call"))


def test_cudnn_is_the_default_on_hopper():
    case = make_case(np.random.default_rng(1), [64], [32], **DEEPSEEK)
    static = {"max_prefix_tokens": 64}
    text = jax.jit(lambda c: call(jf.mla_prefill, c | static, softmax_scale=SCALE)).lower(
        {k: v for k, v in case.items() if k not in static}).as_text()
    assert "__cudnn$fmha" in text


def test_one_request_has_a_form_without_padding_masks():
    """One request's calls are compiled with padding masks and without, for when it holds
    every query and key row (cuDNN's masks cost time even where they hide nothing)."""
    case = make_case(np.random.default_rng(3), [1024], [256], tail=0, **DEEPSEEK)
    static = {"max_prefix_tokens": case["max_prefix_tokens"]}
    text = jax.jit(lambda c: call(jf.mla_prefill, c | static, softmax_scale=SCALE)).lower(
        {k: v for k, v in case.items() if k not in static}).as_text()
    masks = set(re.findall(r"mask_type(?:\\22|\W)+([A-Z_]+)", text))
    assert {"NO_MASK", "PADDING", "CAUSAL", "PADDING_CAUSAL"} <= masks, masks
    assert "stablehlo.case" in text or "stablehlo.if" in text


def test_keys_and_values_are_matmuls_of_their_own():
    """k's and v's matmuls of the new tokens' rows are not merged into one product that k
    and v are then copied out of (XLA's dot merger joins small matmuls sharing an operand)."""
    case = make_case(np.random.default_rng(2), [4096], [2048], **DEEPSEEK)
    static = {"max_prefix_tokens": case["max_prefix_tokens"]}
    text = jax.jit(lambda c: call(jf.mla_prefill, c | static, softmax_scale=SCALE)).lower(
        {k: v for k, v in case.items() if k not in static}).compile().as_text()
    rows, heads = case["q"].shape[:2]
    merged = f"[{rows},{heads * (192 + 128)}]"  # rows x (k's and v's columns together)
    assert merged not in text


@pytest.mark.parametrize("bad", BAD)
def test_bad_values_on_cudnn(bad):
    check_bad_value(bad, **DEEPSEEK)


def executable_temp_bytes(t, prefix, heads=128):
    q = jax.ShapeDtypeStruct((t, heads, 192), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((t, 576), jnp.bfloat16)
    pages = max(1, prefix // 64)
    cache = jax.ShapeDtypeStruct((pages, 64, 1, 576), jnp.bfloat16)
    table = jax.ShapeDtypeStruct((1, pages), jnp.int32)
    lens = jax.ShapeDtypeStruct((1,), jnp.int32)
    w = jax.ShapeDtypeStruct((512, heads, 128), jnp.bfloat16)
    fn = jax.jit(lambda *a: jf.mla_prefill(*a[:6], w_uk=a[6], w_uv=a[7], softmax_scale=0.07,
                                           max_prefix_tokens=prefix))
    return fn.lower(q, kv, cache, table, lens, lens, w, w).compile().memory_analysis(
    ).temp_size_in_bytes


def test_memory_linear_at_deepseek_sizes():
    """128 heads: the compiled temporaries at most double with the tokens or the prefix."""
    prompts = [executable_temp_bytes(t, 0) for t in (16384, 32768, 65536)]
    assert prompts[1] <= 2.2 * prompts[0] and prompts[2] <= 2.2 * prompts[1], prompts
    chunks = [executable_temp_bytes(2048, p) for p in (32768, 65536, 131072)]
    assert chunks[1] <= 2.2 * chunks[0] and chunks[2] <= 2.2 * chunks[1], chunks


def test_a_128k_prompt_at_128_heads():
    """A 131072-token prompt: its last queries against attention computed for them alone."""
    t, h = 131072, 128
    key = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(key[0], (t, h, 192), jnp.bfloat16)
    kv = jax.random.normal(key[1], (t, 576), jnp.bfloat16)
    w_uk = (jax.random.normal(key[2], (512, h, 128)) / 512 ** 0.5).astype(jnp.bfloat16)
    w_uv = (jax.random.normal(key[3], (512, h, 128)) / 512 ** 0.5).astype(jnp.bfloat16)
    out, lse = jax.jit(lambda *a: jf.mla_prefill(*a[:2], w_uk=a[2], w_uv=a[3],
                                                 softmax_scale=192 ** -0.5))(q, kv, w_uk, w_uv)
    last, group = 4, 16

    @jax.jit
    def reference(q, kv, w_uk, w_uv):
        """The last queries' attention, 16 heads at a time (all 128 at once in float32 would
        take 21 GB)."""
        def heads(args):
            q, w_uk, w_uv = args  # (last, group, 192), (512, group, 128) twice
            k_nope = jnp.einsum("sc,chd->shd", kv[:, :512], w_uk,
                                preferred_element_type=jnp.float32).astype(jnp.bfloat16)
            k = jnp.concatenate([k_nope, jnp.broadcast_to(kv[:, None, 512:], (t, group, 64))],
                                -1)
            v = jnp.einsum("sc,chd->shd", kv[:, :512], w_uv,
                           preferred_element_type=jnp.float32).astype(jnp.bfloat16)
            s = jnp.einsum("qhd,shd->hqs", q.astype(jnp.float32), k.astype(jnp.float32),
                           precision="highest") * 192 ** -0.5
            causal = jnp.arange(t)[None, :] <= (t - last + jnp.arange(last))[:, None]
            s = jnp.where(causal[None], s, -jnp.inf)
            out = jnp.einsum("hqs,shd->qhd", jax.nn.softmax(s, axis=-1), v.astype(jnp.float32))
            return out, jax.nn.logsumexp(s, axis=-1)

        split = lambda x: jnp.moveaxis(x.reshape(*x.shape[:-2], h // group, group, -1), -3, 0)
        out, lse = jax.lax.map(heads, (split(q[-last:]), split(w_uk), split(w_uv)))
        return (jnp.moveaxis(out, 0, 1).reshape(last, h, 128), lse.reshape(h, last))

    want, want_lse = reference(q, kv, w_uk, w_uv)
    np.testing.assert_allclose(np.asarray(out[-last:], np.float32), np.asarray(want),
                               atol=2e-2, rtol=2e-2)
    np.testing.assert_allclose(np.asarray(lse[:, -last:]), np.asarray(want_lse), rtol=1e-3)
    assert np.isfinite(np.asarray(lse)).all()


@pytest.mark.parametrize("fp8_cache", [False, True], ids=["bf16", "fp8"])
def test_the_layers_two_forms_agree(fp8_cache):
    """The Flax layer's extend of a ragged batch over cached prefixes: the absorbed form
    (FlashMLA's decode) against the expanded one (cuDNN), both in bf16. With an FP8 cache the
    absorbed form's q is quantized to FP8 too (FlashMLA's FP8 decode): a looser tolerance."""
    import flax.nnx as nnx

    from jax_flashmla.flax import MLAConfig, MultiHeadLatentAttention
    config = MLAConfig(hidden_size=512, num_heads=16, q_lora_rank=96)
    layer = MultiHeadLatentAttention(config, rngs=nnx.Rngs(0), dtype=jnp.bfloat16,
                                     param_dtype=jnp.bfloat16)
    prefix_lens = jnp.asarray([0, 63, 1000, 4000], jnp.int32)
    lengths = jnp.asarray([64, 1, 37, 64], jnp.int32)
    table = jnp.arange(4 * 64, dtype=jnp.int32).reshape(4, 64)
    dtype, k_scale = (jnp.float8_e4m3fn, jnp.float32(0.05)) if fp8_cache else (jnp.bfloat16, None)
    kv = jnp.zeros((256, 64, 1, 576), dtype)
    key = jax.random.split(jax.random.key(1), 2)
    prefix = jax.random.normal(key[0], (4, 4000, 512), jnp.bfloat16)
    pos = jnp.broadcast_to(jnp.arange(4000, dtype=jnp.int32), (4, 4000))
    slots = jnp.where(pos < prefix_lens[:, None], jf.token_slots(table, pos), -1)
    _, kv = layer.prefill(prefix, pos, kv, slots, k_scale=k_scale)
    x = jax.random.normal(key[1], (4, 64, 512), jnp.bfloat16)
    new_pos = prefix_lens[:, None] + jnp.arange(64, dtype=jnp.int32)
    outs = {form: layer.extend(x, new_pos, kv, table, prefix_lens, max_prefix_tokens=5120,
                               lengths=lengths, k_scale=k_scale, form=form)[0]
            for form in ("absorbed", "expanded")}
    for i, n in enumerate(np.asarray(lengths)):
        a, e = (np.asarray(outs[f][i, :n], np.float32) for f in ("absorbed", "expanded"))
        assert np.linalg.norm(a - e) / np.linalg.norm(e) < (1e-1 if fp8_cache else 3e-2), i
