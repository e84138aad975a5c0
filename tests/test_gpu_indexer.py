"""DeepSeek-V3.2's indexer as jax_flashmla's CUDA kernels on a Hopper GPU: the scores within
the tensor cores' float32 accumulation of the pure-JAX reference's, the selection exactly
lax.top_k's over the kernel's own scores (position order, equal scores to the earlier token,
NaN above everything), at V3.2's 64 heads with NaN in unused pages, sentinel block-table
entries, rows that see nothing and rows split over several calls."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import SENTINEL_PAGE
from indexer_cases import KERNEL_SCORE_ATOL, KERNEL_SCORE_RTOL
from jax_flashmla import token_slots
from jax_flashmla.sparse import indexer_decode, indexer_prefill, IndexKeyCache, write_sparse_kv
from jax_flashmla.caches.index_keys import quantize_index_keys
from jax_flashmla.ops.indexer import IndexQuery, index_scores
from jax_flashmla.ops import indexer
from jax_flashmla.ops.v4_indexer import v4_indexer_select
from jax_flashmla.caches.index_keys import PAGE_BYTES

pytestmark = pytest.mark.gpu
HEADS, PAGE = 64, 64
CHUNK = 1 << 17  # tokens a cache write of _problem's


def _problem(seed, lengths, heads=HEADS, s_q=1):
    """(query (batch, s_q, heads), cache, block_table, seq_lens): keys written at random pages,
    every unwritten byte 0xFF (NaN), SENTINEL_PAGE past each request's pages."""
    rng = np.random.default_rng(seed)
    pages = [-(-n // PAGE) for n in lengths]
    num_pages = sum(pages) + 3
    perm = rng.permutation(num_pages).astype(np.int32)
    table = np.full((len(lengths), max(max(pages), 1) + 1), SENTINEL_PAGE, np.int32)
    for i, n in enumerate(pages):
        table[i, :n], perm = perm[:n], perm[n:]
    positions = np.concatenate([np.arange(n) for n in lengths]).astype(np.int32)
    requests = np.repeat(np.arange(len(lengths)), lengths)
    slots = table[requests, positions // PAGE] * PAGE + positions % PAGE  # all in the table
    keys = rng.normal(0, 1, (len(slots), 128)).astype(np.float32)
    cache = IndexKeyCache(jnp.full((num_pages, PAGE_BYTES), 0xFF, jnp.uint8))
    for i in range(0, len(slots), CHUNK):  # a write's temporaries grow with its tokens
        cache = write_sparse_kv(cache, slots[i:i + CHUNK], jnp.asarray(keys[i:i + CHUNK]))
    values, scales = quantize_index_keys(jnp.asarray(rng.normal(0, 1, (len(lengths), s_q, heads,
                                                                       128)), jnp.float32))
    weights = jnp.asarray(rng.normal(0, 1, (len(lengths), s_q, heads)), jnp.float32) * scales
    return (IndexQuery(values, weights), cache, jnp.asarray(table),
            jnp.asarray(lengths, jnp.int32))


def _rows(query, table, seq_lens):
    s_q = query.values.shape[1]
    visible = (seq_lens[:, None] - s_q + 1 + jnp.arange(s_q, dtype=jnp.int32)).reshape(-1)
    return (IndexQuery(*(x.reshape(-1, *x.shape[2:]) for x in query)),
            jnp.repeat(table, s_q, axis=0), visible)


def _expected(scores, table, visible, topk):
    """lax.top_k's positions over `scores`, in position order, as the indexer returns slots."""
    scores = jnp.pad(scores, ((0, 0), (0, max(0, topk - scores.shape[1]))),
                     constant_values=-jnp.inf)
    positions = jnp.sort(jax.lax.top_k(scores, topk)[1], axis=-1)
    slots = token_slots(table, positions)
    valid = (positions < visible[:, None]) & (slots >= 0)
    return np.asarray(jnp.where(valid, slots, -1))


@pytest.mark.parametrize("lengths,s_q,topk,heads", [
    ([5000, 2047, 0, 64, 130], 1, 2048, HEADS), ([3000, 1], 2, 2048, HEADS),
    ([900, 77, 640], 1, 100, HEADS), ([70], 2, 2048, HEADS),
    ([1500, 300], 1, 512, 100),  # two chunks of heads, the last padded to 8
    ([140000, 5], 1, 2048, HEADS),  # rows cut into pieces: longer than 8 blocks hold
    ([20000, 17000, 3], 1, 2048, HEADS),  # rows the top-k splits over two blocks
    ([70000] * 16, 1, 2048, HEADS),  # cut into pieces: 4 blocks a row would not hold them
    ([1100000, 40], 1, 2048, HEADS),  # cut into pieces, their candidates into pieces again
    ([140000] * 12, 2, 2048, HEADS),  # many rows cut into pieces
    ([140000] * 3, 1, 4096, HEADS),  # a top-k too large for pieces: each row a cluster's, re-read
])
def test_the_kernels_select_lax_top_k_of_their_scores(lengths, s_q, topk, heads):
    query, cache, table, seq_lens = _problem(len(lengths) + s_q, lengths, heads=heads, s_q=s_q)
    rows, row_table, visible = _rows(query, table, seq_lens)
    call = functools.partial(index_scores, implementation="custom_call")
    assert "jax_flashmla_index_topk" in jax.jit(call).lower(rows, cache, row_table,
                                                            visible).as_text()
    scores = jax.jit(call)(rows, cache, row_table, visible)
    if max(lengths) <= 200_000:  # the reference's float32 logits of 1M tokens: ~35 GB a row
        reference = jax.jit(functools.partial(index_scores, implementation="reference"))(
            rows, cache, row_table, visible)
        np.testing.assert_array_equal(np.isneginf(scores), np.isneginf(reference))
        finite = np.isfinite(np.asarray(reference))
        peak = np.abs(np.asarray(reference)[finite]).max()
        np.testing.assert_allclose(np.asarray(scores)[finite], np.asarray(reference)[finite],
                                   rtol=KERNEL_SCORE_RTOL, atol=KERNEL_SCORE_ATOL * peak)
    decode = jax.jit(functools.partial(indexer_decode, topk=topk, implementation="custom_call"))
    got = np.asarray(decode(query, cache, table, seq_lens)).reshape(-1, topk)
    np.testing.assert_array_equal(got, _expected(scores, row_table, visible, topk))


@pytest.mark.parametrize("pages,nan_page", [(40, 35), (2200, 2100)])  # 2200: cut into pieces
def test_equal_scores_keep_the_earlier_tokens_and_nan_comes_first(pages, nan_page):
    cache = IndexKeyCache.create(pages)  # every key 0: every score 0
    table = jnp.asarray([np.r_[np.arange(pages - 1, 0, -1), SENTINEL_PAGE]], jnp.int32)
    query = IndexQuery(jnp.ones((1, 1, HEADS, 128), jnp.float8_e4m3fn),
                       jnp.ones((1, 1, HEADS), jnp.float32))
    nan_position = nan_page * PAGE + 5  # a NaN key (e4m3 0x7F) past the first 2048 tokens
    data = cache.data.at[int(table[0, nan_page]), 5 * 128].set(0x7F)
    decode = jax.jit(functools.partial(indexer_decode, topk=2048, implementation="custom_call"))
    visible = jnp.asarray([(pages - 2) * PAGE], jnp.int32)
    got = np.asarray(decode(query, IndexKeyCache(data), table, visible))
    positions = np.r_[np.arange(2047), nan_position]
    np.testing.assert_array_equal(got[0, 0], np.asarray(token_slots(table, positions[None]))[0])


@pytest.mark.parametrize("pages,spread", [(300, 1e-3), (2200, 1e-3), (2200, 1e-6)])
def test_scores_close_together_select_as_lax_top_k(pages, spread):
    """Every key 1.0, the scales 1 + spread * u: the scores share their top bits, so that the
    top-k's first passes cannot set most of them aside (300 pages: a cluster's rows; 2200:
    cut into pieces)."""
    rng = np.random.default_rng(pages)
    keys = np.full((pages, 64 * 128), 0x38, np.uint8)  # e4m3 1.0
    scales = (1 + spread * rng.random((pages, 64))).astype(np.float32)
    cache = IndexKeyCache(jnp.asarray(np.concatenate([keys, scales.view(np.uint8)], axis=1)))
    table = jnp.asarray([rng.permutation(pages)], jnp.int32)
    query = IndexQuery(jnp.ones((1, 1, HEADS, 128), jnp.float8_e4m3fn),
                       jnp.ones((1, 1, HEADS), jnp.float32))
    seq_lens = jnp.asarray([pages * PAGE], jnp.int32)
    rows, row_table, visible = _rows(query, table, seq_lens)
    scores = jax.jit(functools.partial(index_scores, implementation="custom_call"))(
        rows, cache, row_table, visible)
    for topk in (512, 2048):
        decode = jax.jit(functools.partial(indexer_decode, topk=topk,
                                           implementation="custom_call"))
        got = np.asarray(decode(query, cache, table, seq_lens)).reshape(-1, topk)
        np.testing.assert_array_equal(got, _expected(scores, row_table, visible, topk))


def test_a_prefill_over_several_calls_selects_as_one(monkeypatch):
    query, cache, table, _ = _problem(7, [1500, 700])
    tokens = 300  # the last 300 of the first request, then 100 of the second
    seq_lens = jnp.asarray([1500, 700], jnp.int32)
    values = jnp.concatenate([jnp.tile(query.values[0], (200, 1, 1)),
                              jnp.tile(query.values[1], (100, 1, 1))])
    weights = jnp.asarray(np.random.default_rng(3).normal(0, 1, (tokens, HEADS)), jnp.float32)
    cu_seqlens = jnp.asarray([0, 200, 300], jnp.int32)
    prefill = functools.partial(indexer_prefill, topk=512)
    one = jax.jit(functools.partial(prefill, implementation="custom_call"))(
        IndexQuery(values, weights), cache, table, seq_lens, cu_seqlens)
    monkeypatch.setattr(indexer, "SCORES_PER_CALL", 32 * 2048)  # 32 rows a call
    split = jax.jit(functools.partial(prefill, implementation="custom_call"))(
        IndexQuery(values, weights), cache, table, seq_lens, cu_seqlens)
    np.testing.assert_array_equal(np.asarray(split), np.asarray(one))
    reference = jax.jit(functools.partial(prefill, implementation="reference"))(
        IndexQuery(values, weights), cache, table, seq_lens, cu_seqlens)
    same = np.mean([set(a) == set(b) for a, b in zip(np.asarray(one), np.asarray(reference))])
    assert same >= 0.9, same  # all but float32 near-ties


def test_int32_min_lengths_select_nothing_and_change_no_other_row():
    """seq_lens of INT32_MIN: a decode's first token (s_q 2) and a prefill's rows but the last
    would see 2**31 - 1 tokens if their count wrapped around int32."""
    query, cache, table, seq_lens = _problem(9, [3000, 700, 130], s_q=2)
    bad = seq_lens.at[1].set(np.iinfo(np.int32).min)
    others = np.asarray([0, 2])
    decode = jax.jit(functools.partial(indexer_decode, topk=2048, implementation="custom_call"))
    got = np.asarray(decode(query, cache, table, bad))
    assert np.all(got[1] == -1)
    alone = decode(IndexQuery(*(x[others] for x in query)), cache, table[others],
                   seq_lens[others])
    np.testing.assert_array_equal(got[others], np.asarray(alone))
    prefill = jax.jit(functools.partial(indexer_prefill, topk=2048, implementation="custom_call"))
    rows = IndexQuery(*(x.reshape(6, *x.shape[2:]) for x in query))  # 2 new tokens a request
    got = np.asarray(prefill(rows, cache, table, bad, jnp.asarray([0, 2, 4, 6], jnp.int32)))
    assert np.all(got[2:4] == -1)
    alone = prefill(IndexQuery(*(x[np.r_[0:2, 4:6]] for x in rows)), cache, table[others],
                    seq_lens[others], jnp.asarray([0, 2, 4], jnp.int32))
    np.testing.assert_array_equal(got[np.r_[0:2, 4:6]], np.asarray(alone))



@pytest.mark.parametrize("entries,topk", [([70000] * 16, 512), ([5000, 300, 0, 513], 512),
                                          ([900, 77], 100)])
def test_v4_selection_is_lax_top_k_of_the_kernels_scores(entries, topk):
    """DeepSeek-V4's selection on the kernels (index_topk: positions, here entries) over entry
    counts, with the second page of the first request missing from the cache: its entries are
    never picked, and the picks stay ascending with -1 after them."""
    query, cache, table, counts = _problem(len(entries) + 7, entries)
    table = table.at[0, 1].set(cache.data.shape[0] + 5)
    rows, row_table, visible = _rows(query, table, counts)
    scores = jax.jit(functools.partial(index_scores, implementation="custom_call"))(
        rows, cache, row_table, visible)
    scores = jnp.pad(scores, ((0, 0), (0, max(0, topk - scores.shape[1]))),
                     constant_values=-jnp.inf)
    top, picked = (np.asarray(a) for a in jax.lax.top_k(scores, topk))
    last = np.iinfo(np.int32).max
    want = np.sort(np.where(np.isneginf(top), last, picked), axis=-1)
    want = np.where(want == last, -1, want)
    select = jax.jit(functools.partial(v4_indexer_select, ratio=4, topk=topk,
                                       implementation="custom_call"))
    # Start 4 * count, one new token: each query sees all of its request's entries.
    selection = select(query, cache, table, 4 * counts, jnp.ones(len(entries), jnp.int32))
    np.testing.assert_array_equal(np.asarray(selection.entries)[:, 0], want)
    assert not np.isin(np.arange(64, 128), want[0]).any()
    np.testing.assert_array_equal(np.asarray(selection.slots)[:, 0],
                                  np.asarray(token_slots(row_table, jnp.asarray(want))))
