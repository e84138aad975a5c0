"""Merging partial attention results over disjoint key sets by their LSEs: the context-parallel
decode's parts, and the prefill's parts over a prefix."""
import jax
import jax.numpy as jnp


def merge_weights(lses):
    """Normalised weight of each part, (n, b, h, s), and the merged LSE, (b, h, s). A NaN lse
    of any part gives that query a NaN weight (so a NaN out) and a NaN merged lse: a part's
    NaN is never weighted away as a part that saw no key."""
    poisoned = jnp.any(jnp.isnan(lses), axis=0)
    lses = jnp.where(jnp.isposinf(lses), -jnp.inf, lses.astype(jnp.float32))
    top = jnp.max(lses, axis=0)
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    weights = jnp.exp(lses - top)  # exactly 0 for parts that saw no key
    total = jnp.sum(weights, axis=0)
    seen = total > 0
    safe_total = jnp.where(seen, total, 1.0)
    lse = jnp.where(seen, top + jnp.log(safe_total), jnp.inf)
    return weights / safe_total, jnp.where(poisoned, jnp.nan, lse)


def merge_attention_states(outs, lses):
    """Merges partial attention results over disjoint key sets.

    Args:
      outs: (n, batch, s_q, h_q, dv), each normalised over its own keys (any float dtype).
      lses: (n, batch, h_q, s_q) float32 natural-log sums of exp(scores); +inf (FlashMLA's
        mark for no key) or -inf means that part saw no key and contributes nothing.

    Returns:
      (out (batch, s_q, h_q, dv) in outs' dtype, lse (batch, h_q, s_q) float32); a query no
      part saw gets out 0 and lse +inf; one with a NaN lse or out in any part gets a NaN out,
      and with a NaN lse a NaN lse.
    """
    weights, lse = merge_weights(lses)
    out = jnp.einsum("nbhs,nbshd->bshd", weights, outs.astype(jnp.float32),
                     precision=jax.lax.Precision.HIGHEST)
    return out.astype(outs.dtype), lse
