"""DeepSeek-V3.2's attention layer against HF transformers' DeepseekV32Attention (CPU torch,
random weights, index_topk 16 so that contexts above it stay tiny).

HF's eager attention turns its indexer's top-k into a mask over dense attention, the indexer
unrotated and in float32; the layer's indexer scores FP8 keys. So, per token:
  - the selections agree as in tests/test_indexer.py: the same tokens but for pairs whose
    float64 scores (HF's formula, read off a float64 copy of HF's attention) lie within twice
    the FP8 scores' error of each other;
  - the outputs match HF's where the selections agree, and match everywhere HF's attention
    run with the layer's selection in place of its indexer's.
HF runs one request at a time: the prompt, then the decode steps through its DynamicCache (its
indexer keys in the cache's DynamicIndexedLayer). The layer runs the padded batch under jit,
donating both caches, which must be written in place. Cache pages start as NaN bytes, so a
read of a slot nothing was written to shows in the outputs.
"""
import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("flax")

import flax.nnx as nnx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from transformers.models.deepseek_v32 import modeling_deepseek_v32 as hf  # noqa: E402

from jax_flashmla import PagedKVCache  # noqa: E402
from jax_flashmla.kernels import library as kernels
from jax_flashmla.flax import (MLAConfig, SparseMLAConfig,  # noqa: E402
                               SparseMultiHeadLatentAttention, load_attention_weights)
from jax_flashmla.flax.weights import layer_parameter_names  # noqa: E402
from jax_flashmla.sparse import (IndexKeyCache, SparseKVCache, indexer_decode,  # noqa: E402
                                 indexer_prefill)
from jax_flashmla.ops.indexer import IndexQuery, index_scores  # noqa: E402
from jax_flashmla.caches.sparse import TOKEN_BYTES  # noqa: E402
from jax_flashmla.caches.index_keys import PAGE_BYTES  # noqa: E402
from test_flax_mla import float32_matmuls, rel_err  # noqa: E402,F401
from indexer_cases import (assert_same_selection, paged_block_table,  # noqa: E402
                           selected_positions)

TOPK = 16
# A long prompt's sparse attention against HF's in float32: the pure-JAX reference computes in
# float32; FlashMLA's sparse prefill kernel, where it runs, takes q and the rows in bfloat16.
SPARSE_PREFILL_TOL = 1e-2 if kernels.flashmla_available() else 2e-4
_index_scores = jax.jit(index_scores)  # jitted: eagerly, each of their ops would compile alone
_indexer_prefill = jax.jit(indexer_prefill, static_argnames="topk")
_indexer_decode = jax.jit(indexer_decode, static_argnames="topk")
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 16.0,
        "original_max_position_embeddings": 160, "beta_fast": 32, "beta_slow": 1,
        "mscale": 0.707, "mscale_all_dim": 0.5}  # cos and sin scaled: the indexer's rope too


def hf_config(rope_parameters=None):
    config = transformers.DeepseekV32Config(
        vocab_size=64, hidden_size=96, num_attention_heads=4, num_key_value_heads=4,
        q_lora_rank=48, kv_lora_rank=512, qk_nope_head_dim=32, qk_rope_head_dim=64,
        v_head_dim=48, index_n_heads=4, index_head_dim=128, index_topk=TOPK,
        num_hidden_layers=1, intermediate_size=64, moe_intermediate_size=32,
        n_routed_experts=4, n_group=1, topk_group=1, num_experts_per_tok=2,
        max_position_embeddings=2560,
        rope_parameters=rope_parameters or {"rope_type": "default", "rope_theta": 10000.0})
    config._attn_implementation = "eager"
    return config


