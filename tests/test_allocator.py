"""PageAllocator: its invariants under random admit / grow / finish sequences."""
import random

import numpy as np
import pytest

from jax_flashmla.serving import PageAllocator


def _check_invariants(alloc, expected_tokens):
    held = [p for r in alloc.requests for p in alloc.pages(r)]
    assert len(held) == len(set(held)), "a page is held twice"
    free = set(alloc._free)
    assert len(free) == len(alloc._free) == alloc.num_free, "a page is free twice"
    assert not free & set(held), "a page is both free and held"
    assert free | set(held) == set(range(alloc.num_pages)), "a page went missing"
    assert alloc.num_used == len(held)
    assert set(alloc.requests) == set(expected_tokens)
    for r, tokens in expected_tokens.items():
        assert alloc.num_tokens(r) == tokens
        assert len(alloc.pages(r)) == -(-tokens // alloc.page_size)


def _state(alloc):
    return (list(alloc._free), {r: alloc.pages(r) for r in alloc.requests},
            {r: alloc.num_tokens(r) for r in alloc.requests})


def test_allocate_free_reuse_and_exhaustion():
    alloc = PageAllocator(4)
    assert alloc.allocate(2) == [0, 1] and alloc.num_free == 2
    with pytest.raises(PageAllocator.OutOfPagesError, match="3 pages requested, 2 of 4 free"):
        alloc.allocate(3)
    assert alloc.num_free == 2  # all or nothing
    alloc.free([1, 0])
    assert alloc.allocate(2) == [1, 0]  # freed pages come back first
    with pytest.raises(ValueError, match="distinct and allocated"):
        alloc.free([2])  # never handed out
    with pytest.raises(ValueError, match="distinct and allocated"):
        alloc.free([0, 0])
    with pytest.raises(ValueError, match="distinct and allocated"):
        alloc.free([9])
    assert issubclass(PageAllocator.OutOfPagesError, RuntimeError)


def test_request_lifecycle_and_tables():
    alloc = PageAllocator(6)
    assert alloc.admit("a", 64) == [0]
    assert alloc.admit("b", 1) == [1]
    assert alloc.grow("a", 64) == [] and alloc.grow("a", 65) == [2]
    assert alloc.admit("c", 0) == [] and alloc.grow("c", 3) == [3]
    np.testing.assert_array_equal(alloc.block_table(["a", "b", "c"], max_pages=3),
                                  [[0, 2, -1], [1, -1, -1], [3, -1, -1]])
    np.testing.assert_array_equal(alloc.seq_lens(["c", "a"]), [3, 65])
    assert alloc.finish("a") == 2 and alloc.num_free == 4
    assert alloc.admit("d", 130) == [0, 2, 4]  # the freed pages, then fresh ones
    with pytest.raises(ValueError, match="already admitted"):
        alloc.admit("b", 1)
    with pytest.raises(ValueError, match="unknown request 'a'"):
        alloc.grow("a", 100)
    with pytest.raises(ValueError, match="would shrink"):
        alloc.grow("d", 10)
    with pytest.raises(ValueError, match="int >= 0"):
        alloc.admit("e", -1)
    with pytest.raises(PageAllocator.OutOfPagesError):
        alloc.admit("e", 2 * 64 + 1)
    assert "e" not in alloc.requests


@pytest.mark.parametrize("seed", range(8))
def test_random_admit_grow_finish(seed):
    rng = random.Random(seed)
    alloc = PageAllocator(rng.choice([1, 5, 16]), page_size=rng.choice([64, 4]))
    tokens = {}
    next_id = 0
    for _ in range(300):
        op = rng.choice(["admit", "grow", "grow", "finish", "free"])
        before = _state(alloc)
        try:
            if op == "admit":
                n = rng.randrange(0, 3 * alloc.page_size)
                pages = alloc.admit(next_id, n)
                assert pages == alloc.pages(next_id)
                tokens[next_id] = n
                next_id += 1
            elif op == "grow" and tokens:
                r = rng.choice(sorted(tokens))
                n = tokens[r] + rng.choice([0, 1, 1, alloc.page_size, 2 * alloc.page_size + 3])
                old_pages = alloc.pages(r)
                added = alloc.grow(r, n)
                assert alloc.pages(r) == old_pages + added  # existing pages never move
                tokens[r] = n
            elif op == "finish" and tokens:
                r = rng.choice(sorted(tokens))
                held = alloc.pages(r)
                free_before = alloc.num_free
                assert alloc.finish(r) == len(held)
                assert alloc.num_free == free_before + len(held)
                del tokens[r]
            elif op == "free" and tokens:
                # Freeing pages a live request holds is refused and changes nothing.
                r = rng.choice(sorted(tokens))
                if alloc.pages(r):
                    with pytest.raises(ValueError, match="held by requests"):
                        alloc.free(alloc.pages(r)[-1:])
                    assert _state(alloc) == before
        except PageAllocator.OutOfPagesError:
            assert _state(alloc) == before, "a failed call changed the allocator"
            needed = -(-n // alloc.page_size) - (len(alloc.pages(r)) if op == "grow" else 0)
            assert needed > alloc.num_free
        _check_invariants(alloc, tokens)


def test_free_refuses_the_pages_of_a_live_request():
    """Freeing a request's pages by hand would hand them to the next admission while the first
    request still writes them; and finishing it would then free the second's."""
    alloc = PageAllocator(4, page_size=4)
    alloc.admit("a", 6)  # pages 0, 1
    loose = alloc.allocate(1)  # page 2, the caller's
    with pytest.raises(ValueError, match=r"pages \[1\] are held by requests \['a'\]"):
        alloc.free([1])
    with pytest.raises(ValueError, match="held by requests"):
        alloc.free([loose[0], 0])  # all or nothing
    assert alloc.num_free == 1 and alloc.pages("a") == [0, 1]
    alloc.free(loose)
    assert alloc.finish("a") == 2 and alloc.num_free == 4
