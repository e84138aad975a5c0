"""Block tables from SGLang's request-to-token map and from page lists, against NumPy."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_flashmla.serving import build_block_table
from jax_flashmla.serving.block_table import PAD_PAGE, block_table_from_pages, pages_for_tokens
from jax_flashmla.caches.paged import token_slots


def _random_pool(rng, pool_size, max_context, num_pages, page_size=64):
    """req_to_token of a paged token pool: each row's pages are distinct, shuffled pages."""
    pages_per_row = max_context // page_size
    pages = rng.permutation(num_pages)[:pool_size * pages_per_row].reshape(pool_size, -1)
    offsets = np.arange(max_context) % page_size
    return (pages.repeat(page_size, axis=1) * page_size + offsets).astype(np.int32)


def _oracle(req_to_token, req_pool_indices, seq_lens, max_pages, page_size=64):
    table = np.full((len(seq_lens), max_pages), PAD_PAGE, np.int64)
    for i, (row, length) in enumerate(zip(req_pool_indices, seq_lens)):
        for j in range(min(-(-length // page_size), max_pages)):
            table[i, j] = req_to_token[row, j * page_size] // page_size
    return table


@pytest.mark.parametrize("max_pages", [5, 7, 2])
def test_build_block_table_matches_numpy(max_pages):
    # max_pages 5 covers max_context exactly, 7 reads past it, 2 truncates long requests.
    rng = np.random.default_rng(max_pages)
    req_to_token = _random_pool(rng, pool_size=6, max_context=320, num_pages=40)
    req_pool_indices = np.array([4, 0, 5, 2, 1, 3], np.int32)
    seq_lens = np.array([0, 1, 64, 128, 320, 65], np.int32)  # zero, ragged, multiples of 64
    got = build_block_table(jnp.asarray(req_to_token), jnp.asarray(req_pool_indices),
                            jnp.asarray(seq_lens), max_pages=max_pages)
    assert got.shape == (6, max_pages) and got.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(got),
                                  _oracle(req_to_token, req_pool_indices, seq_lens, max_pages))


def test_build_block_table_other_page_size_and_outer_jit():
    rng = np.random.default_rng(3)
    req_to_token = _random_pool(rng, pool_size=3, max_context=64, num_pages=12, page_size=16)
    req_pool_indices = np.array([2, 1], np.int32)
    seq_lens = np.array([17, 48], np.int32)
    build = jax.jit(lambda r, p, s: build_block_table(r, p, s, max_pages=4, page_size=16))
    got = build(jnp.asarray(req_to_token), jnp.asarray(req_pool_indices), jnp.asarray(seq_lens))
    np.testing.assert_array_equal(
        np.asarray(got), _oracle(req_to_token, req_pool_indices, seq_lens, 4, page_size=16))


def test_block_table_slots_are_the_token_pool_slots():
    # Through the table, token p of request i lands on req_to_token[pool index, p].
    rng = np.random.default_rng(4)
    req_to_token = _random_pool(rng, pool_size=4, max_context=256, num_pages=20)
    req_pool_indices = np.array([3, 1, 2], np.int32)
    seq_lens = np.array([200, 64, 0], np.int32)
    table = build_block_table(jnp.asarray(req_to_token), jnp.asarray(req_pool_indices),
                              jnp.asarray(seq_lens), max_pages=4)
    positions = np.broadcast_to(np.arange(256, dtype=np.int32), (3, 256))
    slots = np.asarray(token_slots(table, jnp.asarray(positions)))
    for i, (row, length) in enumerate(zip(req_pool_indices, seq_lens)):
        page_end = pages_for_tokens(int(length)) * 64
        np.testing.assert_array_equal(slots[i, :page_end], req_to_token[row, :page_end])
        assert (slots[i, page_end:] == -1).all()  # past the last page: dropped by write_kv


def test_block_table_from_pages():
    table = block_table_from_pages([[7, 2, 5], [], [0]], max_pages=4)
    assert table.dtype == np.int32
    np.testing.assert_array_equal(table, [[7, 2, 5, -1], [-1, -1, -1, -1], [0, -1, -1, -1]])
    assert block_table_from_pages([], max_pages=3).shape == (0, 3)
    with pytest.raises(ValueError, match=r"page_lists\[1\] has 3 pages, more than max_pages=2"):
        block_table_from_pages([[1], [2, 3, 4]], max_pages=2)
    with pytest.raises(ValueError, match="outside"):
        block_table_from_pages([[1, -2]], max_pages=2)


def test_pages_for_tokens():
    assert [pages_for_tokens(n) for n in (0, 1, 64, 65, 128)] == [0, 1, 1, 2, 2]


def test_input_errors_name_the_argument():
    r2t = jnp.zeros((2, 128), jnp.int32)
    idx = jnp.zeros((3,), jnp.int32)
    with pytest.raises(TypeError, match="seq_lens must be int32"):
        build_block_table(r2t, idx, jnp.zeros((3,), jnp.float32), max_pages=2)
    with pytest.raises(ValueError, match=r"seq_lens must have req_pool_indices' shape \(3,\)"):
        build_block_table(r2t, idx, jnp.zeros((2,), jnp.int32), max_pages=2)
    with pytest.raises(ValueError, match="req_to_token must have rank 2"):
        build_block_table(r2t[0], idx, idx, max_pages=2)
    with pytest.raises(ValueError, match="max_pages must be a positive int"):
        build_block_table(r2t, idx, idx, max_pages=0)
