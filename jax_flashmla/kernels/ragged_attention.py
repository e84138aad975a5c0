"""Flash attention over a ragged batch: requests as segments of one query axis and one key axis.

mla_prefill's building block. Segment r of the queries attends to segment r of the keys,
without a mask or causally (when queries and keys are the same rows: key j <= query i).
Two cores, one contract:
  - "cudnn": cuDNN's flash attention through jax's wrapper of it (private: cudnn_wrapper). One
    request is its plain layout, with padding masks unless it holds every row; several are its
    packed layout (one batch row, segments at offsets).
  - "xla": an online softmax in pure JAX over KEY_BLOCK keys at a time, in float32; for
    machines without cuDNN, and the reference the cuDNN core is tested against.
Neither holds a (queries x keys) array.
"""
import importlib
import math
import re
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jax_flashmla.reference.merge import merge_weights

# The jax releases, (major, minor) from the first up to the one past the last, whose private
# cuDNN wrapper the "cudnn" core is tested with: the floor of pyproject.toml (.ci/floor.sh) to
# the newest tested, 0.11. jax.nn.dot_product_attention, the public face of the same kernel,
# takes no offsets: it has no packed layout for several requests.
CUDNN_JAX_VERSIONS = ((0, 10), (0, 12))

# Keys per step of the pure-JAX core: its scores are (heads, queries, KEY_BLOCK). A page, so
# that prefixes that start on a page see their keys in the same blocks wherever they lie.
KEY_BLOCK = 64


class Segments(NamedTuple):
    """Where each request's rows lie on an axis: rows [starts[r], starts[r] + lens[r]).

    starts is non-decreasing and segments do not overlap (see ordered); lens[r] = 0 is an
    empty request.
    """
    starts: jax.Array  # (batch,) int32
    lens: jax.Array  # (batch,) int32


def ordered(starts, lens):
    """Segments with each empty request's start moved to the end of the rows before it, so
    that starts is non-decreasing. The non-empty ones must already be in order, apart."""
    ends = jnp.where(lens > 0, starts + lens, 0)
    before = jnp.concatenate([jnp.zeros((1,), ends.dtype), jax.lax.cummax(ends)[:-1]])
    return Segments(jnp.where(lens > 0, starts, before).astype(jnp.int32),
                    lens.astype(jnp.int32))


def owners(segments, size, first=0):
    """(owner, local), (size,) int32 each, for rows [first, first + size) of the axis: the
    request whose segment holds the row (-1 for none) and the row's index in it (0 for none)."""
    rows = first + jnp.arange(size, dtype=jnp.int32)
    owner = jnp.searchsorted(segments.starts, rows, side="right").astype(jnp.int32) - 1
    safe = jnp.maximum(owner, 0)
    local = rows - segments.starts[safe]
    held = (owner >= 0) & (local < segments.lens[safe])
    return jnp.where(held, owner, -1), jnp.where(held, local, 0)


def clip(segments, first, size):
    """The segments' parts within rows [first, first + size), relative to `first`."""
    ends = segments.starts + segments.lens
    lo = jnp.clip(segments.starts - first, 0, size)
    hi = jnp.clip(ends - first, 0, size)
    return Segments(lo, jnp.maximum(hi - lo, 0))


# -- the cores: q (t, h, d) over k (s, h, d), v (s, h, dv) -> out (t, h, dv), lse (h, t) ---------
# Rows of no request, and requests without keys, get out 0 and lse +inf (FlashMLA's empty
# query). Key rows outside every segment must be finite: both cores multiply their values by
# a weight of 0, and 0 * NaN is NaN.

def cudnn_wrapper():
    """jax's cuDNN flash attention module (jax._src.cudnn.fused_attention_stablehlo). Raises
    a RuntimeError naming the supported jax versions where this jax is outside
    CUDNN_JAX_VERSIONS or the module does not import."""
    (first, end), version = CUDNN_JAX_VERSIONS, jax.__version__
    supported = f"jax >= {first[0]}.{first[1]}, < {end[0]}.{end[1]}"
    found = re.match(r"(\d+)\.(\d+)", version)
    if found is None or not first <= (int(found[1]), int(found[2])) < end:
        raise RuntimeError(f"cuDNN's flash attention (implementation='custom_call') calls jax's "
                           f"private cuDNN wrapper, tested with {supported}; this is jax "
                           f"{version}: pass implementation='reference'")
    try:
        return importlib.import_module("jax._src.cudnn.fused_attention_stablehlo")
    except ImportError as e:
        raise RuntimeError(f"cuDNN's flash attention (implementation='custom_call') calls jax's "
                           f"private cuDNN wrapper, which jax {version} failed to import ({e}); "
                           f"it is tested with {supported}: pass implementation='reference'"
                           ) from e


