"""Decode steps over a paged cache: one step, batch padding to buckets, and a jitted decode loop.

Speculative decoding needs nothing more, as SGLang's FlashMLA backend does it (topk 1):
  - target verify scores a request's num_draft_tokens drafts in one causal decode_step (s_q =
    num_draft_tokens) over its lengths after the drafts, prefix + num_draft_tokens (a padded
    request staying 0), with a metadata of those lengths and num_q_tokens = num_draft_tokens,
    as a decode step of s_q tokens has it; draft i attends the prefix and drafts 0..i. After
    verification the scheduler sets each length to prefix + accepted tokens; the rejected
    drafts' rows stay in the cache past it, unread, until overwritten.
  - multi-step drafting (EAGLE-style, one draft chain a request) is decode_loop over the
    draft model's attention layer, the draft model between steps as its step_fn.

Conventions:
  - decode_step takes seq_lens that count the tokens it writes (SGLang's decode convention):
    the s_q new tokens of request i sit at positions seq_lens[i] - s_q .. seq_lens[i] - 1.
  - Multi-step functions take prefix_lens, the lengths before their first new token.
  - Length 0 marks a padded request (bucket padding): its writes land on negative positions,
    which write_kv drops, and mla_decode returns out 0 and lse +inf for it. FlashMLA's
    scheduler gives it no KV blocks, so it costs next to nothing (with an FP8 cache, one block:
    mla_decode gives FlashMLA's FP8 kernel empty requests as length 1). A padded request stays
    at length 0 across steps.
  - k_scale, where given, is an FP8 cache's scale: rows are written quantized with it and the
    decode is FlashMLA's FP8 one.
"""
import bisect

import jax
import jax.numpy as jnp
import numpy as np

from jax_flashmla.base import validation
from jax_flashmla.caches.paged import cache_array, token_slots, write_kv
from jax_flashmla.ops.decode import mla_decode
from jax_flashmla.serving.block_table import PAD_PAGE

# Batch sizes to compile a step for, the counterpart of SGLang's CUDA-graph batch sizes: a
# serving loop pads each step to the next bucket and so compiles a handful of shapes.
DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256)


def _pad_rows(x, rows, value):
    pad = [(0, rows - x.shape[0])] + [(0, 0)] * (x.ndim - 1)
    if isinstance(x, np.ndarray):
        return np.pad(x, pad, constant_values=value)
    return jnp.pad(x, pad, constant_values=value)


def pad_batch(seq_lens, block_table, *arrays, buckets=DEFAULT_BUCKETS):
    """Pads one step's per-request arrays to the smallest bucket that holds the batch.

    Args:
      seq_lens: (batch,) int32 lengths; padded with 0, which marks a padded request.
      block_table: (batch, max_pages) int32; padded with PAD_PAGE (-1) rows.
      *arrays: more (batch, ...) arrays (q, new KV rows, ...); padded with zeros.
      buckets: the batch sizes to pad to, strictly increasing positive ints; the last must
        hold the batch. A serving loop that pads every step so compiles one shape a bucket.

    Returns:
      The tuple (seq_lens, block_table, *arrays) with `bucket` rows each (the bucket is
      seq_lens.shape[0]), NumPy arrays staying NumPy (pad on the host, transfer once) and JAX
      arrays staying JAX. Slice the step's outputs back with [:batch].
    """
    buckets = tuple(buckets)
    if (not buckets or any(not isinstance(b, (int, np.integer)) or b < 1 for b in buckets)
            or any(a >= b for a, b in zip(buckets, buckets[1:]))):
        raise ValueError(f"pad_batch: buckets must be strictly increasing positive ints; "
                         f"got {buckets}")
    validation.check_rank("pad_batch", "seq_lens", seq_lens, 1, "(batch,)")
    batch = seq_lens.shape[0]
    if batch > buckets[-1]:
        raise ValueError(f"pad_batch: the batch ({batch} requests, seq_lens' length) is larger "
                         f"than the largest bucket {buckets[-1]}; add a larger bucket or split "
                         f"the batch")
    for name, x in [("block_table", block_table)] + [(f"arrays[{i}]", a)
                                                     for i, a in enumerate(arrays)]:
        if x.ndim < 1 or x.shape[0] != batch:
            raise ValueError(f"pad_batch: {name} must have seq_lens' batch {batch} as its "
                             f"first dimension; got shape {tuple(x.shape)}")
    bucket = int(buckets[bisect.bisect_left(buckets, batch)])
    return (_pad_rows(seq_lens, bucket, 0), _pad_rows(block_table, bucket, PAD_PAGE),
            *(_pad_rows(a, bucket, 0) for a in arrays))


