"""DeepSeek-V4's indexer (jax_flashmla.ops.v4_indexer) against HF transformers'
DeepseekV4Indexer on CPU, driven as DeepseekV4Attention drives it (tests/v4_compressor_hf.py):
a prompt at once, chunks of 1, 3, 37 and 129 tokens, then decode steps; a ragged batch against
each request alone; bad starts, lengths and tables.

HF scores unquantized q and entries; ours are rotated and FP8 (module doc). So:
  - the stored entries and the queries are HF's rotated, to e4m3's rounding (half a unit in
    the last of 3 mantissa bits: 2**-4 of a value, 2**-10 of the scale below the normals);
  - the scores are HF's within fp8_score_bound, the most e4m3's rounding of q and of the
    entries can move a score (plus float32's 1e-5 of the call's largest score; on a GPU, plus
    the scoring kernel's own error against the stored FP8 values, indexer_cases'
    KERNEL_SCORE_RTOL and KERNEL_SCORE_ATOL);
  - the selections are HF's up to ties (tests/v4_ties.py's rule): with k = min(topk,
    visible) and s_k the k-th largest exact score (HF's), every entry scoring above s_k + slack
    is selected and none below s_k - slack, slack twice the row's largest FP8 score error.
    HF's own selections pass the same rule with no slack beyond float32's. Ties are real
    here: a score is exactly 0 where every head's relu is.
Caches start as NaN bytes: a read of an entry never written shows.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from indexer_cases import KERNEL_SCORE_ATOL, KERNEL_SCORE_RTOL, paged_block_table
from v4_compressor_hf import CSA, HIDDEN, HFLayers, config, torch
from v4_ties import assert_top_up_to_ties

from jax_flashmla.caches.index_keys import (PAGE_BYTES, IndexKeyCache, power_of_two_scales,
                                            read_index_keys)
from jax_flashmla.kernels import library as kernels
from jax_flashmla.ops.compressor import compress, initial_state
from jax_flashmla.ops.indexer import HADAMARD, IndexQuery, index_scores
from jax_flashmla.ops.v4_indexer import (V4IndexerWeights, v4_index_query, v4_indexer_select,
                                         visible_entries, write_v4_index_keys)

TOPK, RATIO, HEADS = 8, 4, 4
CHUNKS = (1, 3, 37, 129)
STEPS = 22
F32_TOL = 1e-5  # float32 against float32 (torch's and XLA's roundings)
ROTATION = HADAMARD.astype(np.float64) / np.sqrt(128)

_compress = jax.jit(compress, donate_argnums=1)
_write = jax.jit(write_v4_index_keys, donate_argnums=0)
_query = jax.jit(v4_index_query)
_select = jax.jit(v4_indexer_select, static_argnames=("ratio", "topk"))
_pow2_scales = jax.jit(power_of_two_scales)
_read = jax.jit(read_index_keys)


@functools.partial(jax.jit, static_argnames="n")
def _request_scores(query, cache, table, start, b, n):
    """Request b's first n rows' scores from index_scores over its block-table row: one
    compiled program per n, where slicing op by op compiled each slice anew."""
    rows = IndexQuery(jax.lax.dynamic_index_in_dim(query.values, b, keepdims=False)[:n],
                      jax.lax.dynamic_index_in_dim(query.weights, b, keepdims=False)[:n])
    start = jax.lax.dynamic_slice_in_dim(start, b, 1)
    visible = visible_entries(start, jnp.asarray([n], jnp.int32), n, RATIO)[0]
    table = jnp.repeat(jax.lax.dynamic_slice_in_dim(table, b, 1), n, 0)
    return index_scores(rows, cache, table, visible)


def row_padded(fn, x, fill=0):
    """fn(x), numpy, for a jitted fn that computes each row of x (its first axis) alone: x's
    rows padded with fill to a power of two, so that the calls' growing counts of entries and
    tokens share a few compiled programs."""
    x = np.asarray(x)
    padded = np.full((1 << max(0, len(x) - 1).bit_length(), *x.shape[1:]), fill, x.dtype)
    padded[:len(x)] = x
    return jax.tree.map(lambda y: np.asarray(y)[:len(x)], fn(padded))


def _config():
    """The compressor tests' config with V4's 128-wide indexer, 4 heads, index_topk 8."""
    cfg = config()
    cfg.index_head_dim, cfg.index_n_heads, cfg.index_topk = 128, HEADS, TOPK
    return cfg


class HF:
    """HFLayers whose CSA indexer's calls are recorded: its inputs, its scorer's raw scores
    and its top-k, for one request fed at a time."""

    def __init__(self, seed=0):
        self.layers = HFLayers(_config(), seed=seed)
        indexer = self.layers.layers[CSA].compressor.indexer
        self.indexer = indexer
        indexer.register_forward_hook(self._record_call)
        indexer.scorer.register_forward_hook(
            lambda module, args, out: self.seen.update(scores=out[0].double().numpy()))
        self.seen = {}

    def _record_call(self, module, args, out):
        hidden, q_residual, position_ids = args[:3]
        self.seen.update(hidden=hidden, q_residual=q_residual[0].float().numpy(),
                         positions=position_ids[0].numpy(), topk=out[0].numpy())

    def feed(self, request, x):
        """Feeds request the tokens x (n, hidden); keeps its indexer's entries so far."""
        self.entries = self.layers.feed(request, x)[CSA, True]

    def weights(self):
        tensors = {name: jnp.asarray(t.numpy())
                   for name, t in self.indexer.state_dict().items()}
        return V4IndexerWeights.from_state_dict(tensors, self.layers.cfg.rms_norm_eps)

    def rotated_queries(self):
        """The last call's q (after RoPE, as HF scores it), rotated: (S, heads, 128) float64."""
        seen = self.seen
        n = len(seen["positions"])
        positions = torch.as_tensor(seen["positions"])[None]
        with torch.no_grad():
            q = self.indexer.q_b_proj(torch.as_tensor(seen["q_residual"])[None])
            q = q.view(1, n, HEADS, 128).transpose(1, 2)
            cos, sin = self.indexer.rotary_emb(seen["hidden"], position_ids=positions,
                                               layer_type="compress")
            q = modeling_rope(q, cos, sin).transpose(1, 2)[0]
        return q.double().numpy() @ ROTATION

    def head_weights(self):
        """The last call's w_h * heads**-0.5 * 128**-0.5: (S, heads) float64."""
        with torch.no_grad():
            w = self.indexer.scorer.weights_proj(self.seen["hidden"])[0]
        return w.double().numpy() * HEADS ** -0.5 * 128 ** -0.5


