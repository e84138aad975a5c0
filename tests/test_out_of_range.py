"""Out-of-range lengths and block-table entries, by default: a request whose length is
outside [0, max_pages * 64] or that reads a page outside [0, num_pages) is decoded as one of
length 0 (out 0, lse +inf) on every implementation, and every other request's out and lse
are bit for bit what they are without it. The lengths are made safe once per step by the
metadata (get_mla_metadata takes the block table and num_pages), or by mla_decode itself
without one; a metadata of other lengths poisons those requests, on every implementation."""
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flashmla as jf
from helpers import K_SCALE, fp8_inputs, make_decode_inputs
from jax_flashmla.caches import fp8

BAD = 1  # the request made bad


def _last_read_page(seq_lens):
    return (int(seq_lens[BAD]) + 63) // 64 - 1


CASES = {
    "a length past the block table": lambda bt, sl, pages: (bt, sl.at[BAD].set(bt.shape[1] * 64 + 1)),
    "a negative length": lambda bt, sl, pages: (bt, sl.at[BAD].set(-5)),
    "a page past the cache": lambda bt, sl, pages: (bt.at[BAD, 0].set(pages), sl),
    "a negative last page": lambda bt, sl, pages: (bt.at[BAD, _last_read_page(sl)].set(-1), sl),
}


def _inputs(dtype, s_q):
    if dtype == "fp8":
        q, kv, bt, sl = fp8_inputs(3, batch=4, s_q=s_q, zero_lengths=0)
        return q, kv, bt, sl, jnp.float32(K_SCALE)
    q, kv, bt, sl = make_decode_inputs(np.random.default_rng(3), batch=4, s_q=s_q, h_q=16,
                                       mean_sk=150, varlen=True, dtype=jnp.bfloat16)
    return q, kv, jnp.asarray(bt), jnp.asarray(sl), None


def _decode(q, kv, bt, sl, k_scale, implementation, metadata):
    md = None
    if metadata == "metadata":
        md = jf.get_mla_metadata(sl, block_table=bt, num_pages=kv.shape[0], num_heads_q=q.shape[2],
                                 num_q_tokens=q.shape[1], fp8=k_scale is not None,
                                 implementation=implementation)
    return jf.mla_decode(q, kv, bt, sl, metadata=md, softmax_scale=0.1,
                         implementation=implementation, k_scale=k_scale)


DECODES = [(implementation, metadata) for implementation in ("reference", "custom_call")
           for metadata in ("none", "metadata")]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("implementation,metadata", DECODES)
@pytest.mark.parametrize("dtype,s_q", [("bf16", 1), ("bf16", 2), ("fp8", 1), ("fp8", 2)])
def test_an_out_of_range_request_is_decoded_empty(case, implementation, metadata, dtype, s_q):
    q, kv, bt, sl, k_scale = _inputs(dtype, s_q)
    assert int(sl[BAD]) > 0
    bad_bt, bad_sl = CASES[case](bt, sl, kv.shape[0])
    out, lse = _decode(q, kv, bad_bt, bad_sl, k_scale, implementation, metadata)
    # The same step with the bad request's length 0 and its table row as it was.
    want_out, want_lse = _decode(q, kv, bt, sl.at[BAD].set(0), k_scale, implementation, metadata)
    assert not np.any(np.asarray(out[BAD], np.float32))
    assert np.all(np.asarray(lse[BAD]) == np.inf)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(want_out, np.float32))
    np.testing.assert_array_equal(np.asarray(lse), np.asarray(want_lse))


@pytest.mark.parametrize("implementation", ["reference", "custom_call"])
def test_entries_past_a_requests_pages_leave_it_as_it_is(implementation):
    """Entries a request does not read may hold anything (here one past the cache)."""
    q, kv, bt, sl, _ = _inputs("bf16", 1)
    pages_read = (int(sl[BAD]) + 63) // 64
    assert pages_read < bt.shape[1]
    out, lse = _decode(q, kv, bt.at[BAD, pages_read].set(kv.shape[0] + 7), sl, None,
                       implementation, "metadata")
    want_out, want_lse = _decode(q, kv, bt, sl, None, implementation, "none")
    assert np.all(np.isfinite(np.asarray(lse[BAD])))
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(want_out, np.float32))
    np.testing.assert_array_equal(np.asarray(lse), np.asarray(want_lse))


