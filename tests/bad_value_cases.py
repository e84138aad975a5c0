"""Bad values for the sparse ops, the indexer, mla_prefill and the Flax layers' extend.

Each case builds small inputs holding one bad value, calls the public op with its default
implementation (on a Hopper GPU FlashMLA's kernels, jax_flashmla's own and cuDNN; elsewhere the
pure-JAX ones), blocks on the result and asserts the documented outcome: out 0 and lse +inf for
a query that sees nothing, NaN only within the bad request, and every other request
bit-identical to the call without the bad value.

    python tests/bad_value_cases.py GROUP [GROUP...] [--then-valid-call]

runs the groups' cases in this process, a line per case (PASS, FAIL and why, or SKIP and why)
and exits 1 if any failed; a case after an illegal address still runs (and fails with it).
--then-valid-call then decodes valid inputs through the sparse and the dense decode and
asserts them bit-identical to FlashMLA's ops called from torch: the CUDA context outlived the
cases. tests/test_gpu_bad_values.py runs the groups on the GPU, each in a process of its own;
tests/test_bad_values.py runs the cases on the CPU.
"""
import dataclasses
import functools
import sys
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

import jax_flashmla as jf
from jax_flashmla.kernels import library as kernels
from jax_flashmla.sparse import (indexer_decode, indexer_prefill, IndexKeyCache, mask_indices,
                                 sparse_mla_decode, sparse_mla_prefill, SparseKVCache,
                                 write_sparse_kv)
from jax_flashmla.caches.index_keys import quantize_index_keys
from jax_flashmla.caches.v4 import V4KVCache
from jax_flashmla.caches.sparse import quantize_tokens
from jax_flashmla.ops.indexer import IndexQuery
from jax_flashmla.ops.sparse import MaskedIndices
from jax_flashmla.caches.index_keys import PAGE_BYTES
from helpers import SENTINEL_PAGE, make_decode_inputs, torch_decode, torch_view
from prefill_cases import call, make_case, rows_of

INT32_MIN, INT32_MAX = -2**31, 2**31 - 1
SCALE = 0.1
ILLEGAL_ADDRESS = ("CUDA_ERROR_ILLEGAL_ADDRESS", "illegal memory access")


@dataclasses.dataclass(frozen=True)
class Case:
    """run() raises if the outcome is not the documented one; `needs` says why a case runs on
    a GPU alone (it checks what the GPU's default lowers to), None where it runs anywhere."""

    name: str
    run: Callable[[], None]
    needs: str | None = None


# The groups in the order the one-process run takes them.
GROUPS = {group: [] for group in ("sparse_prefill", "indexer", "prefill_cudnn_bf16",
                                  "prefill_cudnn_fp8", "flax_extend", "sparse_decode",
                                  "v4_decode")}


def case(group, needs=None):
    def register(fn):
        GROUPS[group].append(Case(fn.__name__, fn, needs))
        return fn
    return register


def _host(x):
    """x as NumPy, floats narrower than float32 (bfloat16 is NumPy's kind "V") widened
    exactly to float32."""
    x = np.asarray(x)
    narrow = x.dtype.kind == "V" or (x.dtype.kind == "f" and x.dtype.itemsize < 4)
    return x.astype(np.float32) if narrow else x


def assert_same(got, want, what):
    np.testing.assert_array_equal(_host(got), _host(want), err_msg=what)


def assert_empty(out, lse, what):
    """out 0 and lse +inf: the answer of queries that see nothing."""
    out, lse = _host(out), np.asarray(lse)
    assert np.all(out == 0), (f"{what}: out is not 0 ({np.isnan(out).sum()} NaN, largest |out| "
                              f"{np.nanmax(np.abs(out), initial=0)})")
    assert np.all(np.isposinf(lse)), f"{what}: lse is not +inf (e.g. {lse.ravel()[:3]})"


def assert_lowers_to(fn, target, *args):
    text = jax.jit(fn).lower(*args).as_text()
    assert target in text, f"the default implementation does not lower to {target}"


def assert_no_kernel(fn, target, *args):
    text = jax.jit(fn).lower(*args).as_text()
    assert target not in text, f"{target} is still called"


ON_GPU = "checks what the default lowers to on a Hopper GPU"

# -- sparse decode ------------------------------------------------------------------------------

SPARSE_DECODE = "jax_flashmla_mla_sparse_decode"
_decode = jax.jit(functools.partial(sparse_mla_decode, softmax_scale=SCALE))


def _sparse_decode_problem(seed, batch=3, s_q=1, h_q=16, topk=64, pages=4):
    """q, an FP8 cache of `pages` pages and valid indices (batch, s_q, topk) into it."""
    rng = np.random.default_rng(seed)
    cache = quantize_tokens(jnp.asarray(rng.normal(0, 0.3, (pages, 64, 1, 576)), jnp.float32))
    indices = jnp.asarray(rng.integers(0, pages * 64, (batch, s_q, topk)), jnp.int32)
    q = jnp.asarray(rng.normal(0, 1, (batch, s_q, h_q, 576)), jnp.bfloat16)
    return q, cache, indices


def _past(keys, n):
    """n invalid indices past `keys` keys, up to INT32_MAX."""
    return jnp.asarray(np.resize([keys, keys + 10, 10**6, INT32_MAX], n), jnp.int32)


@case("sparse_decode", needs=ON_GPU)
def sparse_decode_defaults_to_flashmlas_kernel():
    q, cache, indices = _sparse_decode_problem(0)
    assert_lowers_to(_decode, SPARSE_DECODE, q, cache, indices)