def hf_attention(config, seed):
    torch.manual_seed(seed)
    attn = hf.DeepseekV32Attention(config, layer_idx=0).eval()
    with torch.no_grad():
        for name, p in attn.named_parameters():
            if name.endswith(("layernorm.weight", "k_norm.weight")):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith("k_norm.bias"):
                p.copy_(0.2 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
    return attn


def sparse_layer(config, attn):
    layer = SparseMultiHeadLatentAttention(SparseMLAConfig.from_hf(config), rngs=nnx.Rngs(0))
    return load_attention_weights(layer, attn.state_dict())


def hf_run(config, attn, x, chunks, forced=None):
    """HF's attention over one request x (n, hidden), fed in chunks (sizes summing to n: a
    prompt, then decode steps) through a DynamicCache.

    forced: None, or per token the positions it attends to in place of its indexer's.
    Returns (out (n, hidden), per token the positions HF's indexer selected, up to itself).
    """
    rotary = hf.DeepseekV32RotaryEmbedding(config)
    cache = transformers.DynamicCache(config=config)
    indexer_forward = attn.indexer.forward
    outs, selected, start = [], [], 0

    def indexer(*args, **kwargs):
        chosen = indexer_forward(*args, **kwargs)
        size = chosen.shape[1]
        selected.extend([p for p in row if p <= start + j]
                        for j, row in enumerate(chosen[0].tolist()))
        if forced is None:
            return chosen
        # Padded with the token itself, which every selection holds anyway.
        rows = [list(forced[start + j]) + [start + j] * (TOPK - len(forced[start + j]))
                for j in range(size)]
        return torch.tensor(rows, dtype=torch.int32)[None]

    attn.indexer.forward = indexer
    try:
        for size in chunks:
            h = torch.from_numpy(x[start:start + size])[None]
            mask = torch.triu(torch.full((size, start + size), float("-inf")), diagonal=start + 1)
            cos_sin = rotary(h, torch.arange(start, start + size)[None])
            with torch.no_grad():
                out, _ = attn(h, position_embeddings=cos_sin, attention_mask=mask[None, None],
                              cache=cache)
            outs.append(out[0].numpy())
            start += size
    finally:
        del attn.indexer.forward
    return np.concatenate(outs), selected


class _TopkInputs(torch.overrides.TorchFunctionMode):
    """Records what torch.Tensor.topk is called on: in HF's attention, its indexer's scores."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.topk:
            self.seen.append(args[0])
        return func(*args, **(kwargs or {}))


def exact_scores(config, attn, x):
    """(n, n) float64 scores of HF's indexer over request x (n, hidden), from a float64 copy
    of HF's attention; -inf past each token."""
    double = copy.deepcopy(attn).double()
    n = len(x)
    h = torch.from_numpy(x).double()[None]
    rotary = hf.DeepseekV32RotaryEmbedding(config)
    cos_sin = tuple(t.double() for t in rotary(h, torch.arange(n)[None]))
    mask = torch.triu(torch.full((n, n), float("-inf"), dtype=torch.float64), diagonal=1)
    with torch.no_grad(), _TopkInputs() as recorder:
        double(h, position_embeddings=cos_sin, attention_mask=mask[None, None])
    return recorder.seen[-1][0].numpy()


def assert_selections(query, index_cache, table_row, mine, hf_selected, exact):
    """mine and hf_selected (per token, positions) agree but for FP8 near-ties; query: the
    layer's IndexQuery of the tokens, exact: their rows of exact_scores."""
    visible = np.asarray([np.isfinite(row).sum() for row in exact], np.int32)
    fp8 = np.asarray(_index_scores(query, index_cache, np.repeat(table_row[None], len(exact), 0),
                                  visible))[:, :exact.shape[1]]
    finite = np.isfinite(exact)
    error = np.where(finite, np.abs(fp8 - np.where(finite, exact, 0)), 0).max(-1)
    peak = np.abs(exact[finite]).max()
    assert np.all(error <= 0.15 * peak), (error, peak)  # FP8 rounding, nothing more
    assert_same_selection(mine, hf_selected, exact, 2 * error + 1e-6 * peak)


def assert_after_prompt_as_hf(config, attn, x, sizes, query, index_cache, table_row, mine, got):
    """The tokens after request x's prompt (sizes[0] tokens; then chunks or steps of sizes[1:])
    against HF fed the same sizes: mine, their selections (positions), agree with HF's but
    for FP8 near-ties (query: their IndexQuery); got, their outputs, match HF's run with mine
    in place of its indexer's, and HF's own where the selections agree."""
    n = sizes[0]
    want, hf_selected = hf_run(config, attn, x, sizes)
    assert_selections(query, index_cache, table_row, mine, hf_selected[n:],
                      exact_scores(config, attn, x)[n:])
    prompt = [list(range(max(0, p + 1 - TOPK), p + 1)) for p in range(n)]  # any
    forced, _ = hf_run(config, attn, x, sizes, forced=prompt + mine)
    for t, (m, h) in enumerate(zip(mine, hf_selected[n:])):
        # The FP8 latent (3 mantissa bits: 2-4% here) and the bf16 query, nothing more.
        assert rel_err(got[t], forced[n + t]) < 6e-2, (t, rel_err(got[t], forced[n + t]))
        if sorted(m) == sorted(h):
            assert rel_err(got[t], want[n + t]) < 6e-2, t


def prefilled(layer, rng, prompts, xs):
    """(block table, caches) of requests xs (each its prompt, then tokens for later) with
    their prompts (lengths `prompts`) prefilled by the layer into fresh NaN caches."""
    b, s = len(prompts), max(prompts)
    table, num_pages = paged_block_table(rng, [len(x) for x in xs])
    prefill = jax.jit(lambda x, kv, index: layer.prefill(
        x, jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s)), kv, index, table,
        lengths=jnp.asarray(prompts, jnp.int32)), donate_argnums=(1, 2))
    return table, in_place(prefill, nan_caches(num_pages), padded(xs, s))[1]


