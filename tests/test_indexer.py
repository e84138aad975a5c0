"""DeepSeek-V3.2's lightning indexer on CPU: the paged FP8 index-key cache (quantization, round
trip, writes in place), the scores against float64 evaluations of the formula, the selection
against lax.top_k and a float64 top-k, HF transformers' DeepseekV32Indexer on the same weights,
FlashMLA-style inputs (NaN in unused pages, sentinel block-table slots, zero lengths) and the
errors a bad call raises."""
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.experimental import checkify

from indexer_cases import (KERNEL_SCORE_ATOL, KERNEL_SCORE_RTOL, assert_same_selection,
                           paged_block_table, selected_positions)
from jax_flashmla import token_slots, value_checks
from jax_flashmla.kernels import library as kernels
from jax_flashmla.sparse import (index_keys, index_query, indexer_decode, indexer_prefill,
                                 IndexerWeights, IndexKeyCache, write_sparse_kv)
from jax_flashmla.caches.index_keys import dequantize_index_keys, quantize_index_keys
from jax_flashmla.ops.indexer import IndexQuery, index_scores
from jax_flashmla.caches.index_keys import PAGE_BYTES

PAGE = 64
HEADS, HIDDEN, Q_LORA = 4, 64, 32
INT32_MIN, INT32_MAX = np.iinfo(np.int32).min, np.iinfo(np.int32).max
# HF's default rope over qk_rope_head_dim 64: what DeepseekV32RotaryEmbedding's inv_freq holds.
INV_FREQ = (1.0 / 10000.0 ** (np.arange(0, 64, 2, dtype=np.float32) / 64)).astype(np.float32)

# The scores' float32 sums against float64: XLA's on CPU, the kernel's on a GPU.
SCORE_RTOL, SCORE_ATOL = ((KERNEL_SCORE_RTOL, KERNEL_SCORE_ATOL)
                          if kernels.own_kernels_available() else (1e-5, 1e-6))

# Jitted (once per shape): called eagerly, JAX would dispatch them op by op.
_keys = jax.jit(lambda weights, x, positions: index_keys(weights, x, positions, INV_FREQ))
_query = jax.jit(lambda weights, x, q_lora, positions: index_query(weights, x, q_lora,
                                                                   positions, INV_FREQ))
_write = jax.jit(write_sparse_kv)
_scores = jax.jit(index_scores)
_decode = jax.jit(indexer_decode, static_argnames="topk")
_prefill = jax.jit(indexer_prefill, static_argnames="topk")


def _weights(rng):
    normal = lambda shape, std, mean=0.0: jnp.asarray(rng.normal(mean, std, shape), jnp.float32)
    return IndexerWeights(wq_b=normal((HEADS * 128, Q_LORA), Q_LORA ** -0.5),
                          wk=normal((128, HIDDEN), HIDDEN ** -0.5),
                          k_norm_weight=normal((128,), 0.2, 1.0), k_norm_bias=normal((128,), 0.2),
                          weights_proj=normal((HEADS, HIDDEN), HIDDEN ** -0.5))


def _nan_cache(num_pages):
    """Every byte 0xFF: NaN as an e4m3 value and as a float32 scale, wherever nothing is written."""
    return IndexKeyCache(jnp.full((num_pages, PAGE_BYTES), 0xFF, jnp.uint8))


def _stored_keys(data, slots):
    """float64 (e4m3 values (n, 128), scales (n,)) at slots, read from the cache's bytes by the
    documented layout."""
    data, slots = np.asarray(data), np.asarray(slots)
    page, offset = slots[:, None] // PAGE, slots[:, None] % PAGE
    values = data[page, 128 * offset + np.arange(128)].view(ml_dtypes.float8_e4m3fn)
    scales = data[page, 8192 + 4 * offset + np.arange(4)].copy().view(np.float32)[:, 0]
    return values.astype(np.float64), scales.astype(np.float64)