def test_the_metadata_carries_the_lengths_it_was_made_for():
    _, kv, bt, sl, _ = _inputs("bf16", 1)
    bad_bt = bt.at[2, 0].set(-3)
    bad_sl = sl.at[BAD].set(10**6)
    for implementation in ("reference", "custom_call"):
        md = jf.get_mla_metadata(bad_sl, block_table=bad_bt, num_pages=kv.shape[0],
                                 num_heads_q=16, implementation=implementation)
        np.testing.assert_array_equal(np.asarray(md.seq_lens),
                                      np.asarray(sl.at[BAD].set(0).at[2].set(0)))


@pytest.mark.parametrize("implementation", ["reference", "custom_call"])
@pytest.mark.parametrize("dtype,s_q", [("bf16", 1), ("bf16", 2), ("fp8", 1)])
def test_a_metadata_of_other_lengths_poisons_those_requests(dtype, s_q, implementation):
    """A metadata made for another step's lengths: each request whose length differs comes
    out NaN, not attention over other keys; a request the metadata made empty stays empty;
    the others are bit for bit the step's own."""
    q, kv, bt, sl, k_scale = _inputs(dtype, s_q)
    old = sl.at[0].add(-7).at[2].set(kv.shape[0] * 64 + 1)  # 2: out of range then
    md = jf.get_mla_metadata(old, block_table=bt, num_pages=kv.shape[0], num_heads_q=q.shape[2],
                             num_q_tokens=s_q, fp8=k_scale is not None,
                             implementation=implementation)
    out, lse = jf.mla_decode(q, kv, bt, sl, metadata=md, softmax_scale=0.1,
                             implementation=implementation, k_scale=k_scale)
    want_out, want_lse = _decode(q, kv, bt, sl.at[2].set(0), k_scale, implementation, "metadata")
    out, want_out = np.asarray(out, np.float32), np.asarray(want_out, np.float32)
    assert np.isnan(out[0]).all() and not np.isnan(out[1:]).any()
    assert not out[2].any() and np.all(np.asarray(lse[2]) == np.inf)
    np.testing.assert_array_equal(out[1:], want_out[1:])
    np.testing.assert_array_equal(np.asarray(lse[1:]), np.asarray(want_lse[1:]))


@pytest.mark.parametrize("implementation", ["reference", "custom_call"])
def test_a_metadata_of_another_table_poisons_the_requests_it_sends_outside(implementation):
    """A metadata made with one table, a decode given another in which two requests read a
    page outside the cache: those two come out NaN (the kernels read page 0 there, never
    outside the cache; the C++ model refuses a read outside it), the others bit for bit the
    decode's own."""
    q, kv, bt, sl, _ = _inputs("bf16", 1)
    md = jf.get_mla_metadata(sl, block_table=bt, num_pages=kv.shape[0], num_heads_q=16,
                             implementation=implementation)
    far = bt.at[BAD, 0].set(10**6).at[0, 0].set(-9)
    out, lse = jf.mla_decode(q, kv, far, sl, metadata=md, softmax_scale=0.1,
                             implementation=implementation)
    want_out, want_lse = _decode(q, kv, bt, sl, None, implementation, "none")
    out, want_out = np.asarray(out, np.float32), np.asarray(want_out, np.float32)
    assert np.isnan(out[[0, BAD]]).all()
    np.testing.assert_array_equal(out[2:], want_out[2:])
    np.testing.assert_array_equal(np.asarray(lse[2:]), np.asarray(want_lse[2:]))


