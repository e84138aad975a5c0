"""Chunked prefill: a prompt's (or a turn's) new tokens in chunks over the cached prefix.

A serving loop prefills a long prompt a chunk at a time (MultiHeadLatentAttention.extend,
jax_flashmla.mla_prefill): chunk k attends to the tokens before it, read from the paged cache,
and causally to itself, then writes its rows. Between two chunks the loop runs decode steps of
its other requests, so that a long prompt does not stall them. plan_chunks cuts the tokens and
gives each chunk its compiled shape: its token count and its prefix's (max_prefix_tokens, a
static argument) rounded up to a few sizes, so that the loop compiles a few shapes, not one per
length.
"""
from typing import NamedTuple

import numpy as np

from jax_flashmla.base.validation import PAGE_SIZE


class Chunk(NamedTuple):
    """One chunk of plan_chunks: the tokens at positions [position, position + length),
    padded to padded_length tokens, over a prefix of position cached tokens, which
    max_prefix_tokens (a multiple of 64 >= position, 0 for none) holds."""

    position: int
    length: int
    padded_length: int
    max_prefix_tokens: int


def _check_int(where, name, value, least):
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < least:
        raise ValueError(f"{where}: {name} must be an int >= {least}; got {value!r}")


def _power_of_two_bucket(length):
    """0 for length 0, else the smallest power of two >= max(length, one page)."""
    return 0 if length == 0 else 1 << (max(length, PAGE_SIZE) - 1).bit_length()


def plan_chunks(num_tokens, chunk_size, *, start=0, prefix_step=None):
    """The chunks in which to prefill num_tokens new tokens that follow start cached ones, and
    the shapes to compile them at.

    Args:
      num_tokens: int >= 0, the new tokens (a prompt; a turn's new tokens).
      chunk_size: int >= 1, the most tokens per chunk.
      start: int >= 0, the position of the first new token: the tokens already in the cache
        (0 for a new prompt, the conversation so far for a later turn).
      prefix_step: None, or a positive multiple of 64: the prefix buckets past it are its
        multiples instead of powers of two, so that a long prefix pads by less than
        prefix_step tokens.

    Returns:
      A list of Chunk(position, length, padded_length, max_prefix_tokens), in order: chunk k
      holds the tokens at positions [position, position + length); its prefix (the tokens it
      attends to in the cache) is position tokens long. The chunks cover [start, start +
      num_tokens) exactly, without overlap; each has chunk_size tokens but the last, which has
      1 to chunk_size. No chunk for num_tokens = 0.
      padded_length: the tokens to pad the chunk to: chunk_size when there are several chunks,
        else the smallest power of two >= max(num_tokens, 64), at most chunk_size.
      max_prefix_tokens: the prefix's bucket, mla_prefill's and extend's static argument: 0
        for no prefix, else the smallest power of two >= max(position, 64), or past
        prefix_step the smallest multiple of prefix_step >= position.
      A loop so compiles a logarithm of the longest lengths' shapes.
    """
    for name, value, least in (("num_tokens", num_tokens, 0), ("chunk_size", chunk_size, 1),
                               ("start", start, 0)):
        _check_int("plan_chunks", name, value, least)
    if prefix_step is not None:
        _check_int("plan_chunks", "prefix_step", prefix_step, 1)
        if prefix_step % PAGE_SIZE:
            raise ValueError(f"plan_chunks: prefix_step must be a multiple of {PAGE_SIZE} (a "
                             f"prefix bucket is whole pages); got {prefix_step!r}")
        prefix_step = int(prefix_step)
    num_tokens, chunk_size, start = int(num_tokens), int(chunk_size), int(start)
    if num_tokens > chunk_size:
        padded = chunk_size
    else:
        padded = min(_power_of_two_bucket(num_tokens), chunk_size)

    def prefix_bucket(position):
        size = _power_of_two_bucket(position)
        if prefix_step is not None and size > prefix_step:
            size = -(-position // prefix_step) * prefix_step
        return size

    end = start + num_tokens
    return [Chunk(p, min(chunk_size, end - p), padded, prefix_bucket(p))
            for p in range(start, end, chunk_size)]
