"""The Flax layer's extend against HF's DeepSeek-V3 attention continuing from a DynamicCache.

Each request's prefix goes through HF's attention into a DynamicCache, then its new tokens
through the same attention with that cache; the layer prefills the same prefixes into a bf16
paged cache and extends the ragged batch of new tokens over them in one call.
"""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("flax")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf  # noqa: E402

import jax_flashmla as jf  # noqa: E402
from test_flax_mla import (CASES, block_tables, flax_layer, float32_matmuls, hf_attention,  # noqa: E402,F401
                           hf_config, rel_err)


def hf_extend(config, attn, prefix, new):
    """HF's outputs for `new` (1, n, hidden) after `prefix` (1, p, hidden) went into a
    DynamicCache."""
    rotary = hf.DeepseekV3RotaryEmbedding(config)
    cache = transformers.DynamicCache(config=config)
    p, n = prefix.shape[1], new.shape[1]
    with torch.no_grad():
        for x, start in ((prefix, 0), (new, p)):
            if x.shape[1] == 0:  # no prefix: nothing to cache
                continue
            x = torch.from_numpy(x)
            s = x.shape[1]
            cos_sin = rotary(x, torch.arange(start, start + s)[None])
            mask = torch.triu(torch.full((s, start + s), float("-inf")), diagonal=start + 1)
            out, _ = attn(x, position_embeddings=cos_sin, attention_mask=mask[None, None],
                          cache=cache)
    assert out.shape[1] == n
    return out.numpy()[0]


@pytest.mark.parametrize("case", ["q_lora_yarn", "no_q_lora", "rotate_half"])
def test_extend_matches_hf_with_a_dynamic_cache(case):
    config = hf_config(**CASES[case])
    attn = hf_attention(config)
    layer = flax_layer(config, attn)
    prefix_lens, new_lens = [5, 64, 130, 0], [3, 40, 64, 20]
    rng = np.random.default_rng(2)
    hidden = config.hidden_size
    seqs = [rng.standard_normal((1, p + n, hidden)).astype(np.float32)
            for p, n in zip(prefix_lens, new_lens)]
    b, s_new, s_pre = len(seqs), max(new_lens), max(prefix_lens)
    table = block_tables([p + n for p, n in zip(prefix_lens, new_lens)], 4, 16)
    kv = jnp.zeros((16, 64, 1, 576), jnp.bfloat16)

    def padded(parts, width, start):
        x = np.zeros((b, width, hidden), np.float32)
        pos = np.zeros((b, width), np.int32)
        for i, (part, st) in enumerate(zip(parts, start)):
            x[i, :part.shape[1]] = part[0]
            pos[i] = st + np.arange(width)
        return jnp.asarray(x), jnp.asarray(pos)

    pre_x, pre_pos = padded([x[:, :p] for x, p in zip(seqs, prefix_lens)], s_pre, [0] * b)
    real = np.arange(s_pre)[None, :] < np.asarray(prefix_lens)[:, None]
    slots = jnp.where(real, jf.token_slots(table, pre_pos), -1)
    _, kv = jax.jit(layer.prefill)(pre_x, pre_pos, kv, slots)  # eagerly, op by op compiles
    new_x, new_pos = padded([x[:, p:] for x, p in zip(seqs, prefix_lens)], s_new, prefix_lens)
    extend = jax.jit(lambda x, pos, kv, lens: layer.extend(
        x, pos, kv, table, jnp.asarray(prefix_lens, jnp.int32), max_prefix_tokens=320,
        lengths=lens))
    out, kv = extend(new_x, new_pos, kv, jnp.asarray(new_lens, jnp.int32))
    for i, (x, p, n) in enumerate(zip(seqs, prefix_lens, new_lens)):
        want = hf_extend(config, attn, x[:, :p], x[:, p:])
        # The prefix's rows come back from a bf16 cache: its rounding, nothing more.
        assert rel_err(out[i, :n], want) < 1e-2, (i, rel_err(out[i, :n], want))
        assert np.all(np.asarray(out[i, n:]) == np.asarray(layer.o_proj(
            jnp.zeros((1, 4 * config.v_head_dim)))))  # padding: o_proj of a zero attention
    # The new rows went to their slots: prefix + n rows of each request are now cached.
    rows = np.asarray(kv[np.asarray(table)[:, :4]].reshape(b, 256, 576).astype(jnp.float32))
    for i, (p, n) in enumerate(zip(prefix_lens, new_lens)):
        assert np.isfinite(rows[i, :p + n]).all() and np.abs(rows[i, p:p + n]).sum() > 0