def nan_caches(num_pages):
    return (SparseKVCache(jnp.full((num_pages, 64, 1, TOKEN_BYTES), 0xFF, jnp.uint8)),
            IndexKeyCache(jnp.full((num_pages, PAGE_BYTES), 0xFF, jnp.uint8)))


def padded(xs, width):
    x = np.zeros((len(xs), width, xs[0].shape[-1]), np.float32)
    for i, xi in enumerate(xs):
        x[i, :min(len(xi), width)] = xi[:width]
    return jnp.asarray(x)


def in_place(call, caches, *args):
    """call(*args, *caches) under jit donating the caches; asserts they were written in place."""
    pointers = [c.data.unsafe_buffer_pointer() for c in caches]
    out, *new = call(*args, *caches)
    assert all(c.data.is_deleted() for c in caches)
    assert [c.data.unsafe_buffer_pointer() for c in new] == pointers
    return out, new


@pytest.mark.parametrize("lengths,rope", [
    ([5, 12, 0], None),  # s = 12 <= index_topk: mla_prefill over every token
    ([100, 9], YARN),  # s = 100: the indexer and sparse_mla_prefill
], ids=["dense", "sparse_yarn"])
def test_prefill_matches_hf(lengths, rope):
    config = hf_config(rope)
    attn = hf_attention(config, seed=1)
    layer = sparse_layer(config, attn)
    rng = np.random.default_rng(2)
    xs = [rng.standard_normal((n, config.hidden_size)).astype(np.float32) for n in lengths]
    b, s = len(lengths), max(lengths)
    table, num_pages = paged_block_table(rng, lengths)
    positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    lens = jnp.asarray(lengths, jnp.int32)
    prefill = jax.jit(lambda x, kv, index: layer.prefill(x, positions, kv, index, table,
                                                         lengths=lens), donate_argnums=(1, 2))
    out, (kv, index) = in_place(prefill, nan_caches(num_pages), padded(xs, s))
    if s > TOPK:
        query = jax.tree.map(lambda a: a.reshape(b * s, *a.shape[2:]),
                             jax.jit(layer.index_query)(padded(xs, s), positions))
        chosen = np.asarray(_indexer_prefill(query, index, table, jnp.full((b,), s, jnp.int32),
                                            jnp.arange(b + 1, dtype=jnp.int32) * s, topk=TOPK))
    zero_attention = layer.o_proj(jnp.zeros((config.num_attention_heads * config.v_head_dim,)))
    for i, (n, x) in enumerate(zip(lengths, xs)):
        np.testing.assert_array_equal(np.asarray(out[i, n:]),
                                      np.broadcast_to(zero_attention, (s - n, config.hidden_size)))
        if n == 0:
            continue
        want, hf_selected = hf_run(config, attn, x, [n])
        if s <= TOPK:  # HF selects every visible token too
            assert all(sorted(row) == list(range(j + 1)) for j, row in enumerate(hf_selected))
            np.testing.assert_allclose(np.asarray(out[i, :n]), want, rtol=2e-4, atol=2e-4)
            continue
        rows = slice(i * s, i * s + n)
        mine = [selected_positions(slots, table[i]) for slots in chosen[rows]]
        assert_selections(IndexQuery(*(a[rows] for a in query)), index, table[i], mine,
                          hf_selected, exact_scores(config, attn, x))
        forced, _ = hf_run(config, attn, x, [n], forced=mine)
        np.testing.assert_allclose(np.asarray(out[i, :n]), forced, rtol=SPARSE_PREFILL_TOL,
                                   atol=SPARSE_PREFILL_TOL)
        same = [sorted(a) == sorted(h) for a, h in zip(mine, hf_selected)]
        np.testing.assert_allclose(np.asarray(out[i, :n])[same], want[same],
                                   rtol=SPARSE_PREFILL_TOL, atol=SPARSE_PREFILL_TOL)