def _metadata_of_a_wider_table(dtype, s_q, lengths, own, implementation):
    """A metadata made for lengths (r0, r1) with a table of ceil(r1 / 64) pages, then a decode
    of lengths (r0, own) with the first 4 of those pages: request 1 comes out NaN, where a
    kernel given the carried r1 over 4 columns would read past the table (the C++ model
    refuses it), and request 0 (4 pages) is bit for bit the metadata's own step."""
    rng = np.random.default_rng(11)
    pages = -(-lengths[1] // 64)
    num_pages = 2 * pages + 2
    kv = jnp.asarray(rng.normal(0, 0.1, (num_pages, 64, 1, 576)), jnp.float32)
    q = jnp.asarray(rng.normal(0, 0.1, (2, s_q, 16, 576)), jnp.bfloat16)
    wide = jnp.asarray(rng.permutation(num_pages)[:2 * pages].reshape(2, pages), jnp.int32)
    k_scale = jnp.float32(K_SCALE) if dtype == "fp8" else None
    kv = kv.astype(jnp.bfloat16) if k_scale is None else fp8.quantize(kv, k_scale)
    md = jf.get_mla_metadata(jnp.asarray(lengths, jnp.int32), block_table=wide,
                             num_pages=num_pages, num_heads_q=16, num_q_tokens=s_q,
                             fp8=k_scale is not None, implementation=implementation)
    decode = lambda table, seq_lens: jf.mla_decode(
        q, kv, table, jnp.asarray(seq_lens, jnp.int32), metadata=md, softmax_scale=0.1,
        implementation=implementation, k_scale=k_scale)
    out, lse = decode(wide[:, :4], [lengths[0], own])
    want_out, want_lse = decode(wide, lengths)
    out, want_out = np.asarray(out, np.float32), np.asarray(want_out, np.float32)
    assert np.isnan(out[1]).all() and not np.isnan(want_out).any()
    np.testing.assert_array_equal(out[0], want_out[0])
    np.testing.assert_array_equal(np.asarray(lse[0]), np.asarray(want_lse[0]))


@pytest.mark.parametrize("own", [70, 300])  # another step's length; the metadata's, past 4 pages
@pytest.mark.parametrize("implementation", ["reference", "custom_call"])
@pytest.mark.parametrize("dtype,s_q", [("bf16", 1), ("bf16", 2), ("fp8", 1)])
def test_a_metadata_of_a_wider_table_poisons_its_longer_requests(dtype, s_q, implementation,
                                                                 own):
    _metadata_of_a_wider_table(dtype, s_q, (200, 300), own, implementation)


@pytest.mark.gpu
@pytest.mark.parametrize("lengths", [(200, 300), (200, 3000)])
@pytest.mark.parametrize("own", [70, 300])
@pytest.mark.parametrize("dtype,s_q", [("bf16", 1), ("bf16", 2), ("fp8", 1), ("fp8", 2)])
def test_on_the_gpu_a_metadata_of_a_wider_table_poisons_its_longer_requests(dtype, s_q, own,
                                                                            lengths):
    """FlashMLA's kernels: the schedule names request 1's blocks up to the metadata's length
    (for s_q = 1 the kernel runs to the schedule's last block whatever its length)."""
    _metadata_of_a_wider_table(dtype, s_q, lengths, own, None)


@pytest.mark.parametrize("kwargs,pattern", [
    (dict(num_pages=8), r"get_mla_metadata: block_table must be given .*; got None"),
    (dict(block_table=True, num_pages=0), r"num_pages must be a positive int .* got 0"),
    (dict(block_table=True, num_pages=2.0), r"num_pages must be a positive int .* got 2.0"),
    (dict(block_table=True, num_pages=True), r"num_pages must be a positive int .* got True"),
])
def test_get_mla_metadata_rejects_num_pages(kwargs, pattern):
    sl = jnp.ones((4,), jnp.int32)
    table = jnp.zeros((4, 2), jnp.int32) if kwargs.pop("block_table", False) else None
    with pytest.raises(ValueError, match=pattern):
        jf.get_mla_metadata(sl, block_table=table, num_heads_q=16, implementation="custom_call",
                            **kwargs)