def modeling_rope(q, cos, sin):
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import apply_rotary_pos_emb
    return apply_rotary_pos_emb(q, cos, sin)


def _tokens(seed, n):
    return np.random.default_rng(seed).normal(size=(n, HIDDEN)).astype(np.float32)


class Ours:
    """A batch of requests through compress, write_v4_index_keys, v4_index_query and
    v4_indexer_select, over a NaN cache of permuted pages."""

    def __init__(self, weights, inv_freq, capacities, seed=0):
        self.weights, self.inv_freq = weights, jnp.asarray(inv_freq)
        self.state = initial_state(weights.compressor, len(capacities), jnp.float32)
        table, num_pages = paged_block_table(np.random.default_rng(seed),
                                             [-(-n // RATIO) for n in capacities])
        self.table = jnp.asarray(table)
        self.cache = IndexKeyCache(jnp.full((num_pages, PAGE_BYTES), 0xFF, jnp.uint8))

    def feed(self, xs, q_residuals, seq_len=None, start=None, lengths=None):
        """xs, q_residuals: each request's new tokens' (n, ·), padded to seq_len. Returns
        (V4Selection, the query, the start used) of the call; start and lengths, if given,
        replace the state's count and len(x) in the selection only."""
        real = [len(x) for x in xs]
        seq_len = seq_len or max(1, max(real))
        x = np.zeros((len(xs), seq_len, HIDDEN), np.float32)
        q_res = np.zeros((len(xs), seq_len, q_residuals[0].shape[-1]), np.float32)
        for b, (xb, qb) in enumerate(zip(xs, q_residuals)):
            x[b, :len(xb)], q_res[b, :len(qb)] = xb, qb
        before = jnp.array(self.state.num_tokens)  # the state is donated
        entries, self.state = _compress(self.weights.compressor, self.state, jnp.asarray(x),
                                        jnp.asarray(real, jnp.int32), self.inv_freq)
        self.cache = _write(self.cache, self.table, entries)
        positions = before[:, None] + jnp.arange(seq_len, dtype=jnp.int32)
        query = _query(self.weights, jnp.asarray(x), jnp.asarray(q_res), positions,
                       self.inv_freq)
        start = before if start is None else jnp.asarray(start, jnp.int32)
        lengths = jnp.asarray(real if lengths is None else lengths, jnp.int32)
        return _select(query, self.cache, self.table, start, lengths, ratio=RATIO,
                       topk=TOPK), query, start

    def fp8_scores(self, query, b, start, n):
        """Request b's first n rows' scores from index_scores: (n, max_pages * 64)."""
        return np.asarray(_request_scores(query, self.cache, self.table, start, b, n=n),
                          np.float64)

    def stored_entries(self, b, count):
        """Request b's first count entries as stored, dequantized: (count, 128) float64."""
        j = np.arange(count)
        slots = np.asarray(self.table)[b, j // 64] * 64 + j % 64
        values, scales = row_padded(functools.partial(_read, self.cache.data),
                                    slots.astype(np.int32))  # padded with slot 0's entry
        return values.astype(np.float64) * scales.astype(np.float64)[:, None]


def assert_fp8_error_bound(got, want, scale):
    """got (e4m3 value times its scale) is want rounded to e4m3 at that scale: within half a
    unit in the last place (2**-4 of |want|, 2**-10 of the scale below the normals)."""
    bound = np.maximum(2.0 ** -4 * np.abs(want), 2.0 ** -10 * scale) + F32_TOL * scale
    assert (np.abs(got - want) <= bound).all(), np.abs(got - want).max()


def fp8_score_bound(q, q_scales, keys, k_scales, head_weights):
    """(S, T) the most the FP8 score of each query and entry can lie from the exact one: relu
    moves no difference up, and |q~ . k~ - q . k| <= sum_d dq |k| + |q| dk + dq dk, with dq and
    dk e4m3's rounding bounds (assert_fp8_error_bound's) of q (S, heads, 128) and the keys
    (T, 128); head_weights (S, heads)."""
    dq = np.maximum(2.0 ** -4 * np.abs(q), 2.0 ** -10 * q_scales)
    dk = np.maximum(2.0 ** -4 * np.abs(keys), 2.0 ** -10 * k_scales)
    per_head = (np.einsum("shd,td->sht", dq, np.abs(keys) + dk)
                + np.einsum("shd,td->sht", np.abs(q), dk))
    return np.einsum("sht,sh->st", per_head, np.abs(head_weights))


def check_call(ours, hf, selection, query, b=0, start=None):
    """Request b's rows of a call against HF's record of the same call (module doc)."""
    seen = hf.seen
    n, count = len(seen["positions"]), seen["scores"].shape[-1]
    start = np.asarray(ours.state.num_tokens) - n if start is None else start
    np.testing.assert_array_equal(seen["positions"], start[b] + np.arange(n))
    # Keys and queries: HF's rotated, to e4m3's rounding.
    want_keys = hf.entries @ ROTATION
    assert want_keys.shape == (count, 128)
    k_scales = row_padded(_pow2_scales, want_keys.astype(np.float32))[:, None].astype(float)
    assert_fp8_error_bound(ours.stored_entries(b, count), want_keys, k_scales)
    q_want = hf.rotated_queries()
    q_scales = row_padded(_pow2_scales, q_want.astype(np.float32))[..., None].astype(float)
    got_q = np.asarray(query.values)[b, :n].astype(np.float64) * q_scales
    assert_fp8_error_bound(got_q, q_want, q_scales)
    head_weights = hf.head_weights()
    np.testing.assert_allclose(np.asarray(query.weights)[b, :n] / q_scales[..., 0],
                               head_weights, rtol=F32_TOL, atol=F32_TOL)
    # Scores within the FP8 bound, selections up to ties.
    visible = (seen["positions"] + 1) // RATIO
    exact = np.where(np.arange(count) < visible[:, None], seen["scores"], -np.inf)
    fp8 = ours.fp8_scores(query, b, jnp.asarray(start, jnp.int32), n)[:, :count]
    finite = np.isfinite(exact)
    assert (np.isfinite(fp8) == finite).all()
    peak = np.abs(exact[finite]).max(initial=1.0)
    bound = fp8_score_bound(q_want, q_scales, want_keys, k_scales, head_weights) + F32_TOL * peak
    if kernels.own_kernels_available():  # the scores are the kernel's
        bound += KERNEL_SCORE_RTOL * np.abs(np.where(finite, fp8, 0)) + KERNEL_SCORE_ATOL * peak
    error = np.where(finite, np.abs(fp8 - np.where(finite, exact, 0)), 0)
    assert (error <= bound).all(), (error - bound).max()
    error = error.max(-1, initial=0)
    entries, slots = (np.asarray(a)[b, :n] for a in selection)
    for t in range(n):
        k = min(TOPK, visible[t])
        assert_top_up_to_ties(entries[t], exact[t], k, 2 * error[t] + 1e-6 * peak)
        assert_top_up_to_ties(seen["topk"][t], exact[t], k, 1e-6 * peak)
        assert (entries[t, :k] == np.sort(entries[t, :k])).all() and (entries[t, k:] == -1).all()
        table = np.asarray(ours.table)[b]
        np.testing.assert_array_equal(slots[t, :k], table[entries[t, :k] // 64] * 64
                                      + entries[t, :k] % 64)
        assert (slots[t, k:] == -1).all()


def _run(chunks, seed=0):
    hf = HF(seed)
    x = _tokens(seed, sum(chunks))
    ours = Ours(hf.weights(), hf.layers.inv_freq, [len(x)], seed)
    request, start = hf.layers.request(), 0
    for n in chunks:
        hf.feed(request, x[start:start + n])
        selection, query, _ = ours.feed([x[start:start + n]], [hf.seen["q_residual"]])
        check_call(ours, hf, selection, query)
        start += n
    return ours, hf


def test_prompt_at_once_equals_hf():
    _run([150])


def test_chunks_then_decode_steps_equal_hf():
    _run(CHUNKS + (1,) * STEPS)


def test_visible_entries_is_hfs_causal_threshold():
    start = jnp.asarray([0, 5, 2 ** 31 - 3, -1, 7, 7], jnp.int32)
    lengths = jnp.asarray([6, 6, 2, 6, 7, -1], jnp.int32)
    got = np.asarray(visible_entries(start, lengths, 6, RATIO))
    np.testing.assert_array_equal(got[0], (np.arange(6) + 1) // RATIO)
    np.testing.assert_array_equal(got[1], (5 + np.arange(6) + 1) // RATIO)
    np.testing.assert_array_equal(got[2, :2], (2 ** 31 - 3 + np.arange(2) + 1) // RATIO)
    assert (got[2, 2:] == 0).all() and (got[3:] == 0).all()  # padding, bad start or lengths


@pytest.mark.parametrize("shift", [-1, 0, 1])
def test_a_threshold_off_by_one_fails_against_hf(shift):
    """The comparison sees the threshold: the same call selected as if its tokens sat one
    position earlier or later is not HF's (a visible count moves at every 4th token)."""
    hf = HF()
    x = _tokens(3, 60)
    ours = Ours(hf.weights(), hf.layers.inv_freq, [len(x)])
    request = hf.layers.request()
    hf.feed(request, x[:21])
    ours.feed([x[:21]], [hf.seen["q_residual"]])
    hf.feed(request, x[21:])
    selection, query, _ = ours.feed([x[21:]], [hf.seen["q_residual"]], start=[21 + shift])
    if shift:
        with pytest.raises(AssertionError):
            check_call(ours, hf, selection, query, start=np.asarray([21]))
    else:
        check_call(ours, hf, selection, query, start=np.asarray([21]))


# Per call, each request's new tokens (0: it sits the call out).
RAGGED = [(37, 5, 129, 0), (1, 64, 3, 17), (0, 1, 1, 40), (1, 1, 1, 1), (2, 2, 2, 2)]


def test_ragged_batch_equals_each_request_alone_and_hf():
    hf = [HF() for _ in range(4)]
    xs = [_tokens(10 + b, sum(call[b] for call in RAGGED)) for b in range(4)]
    totals = [len(x) for x in xs]
    batch, starts = Ours(hf[0].weights(), hf[0].layers.inv_freq, totals, seed=5), [0] * 4
    requests = [h.layers.request() for h in hf]
    alone = [Ours(hf[0].weights(), hf[0].layers.inv_freq, [n], seed=b)
             for b, n in enumerate(totals)]
    seq_len = max(map(max, RAGGED))
    for call in RAGGED:
        q_res = []
        for b, n in enumerate(call):
            if n:
                hf[b].feed(requests[b], xs[b][starts[b]:starts[b] + n])
            q_res.append(hf[b].seen["q_residual"][-n:] if n else np.zeros((0, 16), np.float32))
        chunk = [xs[b][starts[b]:starts[b] + n] for b, n in enumerate(call)]
        got, query, _ = batch.feed(chunk, q_res, seq_len=seq_len)
        for b, n in enumerate(call):
            entries = np.asarray(got.entries[b])
            if not n:
                assert (entries == -1).all()
                continue
            check_call(batch, hf[b], got, query, b)
            want, _, _ = alone[b].feed([chunk[b]], [q_res[b]], seq_len=seq_len)
            np.testing.assert_array_equal(entries, np.asarray(want.entries[0]))
        starts = [s + n for s, n in zip(starts, call)]


def _bad_value_problem():
    """Three requests of 52 tokens fed (13 entries each, a page of the table each), and
    queries of 3 tokens (any) for positions 49 to 51 (13 visible entries)."""
    hf = HF()
    ours = Ours(hf.weights(), hf.layers.inv_freq, [60] * 3)
    rng = np.random.default_rng(7)
    xs = [rng.normal(size=(52, HIDDEN)).astype(np.float32) for _ in range(3)]
    q_res = [rng.normal(size=(52, 16)).astype(np.float32) for _ in range(3)]
    ours.feed(xs, q_res)
    return ours, [x[:3] for x in xs], [q[:3] for q in q_res]


def _select_again(ours, xs, q_res, start, lengths):
    """The selection of queries xs with start and lengths given (cache and state as fed)."""
    x = jnp.asarray(np.stack(xs))
    positions = jnp.asarray(start, jnp.int32)[:, None] + jnp.arange(3, dtype=jnp.int32)
    query = _query(ours.weights, x, jnp.asarray(np.stack(q_res)), positions, ours.inv_freq)
    return _select(query, ours.cache, ours.table, jnp.asarray(start, jnp.int32),
                   jnp.asarray(lengths, jnp.int32), ratio=RATIO, topk=TOPK)


@pytest.mark.parametrize("start, lengths", [
    ([49, -1, 49], [3, 3, 3]), ([49, -2 ** 31, 49], [3, 3, 3]), ([49, 49, 49], [3, -1, 3]),
    ([49, 49, 49], [3, 4, 3]), ([49, 49, 49], [3, -2 ** 31, 3]),
    ([49, 2 ** 31 - 3, 49], [3, 3, 3]), ([49, 257, 49], [3, 3, 3])])
def test_bad_start_or_lengths_select_nothing_and_change_no_other_request(start, lengths):
    """A negative start or lengths, lengths past the query's rows, and a start that would
    see more entries than the table holds (a page: 64; position 258 sees 64, 259 sees 65)."""
    ours, xs, q_res = _bad_value_problem()
    good = _select_again(ours, xs, q_res, [49] * 3, [3] * 3)
    got = _select_again(ours, xs, q_res, start, lengths)
    entries, slots = np.asarray(got.entries[1]), np.asarray(got.slots[1])
    if start[1] == 257:  # its first two tokens see 64 entries: 13 written, 51 NaN bytes
        assert (entries[:2] >= 0).any() and (entries[2] == -1).all()
        entries, slots = entries[2:], slots[2:]
    assert (entries == -1).all() and (slots == -1).all()
    assert (np.asarray(good.entries[1]) >= 0).sum() == 3 * TOPK
    for b in (0, 2):
        np.testing.assert_array_equal(np.asarray(got.entries[b]), np.asarray(good.entries[b]))


@pytest.mark.parametrize("page", ["past the cache", "negative"])
def test_entries_of_pages_not_in_the_cache_are_never_selected(page):
    ours, xs, q_res = _bad_value_problem()
    table = np.asarray(ours.table).copy()
    table[1, 0] = ours.cache.data.shape[0] if page == "past the cache" else -1
    ours.table = jnp.asarray(table)
    got = _select_again(ours, xs, q_res, [49] * 3, [3] * 3)
    assert (np.asarray(got.entries[1]) == -1).all() and (np.asarray(got.slots[1]) == -1).all()
    for b in (0, 2):
        slots = np.asarray(got.slots[b])
        assert ((slots >= 0) & (slots < ours.cache.num_tokens)).sum() == 3 * TOPK


def test_the_query_projections_run_at_float32s_precision():
    """v4_index_query's projections (q_b_proj, weights_proj) and the Hadamard rotation ask for
    precision HIGHEST, as compress's do: XLA's default on a GPU would take TF32 passes."""
    hf = HF()
    x = jnp.zeros((1, 3, HIDDEN), jnp.float32)
    q_res = jnp.zeros((1, 3, 16), jnp.float32)
    positions = jnp.arange(3, dtype=jnp.int32)[None]
    lowered = _query.lower(hf.weights(), x, q_res, positions, jnp.asarray(hf.layers.inv_freq))
    dots = [line for line in lowered.as_text().splitlines() if "dot_general" in line]
    assert len(dots) == 3 and all("precision = [HIGHEST, HIGHEST]" in line for line in dots)