def test_decode_matches_hf():
    """Prompts of 5 and 62 tokens (below and above index_topk), then decode steps of 1, 1 and
    2 tokens (the last with a draft token), the longer request crossing into its second page."""
    config = hf_config()
    attn = hf_attention(config, seed=3)
    layer = sparse_layer(config, attn)
    prompts, steps = [5, 62], [1, 1, 2]
    rng = np.random.default_rng(4)
    xs = [rng.standard_normal((n + sum(steps), config.hidden_size)).astype(np.float32)
          for n in prompts]
    table, caches = prefilled(layer, rng, prompts, xs)
    decode = jax.jit(lambda x, pos, kv, index: layer.decode(x, pos, kv, index, table,
                                                            pos[:, -1] + 1),
                     donate_argnums=(2, 3))
    index_query = jax.jit(layer.index_query)
    outs, queries, chosen = [], [], []  # per step
    for step, s_q in enumerate(steps):
        pos = np.asarray(prompts)[:, None] + sum(steps[:step]) + np.arange(s_q)
        x = jnp.asarray(np.stack([xi[p] for xi, p in zip(xs, pos)]))
        pos = jnp.asarray(pos, jnp.int32)
        out, caches = in_place(decode, caches, x, pos)
        outs.append(np.asarray(out))
        # What the decode selected: the same call over the cache it left.
        queries.append(index_query(x, pos))
        chosen.append(np.asarray(_indexer_decode(queries[-1], caches[1], table, pos[:, -1] + 1,
                                                 topk=TOPK)))
    for i, (n, x) in enumerate(zip(prompts, xs)):
        got = np.concatenate([out[i] for out in outs])
        mine = [selected_positions(slots, table[i]) for step in chosen for slots in step[i]]
        query = IndexQuery(*(jnp.concatenate([q[k][i] for q in queries]) for k in range(2)))
        assert_after_prompt_as_hf(config, attn, x, [n] + steps, query, caches[1], table[i],
                                  mine, got)