@pytest.mark.parametrize("form,decode_implementation", [("expanded", None),
                                                        ("absorbed", "reference"),
                                                        ("absorbed", "custom_call")])
def test_both_forms_match_hf_in_bf16(form, decode_implementation):
    """A bf16 layer's extend in either form, the absorbed one through mla_decode (its pure-JAX
    reference and its C++ model), against HF in float32: bf16's precision, as decode's."""
    config = hf_config(**CASES["q_lora_yarn"])
    attn = hf_attention(config)
    layer = flax_layer(config, attn, dtype=jnp.bfloat16)
    prefix_lens, new_lens = [70, 0, 130], [9, 33, 64]
    rng = np.random.default_rng(3)
    seqs = [rng.standard_normal((1, p + n, config.hidden_size)).astype(np.float32)
            for p, n in zip(prefix_lens, new_lens)]
    table = block_tables([p + n for p, n in zip(prefix_lens, new_lens)], 4, 16)
    kv = jnp.zeros((16, 64, 1, 576), jnp.bfloat16)
    b, s_pre, s_new = 3, max(prefix_lens), max(new_lens)
    pre_x = np.zeros((b, s_pre, config.hidden_size), np.float32)
    new_x = np.zeros((b, s_new, config.hidden_size), np.float32)
    for i, (x, p, n) in enumerate(zip(seqs, prefix_lens, new_lens)):
        pre_x[i, :p], new_x[i, :n] = x[0, :p], x[0, p:]
    pre_pos = jnp.broadcast_to(jnp.arange(s_pre, dtype=jnp.int32), (b, s_pre))
    real = np.arange(s_pre)[None, :] < np.asarray(prefix_lens)[:, None]
    # Jitted: eagerly, each op would compile alone.
    _, kv = jax.jit(layer.prefill)(jnp.asarray(pre_x), pre_pos, kv,
                                   jnp.where(real, jf.token_slots(table, pre_pos), -1))
    new_pos = jnp.asarray(prefix_lens, jnp.int32)[:, None] + jnp.arange(s_new, dtype=jnp.int32)
    out, _ = jax.jit(lambda *args, lengths: layer.extend(
        *args, max_prefix_tokens=320, lengths=lengths, form=form,
        decode_implementation=decode_implementation))(
        jnp.asarray(new_x), new_pos, kv, table, jnp.asarray(prefix_lens, jnp.int32),
        lengths=jnp.asarray(new_lens, jnp.int32))
    for i, (x, p, n) in enumerate(zip(seqs, prefix_lens, new_lens)):
        assert rel_err(out[i, :n], hf_extend(config, attn, x[:, :p], x[:, p:])) < 3e-2
        assert np.all(np.isfinite(np.asarray(out[i])))


def test_the_form_chosen_for_a_chunk():
    config = hf_config(48)
    attn = hf_attention(config)
    bf16, f32 = flax_layer(config, attn, dtype=jnp.bfloat16), flax_layer(config, attn)
    assert bf16._extend_form(None, 64) == "absorbed"  # 4 heads: 256 query rows
    assert bf16._extend_form(None, 1024) == "expanded"  # past ABSORBED_MAX_TOKENS
    assert f32._extend_form(None, 64) == "expanded"  # mla_decode takes bf16 / fp16 only
    with pytest.raises(ValueError, match="form must be None, 'absorbed' or 'expanded'"):
        bf16._extend_form("latent", 64)
    with pytest.raises(ValueError, match=r"132 \* 64 query rows"):
        bf16._extend_form("absorbed", 4096)


@pytest.mark.parametrize("form", ["expanded", "absorbed"])
def test_extend_writes_the_donated_cache_in_place(form):
    """Jitted with the cache donated, extend's output cache aliases the input's buffer, and
    the executable holds no temporary the size of the cache."""
    config = hf_config(48)
    layer = flax_layer(config, hf_attention(config), dtype=jnp.bfloat16)
    kv = jnp.zeros((64, 64, 1, 576), jnp.bfloat16)
    table = jnp.arange(64, dtype=jnp.int32).reshape(2, 32)
    x = jnp.zeros((2, 32, config.hidden_size), jnp.float32)
    prefix = jnp.asarray([100, 0], jnp.int32)
    pos = prefix[:, None] + jnp.arange(32, dtype=jnp.int32)
    step = jax.jit(lambda kv, x: layer.extend(x, pos, kv, table, prefix, max_prefix_tokens=128,
                                              form=form)[1], donate_argnums=0)
    stats = step.lower(kv, x).compile().memory_analysis()
    assert stats.alias_size_in_bytes >= kv.nbytes
    assert stats.temp_size_in_bytes < kv.nbytes
