"""Decode context parallelism (DCP): a request's KV tokens split over a mesh axis.

Each device holds its share of every request's tokens in its own paged cache, with its own
block table and lengths; it attends to them with the ordinary decode, and the partial results
are merged exactly through their LSEs. Two layouts decide which device holds token position p
of a request, for n devices along the axis:
  - "contiguous": device p // tokens_per_device, at local position p % tokens_per_device;
  - "round_robin": device p % n, at local position p // n.
"""
import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jax_flashmla.base import checks
from jax_flashmla.caches import paged
from jax_flashmla.ops.decode import mla_decode
from jax_flashmla.reference.merge import merge_attention_states, merge_weights

__all__ = ["dcp_mla_decode", "dcp_write_kv", "local_lengths", "merge_attention_states"]

LAYOUTS = ("contiguous", "round_robin")


def _check_layout(layout, tokens_per_device):
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}; got {layout!r}")
    if layout == "contiguous" and (tokens_per_device is None or tokens_per_device < 1):
        raise ValueError("layout='contiguous' needs tokens_per_device >= 1; got "
                         f"{tokens_per_device!r}")


def local_positions(positions, rank, num_devices, *, layout, tokens_per_device=None):
    """Local positions on device `rank` of global token positions; -1 where another device
    (or no device: negative positions) holds the token."""
    _check_layout(layout, tokens_per_device)
    positions = jnp.asarray(positions)
    if layout == "round_robin":
        mine = positions % num_devices == rank
        local = positions // num_devices
    else:
        mine = positions // tokens_per_device == rank
        local = positions % tokens_per_device
    return jnp.where(mine & (positions >= 0), local, -1).astype(jnp.int32)