def test_extend_matches_hf():
    """Prompts of 5 and 40 tokens, then chunks of 20 and 7 new tokens over what is cached
    (request 0's second chunk 3 tokens, the rest padding), through HF's DynamicCache in the
    same chunks: each new token selects among its prefix and the chunk up to itself."""
    config = hf_config()
    attn = hf_attention(config, seed=5)
    layer = sparse_layer(config, attn)
    prompts, chunks = [5, 40], [[20, 3], [20, 7]]  # per request, its chunks' real tokens
    rng = np.random.default_rng(6)
    xs = [rng.standard_normal((n + sum(c), config.hidden_size)).astype(np.float32)
          for n, c in zip(prompts, chunks)]
    table, caches = prefilled(layer, rng, prompts, xs)
    b = len(prompts)
    extend = jax.jit(lambda x, pos, prefix, lens, kv, index: layer.extend(
        x, pos, kv, index, table, prefix, lengths=lens), donate_argnums=(4, 5))
    index_query = jax.jit(layer.index_query)
    prefix = np.asarray(prompts)
    got, mine, queries = [[] for _ in xs], [[] for _ in xs], [[] for _ in xs]
    for step in range(2):
        lens = np.asarray([c[step] for c in chunks])
        width = int(lens.max())
        pos = prefix[:, None] + np.arange(width)
        x = np.zeros((b, width, config.hidden_size), np.float32)
        for i, xi in enumerate(xs):
            x[i, :lens[i]] = xi[prefix[i]:prefix[i] + lens[i]]
        x, pos = jnp.asarray(x), jnp.asarray(pos, jnp.int32)
        out, caches = in_place(extend, caches, x, pos, jnp.asarray(prefix, jnp.int32),
                               jnp.asarray(lens, jnp.int32))
        zero = np.asarray(layer.o_proj(jnp.zeros((config.num_attention_heads
                                                  * config.v_head_dim,))))
        query = jax.tree.map(lambda a: a.reshape(b * width, *a.shape[2:]), index_query(x, pos))
        chosen = np.asarray(_indexer_prefill(query, caches[1], table,
                                             jnp.asarray(prefix + width, jnp.int32),
                                             jnp.arange(b + 1, dtype=jnp.int32) * width,
                                             topk=TOPK))
        for i in range(b):
            np.testing.assert_array_equal(np.asarray(out[i, lens[i]:]),
                                          np.broadcast_to(zero, (width - lens[i], zero.size)))
            got[i].append(np.asarray(out[i, :lens[i]]))
            rows = slice(i * width, i * width + lens[i])
            mine[i] += [selected_positions(slots, table[i]) for slots in chosen[rows]]
            queries[i].append(IndexQuery(*(a[rows] for a in query)))
        prefix = prefix + lens
    for i, (n, x) in enumerate(zip(prompts, xs)):
        query = IndexQuery(*(jnp.concatenate([q[k] for q in queries[i]]) for k in range(2)))
        assert_after_prompt_as_hf(config, attn, x, [n, *chunks[i]], query, caches[1], table[i],
                                  mine[i], np.concatenate(got[i]))


def test_config_from_hf_reads_the_indexer_and_names_what_is_missing():
    config = SparseMLAConfig.from_hf(hf_config(YARN))
    assert (config.index_n_heads, config.index_head_dim, config.index_topk) == (4, 128, TOPK)
    assert config.q_lora_rank == 48 and config.rope_scaling_dict["factor"] == 16.0
    assert config.softmax_scale == pytest.approx(
        hf.DeepseekV32Attention(hf_config(YARN), layer_idx=0).scaling, rel=1e-12)
    assert SparseMLAConfig.from_hf(hf_config().to_dict()).index_topk == TOPK
    hash(config)
    v3 = transformers.DeepseekV3Config(hidden_size=96, num_attention_heads=4, q_lora_rank=48)
    with pytest.raises(ValueError, match=r"SparseMLAConfig.from_hf: the HF config has no "
                                         r"'index_n_heads'; a DeepSeek-V3.2 config has"):
        SparseMLAConfig.from_hf(v3)
    assert MLAConfig.from_hf(v3).hidden_size == 96  # what a V3 layer reads
    without_topk = {k: v for k, v in hf_config().to_dict().items() if k != "index_topk"}
    with pytest.raises(ValueError, match=r"no 'index_topk'"):
        SparseMLAConfig.from_hf(without_topk)


