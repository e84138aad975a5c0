"""Opt-in checks of the values a scheduler computes, for debugging a serving loop.

Shapes and dtypes are checked at trace time, always. Values live on the device: with
`value_checks()` on while a step is traced, mla_decode, get_mla_metadata, write_kv and the
sparse indexer_decode and indexer_prefill add `jax.experimental.checkify` checks that name the
argument, the request and the value:

  - seq_lens outside [0, max_pages * 64] (the indexer's: negative seq_lens);
  - block-table entries outside [0, num_pages) among the pages a request reads;
  - a metadata made for other seq_lens (another step's), or whose schedule is not the one
    get_mla_metadata makes for its lengths;
  - an FP8 scale that is not positive and finite;
  - indexer_prefill's cu_seqlens not non-decreasing from 0 to at most its tokens.

jit traces a function at its first call (of each shape), not where it is wrapped: call the
step inside the block, or it is traced without the checks and its error never set.

    with jf.value_checks():
        checked_step = jax.jit(checkify.checkify(step))
        err, result = checked_step(*args)  # traced here, inside the block
    err.throw()

A bad value is decoded as with the checks off: a request whose length or block-table entries
are bad as an empty request (out 0, lse +inf), one whose length is not its metadata's as NaN
(mla_decode); the indexer's rows of a negative length, or outside their request's span in
cu_seqlens, see no token (every slot -1). On, each decode also runs on a schedule made anew
for its metadata's lengths, so that no schedule reaches a kernel while its error is on its
way, whatever its fields; it adds a few reductions over seq_lens and its block table and
computes the schedule again: on an H200 a checked 61-layer step at b=128 (s_k 1024) took
1.5-1.9x the unchecked one, a 53-layer one at s_k=4096 1.3-1.4x, the error thrown after each
step (benchmarks/bench_step.py --value-checks).
"""
import contextlib
import contextvars

import jax.numpy as jnp
from jax.experimental import checkify

from jax_flashmla.base.validation import PAGE_SIZE

_ENABLED = contextvars.ContextVar("jax_flashmla_value_checks", default=False)


@contextlib.contextmanager
def value_checks(enabled=True):
    """Adds the value checks to what is traced inside the block: checkify errors that name the
    argument, the request and the value (the module's doc lists them). Trace the step inside
    the block, checkified: jit traces at the first call (of each shape), so that call belongs
    inside the block; a later call of the same shapes runs the checked trace anywhere. Throw
    its error after each call:

        from jax.experimental import checkify

        with jax_flashmla.value_checks():
            checked_step = jax.jit(checkify.checkify(step))
            err, result = checked_step(*args)  # traced here, inside the block
        err.throw()
    """
    token = _ENABLED.set(bool(enabled))
    try:
        yield
    finally:
        _ENABLED.reset(token)


def enabled():
    return _ENABLED.get()


def _first(bad):
    """Index of the first True of a boolean vector (0 when none)."""
    return jnp.argmax(bad.reshape(-1))


def lengths(where, seq_lens, max_pages=None):
    """seq_lens in [0, max_pages * 64], or >= 0 without max_pages."""
    if max_pages is None:
        bad, bound = seq_lens < 0, "negative"
    else:
        capacity = max_pages * PAGE_SIZE
        bad = (seq_lens < 0) | (seq_lens > capacity)
        bound = f"outside [0, max_pages * 64 = {capacity}]"
    i = _first(bad)
    checkify.check(~jnp.any(bad), f"{where}: seq_lens[{{i}}] = {{value}} is {bound}", i=i,
                   value=seq_lens.reshape(-1)[i])


def bad_entries(block_table, seq_lens, num_pages):
    """(batch, max_pages): entries outside [0, num_pages) among those each request reads
    (ceil(seq_lens / 64) of them)."""
    pages_read = (seq_lens[:, None] + PAGE_SIZE - 1) // PAGE_SIZE
    used = jnp.arange(block_table.shape[1])[None, :] < pages_read
    return used & ((block_table < 0) | (block_table >= num_pages))


def bad_requests(block_table, seq_lens, num_pages):
    """(batch,): the requests with a length outside [0, max_pages * 64] or a page they read
    outside the cache."""
    capacity = block_table.shape[1] * PAGE_SIZE
    return ((seq_lens < 0) | (seq_lens > capacity)
            | jnp.any(bad_entries(block_table, jnp.clip(seq_lens, 0, capacity), num_pages),
                      axis=1))


def block_table_entries(where, block_table, seq_lens, num_pages):
    bad = bad_entries(block_table, seq_lens, num_pages)
    flat = _first(bad)
    row, col = flat // block_table.shape[1], flat % block_table.shape[1]
    checkify.check(~jnp.any(bad), f"{where}: block_table[{{row}}, {{col}}] = {{value}} is not a "
                   f"page of the cache (num_pages = {num_pages}), and request {{row}} reads it",
                   row=row, col=col, value=block_table.reshape(-1)[flat])


def scale(where, name, value):
    value = jnp.asarray(value).reshape(())
    checkify.check((value > 0) & jnp.isfinite(value),
                   f"{where}: {name} = {{value}} must be positive and finite", value=value)


def metadata_lengths(where, carried, seq_lens):
    """The decode's seq_lens are the metadata's, but where the metadata made a request empty."""
    stale = (seq_lens != carried) & (carried != 0)
    i = _first(stale)
    checkify.check(~jnp.any(stale), f"{where}: seq_lens[{{i}}] = {{value}}, but the metadata was "
                   "made for {carried} (get_mla_metadata of another step?)", i=i,
                   value=seq_lens[i], carried=carried[i])


def metadata_matches(where, given, expected, names):
    """given and expected: the metadata's arrays and what get_mla_metadata makes for its
    lengths."""
    for name, a, b in zip(names, given, expected):
        checkify.check(jnp.array_equal(a, b), f"{where}: metadata.{name} is not what "
                       "get_mla_metadata makes for the metadata's seq_lens")


def cu_seqlens(where, cu_seqlens, tokens):
    """cu_seqlens (batch + 1,) non-decreasing from 0 to at most the query's tokens."""
    lower = jnp.concatenate([jnp.zeros((1,), jnp.int32), cu_seqlens[:-1]])
    first = jnp.arange(cu_seqlens.shape[0]) == 0
    bad = (cu_seqlens < lower) | (cu_seqlens > tokens) | (first & (cu_seqlens != 0))
    i = _first(bad)
    checkify.check(~jnp.any(bad), f"{where}: cu_seqlens[{{i}}] = {{value}}; cu_seqlens must be "
                   f"non-decreasing from 0 to at most the query's {tokens} tokens", i=i,
                   value=cu_seqlens[i])