@case("sparse_decode")
def sparse_decode_never_reads_indices_past_the_cache():
    """Half of request 1's indices past the cache, all of request 2's: request 1 as with -1
    there, request 2 empty, request 0 untouched."""
    q, cache, indices = _sparse_decode_problem(1)
    keys = cache.shape[0] * 64
    bad = indices.at[1, 0, ::2].set(_past(keys, 32)).at[2, 0].set(_past(keys, 64))
    clean = indices.at[1, 0, ::2].set(-1).at[2].set(-1)
    out, lse = jax.block_until_ready(_decode(q, cache, bad))
    want_out, want_lse = _decode(q, cache, clean)
    assert_empty(out[2], lse[2], "request 2, every index past the cache")
    assert_same(out, want_out, "out against the indices made -1")
    assert_same(lse, want_lse, "lse against the indices made -1")


@case("sparse_decode")
def sparse_decode_takes_int32_extremes_as_invalid():
    q, cache, indices = _sparse_decode_problem(2)
    extremes = jnp.asarray(np.resize([INT32_MIN, INT32_MAX, -2], 16), jnp.int32)
    out, lse = jax.block_until_ready(_decode(q, cache, indices.at[0, 0, :16].set(extremes)))
    want_out, want_lse = _decode(q, cache, indices.at[0, 0, :16].set(-1))
    assert_same(out, want_out, "out against -1")
    assert_same(lse, want_lse, "lse against -1")


@case("sparse_decode")
def sparse_decode_of_two_query_tokens_past_the_cache():
    q, cache, indices = _sparse_decode_problem(3, s_q=2)
    keys = cache.shape[0] * 64
    out, lse = jax.block_until_ready(_decode(q, cache, indices.at[0, 1].set(_past(keys, 64))))
    want_out, want_lse = _decode(q, cache, indices.at[0, 1].set(-1))
    assert_empty(out[0, 1], lse[0, :, 1], "request 0's second token")
    assert_same(out, want_out, "out against -1")
    assert_same(lse, want_lse, "lse against -1")


@case("sparse_decode")
def sparse_decode_topk_length_past_topk_keeps_every_index():
    q, cache, indices = _sparse_decode_problem(4)
    lengths = jnp.asarray([65, INT32_MAX, 10**6], jnp.int32)
    out, lse = jax.block_until_ready(_decode(q, cache, indices, topk_length=lengths))
    want_out, want_lse = _decode(q, cache, indices)
    assert_same(out, want_out, "out against no topk_length")
    assert_same(lse, want_lse, "lse against no topk_length")


@case("sparse_decode")
def sparse_decode_negative_topk_length_keeps_no_index():
    q, cache, indices = _sparse_decode_problem(5)
    lengths = jnp.asarray([64, -1, INT32_MIN], jnp.int32)
    out, lse = jax.block_until_ready(_decode(q, cache, indices, topk_length=lengths))
    want_out, want_lse = _decode(q, cache, indices)
    assert_empty(out[1:], lse[1:], "requests of a negative topk_length")
    assert_same(out[0], want_out[0], "request 0's out")
    assert_same(lse[0], want_lse[0], "request 0's lse")


def check_sink(out_of, q_rows, sink_heads=(0, 1, 2), empty_query=1, nan_reaches_empty=False):
    """attn_sink +inf, -inf and NaN in heads 0, 1, 2: out_of(sink) gives (out (queries, h,
    512), lse (queries, h)). The sink joins each softmax's denominator and not the lse: head 0's
    out is 0, head 1's the sinkless one's, head 2's NaN; the lse and the other heads are as
    under a finite sink; query `empty_query` (no valid index) stays out 0, lse +inf, but for
    head 2's out, NaN too with nan_reaches_empty (DeepSeek-V4's kernel)."""
    finite = jnp.asarray(np.random.default_rng(6).normal(0, 2, q_rows), jnp.float32)
    bad = finite.at[jnp.asarray(sink_heads)].set(jnp.asarray([jnp.inf, -jnp.inf, jnp.nan]))
    out, lse = (_host(x) for x in out_of(bad))
    want_out, want_lse = (_host(x) for x in out_of(finite))
    sinkless, _ = (_host(x) for x in out_of(None))
    others = np.setdiff1d(np.arange(q_rows), sink_heads)
    assert_same(out[:, others], want_out[:, others], "the other heads' out")
    assert_same(lse, want_lse, "lse, which the sink does not join")
    empty_heads = np.arange(q_rows) if not nan_reaches_empty else np.setdiff1d(
        np.arange(q_rows), sink_heads[2:])
    assert_empty(out[empty_query, empty_heads], lse[empty_query],
                 "the query with no valid index")
    if nan_reaches_empty:
        assert np.all(np.isnan(out[empty_query, sink_heads[2]])), "a NaN sink's empty query"
    seen = np.setdiff1d(np.arange(out.shape[0]), [empty_query])
    assert np.all(out[seen, 0] == 0), "a sink of +inf leaves out 0"
    np.testing.assert_allclose(out[seen, 1], sinkless[seen, 1], rtol=1e-2, atol=1e-2,
                               err_msg="a sink of -inf is no sink")
    assert np.all(np.isnan(out[seen, 2])), "a NaN sink makes its head's out NaN"


@case("sparse_decode")
def sparse_decode_attn_sink_infinities_and_nan():
    q, cache, indices = _sparse_decode_problem(6)
    indices = indices.at[1].set(-1)  # a query with no valid index

    def out_of(sink):
        out, lse = jax.block_until_ready(_decode(q, cache, indices, attn_sink=sink))
        return out[:, 0], lse[:, :, 0]
    check_sink(out_of, q.shape[2])