TINY = dict(hidden_size=32, num_heads=2, q_lora_rank=16, qk_nope_head_dim=16, v_head_dim=16,
            index_n_heads=2, index_topk=4)


@pytest.mark.parametrize("change,exc,pattern", [
    (dict(q_lora_rank=None), ValueError, r"q_lora_rank must be set .*; got None"),
    (dict(index_head_dim=64), ValueError, r"index_head_dim must be 128 .*; got 64"),
    (dict(index_topk=0), ValueError, r"index_topk must be a positive int; got 0"),
    (dict(index_n_heads=2.0), ValueError, r"index_n_heads must be a positive int; got 2.0"),
])
def test_bad_configs_are_named(change, exc, pattern):
    with pytest.raises(exc, match=pattern):
        SparseMLAConfig(**{**TINY, **change})


@pytest.fixture
def tiny_layer():
    """hf_config's sizes, under float32_matmuls: its eager ops are compiled already."""
    return SparseMultiHeadLatentAttention(SparseMLAConfig.from_hf(hf_config()), rngs=nnx.Rngs(0))


def test_layer_needs_a_sparse_config_with_576_wide_rows(tiny_layer):
    with pytest.raises(TypeError, match="config must be a SparseMLAConfig; got MLAConfig"):
        SparseMultiHeadLatentAttention(MLAConfig(hidden_size=32, num_heads=2), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="kv_lora_rank 512"):
        SparseMultiHeadLatentAttention(SparseMLAConfig(**TINY, kv_lora_rank=64),
                                       rngs=nnx.Rngs(0))


def _decode_args():
    return dict(hidden_states=jnp.zeros((2, 1, 96)), positions=jnp.zeros((2, 1), jnp.int32),
                kv_cache=SparseKVCache(jnp.zeros((2, 64, 1, TOKEN_BYTES), jnp.uint8)),
                index_cache=IndexKeyCache(jnp.zeros((2, PAGE_BYTES), jnp.uint8)),
                block_table=jnp.zeros((2, 2), jnp.int32), seq_lens=jnp.ones((2,), jnp.int32))


@pytest.mark.parametrize("change,exc,pattern", [
    (dict(kv_cache=PagedKVCache(jnp.zeros((2, 64, 1, 576), jnp.bfloat16))), ValueError,
     r"decode: kv_cache must be a SparseKVCache or a \(num_pages, 64, 1, 656\) uint8 array; "
     r"got PagedKVCache"),
    (dict(kv_cache=jnp.zeros((2, 64, 1, 576), jnp.bfloat16)), ValueError,
     r"kv_cache must be .*; got bfloat16 \(2, 64, 1, 576\)"),
    (dict(index_cache=SparseKVCache(jnp.zeros((2, 64, 1, TOKEN_BYTES), jnp.uint8))), ValueError,
     r"index_cache must be an IndexKeyCache or a \(num_pages, 8448\) uint8 array; got uint8 "
     r"\(2, 64, 1, 656\)"),
    (dict(index_cache=IndexKeyCache(jnp.zeros((3, PAGE_BYTES), jnp.uint8))), ValueError,
     r"kv_cache and index_cache share slots, so they must have the same num_pages; got 2 and 3"),
    (dict(block_table=np.zeros((2, 2), np.int64)), TypeError, r"block_table must be int32"),
    (dict(block_table=jnp.zeros((1, 2), jnp.int32)), ValueError,
     r"block_table must have shape \(2, max_pages\) for hidden_states' batch 2; got \(1, 2\)"),
    (dict(seq_lens=jnp.ones((2, 1), jnp.int32)), ValueError, r"seq_lens must have rank 1"),
    (dict(seq_lens=jnp.ones((3,), jnp.int32)), ValueError,
     r"seq_lens must have shape \(2,\); got \(3,\)"),
    (dict(slots=jnp.zeros((2, 2), jnp.int32)), ValueError,
     r"slots must have shape \(2, 1\); got \(2, 2\)"),
    (dict(hidden_states=jnp.zeros((2, 1, 95))), ValueError, r"hidden_states must have shape"),
])
def test_bad_decode_arguments_are_named(tiny_layer, change, exc, pattern):
    with pytest.raises(exc, match=pattern):
        tiny_layer.decode(**{**_decode_args(), **change})


