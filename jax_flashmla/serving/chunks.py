"""Chunked prefill: a prompt's (or a turn's) new tokens in chunks over the cached prefix.

A serving loop prefills a long prompt a chunk at a time (MultiHeadLatentAttention.extend,
jax_flashmla.mla_prefill): chunk k attends to the tokens before it, read from the paged cache,
and causally to itself, then writes its rows. Between two chunks the loop runs decode steps of
its other requests, so that a long prompt does not stall them. plan_chunks cuts the tokens;
length_bucket rounds a chunk's token count and its prefix's (max_prefix_tokens, a static argument)
up to a few sizes, so that the loop compiles a few shapes, not one per length.
"""
import numpy as np


def _check_int(where, name, value, least):
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < least:
        raise ValueError(f"{where}: {name} must be an int >= {least}; got {value!r}")


def plan_chunks(num_tokens, chunk_size, *, start=0):
    """The chunks in which to prefill num_tokens new tokens that follow start cached ones.

    Args:
      num_tokens: int >= 0, the new tokens (a prompt; a turn's new tokens).
      chunk_size: int >= 1, the most tokens per chunk.
      start: int >= 0, the position of the first new token: the tokens already in the cache
        (0 for a new prompt, the conversation so far for a later turn).

    Returns:
      A list of (position, length) int pairs, in order: chunk k holds the tokens at positions
      [position, position + length); its prefix (the tokens it attends to in the cache) is
      position tokens long. The chunks cover [start, start + num_tokens) exactly, without
      overlap; each has chunk_size tokens but the last, which has 1 to chunk_size. No chunk
      for num_tokens = 0.
    """
    for name, value, least in (("num_tokens", num_tokens, 0), ("chunk_size", chunk_size, 1),
                               ("start", start, 0)):
        _check_int("plan_chunks", name, value, least)
    end = int(start) + int(num_tokens)
    return [(p, min(int(chunk_size), end - p)) for p in range(int(start), end, int(chunk_size))]


def length_bucket(length, *, minimum=64, step=None):
    """A static size >= length from a short list, so that a loop compiles a few shapes.

    0 for length 0; else the smallest power of two >= max(length, minimum), unless step is
    given and that power exceeds step: then the smallest multiple of step >= length. Powers of
    two bound the shapes to a logarithm of the longest length; step bounds the padding of long
    lengths to less than step.

    Use it for a chunk's max_prefix_tokens (MultiHeadLatentAttention.extend, mla_prefill: the
    prefix keys read for the batch; with the default minimum a multiple of 64, as they take),
    and for the padded token count of a chunk: with step = the chunk size, a multiple of
    minimum, no chunk pads past the chunk size.

    Args:
      length: int >= 0.
      minimum: int >= 1, the least nonzero bucket (64: one cache page).
      step: None, or an int >= 1.

    Returns:
      An int: 0 when length is 0, else >= length (and >= minimum, unless step < minimum).
    """
    _check_int("length_bucket", "length", length, 0)
    _check_int("length_bucket", "minimum", minimum, 1)
    if step is not None:
        _check_int("length_bucket", "step", step, 1)
    if length == 0:
        return 0
    size = 1 << (max(int(length), int(minimum)) - 1).bit_length()
    if step is not None and size > step:
        size = -(-int(length) // int(step)) * int(step)
    return size