@case("sparse_decode")
def sparse_decode_over_a_cache_of_no_pages_is_empty():
    q, _, indices = _sparse_decode_problem(7)
    empty = SparseKVCache(jnp.zeros((0, 64, 1, 656), jnp.uint8))
    mixed = indices.at[0, 0, :4].set(jnp.asarray([-1, 0, 5, INT32_MAX], jnp.int32))
    for what, given in (("indices all -1", jnp.full_like(indices, -1)), ("raw indices", mixed),
                        ("MaskedIndices", mask_indices(mixed, empty))):
        assert_empty(*jax.block_until_ready(_decode(q, empty, given)), what)
    assert_no_kernel(_decode, SPARSE_DECODE, q, empty, mixed)


@case("sparse_decode")
def masked_indices_are_not_built_from_an_array():
    """The kernel takes MaskedIndices as they are: built by hand, slots past the cache would
    reach it."""
    try:
        MaskedIndices(jnp.full((3, 1, 64), 10**6, jnp.int32), 256)
    except TypeError:
        return
    raise AssertionError("MaskedIndices(slots, num_keys) was built from an array")


# -- DeepSeek-V4's sparse decode ------------------------------------------------------------------

SPARSE_DECODE_V4 = "jax_flashmla_mla_sparse_decode_v4"
_v4_decode = jax.jit(functools.partial(sparse_mla_decode, softmax_scale=SCALE))


def _v4_cache(rng, pages):
    rows = jnp.asarray(rng.normal(0, 0.3, (pages * 64, 512)), jnp.float32)
    return write_sparse_kv(V4KVCache.create(pages), jnp.arange(pages * 64, dtype=jnp.int32),
                           rows)


def _v4_problem(seed, batch=3, s_q=1, h_q=16, topk=64, window=64):
    """q, a main cache of 4 pages and a window cache of 2, and valid indices into both."""
    rng = np.random.default_rng(seed)
    cache, window_cache = _v4_cache(rng, 4), _v4_cache(rng, 2)
    indices = jnp.asarray(rng.integers(0, 256, (batch, s_q, topk)), jnp.int32)
    window_indices = jnp.asarray(rng.integers(0, 128, (batch, s_q, window)), jnp.int32)
    q = jnp.asarray(rng.normal(0, 1, (batch, s_q, h_q, 512)), jnp.bfloat16)
    return q, cache, indices, window_cache, window_indices


@case("v4_decode", needs=ON_GPU)
def v4_decode_defaults_to_flashmlas_kernel():
    q, cache, indices, window, window_indices = _v4_problem(0)
    assert_lowers_to(lambda *a: _v4_decode(*a[:3], extra_kv_cache=a[3], extra_indices=a[4]),
                     SPARSE_DECODE_V4, q, cache, indices, window, window_indices)


@case("v4_decode")
def v4_decode_never_reads_indices_past_either_cache():
    """Request 1's indices past both caches (int32 extremes among them), request 2's last
    query's too: as with -1 there; request 2's last query empty; request 0 untouched."""
    q, cache, indices, window, window_indices = _v4_problem(1, s_q=2)
    extremes = jnp.asarray(np.resize([INT32_MIN, INT32_MAX, -2, 256, 10**6], 64), jnp.int32)
    bad = indices.at[1, 0].set(extremes).at[2, 1].set(extremes)
    bad_window = window_indices.at[1, 0, ::2].set(extremes[:32]).at[2, 1].set(extremes)
    clean = indices.at[1, 0].set(-1).at[2, 1].set(-1)
    clean_window = window_indices.at[1, 0, ::2].set(-1).at[2, 1].set(-1)
    out, lse = jax.block_until_ready(_v4_decode(q, cache, bad, extra_kv_cache=window,
                                                extra_indices=bad_window))
    want_out, want_lse = _v4_decode(q, cache, clean, extra_kv_cache=window,
                                    extra_indices=clean_window)
    assert_empty(out[2, 1], lse[2, :, 1], "request 2's last query, every index invalid")
    assert_same(out, want_out, "out against the indices made -1")
    assert_same(lse, want_lse, "lse against the indices made -1")


@case("v4_decode")
def v4_decode_lengths_past_topk_keep_every_index_and_negative_ones_none():
    q, cache, indices, window, window_indices = _v4_problem(2)
    past = jnp.asarray([65, INT32_MAX, 10**6], jnp.int32)
    negative = jnp.asarray([-1, INT32_MIN, 0], jnp.int32)
    call = lambda lengths, window_lengths: jax.block_until_ready(_v4_decode(
        q, cache, indices, topk_length=lengths, extra_kv_cache=window,
        extra_indices=window_indices, extra_topk_length=window_lengths))
    got, want = call(past, past), call(None, None)
    assert_same(got[0], want[0], "out, lengths past topk")
    assert_same(got[1], want[1], "lse, lengths past topk")
    out, lse = call(negative, negative)
    assert_empty(out, lse, "negative lengths in both caches")
    window_alone = _v4_decode(q, window, window_indices)
    out, lse = call(negative, None)
    np.testing.assert_allclose(_host(out), _host(window_alone[0]), rtol=1e-2, atol=1e-5,
                               err_msg="negative main lengths leave the window")


@case("v4_decode")
def v4_decode_attn_sink_infinities_and_nan():
    q, cache, indices, window, window_indices = _v4_problem(3)
    indices, window_indices = indices.at[1].set(-1), window_indices.at[1].set(-1)

    def out_of(sink):
        out, lse = jax.block_until_ready(_v4_decode(q, cache, indices, attn_sink=sink,
                                                    extra_kv_cache=window,
                                                    extra_indices=window_indices))
        return out[:, 0], lse[:, :, 0]
    check_sink(out_of, q.shape[2], nan_reaches_empty=True)