def decode_step(kv_cache, block_table, seq_lens, q, kv, *, metadata=None, softmax_scale=None,
                implementation=None, k_scale=None):
    """Writes s_q new tokens per request, then attends their queries over the cache: a decode
    step, or speculative decoding's target verify of s_q drafts (module doc).

    Args:
      kv_cache: PagedKVCache or its (num_pages, 64, 1, 576) array.
      block_table: (batch, max_pages) int32, covering every page up to seq_lens.
      seq_lens: (batch,) int32 lengths counting the new tokens; 0 for a padded request.
      q: (batch, s_q, h_q, 576) bfloat16/float16, the new tokens' queries.
      kv: (batch, s_q, 576) the new tokens' cache rows, cast to the cache's dtype.
      metadata: get_mla_metadata(seq_lens, block_table=block_table, num_pages=<the cache's
        pages>, num_heads_q=h_q, num_q_tokens=s_q, fp8=<an FP8 cache>); computed next to the
        kernel when None. Share one across the layers of a step.
      softmax_scale, implementation: as in mla_decode. Attention is causal: new token i sees
        the first seq_lens - s_q + i + 1 keys, itself included.
      k_scale: with a float8_e4m3fn cache (and only then), its float32 scale: the new rows are
        quantized with it (write_kv's scale) and the decode is FlashMLA's FP8 one (mla_decode).

    Returns:
      (kv_cache updated, of kv_cache's kind; out (batch, s_q, h_q, 512); lse (batch, h_q, s_q)).
    """
    validation.check_rank("decode_step", "q", q, 4, "(batch, s_q, h_q, 576)")
    batch, s_q = q.shape[:2]
    if kv.shape != (batch, s_q, validation.HEAD_DIM):
        raise ValueError(f"decode_step: kv must have shape ({batch}, {s_q}, "
                         f"{validation.HEAD_DIM}) for q's batch and s_q; got {tuple(kv.shape)}")
    validation.check_rank("decode_step", "seq_lens", seq_lens, 1, "(batch,)")
    positions = seq_lens[:, None] - s_q + jnp.arange(s_q, dtype=seq_lens.dtype)[None, :]
    kv_cache = write_kv(kv_cache, token_slots(block_table, positions), kv=kv, scale=k_scale)
    out, lse = mla_decode(q, cache_array(kv_cache, "decode_step"), block_table, seq_lens,
                          metadata=metadata, softmax_scale=softmax_scale, causal=True,
                          implementation=implementation, k_scale=k_scale)
    return kv_cache, out, lse


def write_prompt(kv_cache, block_table, prompt_lens, prompt_kv, *, scale=None):
    """Stores each request's prompt rows at positions 0 .. prompt_lens - 1.

    Args:
      kv_cache: PagedKVCache or its array.
      block_table: (batch, max_pages) int32.
      prompt_lens: (batch,) int32; rows of prompt_kv past a request's length are not written.
      prompt_kv: (batch, max_prompt, 576) rows of the prompt tokens.
      scale: with a float8_e4m3fn cache (and only then), its float32 scale (write_kv's).

    Returns:
      The updated cache, of kv_cache's kind.
    """
    validation.check_rank("write_prompt", "prompt_kv", prompt_kv, 3, "(batch, max_prompt, 576)")
    positions = jnp.arange(prompt_kv.shape[1], dtype=jnp.int32)[None, :]
    positions = jnp.where(positions < prompt_lens[:, None], positions, -1)
    return write_kv(kv_cache, token_slots(block_table, positions), kv=prompt_kv, scale=scale)


def step_seq_lens(prefix_lens, num_steps):
    """(num_steps, batch) int32: lengths after each one-token step, prefix_lens + t + 1;
    padded requests (prefix length 0) stay 0."""
    steps = jnp.arange(1, num_steps + 1, dtype=prefix_lens.dtype)[:, None]
    return jnp.where(prefix_lens[None, :] > 0, prefix_lens[None, :] + steps, 0)


def decode_loop(kv_cache, block_table, prefix_lens, q, kv, step_fn, carry, *, num_steps,
                softmax_scale=None, implementation=None, k_scale=None):
    """num_steps decode steps over one cache, in one jax.lax.scan: a model's decode, or a draft
    model's multi-step drafting (module doc).

    Step t writes its token's row kv_t at position prefix_lens + t, attends q_t over the
    prefix_lens + t + 1 keys up to it, and calls step_fn(carry, out_t) -> (carry, q_{t+1},
    kv_{t+1}) (the model between two attentions; its last q and kv go unused).

    Args:
      kv_cache: PagedKVCache or its array, the prompt already written (write_prompt).
      block_table: (batch, max_pages) int32 covering prefix_lens + num_steps tokens: allocate
        the pages beforehand, the loop runs on device with no scheduler in between.
      prefix_lens: (batch,) int32 lengths before step 0; 0 marks a padded request.
      q: (batch, 1, h_q, 576) and kv: (batch, 1, 576), the first decoded token's query and row.
      step_fn: traced once; q_{t+1} and kv_{t+1} must keep q's and kv's shapes.
      carry: any pytree step_fn threads through the steps.
      num_steps: static number of steps.
      softmax_scale, implementation: as in mla_decode.
      k_scale: with a float8_e4m3fn cache, its float32 scale (decode_step's).

    Returns:
      (kv_cache, out (num_steps, batch, 1, h_q, 512), lse (num_steps, batch, h_q, 1), carry).
      Jit it with the cache donated to update the cache in place.
    """
    validation.check_rank("decode_loop", "q", q, 4, "(batch, 1, h_q, 576)")
    if q.shape[1] != 1:
        raise ValueError(f"decode_loop: q must have s_q = 1, one token per step; got shape "
                         f"{tuple(q.shape)} (decode_step takes several, as target verify does)")

    def body(state, lens_t):
        cache, q_t, kv_t, carry = state
        cache, out, lse = decode_step(cache, block_table, lens_t, q_t, kv_t,
                                      softmax_scale=softmax_scale, implementation=implementation,
                                      k_scale=k_scale)
        carry, q_next, kv_next = step_fn(carry, out)
        return (cache, q_next.astype(q_t.dtype), kv_next.astype(kv_t.dtype), carry), (out, lse)

    (kv_cache, _, _, carry), (out, lse) = jax.lax.scan(
        body, (kv_cache, q, kv, carry), step_seq_lens(prefix_lens, num_steps))
    return kv_cache, out, lse, carry