class Problem:
    """Requests of random tokens (2 spare ones past each length, for queries of empty requests):
    the keys of the first `written` tokens of each written into a NaN-filled paged cache, and
    the float64 HF-style scores without rotation or quantization."""

    def __init__(self, seed, lengths, weights=None, written=None):
        rng = np.random.default_rng(seed)
        self.weights = _weights(rng) if weights is None else weights
        self.lengths = np.asarray(lengths, np.int32)
        self.block_table, num_pages = paged_block_table(rng, lengths)
        self.x = [rng.normal(0, 1, (n + 2, HIDDEN)).astype(np.float32) for n in lengths]
        self.q_lora = [rng.normal(0, 1, (n + 2, Q_LORA)).astype(np.float32) for n in lengths]
        written = lengths if written is None else written
        self.cache = self.write(_nan_cache(num_pages), [(r, p) for r, n in enumerate(written)
                                                        for p in range(n)])

    def slots(self, request, positions):
        positions = np.asarray(positions)
        return self.block_table[request, positions // PAGE] * PAGE + positions % PAGE

    def write(self, cache, pairs):
        """cache with the keys of the tokens (request, position) in pairs written."""
        _, positions = np.asarray(pairs, np.int32).T
        x = np.stack([self.x[r][p] for r, p in pairs])
        slots = np.concatenate([self.slots(r, [p]) for r, p in pairs]).astype(np.int32)
        return _write(cache, jnp.asarray(slots), _keys(self.weights, x, jnp.asarray(positions)))

    def query(self, pairs):
        """The IndexQuery of the tokens (request, position) in pairs, (len(pairs), ...)."""
        _, positions = np.asarray(pairs, np.int32).T
        x = np.stack([self.x[r][p] for r, p in pairs])
        q_lora = np.stack([self.q_lora[r][p] for r, p in pairs])
        return _query(self.weights, x, q_lora, jnp.asarray(positions))

    def exact_scores(self, request, positions):
        """(len(positions), length) float64 scores, HF's formula with no rotation or FP8; -inf
        past each position (causal)."""
        w = {k: np.asarray(v, np.float64) for k, v in vars(self.weights).items()}
        n = int(self.lengths[request])
        x, q_lora = np.float64(self.x[request]), np.float64(self.q_lora[request])
        k = x[:n] @ w["wk"].T
        k = (k - k.mean(-1, keepdims=True)) / np.sqrt(k.var(-1, keepdims=True) + 1e-6)
        k = _rope_f64(k * w["k_norm_weight"] + w["k_norm_bias"], np.arange(n))
        q = (q_lora[positions] @ w["wq_b"].T).reshape(len(positions), HEADS, 128)
        q = _rope_f64(q, np.asarray(positions)[:, None])
        head_weights = x[positions] @ w["weights_proj"].T * HEADS ** -0.5 * 128 ** -0.5
        scores = np.einsum("mhn,mh->mn", np.maximum(np.einsum("mhd,nd->mhn", q, k), 0),
                           head_weights)
        return np.where(np.arange(n)[None, :] <= np.asarray(positions)[:, None], scores, -np.inf)

    def exact_and_slack(self, request, positions, query):
        """exact_scores, and per row twice the largest error of index_scores (FP8) against
        them: how far apart two tokens the FP8 scores order either way can be."""
        exact = self.exact_scores(request, positions)
        block_table = np.repeat(self.block_table[request:request + 1], len(positions), axis=0)
        fp8 = np.asarray(_scores(query, self.cache, block_table,
                                 np.asarray(positions, np.int32) + 1))[:, :exact.shape[1]]
        finite = np.isfinite(exact)
        error = np.where(finite, np.abs(fp8 - np.where(finite, exact, 0)), 0).max(-1)
        peak = np.abs(exact[finite]).max()
        assert np.all(error <= 0.15 * peak), (error, peak)  # FP8 rounding, no more
        return exact, 2 * error + 1e-6 * peak


def _top(scores, topk):
    """Each row's positions of its min(topk, finite) largest scores."""
    return [list(np.argsort(-row, kind="stable")[:min(topk, np.isfinite(row).sum())])
            for row in scores]


def _rope_f64(x, positions):
    angles = np.asarray(positions, np.float64)[..., None] * np.float64(INV_FREQ)
    x1, x2, rest = x[..., :32], x[..., 32:64], x[..., 64:]
    return np.concatenate([x1 * np.cos(angles) - x2 * np.sin(angles),
                           x2 * np.cos(angles) + x1 * np.sin(angles), rest], axis=-1)


def _stored_scores_f64(query, cache, block_table, visible):
    """The formula in float64 over the e4m3 values and scales as stored: (rows, context)."""
    values = np.asarray(query.values).astype(np.float64)
    weights = np.asarray(query.weights, np.float64)
    out = np.full((len(values), block_table.shape[1] * PAGE), -np.inf)
    for row, n in enumerate(np.asarray(visible)):
        if n > 0:
            positions = np.arange(n)
            keys, scales = _stored_keys(cache.data, block_table[row, positions // PAGE] * PAGE
                                        + positions % PAGE)
            out[row, :n] = scales * (weights[row] @ np.maximum(values[row] @ keys.T, 0))
    return out


def test_quantize_round_trip_is_exact_on_the_fp8_grid():
    rng = np.random.default_rng(0)
    grid = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    grid = grid[np.isfinite(grid) & (np.abs(grid) <= 256)]
    values = rng.choice(grid, (6, 128))
    values[:, 0] = 256.0  # amax / 448 = 0.57 * scale, which rounding up gives back exactly
    scales = 2.0 ** rng.integers(-12, 12, 6)
    keys = jnp.asarray(values * scales[:, None], jnp.float32)
    got_values, got_scales = jax.jit(quantize_index_keys)(keys)
    np.testing.assert_array_equal(np.asarray(got_scales), scales)
    np.testing.assert_array_equal(np.asarray(dequantize_index_keys(got_values, got_scales)), keys)
    slots = np.arange(64, 70, dtype=np.int32)
    cache = _write(IndexKeyCache.create(2), jnp.asarray(slots), keys)
    stored_values, stored_scales = _stored_keys(cache.data, slots)
    np.testing.assert_array_equal(stored_values * stored_scales[:, None], keys)


def test_scales_are_the_power_of_two_at_or_above_amax_over_448():
    spread = np.array([[1e-3], [1], [7], [300], [0]])
    keys = np.random.default_rng(1).normal(0, 1, (5, 128)) * spread
    _, scales = jax.jit(quantize_index_keys)(jnp.asarray(keys, jnp.float32))
    scales, amax = np.asarray(scales), np.abs(keys).max(-1) / 448
    np.testing.assert_array_equal(np.log2(scales), np.round(np.log2(scales)))
    assert np.all(scales[:4] >= amax[:4]) and np.all(scales[:4] < 2 * amax[:4])
    assert scales[4] == 2.0 ** -22  # DeepSeek's amax floor 1e-4, over 448, rounded up


def test_writes_land_in_place_and_bad_slots_write_nothing():
    cache = IndexKeyCache.create(3)
    fresh = np.asarray(cache.data).copy()
    slots = jnp.asarray([[5, 130], [-1, 3 * PAGE], [10**6, -PAGE]], jnp.int32)
    keys = jnp.asarray(np.random.default_rng(2).normal(0, 3, (3, 2, 128)), jnp.float32)
    write = jax.jit(write_sparse_kv, donate_argnums=0)
    pointer = cache.data.unsafe_buffer_pointer()
    new = write(cache, slots, keys)
    assert cache.data.is_deleted() and new.data.unsafe_buffer_pointer() == pointer
    values, scales = (np.asarray(a) for a in jax.jit(quantize_index_keys)(keys[0]))
    expected = fresh.copy()
    for (page, offset), value, scale in zip([(0, 5), (2, 2)], values, scales):
        expected[page, 128 * offset:128 * offset + 128] = value.view(np.uint8)
        expected[page, 8192 + 4 * offset:8192 + 4 * offset + 4] = np.float32([scale]).view(np.uint8)
    np.testing.assert_array_equal(np.asarray(new.data), expected)


def test_scores_follow_the_formula_over_the_stored_fp8_values():
    problem = Problem(3, [150, 90])
    rows = [(0, 0), (0, 63), (0, 64), (0, 149), (1, 5), (1, 89)]
    query = problem.query(rows)
    block_table = problem.block_table[[r for r, _ in rows]]
    visible = np.asarray([p + 1 for _, p in rows], np.int32)
    got = np.asarray(_scores(query, problem.cache, block_table, visible))
    stored = _stored_scores_f64(query, problem.cache, block_table, visible)
    np.testing.assert_array_equal(np.isinf(got), np.isinf(stored))
    finite = np.isfinite(stored)
    scale = np.abs(stored[finite]).max()
    np.testing.assert_allclose(got[finite], stored[finite], rtol=SCORE_RTOL,
                               atol=SCORE_ATOL * scale)
    # Against HF's formula in float64, unrotated and unquantized: within the FP8 rounding (3
    # mantissa bits: a few percent), where another rope or scale would miss by far more.
    for i, (r, p) in enumerate(rows):
        exact = problem.exact_scores(r, [p])[0, :p + 1]
        error = got[i, :p + 1] - exact
        assert np.linalg.norm(error) <= 0.08 * np.linalg.norm(exact) + 1e-6 * scale, i
        assert np.abs(error).max() <= 0.15 * np.abs(exact).max() + 1e-6 * scale, i


@pytest.mark.parametrize("topk,lengths", [(16, [150, 10, 0, 64]), (2048, [2100, 700, 1])])
def test_decode_is_lax_top_k_of_the_scores(topk, lengths):
    problem, s_q = Problem(4, lengths), 2
    query = problem.query([(r, max(p, 0)) for r, n in enumerate(lengths)
                           for p in range(n - s_q, n)])
    query = IndexQuery(*(x.reshape(len(lengths), s_q, *x.shape[1:]) for x in query))
    got = np.asarray(_decode(query, problem.cache, problem.block_table, problem.lengths,
                             topk=topk))
    assert got.shape == (len(lengths), s_q, topk) and got.dtype == np.int32
    visible = (problem.lengths[:, None] - s_q + 1 + np.arange(s_q)).reshape(-1).astype(np.int32)
    block_table = np.repeat(problem.block_table, s_q, axis=0)
    rows = IndexQuery(*(x.reshape(-1, *x.shape[2:]) for x in query))
    scores = _scores(rows, problem.cache, block_table, visible)
    scores = jnp.pad(scores, ((0, 0), (0, max(0, topk - scores.shape[1]))),
                     constant_values=-jnp.inf)
    positions = jnp.sort(jax.lax.top_k(scores, topk)[1], axis=-1)  # in position order
    slots = token_slots(jnp.asarray(block_table), positions)
    expected = np.where(np.asarray(positions) < visible[:, None], slots, -1)
    np.testing.assert_array_equal(got.reshape(-1, topk), expected)
    kept = np.minimum(np.maximum(visible, 0), topk)
    np.testing.assert_array_equal((got.reshape(-1, topk) >= 0).sum(-1), kept)
    assert np.all(got.reshape(-1, topk)[np.arange(topk) >= kept[:, None]] == -1)
    # The float64 top-k of the formula over the stored values, but for float32 near-ties.
    stored = _stored_scores_f64(rows, problem.cache, block_table, visible)
    mine = [selected_positions(s, row) for s, row in zip(got.reshape(-1, topk), block_table)]
    slack = np.full(len(stored), 2 * max(SCORE_ATOL, 5e-6)
                    * np.abs(stored[np.isfinite(stored)]).max())
    assert_same_selection(mine, _top(stored, topk), stored, slack)


def test_equal_scores_keep_the_earlier_tokens():
    cache = IndexKeyCache.create(4)  # every key 0: every score 0
    block_table = jnp.asarray([[2, 0, 3]], jnp.int32)
    query = IndexQuery(jnp.ones((1, 1, HEADS, 128), jnp.float8_e4m3fn),
                       jnp.ones((1, 1, HEADS), jnp.float32))
    got = _decode(query, cache, block_table, jnp.asarray([100], jnp.int32), topk=80)
    expected = np.asarray(token_slots(block_table, jnp.arange(80, dtype=jnp.int32)[None]))
    np.testing.assert_array_equal(np.asarray(got)[0, 0], expected[0])


def test_a_page_missing_from_the_cache_leaves_no_gap_in_the_selection():
    """A block-table entry past the cache among the visible tokens: its tokens score -inf and
    are never taken; the others stay in position order, every -1 after them."""
    problem, query = _decode_problem(13, [200], s_q=1)
    table = problem.block_table.copy()
    table[0, 1] = problem.cache.data.shape[0] + 7  # tokens 64 to 127
    got = np.asarray(_decode(query, problem.cache, table, problem.lengths, topk=256))[0, 0]
    readable = problem.slots(0, np.r_[0:64, 128:200])
    np.testing.assert_array_equal(got, np.r_[readable, np.full(256 - len(readable), -1)])


def test_nan_scores_of_either_sign_are_taken_first():
    """Key scales of NaN with and without the sign bit (garbage in a page): those tokens score
    NaN, which ranks above every number whatever its sign."""
    problem, query = _decode_problem(14, [300], s_q=1)
    data = np.asarray(problem.cache.data).copy()
    nan_tokens = [5, 77, 150, 299]
    for position, bits in zip(nan_tokens, [0xFFFFFFFF, 0xFFC00000, 0x7FC00000, 0x7FFFFFFF]):
        slot = int(problem.slots(0, [position])[0])
        scale = 128 * PAGE + 4 * (slot % PAGE)
        data[slot // PAGE, scale:scale + 4] = np.asarray([bits], np.uint32).view(np.uint8)
    got = np.asarray(_decode(query, IndexKeyCache(jnp.asarray(data)), problem.block_table,
                             problem.lengths, topk=8))[0, 0]
    assert set(problem.slots(0, nan_tokens).tolist()) <= set(got.tolist()), got


def test_prefill_is_causal_over_a_cached_prefix_and_matches_decode():
    lengths = [110, 50, 12, 0]
    new = [70, 50, 0, 0]  # request 0 extends a 40-token prefix; request 2 adds nothing
    problem, padding = Problem(5, lengths), 3
    pairs = [(r, p) for r, (n, k) in enumerate(zip(lengths, new)) for p in range(n - k, n)]
    query = problem.query(pairs + [(0, 0)] * padding)
    cu_seqlens = np.concatenate([[0], np.cumsum(new)]).astype(np.int32)
    got = np.asarray(_prefill(query, problem.cache, problem.block_table, problem.lengths,
                              cu_seqlens, topk=16))
    assert got.shape == (len(pairs) + padding, 16)
    assert np.all(got[len(pairs):] == -1)
    for r, (n, k) in enumerate(zip(lengths, new)):
        if not k:
            continue
        rows, positions = slice(cu_seqlens[r], cu_seqlens[r + 1]), np.arange(n - k, n)
        mine = got[rows]
        np.testing.assert_array_equal((mine >= 0).sum(-1), np.minimum(16, positions + 1))
        exact, slack = problem.exact_and_slack(r, positions, IndexQuery(*(x[rows] for x in query)))
        assert_same_selection([selected_positions(s, problem.block_table[r]) for s in mine],
                               _top(exact, 16), exact, slack)
        # The last new token, decoded alone, selects the same.
        last = _decode(IndexQuery(*(x[rows][-1:][None] for x in query)), problem.cache,
                       problem.block_table[r:r + 1], problem.lengths[r:r + 1], topk=16)
        np.testing.assert_array_equal(np.asarray(last)[0, 0], mine[-1])


def _decode_problem(seed, lengths, s_q=2):
    """A Problem and the (batch, s_q) IndexQuery of each request's last s_q tokens."""
    problem = Problem(seed, lengths)
    query = problem.query([(r, p) for r, n in enumerate(lengths) for p in range(n - s_q, n)])
    return problem, IndexQuery(*(x.reshape(len(lengths), s_q, *x.shape[1:]) for x in query))


@pytest.mark.parametrize("bad", [INT32_MIN, INT32_MIN + 1, -1])
def test_a_negative_length_selects_nothing_and_changes_no_other_request(bad):
    """seq_lens - s_q + j + 1 would wrap around int32 at INT32_MIN (to a token that sees all)."""
    problem, query = _decode_problem(10, [150, 70, 64])
    seq_lens = problem.lengths.copy()
    seq_lens[1] = bad
    got = np.asarray(_decode(query, problem.cache, problem.block_table, seq_lens, topk=16))
    assert np.all(got[1] == -1)
    others = np.asarray([0, 2])
    alone = _decode(IndexQuery(*(x[others] for x in query)), problem.cache,
                    problem.block_table[others], problem.lengths[others], topk=16)
    np.testing.assert_array_equal(got[others], np.asarray(alone))


def test_a_length_past_the_table_sees_every_token_the_table_holds():
    problem, query = _decode_problem(12, [150, 70])
    capacity = problem.block_table.shape[1] * PAGE
    past = _decode(query, problem.cache, problem.block_table,
                   np.asarray([INT32_MAX, 70], np.int32), topk=256)
    every = _decode(query, problem.cache, problem.block_table,
                    np.asarray([capacity + 1, 70], np.int32), topk=256)  # both tokens see all
    np.testing.assert_array_equal(np.asarray(past), np.asarray(every))
    assert np.all((np.asarray(past)[0] >= 0).sum(-1) == capacity)


@pytest.mark.parametrize("bad", [INT32_MIN, -1])
def test_prefill_rows_of_a_negative_length_select_nothing_and_change_no_other(bad):
    lengths, new = [110, 50, 12], [70, 5, 12]
    problem = Problem(11, lengths)
    pairs = [(r, p) for r, (n, k) in enumerate(zip(lengths, new)) for p in range(n - k, n)]
    query = problem.query(pairs)
    cu_seqlens = np.concatenate([[0], np.cumsum(new)]).astype(np.int32)
    seq_lens = problem.lengths.copy()
    seq_lens[1] = bad
    got = np.asarray(_prefill(query, problem.cache, problem.block_table, seq_lens, cu_seqlens,
                              topk=16))
    assert np.all(got[70:75] == -1)
    others = np.r_[0:70, 75:87]
    alone = _prefill(IndexQuery(*(x[others] for x in query)), problem.cache,
                     problem.block_table[[0, 2]], problem.lengths[[0, 2]],
                     np.asarray([0, 70, 82], np.int32), topk=16)
    np.testing.assert_array_equal(got[others], np.asarray(alone))


def _checked_error(seq_lens, cu_seqlens=None):
    """value_checks()' error of indexer_decode (cu_seqlens None), or indexer_prefill, over two
    requests of two new tokens."""
    query = IndexQuery(jnp.ones((2, 2, HEADS, 128), jnp.float8_e4m3fn),
                       jnp.ones((2, 2, HEADS), jnp.float32))
    cache, table = IndexKeyCache.create(4), jnp.asarray([[0, 1], [2, 3]], jnp.int32)

    def call(seq_lens, cu_seqlens):
        if cu_seqlens is None:
            return indexer_decode(query, cache, table, seq_lens, topk=16)
        rows = IndexQuery(*(x.reshape(4, *x.shape[2:]) for x in query))
        return indexer_prefill(rows, cache, table, seq_lens, cu_seqlens, topk=16)

    as_int32 = lambda x: None if x is None else jnp.asarray(x, jnp.int32)
    with value_checks():
        return jax.jit(checkify.checkify(call))(as_int32(seq_lens), as_int32(cu_seqlens))[0]


@pytest.mark.parametrize("seq_lens,cu_seqlens,message", [
    ([5, INT32_MIN], None, rf"indexer_decode: seq_lens\[1\] = {INT32_MIN} is negative"),
    ([-3, 9], [0, 2, 4], r"indexer_prefill: seq_lens\[0\] = -3 is negative"),
    ([3, 9], [0, 3, 2], r"indexer_prefill: cu_seqlens\[2\] = 2; cu_seqlens must be "
                        r"non-decreasing from 0 to at most the query's 4 tokens"),
    ([3, 9], [0, 3, INT32_MAX], rf"indexer_prefill: cu_seqlens\[2\] = {INT32_MAX}; "),
    ([3, 9], [1, 3, 4], r"indexer_prefill: cu_seqlens\[0\] = 1; "),
])
def test_value_checks_name_the_bad_lengths(seq_lens, cu_seqlens, message):
    with pytest.raises(checkify.JaxRuntimeError, match=message):
        _checked_error(seq_lens, cu_seqlens).throw()
    _checked_error([5, 9]).throw()
    _checked_error([3, 9], [0, 2, 4]).throw()


def _hf_indexer(seed, topk):
    torch = pytest.importorskip("torch")
    modeling = pytest.importorskip("transformers.models.deepseek_v32.modeling_deepseek_v32")
    from transformers import DeepseekV32Config
    config = DeepseekV32Config(
        hidden_size=HIDDEN, q_lora_rank=Q_LORA, index_n_heads=HEADS, index_head_dim=128,
        qk_rope_head_dim=64, index_topk=topk, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=32, v_head_dim=32,
        vocab_size=100, n_routed_experts=4, n_group=1, topk_group=1, num_experts_per_tok=2,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    torch.manual_seed(seed)
    indexer = modeling.DeepseekV32Indexer(config, layer_idx=0).eval()
    torch.nn.init.normal_(indexer.k_norm.weight, 1.0, 0.2)
    torch.nn.init.normal_(indexer.k_norm.bias, 0.0, 0.2)
    rotary = modeling.DeepseekV32RotaryEmbedding(config)
    np.testing.assert_allclose(rotary.inv_freq.numpy(), INV_FREQ, rtol=1e-6)
    state = {name: tensor.numpy() for name, tensor in indexer.state_dict().items()}
    weights = IndexerWeights.from_state_dict(state)
    return torch, config, indexer, rotary, weights


def _hf_call(torch, indexer, rotary, x, q_lora, start, cache=None):
    """HF's selected positions of tokens start.. of one request (x, q_lora (n, dim) NumPy)."""
    n = len(x)
    positions = torch.arange(start, start + n)[None]
    x, q_lora = torch.from_numpy(x)[None], torch.from_numpy(q_lora)[None]
    mask = torch.arange(start + n)[None, :] <= positions[0, :, None]
    with torch.no_grad():
        out = indexer(x, q_lora, rotary(x, positions), mask[None], positions, cache=cache)
    return [[p for p in row if p <= start + i] for i, row in enumerate(out[0].tolist())]


def test_prefill_selects_what_hf_selects():
    torch, _, indexer, rotary, weights = _hf_indexer(6, topk=16)
    lengths = [130, 45]
    problem = Problem(7, lengths, weights)
    query = problem.query([(r, p) for r, n in enumerate(lengths) for p in range(n)])
    cu_seqlens = np.asarray([0, 130, 175], np.int32)
    got = np.asarray(_prefill(query, problem.cache, problem.block_table, problem.lengths,
                              cu_seqlens, topk=16))
    for r, n in enumerate(lengths):
        rows = slice(cu_seqlens[r], cu_seqlens[r + 1])
        hf = _hf_call(torch, indexer, rotary, problem.x[r][:n], problem.q_lora[r][:n], 0)
        exact, slack = problem.exact_and_slack(r, np.arange(n),
                                               IndexQuery(*(x[rows] for x in query)))
        # HF selects the float64 formula's top tokens (this test's oracle is HF's) ...
        float32_rounding = 1e-5 * np.abs(exact[np.isfinite(exact)]).max()
        assert_same_selection(hf, _top(exact, 16), exact, np.full(n, float32_rounding))
        # ... and the FP8 indexer what HF selects, but for tokens FP8 rounding can reorder.
        mine = [selected_positions(s, problem.block_table[r]) for s in got[rows]]
        assert_same_selection(mine, hf, exact, slack)


def test_decode_after_the_prompt_selects_what_hf_selects():
    torch, config, indexer, rotary, weights = _hf_indexer(8, topk=16)
    from transformers.cache_utils import DynamicCache
    lengths, s_q = [100, 40], 2
    problem = Problem(9, lengths, weights, written=[n - s_q for n in lengths])
    hf = []
    for r, n in enumerate(lengths):
        hf_cache = DynamicCache(config=config)
        prompt, new = slice(0, n - s_q), slice(n - s_q, n)
        _hf_call(torch, indexer, rotary, problem.x[r][prompt], problem.q_lora[r][prompt], 0,
                 hf_cache)
        hf.append(_hf_call(torch, indexer, rotary, problem.x[r][new], problem.q_lora[r][new],
                           n - s_q, hf_cache))
    pairs = [(r, p) for r, n in enumerate(lengths) for p in range(n - s_q, n)]
    problem.cache = problem.write(problem.cache, pairs)  # the decode step's new keys
    query = IndexQuery(*(x.reshape(len(lengths), s_q, *x.shape[1:])
                         for x in problem.query(pairs)))
    got = np.asarray(_decode(query, problem.cache, problem.block_table, problem.lengths,
                             topk=16))
    for r, n in enumerate(lengths):
        exact, slack = problem.exact_and_slack(r, np.arange(n - s_q, n),
                                               IndexQuery(*(x[r] for x in query)))
        mine = [selected_positions(s, problem.block_table[r]) for s in got[r]]
        assert_same_selection(mine, hf[r], exact, slack)


@pytest.mark.parametrize("call,exc,pattern", [
    (lambda q, c, bt, sl: indexer_decode(q.values, c, bt, sl), TypeError,
     r"indexer_decode: query must be an IndexQuery"),
    (lambda q, c, bt, sl: indexer_decode(IndexQuery(q.values.astype(jnp.float32), q.weights), c,
                                         bt, sl), ValueError,
     r"query.values must be float8_e4m3fn of shape \('batch', 's_q', 'heads', 128\); got float32"),
    (lambda q, c, bt, sl: indexer_decode(q, c.data[:, :100], bt, sl), ValueError,
     r"cache must be an IndexKeyCache or a \(num_pages >= 1, 8448\) uint8 array; got uint8 "
     r"\(2, 100\)"),
    (lambda q, c, bt, sl: indexer_decode(q, c, np.asarray(bt, np.int64), sl), TypeError,
     r"block_table must be int32; got int64"),
    (lambda q, c, bt, sl: indexer_decode(q, c, bt[:1], sl), ValueError,
     r"block_table must have shape \(2, max_pages >= 1\); got \(1, 2\)"),
    (lambda q, c, bt, sl: indexer_decode(q, c, bt, sl[:1]), ValueError,
     r"seq_lens must have shape \(2,\); got \(1,\)"),
    (lambda q, c, bt, sl: indexer_decode(q, c, bt, sl, topk=0), ValueError,
     r"topk must be a positive Python int; got 0"),
    (lambda q, c, bt, sl: indexer_prefill(IndexQuery(*(x[0] for x in q)), c, bt, sl,
                                          jnp.zeros((2,), jnp.int32)), ValueError,
     r"indexer_prefill: cu_seqlens must have shape \(3,\); got \(2,\)"),
    (lambda q, c, bt, sl: write_sparse_kv(c, jnp.zeros((3,), jnp.int32), jnp.zeros((3, 64))),
     ValueError, r"write_sparse_kv: keys must be floating with shape \(3, 128\)"),
    (lambda q, c, bt, sl: write_sparse_kv(c, np.zeros((3,), np.int64), jnp.zeros((3, 128))),
     TypeError, r"write_sparse_kv: slots must be int32; got int64"),
    (lambda q, c, bt, sl: indexer_decode(q, c, bt, sl, implementation="triton"), ValueError,
     r"indexer_decode: implementation must be None or one of \('custom_call', 'reference'\); "
     r"got 'triton'"),
])
def test_bad_arguments_are_named(call, exc, pattern):
    query = IndexQuery(jnp.zeros((2, 1, HEADS, 128), jnp.float8_e4m3fn),
                       jnp.zeros((2, 1, HEADS), jnp.float32))
    with pytest.raises(exc, match=pattern):
        call(query, IndexKeyCache.create(2), jnp.zeros((2, 2), jnp.int32),
             jnp.ones((2,), jnp.int32))


def test_a_table_whose_positions_pass_int32_is_refused():
    query = IndexQuery(jax.ShapeDtypeStruct((1, 1, HEADS, 128), jnp.float8_e4m3fn),
                       jax.ShapeDtypeStruct((1, 1, HEADS), jnp.float32))
    table = jax.ShapeDtypeStruct((1, 2 ** 25), jnp.int32)  # 2**31 positions
    with pytest.raises(ValueError, match=r"indexer_decode: block_table may have at most "
                                         r"33554431 pages a row, whose positions fit int32; "
                                         r"got 33554432"):
        jax.eval_shape(indexer_decode, query, IndexKeyCache.create(1), table,
                       jax.ShapeDtypeStruct((1,), jnp.int32))


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="the custom call runs on a GPU")
def test_the_custom_call_off_the_gpu_says_so():
    query = IndexQuery(jnp.zeros((1, 1, HEADS, 128), jnp.float8_e4m3fn),
                       jnp.zeros((1, 1, HEADS), jnp.float32))
    with pytest.raises(RuntimeError, match=r"index_scores: implementation='custom_call' runs "
                                           r"jax_flashmla's CUDA kernel, which needs a Hopper "
                                           r"GPU; JAX's default backend is cpu; pass "
                                           r"implementation='reference' or None$"):
        index_scores(IndexQuery(*(x[0] for x in query)), IndexKeyCache.create(1),
                     jnp.zeros((1, 1), jnp.int32), jnp.ones((1,), jnp.int32),
                     implementation="custom_call")


@pytest.mark.parametrize("change,exc,pattern", [
    (dict(x=jnp.zeros((5, HIDDEN + 1))), ValueError,
     r"index_query: x must have a last dimension of 64 \(weights' hidden size\); got \(5, 65\)"),
    (dict(q_lora=jnp.zeros((5, Q_LORA + 1))), ValueError,
     r"index_query: q_lora must have shape \(5, 32\)"),
    (dict(positions=np.arange(5)), TypeError, r"index_query: positions must be int32; got int64"),
    (dict(positions=jnp.arange(4, dtype=jnp.int32)), ValueError,
     r"index_query: positions must have shape \(5,\) \(x's leading shape\); got \(4,\)"),
    (dict(inv_freq=np.ones(65, np.float32)), ValueError,
     r"index_query: inv_freq must have shape \(rope_dim // 2,\), rope_dim <= 128; got \(65,\)"),
])
def test_bad_projection_arguments_are_named(change, exc, pattern):
    args = dict(weights=_weights(np.random.default_rng(0)), x=jnp.zeros((5, HIDDEN)),
                q_lora=jnp.zeros((5, Q_LORA)), positions=jnp.arange(5, dtype=jnp.int32),
                inv_freq=INV_FREQ)
    args.update(change)
    with pytest.raises(exc, match=pattern):
        index_query(**args)