@case("v4_decode")
def v4_decode_over_a_main_cache_of_no_pages():
    """No main pages: the window alone is read; no window pages either: the empty answer,
    without a kernel."""
    q, _, indices, window, window_indices = _v4_problem(4)
    empty = V4KVCache(jnp.zeros((0, 65, 576), jnp.uint8))
    mixed = indices.at[0, 0, :4].set(jnp.asarray([-1, 0, 5, INT32_MAX], jnp.int32))
    out, lse = jax.block_until_ready(_v4_decode(q, empty, mixed, extra_kv_cache=window,
                                                extra_indices=window_indices))
    window_alone = _v4_decode(q, window, window_indices)
    np.testing.assert_allclose(_host(out), _host(window_alone[0]), rtol=1e-2, atol=1e-5)
    np.testing.assert_allclose(_host(lse), _host(window_alone[1]), rtol=1e-6)
    empty_args = (q, empty, mixed, empty, window_indices)
    call = lambda *a: _v4_decode(*a[:3], extra_kv_cache=a[3], extra_indices=a[4])
    assert_empty(*jax.block_until_ready(call(*empty_args)), "no pages in either cache")
    assert_no_kernel(call, SPARSE_DECODE_V4, *empty_args)


# -- sparse prefill -----------------------------------------------------------------------------

SPARSE_PREFILL = "jax_flashmla_mla_sparse_prefill"
_prefill = jax.jit(functools.partial(sparse_mla_prefill, softmax_scale=SCALE))


def _sparse_prefill_problem(seed, tokens=8, h_q=16, topk=32, keys=100):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(0, 1, (tokens, h_q, 576)), jnp.bfloat16)
    kv = jnp.asarray(rng.normal(0, 0.3, (keys, 576)), jnp.bfloat16)
    indices = jnp.asarray(rng.integers(0, keys, (tokens, topk)), jnp.int32)
    return q, kv, indices


@case("sparse_prefill", needs=ON_GPU)
def sparse_prefill_defaults_to_flashmlas_kernel():
    assert_lowers_to(_prefill, SPARSE_PREFILL, *_sparse_prefill_problem(0))


@case("sparse_prefill")
def sparse_prefill_never_reads_indices_past_the_keys():
    q, kv, indices = _sparse_prefill_problem(1)
    keys = kv.shape[0]
    extremes = jnp.asarray(np.resize([keys, keys + 5, 10**6, INT32_MAX, INT32_MIN, -2], 16),
                           jnp.int32)
    bad = indices.at[2, ::2].set(extremes).at[5].set(_past(keys, 32))
    clean = indices.at[2, ::2].set(-1).at[5].set(-1)
    out, lse = jax.block_until_ready(_prefill(q, kv, bad))
    want_out, want_lse = _prefill(q, kv, clean)
    assert_empty(out[5], lse[:, 5], "token 5, every index past the keys")
    assert_same(out, want_out, "out against the indices made -1")
    assert_same(lse, want_lse, "lse against the indices made -1")


@case("sparse_prefill")
def sparse_prefill_topk_length_out_of_range():
    q, kv, indices = _sparse_prefill_problem(2)
    lengths = jnp.asarray([33, INT32_MAX, -1, INT32_MIN, 32, 10**6, 0, 32], jnp.int32)
    out, lse = jax.block_until_ready(_prefill(q, kv, indices, topk_length=lengths))
    want_out, want_lse = _prefill(q, kv, indices)
    empty = np.asarray([2, 3, 6])
    full = np.setdiff1d(np.arange(8), empty)
    assert_empty(out[empty], lse[:, empty], "tokens of topk_length <= 0")
    assert_same(out[full], want_out[full], "out of topk_length >= topk against none")
    assert_same(lse[:, full], want_lse[:, full], "lse of topk_length >= topk against none")


@case("sparse_prefill")
def sparse_prefill_attn_sink_infinities_and_nan():
    q, kv, indices = _sparse_prefill_problem(3)
    indices = indices.at[1].set(-1)

    def out_of(sink):
        out, lse = jax.block_until_ready(_prefill(q, kv, indices, attn_sink=sink))
        return out, lse.T
    check_sink(out_of, q.shape[1])


@case("sparse_prefill")
def sparse_prefill_nan_row_reaches_only_its_readers():
    """A NaN row read by token 3 alone makes its out NaN and changes no other token; a NaN
    row no token reads changes nothing."""
    q, kv, indices = _sparse_prefill_problem(4)
    read, unread = 7, 9
    indices = jnp.where((indices == read) | (indices == unread), -1, indices).at[3, 0].set(read)
    out, lse = jax.block_until_ready(_prefill(q, kv.at[jnp.asarray([read, unread])].set(jnp.nan),
                                              indices))
    want_out, want_lse = _prefill(q, kv, indices)
    assert np.all(np.isnan(_host(out[3]))), "token 3 read the NaN row"
    others = np.setdiff1d(np.arange(q.shape[0]), [3])
    assert_same(out[others], want_out[others], "the other tokens' out")
    assert_same(lse[:, others], want_lse[:, others], "the other tokens' lse")


@case("sparse_prefill")
def sparse_prefill_over_no_keys_is_empty():
    q, _, indices = _sparse_prefill_problem(5)
    kv = jnp.zeros((0, 576), jnp.bfloat16)
    assert_empty(*jax.block_until_ready(_prefill(q, kv, indices.at[0].set(-1))), "kv of no keys")
    assert_no_kernel(_prefill, SPARSE_PREFILL, q, kv, indices)

# -- the indexer --------------------------------------------------------------------------------