def local_lengths(seq_lens, rank, num_devices, *, layout, tokens_per_device=None):
    """How many of each request's first seq_lens tokens device `rank` holds."""
    _check_layout(layout, tokens_per_device)
    seq_lens = jnp.asarray(seq_lens)
    if layout == "round_robin":
        return jnp.maximum((seq_lens - rank + num_devices - 1) // num_devices, 0).astype(jnp.int32)
    return jnp.clip(seq_lens - rank * tokens_per_device, 0, tokens_per_device).astype(jnp.int32)


def dcp_write_kv(kv_cache, block_tables, positions, *, mesh, axis, layout,
                 tokens_per_device=None, latent=None, rope=None, kv=None, scale=None):
    """Writes new tokens into a cache whose tokens are split over mesh axis `axis`.

    Args:
      kv_cache: (n * pages_per_device, 64, 1, 576), sharded along `axis` (each device's pages).
      block_tables: (n, batch, max_local_pages) int32 sharded along `axis`: each device's
        block table over its own pages.
      positions: (batch, t) int32 global positions of the new tokens (replicated).
      latent/rope or kv: (batch, t, 512)/(batch, t, 64) or (batch, t, 576), replicated.
      scale: with a float8_e4m3fn cache (and only then), its float32 scale (write_kv's).

    Returns:
      The cache, each token written on the one device that holds its position.
    """
    write = _sharded_write(mesh, axis, layout, tokens_per_device)
    return write(kv_cache, block_tables, positions, dict(latent=latent, rope=rope, kv=kv), scale)


@functools.lru_cache(maxsize=256)
def _sharded_write(mesh, axis, layout, tokens_per_device):
    """dcp_write_kv's shard_map, jitted once per mesh, axis and layout: called eagerly, a
    shard_map runs (and compiles) its body op by op on every call; jitted, it compiles once
    per shapes. Under an outer jit the inner one is inlined."""
    n = mesh.shape[axis]

    def write(local_cache, table, positions, rows, scale):
        rank = jax.lax.axis_index(axis)
        local = local_positions(positions, rank, n, layout=layout,
                                tokens_per_device=tokens_per_device)
        slots = paged.token_slots(table[0], local)
        return paged.write_kv(local_cache, slots, **rows, scale=scale)

    @jax.jit
    def sharded(kv_cache, block_tables, positions, rows, scale):
        replicated = jax.tree.map(lambda _: P(), (rows, scale))
        return jax.shard_map(write, mesh=mesh, in_specs=(P(axis), P(axis), P(), *replicated),
                             out_specs=P(axis))(kv_cache, block_tables, positions, rows, scale)

    return sharded


def dcp_mla_decode(q, kv_cache, block_tables, seq_lens, *, mesh, axis, head_axis=None,
                   scatter_heads=False, softmax_scale=None, causal=True,
                   implementation=None, k_scale=None):
    """MLA decode with each request's KV tokens split over mesh axis `axis`.

    Args:
      q: (batch, 1, h_q, 576): one query token per request (with s_q > 1 each device would
        need the global causal mask; pass causal=False for queries that see every key).
        Replicated along `axis`; may be split along its heads over `head_axis` (DCP x TP).
      kv_cache: (n * pages_per_device, 64, 1, 576) sharded along `axis`.
      block_tables: (n, batch, max_local_pages) int32, each device's table over its pages.
      seq_lens: (n, batch) int32, each device's local lengths (see local_lengths). A request
        out of range on any device (a local length past its table, or a page it reads
        outside that device's cache) is decoded empty, out 0 and lse +inf, as mla_decode
        decodes one on a single device.
      scatter_heads: return out with its heads split over `axis` (a reduce-scatter instead
        of an all-reduce), as a following head-parallel projection wants it.
      softmax_scale, causal, implementation: as in mla_decode.
      k_scale: with a float8_e4m3fn cache, its float32 scale (mla_decode's), replicated.

    Returns:
      (out (batch, 1, h_q, 512), lse (batch, h_q, 1)), merged over all devices of `axis`;
      out in mla_decode's dtype (q's, or bfloat16 with an FP8 cache).
    """
    if q.ndim != 4 or (q.shape[1] != 1 and causal):
        raise ValueError(f"dcp_mla_decode: q must be (batch, 1, h_q, 576) with causal=True "
                         f"(a global causal mask over split keys is not supported); got "
                         f"shape {tuple(q.shape)}")
    if scatter_heads:
        local_heads = q.shape[2] // (mesh.shape[head_axis] if head_axis else 1)
        if local_heads % mesh.shape[axis]:
            raise ValueError(f"dcp_mla_decode: scatter_heads splits each device's {local_heads} "
                             f"heads over the {mesh.shape[axis]} devices of axis {axis!r}, "
                             "which must divide them; pass scatter_heads=False or change the "
                             "mesh")
    heads_out = (head_axis, axis) if scatter_heads and head_axis else (
        axis if scatter_heads else head_axis)

    def local(q, kv, table, lens, k_scale):
        out, lse = mla_decode(q, kv, table[0], lens[0], softmax_scale=softmax_scale,
                              causal=causal, implementation=implementation, k_scale=k_scale)
        # Only the LSEs travel in full (they are small); outputs are summed once, weighted. A
        # request out of range here (decoded empty here) travels as lse -inf, which no decode
        # returns, so that every device weights all its parts 0.
        out_of_range = checks.bad_requests(table[0], lens[0], kv.shape[0])
        lses = jax.lax.all_gather(jnp.where(out_of_range[:, None, None], -jnp.inf, lse), axis)
        lses = jnp.where(jnp.any(jnp.isneginf(lses), axis=0), jnp.inf, lses)
        weights, merged_lse = merge_weights(lses)
        rank = jax.lax.axis_index(axis)
        part = out.astype(jnp.float32) * weights[rank].transpose(0, 2, 1)[..., None]
        if not scatter_heads:
            return jax.lax.psum(part, axis).astype(out.dtype), merged_lse
        merged = jax.lax.psum_scatter(part, axis, scatter_dimension=2, tiled=True)
        heads = merged.shape[2]
        return (merged.astype(out.dtype),
                jax.lax.dynamic_slice_in_dim(merged_lse, rank * heads, heads, axis=1))

    return jax.shard_map(local, mesh=mesh,
                         in_specs=(P(None, None, head_axis, None), P(axis), P(axis), P(axis),
                                   jax.tree.map(lambda _: P(), k_scale)),
                         out_specs=(P(None, None, heads_out, None), P(None, heads_out, None)),
                         check_vma=False)(q, kv_cache, block_tables, seq_lens, k_scale)
