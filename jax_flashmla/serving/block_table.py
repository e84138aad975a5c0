"""Block tables: the (batch, max_pages) int32 page lists mla_decode reads.

Entry j of request i is the page holding its tokens [64 j, 64 j + 64). Entries past a request's
last page hold PAD_PAGE (-1), as SGLang's FlashMLA backend fills them: mla_decode never reads
them, and token_slots maps any position on them to an invalid slot, so writes there drop.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax_flashmla.base import validation
from jax_flashmla.base.validation import PAGE_SIZE

PAD_PAGE = -1


def pages_for_tokens(num_tokens, page_size=PAGE_SIZE):
    """Pages needed to hold num_tokens tokens (ceil division)."""
    return (num_tokens + page_size - 1) // page_size


@functools.partial(jax.jit, static_argnames=("max_pages", "page_size"))
def build_block_table(req_to_token, req_pool_indices, seq_lens, *, max_pages, page_size=PAGE_SIZE):
    """SGLang's FlashMLA block table from its request-to-token map, on device.

    Args:
      req_to_token: (pool_size, max_context) int32; row r lists the token-pool slots of request
        pool entry r, token by token. Its allocator is paged: tokens [64 j, 64 j + 64) of a
        request share one page, so token 64 j's slot names the page (slot // page_size).
      req_pool_indices: (batch,) int32, each request's row of req_to_token.
      seq_lens: (batch,) int32 KV lengths.
      max_pages: static width of the table; requests longer than max_pages * page_size keep
        only their first max_pages pages, so pick it >= ceil(max(seq_lens) / page_size).
      page_size: tokens per page (FlashMLA's cache uses 64).

    Returns:
      (batch, max_pages) int32: req_to_token[req_pool_indices[i], j * page_size] // page_size
      for j < ceil(seq_lens[i] / page_size), PAD_PAGE (-1) after.
    """
    where = "build_block_table"
    validation.check_rank(where, "req_to_token", req_to_token, 2, "(pool_size, max_context)")
    validation.check_rank(where, "req_pool_indices", req_pool_indices, 1, "(batch,)")
    validation.check_rank(where, "seq_lens", seq_lens, 1, "(batch,)")
    for name, x in (("req_to_token", req_to_token), ("req_pool_indices", req_pool_indices),
                    ("seq_lens", seq_lens)):
        validation.check_int32(where, name, x)
    if seq_lens.shape != req_pool_indices.shape:
        raise ValueError(f"{where}: seq_lens must have req_pool_indices' shape "
                         f"{tuple(req_pool_indices.shape)}; got {tuple(seq_lens.shape)}")
    for name, value in (("max_pages", max_pages), ("page_size", page_size)):
        if not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{where}: {name} must be a positive int; got {value!r}")
    max_context = req_to_token.shape[1]
    first_tokens = jnp.arange(max_pages, dtype=jnp.int32) * page_size
    # Columns past max_context can only belong to pages past a valid request's length (its
    # tokens all fit in req_to_token); clamp them to stay in bounds, the mask then drops them.
    rows = req_to_token[req_pool_indices[:, None], jnp.minimum(first_tokens, max_context - 1)]
    used = first_tokens[None, :] < seq_lens[:, None]
    return jnp.where(used, rows // page_size, PAD_PAGE).astype(jnp.int32)


def block_table_from_pages(page_lists, max_pages):
    """A block table from per-request page lists, on the host.

    Args:
      page_lists: sequence of batch sequences of page ids (ints >= 0), each in token order.
      max_pages: width of the table; every list must fit.

    Returns:
      np.ndarray (batch, max_pages) int32, lists left-aligned, PAD_PAGE (-1) after.
    """
    table = np.full((len(page_lists), max_pages), PAD_PAGE, np.int32)
    for i, pages in enumerate(page_lists):
        pages = np.asarray(pages, np.int64).reshape(-1)
        if pages.size > max_pages:
            raise ValueError(f"block_table_from_pages: page_lists[{i}] has {pages.size} pages, "
                             f"more than max_pages={max_pages}")
        if pages.size and (pages.min() < 0 or pages.max() > np.iinfo(np.int32).max):
            raise ValueError(f"block_table_from_pages: page_lists[{i}] has page ids outside "
                             f"[0, 2**31); got {pages.tolist()}")
        table[i, :pages.size] = pages
    return table