INDEX_TOPK = "jax_flashmla_index_topk"
TOPK, HEADS = 64, 64
_index_decode = jax.jit(functools.partial(indexer_decode, topk=TOPK))
_index_prefill = jax.jit(functools.partial(indexer_prefill, topk=TOPK))


def _index_problem(seed, lengths=(300, 200, 150), s_q=1, rows=None):
    """(query, cache, block_table, seq_lens) as tests/test_gpu_indexer.py makes them: keys at
    random pages, unwritten bytes 0xFF (NaN), SENTINEL_PAGE past each request's pages. The
    query has (batch, s_q) rows, or `rows` rows of a prefill."""
    rng = np.random.default_rng(seed)
    pages = [-(-n // 64) for n in lengths]
    num_pages = sum(pages) + 3
    perm = rng.permutation(num_pages).astype(np.int32)
    table = np.full((len(lengths), max(pages) + 1), SENTINEL_PAGE, np.int32)
    for i, n in enumerate(pages):
        table[i, :n], perm = perm[:n], perm[n:]
    positions = np.concatenate([np.arange(n) for n in lengths]).astype(np.int32)
    requests = np.repeat(np.arange(len(lengths)), lengths)
    slots = jf.token_slots(jnp.asarray(table[requests]), jnp.asarray(positions[:, None]))[:, 0]
    cache = write_sparse_kv(IndexKeyCache(jnp.full((num_pages, PAGE_BYTES), 0xFF, jnp.uint8)),
                             slots, jnp.asarray(rng.normal(0, 1, (len(slots), 128)), jnp.float32))
    shape = (len(lengths), s_q) if rows is None else (rows,)
    values, scales = quantize_index_keys(jnp.asarray(rng.normal(0, 1, shape + (HEADS, 128)),
                                                     jnp.float32))
    weights = jnp.asarray(rng.normal(0, 1, shape + (HEADS,)), jnp.float32) * scales
    return (IndexQuery(values, weights), cache, jnp.asarray(table),
            jnp.asarray(lengths, jnp.int32))


@case("indexer", needs=ON_GPU)
def indexer_defaults_to_its_kernel():
    assert_lowers_to(_index_decode, INDEX_TOPK, *_index_problem(0))


@case("indexer")
def indexer_block_table_entries_past_the_cache():
    """Request 1's pages named past the cache (and negative): it selects as with -1 there,
    the other requests as without them."""
    query, cache, table, seq_lens = _index_problem(1)
    entries = jnp.asarray([cache.data.shape[0] + 5, 10**6, INT32_MAX, -7], jnp.int32)
    got = jax.block_until_ready(_index_decode(query, cache, table.at[1, :4].set(entries),
                                              seq_lens))
    assert_same(got, _index_decode(query, cache, table.at[1, :4].set(-1), seq_lens),
                "against those entries -1")
    clean = _index_decode(query, cache, table, seq_lens)
    assert_same(got[::2], clean[::2], "the other requests")


def _assert_within_its_pages(slots, table_row):
    slots, pages = np.asarray(slots), np.asarray(table_row)
    assert np.all((slots == -1) | np.isin(slots // 64, pages[pages >= 0])), \
        "a slot outside the request's pages"


@case("indexer")
def indexer_nan_keys_stay_in_their_request():
    """A NaN key (e4m3 0x7F) in request 1's first page: the other requests select as without
    it, request 1 among its own pages."""
    query, cache, table, seq_lens = _index_problem(2)
    poisoned = IndexKeyCache(cache.data.at[int(table[1, 0]), 5 * 128].set(0x7F))  # its token 5
    got = jax.block_until_ready(_index_decode(query, poisoned, table, seq_lens))
    assert_same(got[::2], _index_decode(query, cache, table, seq_lens)[::2], "the other requests")
    _assert_within_its_pages(got[1], table[1])


@case("indexer")
def indexer_nan_query_weights_stay_in_their_request():
    query, cache, table, seq_lens = _index_problem(3)
    bad = IndexQuery(query.values, query.weights.at[1].set(jnp.nan))
    got = jax.block_until_ready(_index_decode(bad, cache, table, seq_lens))
    assert_same(got[::2], _index_decode(query, cache, table, seq_lens)[::2], "the other requests")
    _assert_within_its_pages(got[1], table[1])


@case("indexer")
def indexer_seq_lens_past_the_table_see_the_whole_table():
    query, cache, table, seq_lens = _index_problem(4)
    capacity = table.shape[1] * 64
    got = jax.block_until_ready(_index_decode(query, cache, table,
                                              seq_lens.at[1].set(capacity + 1000)))
    assert_same(got, _index_decode(query, cache, table, seq_lens.at[1].set(capacity)),
                "against the table's length")


@case("indexer")
def indexer_int32_extreme_seq_lens_at_two_query_tokens():
    """s_q = 2: INT32_MIN (and any negative length) selects nothing; INT32_MAX sees the whole
    table; request 0 as without them."""
    query, cache, table, seq_lens = _index_problem(5, lengths=(300, 200, 150, 100), s_q=2)
    capacity = table.shape[1] * 64
    got = np.asarray(jax.block_until_ready(_index_decode(
        query, cache, table, seq_lens.at[1:].set(jnp.asarray([INT32_MIN, -1, INT32_MAX])))))
    assert np.all(got[1:3] == -1), "a negative length selects nothing"
    whole = _index_decode(query, cache, table, seq_lens.at[3].set(capacity + 1))
    assert_same(got[3], whole[3], "INT32_MAX against the table's length")
    assert_same(got[0], _index_decode(query, cache, table, seq_lens)[0], "request 0")


@case("indexer")
def indexer_prefill_with_an_int32_min_length():
    """Request 1 of a prefill (rows 20 to 30) with seq_lens INT32_MIN selects nothing, with
    INT32_MAX the whole table; request 0 as without it."""
    query, cache, table, seq_lens = _index_problem(6, lengths=(300, 200), rows=30)
    cu_seqlens = jnp.asarray([0, 20, 30], jnp.int32)
    clean = _index_prefill(query, cache, table, seq_lens, cu_seqlens)
    low = np.asarray(jax.block_until_ready(_index_prefill(
        query, cache, table, seq_lens.at[1].set(INT32_MIN), cu_seqlens)))
    assert np.all(low[20:] == -1), "INT32_MIN selects nothing"
    assert_same(low[:20], clean[:20], "request 0")
    high = _index_prefill(query, cache, table, seq_lens.at[1].set(INT32_MAX), cu_seqlens)
    whole = _index_prefill(query, cache, table, seq_lens.at[1].set(table.shape[1] * 64 + 10),
                           cu_seqlens)
    assert_same(high, whole, "INT32_MAX against past the table's length")

# -- mla_prefill --------------------------------------------------------------------------------

# Request 2 takes the bad value; query_starts are given, so that no other request moves.
PREFILL = dict(prefix_lens=[0, 63, 65, 700], query_lens=[40, 1, 37, 30], gaps=[2, 0, 5, 3])
BAD_REQUEST = 2
CUDNN = "__cudnn$fmha"


@functools.lru_cache(maxsize=None)
def _prefill_case(fp8_cache):
    """The batch (make_case's arguments) and its answer."""
    inputs = make_case(np.random.default_rng(3), **PREFILL, fp8_cache=fp8_cache)
    return inputs, jax.block_until_ready(call(jf.mla_prefill, inputs, softmax_scale=SCALE))


def _bad_rows(inputs):
    first, n = rows_of(inputs)[BAD_REQUEST]
    mine = np.arange(first, first + n)
    return mine, np.setdiff1d(np.arange(inputs["q"].shape[0]), mine)


def _check_prefill_empties_request(fp8_cache, **changes):
    """mla_prefill with request 2's entries of `changes` (name: (index, value)): request 2
    empty, the others bit-identical to the batch without the bad value."""
    inputs, (want_out, want_lse) = _prefill_case(fp8_cache)
    mine, others = _bad_rows(inputs)
    bad = dict(inputs)
    for name, (index, value) in changes.items():
        bad[name] = bad[name].at[index].set(value)
    out, lse = jax.block_until_ready(call(jf.mla_prefill, bad, softmax_scale=SCALE))
    assert_empty(out[mine], lse[:, mine], f"request {BAD_REQUEST}")
    assert_same(out[others], want_out[others], "the other requests' out")
    assert_same(lse[:, others], want_lse[:, others], "the other requests' lse")


def _prefill_cases(fp8_cache):
    r = BAD_REQUEST
    row_capacity = (-(-max(PREFILL["prefix_lens"]) // 64) + 1) * 64  # make_case's table width
    empties = {
        "query_start_near_int32_max": dict(query_starts=(r, 2**31 - 10)),
        "query_len_int32_max": dict(query_lens=(r, INT32_MAX)),
        "query_len_int32_min": dict(query_lens=(r, INT32_MIN)),
        "prefix_past_its_block_table_row": dict(prefix_lens=(r, row_capacity + 1)),
        "prefix_int32_max": dict(prefix_lens=(r, INT32_MAX)),
        "prefix_int32_min": dict(prefix_lens=(r, INT32_MIN)),
        "block_table_entry_past_the_cache": dict(block_table=((r, 0), 10**6)),
        "block_table_entry_int32_max": dict(block_table=((r, 1), INT32_MAX)),
        "block_table_entry_int32_min": dict(block_table=((r, 0), INT32_MIN)),
    }
    cases = [Case(f"mla_prefill_{name}", functools.partial(
        _check_prefill_empties_request, fp8_cache, **changes)) for name, changes in empties.items()]
    return cases + [Case(fn.__name__, functools.partial(fn, fp8_cache)) for fn in (
        mla_prefill_nan_in_a_prefix_row_stays_in_its_request,
        mla_prefill_nan_in_a_new_row_stays_in_its_request,
        mla_prefill_nan_in_padding_rows_changes_nothing)]


def _check_nan_stays(inputs, bad, seen_by):
    """bad (inputs with a NaN of request 2's) gives NaN in request 2's rows `seen_by` (its
    queries that see it), changes no other request's rows, and leaves padding out 0, lse +inf."""
    _, (want_out, want_lse) = _prefill_case(inputs["k_scale"] is not None)
    mine, others = _bad_rows(inputs)
    out, lse = (_host(x) for x in jax.block_until_ready(call(jf.mla_prefill, bad,
                                                                 softmax_scale=SCALE)))
    assert np.all(np.isnan(out[mine[seen_by]]).any(axis=(1, 2))), \
        "a query of request 2 that sees the NaN has no NaN in its out"
    assert_same(out[others], want_out[others], "the other requests' out (and padding)")
    assert_same(lse[:, others], want_lse[:, others], "the other requests' lse (and padding)")


def mla_prefill_nan_in_a_prefix_row_stays_in_its_request(fp8_cache):
    inputs, _ = _prefill_case(fp8_cache)
    page = int(inputs["block_table"][BAD_REQUEST, 0])
    cache = inputs["kv_cache"]
    bad = dict(inputs, kv_cache=cache.at[page, 10, 0, 3].set(jnp.asarray(jnp.nan, cache.dtype)))
    _check_nan_stays(inputs, bad, slice(None))  # every new token sees the whole prefix


def mla_prefill_nan_in_a_new_row_stays_in_its_request(fp8_cache):
    inputs, _ = _prefill_case(fp8_cache)
    mine, _ = _bad_rows(inputs)
    bad = dict(inputs, kv=inputs["kv"].at[mine[5], 7].set(jnp.nan))
    _check_nan_stays(inputs, bad, slice(5, None))  # causal: tokens 5 on see token 5


def mla_prefill_nan_in_padding_rows_changes_nothing(fp8_cache):
    """NaN in q and kv of every padding row (the gaps before requests and q's tail)."""
    inputs, (want_out, want_lse) = _prefill_case(fp8_cache)
    used = np.zeros(inputs["q"].shape[0], bool)
    for first, n in rows_of(inputs):
        used[first:first + n] = True
    padding = jnp.asarray(np.flatnonzero(~used))
    bad = dict(inputs, q=inputs["q"].at[padding].set(jnp.nan),
               kv=inputs["kv"].at[padding].set(jnp.nan))
    out, lse = jax.block_until_ready(call(jf.mla_prefill, bad, softmax_scale=SCALE))
    assert_same(out, want_out, "out")
    assert_same(lse, want_lse, "lse")


def mla_prefill_defaults_to_cudnn(fp8_cache):
    inputs, _ = _prefill_case(fp8_cache)
    static = {"max_prefix_tokens": inputs["max_prefix_tokens"]}
    assert_lowers_to(lambda c: call(jf.mla_prefill, c | static, softmax_scale=SCALE), CUDNN,
                     {k: v for k, v in inputs.items() if k not in static})


for _fp8, _group in ((False, "prefill_cudnn_bf16"), (True, "prefill_cudnn_fp8")):
    GROUPS[_group] += [Case("mla_prefill_defaults_to_cudnn", functools.partial(
        mla_prefill_defaults_to_cudnn, _fp8), ON_GPU)] + _prefill_cases(_fp8)

# -- the Flax layers' extend --------------------------------------------------------------------

# Three rows of 8 new tokens over 4 pages each; row 1 is idle (no prefix, no new token) in the
# clean call and takes the bad values.
EXTEND_PREFIX, EXTEND_LENGTHS, EXTEND_TOKENS, EXTEND_PAGES = (70, 0, 130), (5, 0, 3), 8, 12
EXTEND_SIZES = dict(hidden_size=64, num_heads=4, q_lora_rank=32, qk_nope_head_dim=32,
                    v_head_dim=48)
CAPACITY = 512  # max_prefix_tokens: the clean prefixes' pages and a bad row's 100 tokens
PAST = EXTEND_PAGES + 10**6
BAD_EXTENDS = {  # name: (prefix_lens[1], lengths[1], block_table[1])
    "length_past_the_row": (0, EXTEND_TOKENS + 5, None),
    "length_int32_max": (0, INT32_MAX, None),
    "negative_length": (0, -3, None),
    "length_int32_min": (0, INT32_MIN, None),
    "prefix_int32_max": (INT32_MAX, 4, None),
    "prefix_int32_min": (INT32_MIN, 4, None),
    "block_table_row_past_the_cache": (100, 4, (PAST,) * 4),
    "block_table_row_int32_extremes": (100, 4, (INT32_MAX, INT32_MIN, INT32_MAX, -5)),
}


@functools.lru_cache(maxsize=None)
def _extend_layer(sparse):
    """A bf16 MultiHeadLatentAttention, or a DeepSeek-V3.2 layer (float32, index_topk 16)."""
    import flax.nnx as nnx

    from jax_flashmla.flax import (MLAConfig, MultiHeadLatentAttention, SparseMLAConfig,
                                   SparseMultiHeadLatentAttention)
    if sparse:
        return SparseMultiHeadLatentAttention(
            SparseMLAConfig(**EXTEND_SIZES, index_n_heads=4, index_topk=16), rngs=nnx.Rngs(0))
    return MultiHeadLatentAttention(MLAConfig(**EXTEND_SIZES), rngs=nnx.Rngs(0),
                                    dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)


def _extend_inputs(sparse):
    """(x, positions, caches, block_table, prefix_lens, lengths) of the clean call."""
    rng = np.random.default_rng(9)
    batch, s = len(EXTEND_PREFIX), EXTEND_TOKENS
    prefix = jnp.asarray(EXTEND_PREFIX, jnp.int32)
    x = jnp.asarray(rng.normal(0, 1, (batch, s, EXTEND_SIZES["hidden_size"])), jnp.float32)
    positions = prefix[:, None] + jnp.arange(s, dtype=jnp.int32)
    table = jnp.arange(EXTEND_PAGES, dtype=jnp.int32).reshape(batch, -1)
    if sparse:
        caches = (SparseKVCache.create(EXTEND_PAGES), IndexKeyCache.create(EXTEND_PAGES))
    else:
        caches = (jnp.asarray(rng.normal(0, 1, (EXTEND_PAGES, 64, 1, 576)), jnp.bfloat16),)
    return x, positions, caches, table, prefix, jnp.asarray(EXTEND_LENGTHS, jnp.int32)


@functools.lru_cache(maxsize=None)
def _extend(sparse, form):
    """The layer's extend, jitted: (out, *caches)."""
    layer = _extend_layer(sparse)

    def extend(x, positions, caches, table, prefix, lengths):
        if sparse:
            return layer.extend(x, positions, *caches, table, prefix, lengths=lengths)
        return layer.extend(x, positions, caches[0], table, prefix, max_prefix_tokens=CAPACITY,
                            lengths=lengths, form=form)
    return jax.jit(extend)


def _check_extend(sparse, form, prefix_len, length, table_row):
    """Row 1 with these values: its out what o_proj makes of no attention, the other rows' out
    and cache pages bit-identical to the call with row 1 idle."""
    x, positions, caches, table, prefix, lengths = _extend_inputs(sparse)
    extend = _extend(sparse, form)
    clean = jax.block_until_ready(extend(x, positions, caches, table, prefix, lengths))
    pages = np.asarray(table)[::2].ravel()  # rows 0 and 2's
    if table_row is not None:
        table = table.at[1].set(jnp.asarray(table_row, jnp.int32))
    got = jax.block_until_ready(extend(x, positions, caches, table, prefix.at[1].set(prefix_len),
                                       lengths.at[1].set(length)))
    layer = _extend_layer(sparse)
    nothing = layer.o_proj(jnp.zeros((1, layer.config.num_heads * layer.config.v_head_dim),
                                     layer.dtype))
    out = _host(got[0])
    assert np.all(out[1] == _host(nothing)), "row 1 attended to something"
    assert_same(out[::2], clean[0][::2], "the other rows' out")
    for i, (cache, want) in enumerate(zip(got[1:], clean[1:])):
        assert_same(getattr(cache, "data", cache)[pages], getattr(want, "data", want)[pages],
                    f"cache {i}: the other rows' pages")


for _name, _values in BAD_EXTENDS.items():
    for _form in ("absorbed", "expanded"):
        GROUPS["flax_extend"].append(Case(f"mla_extend_{_form}_{_name}", functools.partial(
            _check_extend, False, _form, *_values)))
    GROUPS["flax_extend"].append(Case(f"sparse_mla_extend_{_name}", functools.partial(
        _check_extend, True, None, *_values)))

# -- a valid call after the cases ---------------------------------------------------------------

ON_FLASHMLA = "compares with FlashMLA's ops from torch on a Hopper GPU"


def valid_sparse_decode():
    """As tests/test_gpu_sparse.py compares it: sparse_decode_fwd from torch on the same
    buffers."""
    import torch

    kernels.ensure_cuda_targets()
    q, cache, indices = _sparse_decode_problem(10, batch=4, h_q=64, topk=128, pages=40)
    indices = indices.at[0, 0, ::5].set(-1)
    out, lse = jax.block_until_ready(_decode(q, cache, indices))
    op = getattr(torch.ops.sgl_kernel, "sparse_decode_fwd")
    kv = torch_view(torch, cache).view(torch.float8_e4m3fn)
    t_out, t_lse, *_ = op(torch_view(torch, q), kv, torch_view(torch, indices), None, None, None,
                          None, None, None, None, 512, SCALE)
    torch.cuda.synchronize()
    assert_same(out, t_out.float().cpu().numpy(), "out against sparse_decode_fwd")
    assert_same(lse, t_lse.cpu().numpy(), "lse against sparse_decode_fwd")


def valid_dense_decode():
    """As tests/test_gpu.py compares it: FlashMLA's metadata and decode ops from torch."""
    q, kv, bt, sl = make_decode_inputs(np.random.default_rng(7), batch=16, s_q=1, h_q=16,
                                       mean_sk=1000, varlen=True, dtype=jnp.bfloat16)
    bt, sl = jnp.asarray(bt), jnp.asarray(sl)

    @jax.jit
    def step(q, kv, bt, sl):
        md = jf.get_mla_metadata(sl, block_table=bt, num_pages=kv.shape[0], num_heads_q=16)
        return jf.mla_decode(q, kv, bt, sl, metadata=md, softmax_scale=SCALE)

    out, lse = jax.block_until_ready(step(q, kv, bt, sl))
    t_out, t_lse = torch_decode(q, kv, bt, sl, softmax_scale=SCALE)
    assert_same(out, t_out, "out against FlashMLA's decode")
    assert_same(lse, t_lse, "lse against FlashMLA's decode")


VALID_CALLS = [Case("valid_call/sparse_decode", valid_sparse_decode, ON_FLASHMLA),
               Case("valid_call/dense_decode", valid_dense_decode, ON_FLASHMLA)]

# -- running ------------------------------------------------------------------------------------


def run(case):
    """(status, detail) of a case: ("PASS", ""), ("FAIL", why) or ("SKIP", why)."""
    if case.needs is not None and jax.default_backend() != "gpu":
        return "SKIP", case.needs
    try:
        case.run()
    except Exception as e:  # noqa: BLE001 - a case's failure is reported, and the next one runs
        reason = " | ".join(line.strip() for line in f"{type(e).__name__}: {e}".splitlines()
                            if line.strip())
        if any(marker in reason for marker in ILLEGAL_ADDRESS):
            reason = "illegal address, the CUDA context is poisoned: " + reason
        return "FAIL", reason[:3000]
    return "PASS", ""


def main(argv):
    then_valid = "--then-valid-call" in argv
    groups = [a for a in argv if a != "--then-valid-call"]
    if not groups or any(g not in GROUPS for g in groups):
        print(f"usage: bad_value_cases.py GROUP [GROUP...] [--then-valid-call]; groups: "
              f"{' '.join(GROUPS)}", file=sys.stderr)
        return 2
    named = [(f"{g}/{c.name}", c) for g in groups for c in GROUPS[g]]
    named += [(c.name, c) for c in VALID_CALLS] if then_valid else []
    failed = 0
    for name, c in named:
        status, detail = run(c)
        print(f"{status} {name}" + (f": {detail}" if detail else ""), flush=True)
        failed += status == "FAIL"
    print(f"{failed} of {len(named)} failed", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
