"""Paged index-key problems and selection checks shared by the indexer's and the V3.2 layer's
tests: block tables over permuted pages, slots back to positions, and two selections compared
but for near-ties."""
import numpy as np

from helpers import SENTINEL_PAGE

PAGE = 64
# The indexer's scoring kernel against float64 sums of the stored FP8 values it scores: the
# tensor cores sum each q_h . k with fewer bits than float32 keeps, so the error follows the
# largest scores of a call (atol, of its largest |score|), not each score's own size alone.
KERNEL_SCORE_RTOL, KERNEL_SCORE_ATOL = 2e-3, 5e-4


def paged_block_table(rng, lengths, extra_pages=2):
    """(block_table (batch, max_pages) int32, num_pages): a random permutation of the pages,
    SENTINEL_PAGE past each request's last page."""
    pages = [-(-int(n) // PAGE) for n in lengths]
    max_pages = max(1, max(pages))
    num_pages = sum(pages) + extra_pages
    perm = rng.permutation(num_pages).astype(np.int32)
    block_table = np.full((len(lengths), max_pages), SENTINEL_PAGE, np.int32)
    for i, n in enumerate(pages):
        block_table[i, :n], perm = perm[:n], perm[n:]
    return block_table, num_pages


def selected_positions(slots, block_table_row):
    """Token positions of a row's selected slots (-1 dropped), through its block table."""
    page_of = {int(p): j for j, p in enumerate(block_table_row)}
    return [page_of[int(s) // PAGE] * PAGE + int(s) % PAGE for s in slots if s >= 0]


def assert_same_selection(got, want, exact, slack):
    """got and want (lists of position lists) select the same tokens but for near-ties: a token
    only one of them keeps scores (exact, float64) within slack of one only the other keeps."""
    agree = total = 0
    for row, (a, b) in enumerate(zip(got, want)):
        assert len(a) == len(set(a)) == len(b), (row, a, b)
        only_got, only_want = sorted(set(a) - set(b)), sorted(set(b) - set(a))
        if only_got:
            gap = exact[row, only_want].max() - exact[row, only_got].min()
            assert gap <= slack[row], (row, only_got, only_want, gap, slack[row])
        agree, total = agree + len(a) - len(only_got), total + len(a)
    assert agree >= 0.9 * total, (agree, total)
