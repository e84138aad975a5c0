"""Ragged prefill/extend batches (new tokens along one axis) and their float64 oracle, shared
by the CPU and GPU tests.

The cache holds NaN wherever no prefix row is (unused pages and the tails of used ones); block
tables hold out-of-range sentinels past each request's prefix pages.
"""
import jax.numpy as jnp
import numpy as np

from jax_flashmla.caches import fp8

PAGE = 64
K_SCALE = 0.02
SENTINEL = 1 << 20  # a page number past any cache: must never be read


def make_case(rng, prefix_lens, query_lens, *, gaps=None, tail=3, heads=2, nope=32, v_dim=48,
              fp8_cache=False, dtype=jnp.bfloat16):
    """Inputs of mla_prefill for requests with these prefix and new-token lengths. The new
    tokens are packed one request after the other (query_starts None), or with gaps[r]
    padding rows before request r (query_starts given); `tail` padding rows end q. Returns a
    dict of its arguments, max_prefix_tokens the prefixes' pages."""
    b = len(prefix_lens)
    max_prefix_tokens = max(PAGE, sum(-(-p // PAGE) * PAGE for p in prefix_lens))
    width = max(1, -(-max(prefix_lens) // PAGE)) + 1  # one sentinel column past the longest
    num_pages = b * width + 3
    cache = np.full((num_pages, PAGE, 1, 576), np.nan, np.float32)
    table = np.full((b, width), SENTINEL, np.int32)
    pages = rng.permutation(num_pages)
    used = 0
    for r, p in enumerate(prefix_lens):
        count = -(-p // PAGE)
        table[r, :count] = pages[used:used + count]
        used += count
        for pos in range(p):
            cache[table[r, pos // PAGE], pos % PAGE, 0] = rng.standard_normal(576)
    k_scale = None
    if fp8_cache:
        k_scale = jnp.float32(K_SCALE)
        cache_arr = fp8.quantize(jnp.asarray(cache * K_SCALE * 20), k_scale)
    else:
        cache_arr = jnp.asarray(cache, dtype)
    starts, row = [], 0
    for r, n in enumerate(query_lens):
        row += gaps[r] if gaps is not None else 0
        starts.append(row)
        row += n
    t = row + tail
    return dict(
        q=jnp.asarray(rng.standard_normal((t, heads, nope + 64)), dtype),
        kv=jnp.asarray(rng.standard_normal((t, 576)), dtype),
        kv_cache=cache_arr, block_table=jnp.asarray(table),
        prefix_lens=jnp.asarray(prefix_lens, jnp.int32),
        query_lens=jnp.asarray(query_lens, jnp.int32),
        query_starts=None if gaps is None else jnp.asarray(starts, jnp.int32),
        w_uk=jnp.asarray(rng.standard_normal((512, heads, nope)) / 512 ** 0.5, dtype),
        w_uv=jnp.asarray(rng.standard_normal((512, heads, v_dim)) / 512 ** 0.5, dtype),
        k_scale=k_scale, max_prefix_tokens=max_prefix_tokens)


def rows_of(case):
    """[(first row, rows)] of each request in q."""
    lens = [int(n) for n in np.asarray(case["query_lens"])]
    if case["query_starts"] is None:
        return list(zip(np.cumsum([0] + lens[:-1]).tolist(), lens))
    return list(zip(np.asarray(case["query_starts"]).tolist(), lens))


def oracle(case, scale):
    """float64 out (tokens, h, v_dim) and lse (h, tokens): each request's new tokens over its
    prefix rows (dequantized) and its new rows, query i seeing keys [0, prefix + i]; out 0 and
    lse +inf in padding rows. Keys and values are decompressed from the rows as the op does,
    in float64."""
    f64 = lambda x: np.asarray(jnp.asarray(x, jnp.float32), np.float64)  # noqa: E731
    q, kv, w_uk, w_uv = f64(case["q"]), f64(case["kv"]), f64(case["w_uk"]), f64(case["w_uv"])
    cache = case["kv_cache"]
    cache = f64(fp8.dequantize(cache, case["k_scale"]) if case["k_scale"] is not None else cache)
    table = np.asarray(case["block_table"])
    t, h, _ = q.shape
    out = np.zeros((t, h, w_uv.shape[-1]))
    lse = np.full((h, t), np.inf)
    prefix_lens = np.asarray(case["prefix_lens"])
    for r, (first, n) in enumerate(rows_of(case)):
        p = prefix_lens[r]
        prefix = np.stack([cache[table[r, i // PAGE], i % PAGE, 0] for i in range(p)]
                          ) if p else np.zeros((0, 576))
        mine = slice(first, first + n)
        rows = np.concatenate([prefix, kv[mine]])
        k = np.concatenate([np.einsum("sc,chd->shd", rows[:, :512], w_uk),
                            np.broadcast_to(rows[:, None, 512:], (len(rows), h, 64))], axis=-1)
        v = np.einsum("sc,chd->shd", rows[:, :512], w_uv)
        s = np.einsum("thd,shd->hts", q[mine], k) * scale
        visible = np.arange(p + n)[None, :] <= p + np.arange(n)[:, None]
        s = np.where(visible[None], s, -np.inf)
        top = s.max(-1, keepdims=True)
        w = np.exp(s - top)
        total = w.sum(-1, keepdims=True)
        out[mine] = np.einsum("hts,shd->thd", w / total, v)
        lse[:, mine] = (top + np.log(total))[..., 0]
    return out, lse


def without(case, r):
    """The case with request r dropped from the batch, the others' rows where they were."""
    keep = np.arange(len(case["query_lens"])) != r
    starts = np.asarray([first for first, _ in rows_of(case)], np.int32)[keep]
    return case | {name: case[name][keep] for name in ("prefix_lens", "query_lens",
                                                       "block_table")} | dict(
        query_starts=jnp.asarray(starts))


def call(op, case, **kwargs):
    names = ("q", "kv", "kv_cache", "block_table", "prefix_lens", "query_lens")
    return op(*(case[n] for n in names), w_uk=case["w_uk"], w_uv=case["w_uv"],
              max_prefix_tokens=case["max_prefix_tokens"], query_starts=case["query_starts"],
              k_scale=case["k_scale"], **kwargs)
