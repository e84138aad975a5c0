"""Speculative decoding over the paged cache: target verify and multi-step drafting (topk 1).

They mirror SGLang's FlashMLA backend:
  - Target verify scores num_draft_tokens drafts per request in one causal call (s_q = the
    number of drafts) over lengths prefix + num_draft_tokens, with metadata computed for
    those lengths and num_q_tokens = num_draft_tokens.
  - The multi-step draft backend runs several single-token decode steps over one cache (the
    draft model's one attention layer), one metadata per step computed up front (step i over
    prefix + i + 1 keys); FlashMLA's draft backend supports topk = 1 only, one draft chain per
    request.
After verification the scheduler sets each request's length to prefix + accepted tokens;
the rejected drafts' rows stay in the cache past that length, unread, until overwritten.
Prefix length 0 marks a padded request, as in jax_flashmla/serving/loop.py.
"""
import jax
import jax.numpy as jnp

from jax_flashmla.base import validation
from jax_flashmla.caches.paged import PagedKVCache
from jax_flashmla.ops.decode import get_mla_metadata
from jax_flashmla.serving.loop import decode_step, run_steps, step_seq_lens


def _check_count(where, name, value):
    if not isinstance(value, int) or value < 1:
        raise ValueError(f"{where}: {name} must be a positive int; got {value!r}")


def verify_seq_lens(prefix_lens, num_draft_tokens):
    """(batch,) int32: prefix_lens + num_draft_tokens, padded requests (0) staying 0."""
    return jnp.where(prefix_lens > 0, prefix_lens + num_draft_tokens, 0).astype(prefix_lens.dtype)


def target_verify_metadata(prefix_lens, num_draft_tokens, *, block_table, num_pages,
                           num_heads_q, num_sms=None, implementation=None, fp8=False):
    """The metadata of target_verify; block_table, num_pages, fp8 as get_mla_metadata's (an
    out-of-range request is verified empty)."""
    _check_count("target_verify_metadata", "num_draft_tokens", num_draft_tokens)
    return get_mla_metadata(verify_seq_lens(prefix_lens, num_draft_tokens),
                            block_table=block_table, num_pages=num_pages,
                            num_heads_q=num_heads_q, num_q_tokens=num_draft_tokens,
                            num_sms=num_sms, implementation=implementation, fp8=fp8)


def target_verify(kv_cache, block_table, prefix_lens, q, draft_kv, *, metadata=None,
                  softmax_scale=None, implementation=None, k_scale=None):
    """Writes the draft tokens and scores them with the target model's attention.

    Args:
      kv_cache: PagedKVCache or its (num_pages, 64, 1, 576) array.
      block_table: (batch, max_pages) int32 covering prefix_lens + num_draft_tokens tokens.
      prefix_lens: (batch,) int32 accepted lengths before the drafts; 0 for padding.
      q: (batch, num_draft_tokens, h_q, 576) the drafts' queries in the target model.
      draft_kv: (batch, num_draft_tokens, 576) their cache rows, written at positions
        prefix_lens .. prefix_lens + num_draft_tokens - 1.
      metadata: target_verify_metadata(prefix_lens, num_draft_tokens, block_table=block_table,
        num_pages=<the cache's pages>, num_heads_q=h_q); when None each decode checks its own
        lengths.
      softmax_scale, implementation: as in mla_decode.
      k_scale: with a float8_e4m3fn cache, its float32 scale (decode_step's).

    Returns:
      (kv_cache, out (batch, num_draft_tokens, h_q, 512), lse (batch, h_q, num_draft_tokens)),
      draft i attending the prefix and drafts 0..i: the same as num_draft_tokens single-token
      decode steps.
    """
    validation.check_rank("target_verify", "q", q, 4, "(batch, num_draft_tokens, h_q, 576)")
    seq_lens = verify_seq_lens(prefix_lens, q.shape[1])
    return decode_step(kv_cache, block_table, seq_lens, q, draft_kv, metadata=metadata,
                       softmax_scale=softmax_scale, implementation=implementation,
                       k_scale=k_scale)


def multi_step_draft(kv_cache, block_table, prefix_lens, q, kv, draft_fn, carry, *, num_steps,
                     topk=1, softmax_scale=None, implementation=None, k_scale=None):
    """num_steps draft decode steps over one cache (EAGLE-style chain, topk 1).

    Step i writes its draft token's row at position prefix_lens + i and attends over the
    prefix_lens + i + 1 keys up to it; draft_fn(carry, out_i) -> (carry, q_{i+1}, kv_{i+1})
    is the draft model between steps (it picks the top-1 token).

    Args:
      kv_cache: PagedKVCache or its array (the draft model's cache layer).
      block_table: (batch, max_pages) int32 covering prefix_lens + num_steps tokens.
      prefix_lens: (batch,) int32 lengths before the first draft token; 0 for padding.
      q: (batch, 1, h_q, 576), kv: (batch, 1, 576), the first draft token's query and row.
      draft_fn, carry: as step_fn and carry of decode_loop.
      num_steps: static number of draft steps.
      topk: draft branches per request; FlashMLA's draft backend supports 1 only.
      softmax_scale, implementation: as in mla_decode.
      k_scale: with a float8_e4m3fn cache, its float32 scale (decode_step's).

    Returns:
      (kv_cache, out (num_steps, batch, 1, h_q, 512), lse (num_steps, batch, h_q, 1), carry).
      Each step's metadata is made up front, for the in-range requests (a step of an
      out-of-range request is decoded empty): the cache is one layer's, so no other layer
      shares them.
    """
    if topk != 1:
        raise ValueError(f"multi_step_draft: topk must be 1 (FlashMLA's draft backend decodes "
                         f"one chain per request); got {topk!r}")
    _check_count("multi_step_draft", "num_steps", num_steps)
    validation.check_rank("multi_step_draft", "q", q, 4, "(batch, 1, h_q, 576)")
    if q.shape[1] != 1:
        raise ValueError(f"multi_step_draft: q must have s_q = 1; got shape {tuple(q.shape)}")
    pages = kv_cache.num_pages if isinstance(kv_cache, PagedKVCache) else kv_cache.shape[0]
    lens = step_seq_lens(prefix_lens, num_steps)
    per_step = [get_mla_metadata(lens[i], block_table=block_table, num_pages=pages,
                                 num_heads_q=q.shape[2], implementation=implementation,
                                 fp8=k_scale is not None)
                for i in range(num_steps)]
    metadata = jax.tree.map(lambda *leaves: jnp.stack(leaves), *per_step)
    return run_steps(kv_cache, block_table, lens, metadata, q, kv, draft_fn, carry,
                     softmax_scale=softmax_scale, implementation=implementation, k_scale=k_scale)