def test_bad_prefill_arguments_are_named(tiny_layer):
    args = _decode_args()
    del args["seq_lens"]
    with pytest.raises(ValueError, match=r"prefill: lengths must have shape \(2,\); got \(1,\)"):
        tiny_layer.prefill(**args, lengths=jnp.ones((1,), jnp.int32))
    with pytest.raises(ValueError, match=r"prefill: index_cache must be an IndexKeyCache"):
        tiny_layer.prefill(**{**args, "index_cache": jnp.zeros((2, 100), jnp.uint8)})


def test_bad_extend_arguments_are_named(tiny_layer):
    args = _decode_args()
    del args["seq_lens"]
    with pytest.raises(ValueError, match=r"extend: prefix_lens must have shape \(2,\); got \(3,\)"):
        tiny_layer.extend(**args, prefix_lens=jnp.ones((3,), jnp.int32))
    with pytest.raises(TypeError, match=r"extend: prefix_lens must be int32"):
        tiny_layer.extend(**args, prefix_lens=jnp.ones((2,), jnp.float32))


def test_weights_load_with_the_indexer_and_name_what_is_missing(tmp_path):
    config = hf_config()
    attn = hf_attention(config, seed=5)
    prefix = "model.layers.0.self_attn."
    state = {prefix + name: tensor for name, tensor in attn.state_dict().items()}
    layer = SparseMultiHeadLatentAttention(SparseMLAConfig.from_hf(config), rngs=nnx.Rngs(0))
    # Every tensor HF's attention has.
    assert sorted(layer_parameter_names(layer)) == sorted(attn.state_dict())
    load_attention_weights(layer, state, prefix=prefix)
    np.testing.assert_array_equal(np.asarray(layer.indexer.wq_b[...]),
                                  attn.indexer.wq_b.weight.detach().numpy())
    np.testing.assert_array_equal(np.asarray(layer.indexer.k_norm_bias[...]),
                                  attn.indexer.k_norm.bias.detach().numpy())
    st = pytest.importorskip("safetensors.torch")
    st.save_file({k: v.contiguous() for k, v in state.items()}, str(tmp_path / "model.safetensors"))
    from_file = load_attention_weights(
        SparseMultiHeadLatentAttention(SparseMLAConfig.from_hf(config), rngs=nnx.Rngs(0)),
        tmp_path / "model.safetensors", prefix=prefix)
    for a, b in zip(jax.tree.leaves(nnx.state(from_file)), jax.tree.leaves(nnx.state(layer))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    missing = {k: v for k, v in state.items() if not k.endswith("indexer.wk.weight")}
    with pytest.raises(KeyError, match=r"'model.layers.0.self_attn.indexer.wk.weight'"):
        load_attention_weights(layer, missing, prefix=prefix)
    bad = {**state, prefix + "indexer.weights_proj.weight": torch.zeros(3, 96)}
    with pytest.raises(ValueError, match=r"indexer.weights_proj.weight'\] has shape \(3, 96\); "
                                         r"the layer's config needs \(4, 96\)"):
        load_attention_weights(layer, bad, prefix=prefix)