def cudnn_attention(q, k, v, q_segments, kv_segments, *, causal, scale):
    fa = cudnn_wrapper()
    mask = fa.MaskType.PADDING_CAUSAL if causal else fa.MaskType.PADDING
    t, dv = q.shape[0], v.shape[-1]
    if q_segments.lens.shape[0] == 1:
        # One request, its rows from row 0 of both axes (mla_prefill moves them there). cuDNN
        # needs a query and a key: an empty request is computed on one and cleared below.
        def padded(q, k, v):
            return fa.dot_product_attention(
                q, k, v, q_seqlen=jnp.maximum(q_segments.lens, 1),
                kv_seqlen=jnp.maximum(kv_segments.lens, 1), scale=scale, mask_type=mask,
                qkv_layout="BTNH", return_residual=True)

        def whole(q, k, v):
            return fa.dot_product_attention(
                q, k, v, scale=scale, qkv_layout="BTNH", return_residual=True,
                mask_type=fa.MaskType.CAUSAL if causal else fa.MaskType.NO_MASK)

        # cuDNN's padding masks slow a call even where they hide nothing (docs/design.md), so a
        # request that holds every row (a full chunk, a whole prefix slice) goes without them.
        every_row = (q_segments.lens[0] == t) & (kv_segments.lens[0] == k.shape[0])
        out, stats = jax.lax.cond(every_row, whole, padded, q[None], k[None], v[None])
        return clear(out[0], stats[0].astype(jnp.float32), q_segments, kv_segments)
    # The packed layout. jax's wrapper scales every offset by q's heads * head dim, v's and
    # out's too: v is padded to q's head dim so that its rows have that stride.
    v = jnp.pad(v, ((0, 0), (0, 0), (0, q.shape[-1] - dv)))
    offsets = lambda seg, size: jnp.concatenate(  # noqa: E731 - -1 closes the list
        [jnp.clip(seg.starts, 0, size - 1), jnp.full((1,), -1, jnp.int32)])[None]
    out, stats = fa.dot_product_attention(
        q[None], k[None], v[None], q_seqlen=q_segments.lens[None],
        kv_seqlen=kv_segments.lens[None], q_offsets=offsets(q_segments, t),
        kv_offsets=offsets(kv_segments, k.shape[0]), scale=scale, mask_type=mask,
        qkv_layout="BTNH", return_residual=True)
    # The softmax statistics are (requests, heads, t): request r's query i at [r, :, i].
    owner, local = owners(q_segments, t)
    lse = stats[jnp.maximum(owner, 0), :, local].T.astype(jnp.float32)
    return clear(out[0, ..., :dv], lse, q_segments, kv_segments)


def xla_attention(q, k, v, q_segments, kv_segments, *, causal, scale):
    t, h, _ = q.shape
    s = k.shape[0]
    blocks = max(1, math.ceil(s / KEY_BLOCK))
    pad = blocks * KEY_BLOCK - s
    k = jnp.pad(k, ((0, pad), (0, 0), (0, 0))).reshape(blocks, KEY_BLOCK, h, -1)
    v = jnp.pad(v, ((0, pad), (0, 0), (0, 0))).reshape(blocks, KEY_BLOCK, h, -1)
    q_owner, _ = owners(q_segments, t)
    k_owner = jnp.pad(owners(kv_segments, s)[0], (0, pad), constant_values=-1)
    q32 = q.astype(jnp.float32)
    query_row = jnp.arange(t, dtype=jnp.int32)

    def step(carry, block):
        top, total, acc = carry
        index, k_blk, v_blk = block
        key_row = index * KEY_BLOCK + jnp.arange(KEY_BLOCK, dtype=jnp.int32)
        visible = (k_owner[key_row][None, :] == q_owner[:, None]) & (q_owner[:, None] >= 0)
        if causal:
            visible = visible & (key_row[None, :] <= query_row[:, None])
        scores = jnp.einsum("thd,shd->hts", q32, k_blk.astype(jnp.float32),
                            precision=jax.lax.Precision.HIGHEST) * scale
        scores = jnp.where(visible[None], scores, -jnp.inf)
        new_top = jnp.maximum(top, jnp.max(scores, axis=-1))
        shift = jnp.where(jnp.isfinite(new_top), new_top, 0.0)
        weights = jnp.exp(scores - shift[..., None])
        rescale = jnp.exp(jnp.where(jnp.isfinite(top), top, shift) - shift)
        total = total * rescale + jnp.sum(weights, axis=-1)
        acc = acc * rescale[..., None] + jnp.einsum(
            "hts,shd->htd", weights, v_blk.astype(jnp.float32),
            precision=jax.lax.Precision.HIGHEST)
        return (new_top, total, acc), None

    init = (jnp.full((h, t), -jnp.inf, jnp.float32), jnp.zeros((h, t), jnp.float32),
            jnp.zeros((h, t, v.shape[-1]), jnp.float32))
    (top, total, acc), _ = jax.lax.scan(step, init, (jnp.arange(blocks, dtype=jnp.int32), k, v))
    seen = total > 0
    out = acc / jnp.where(seen, total, 1.0)[..., None]
    lse = top + jnp.log(jnp.where(seen, total, 1.0))
    return clear(out.transpose(1, 0, 2).astype(q.dtype), lse, q_segments, kv_segments)


def clear(out, lse, q_segments, kv_segments):
    """out 0 and lse +inf for rows of no request and requests without keys."""
    owner, _ = owners(q_segments, out.shape[0])
    live = (owner >= 0) & (kv_segments.lens[jnp.maximum(owner, 0)] > 0)  # (t,)
    out = jnp.where(live[:, None, None], out, jnp.zeros((), out.dtype))
    lse = jnp.where(live[None, :] & ~jnp.isneginf(lse), lse, jnp.inf)
    return out, lse


CORES = {"cudnn": cudnn_attention, "xla": xla_attention}


def merge(outs, lses):
    """Parts of each query's keys merged through their LSEs (merge_attention_states' rule),
    elementwise so that it fuses into one pass over the parts: outs [(t, h, d)], lses [(h, t)]
    -> out (t, h, d) float32, lse (h, t)."""
    weights, lse = merge_weights(jnp.stack(lses))
    weights = weights.transpose(0, 2, 1)[..., None]  # (parts, t, h, 1)
    out = sum(w * o.astype(jnp.float32) for w, o in zip(weights, outs))
    return out, lse
