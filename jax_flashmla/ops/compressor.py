"""DeepSeek-V4's KV compressors in JAX: HCA's, CSA's and the CSA indexer's own.

As HF transformers' DeepseekV4HCACompressor / DeepseekV4CSACompressor (and the compressor
inside DeepseekV4Indexer) with their cache layers. A compressor of ratio r (CSA 4, HCA 128)
cuts a request's tokens into windows of r; window j's tokens are positions [r j, r j + r).
  - kv = x @ kv_proj.T, gate = x @ gate_proj.T, in x's dtype (float32 at float32's precision,
    as torch's matmuls: XLA's default on a GPU would take TF32 passes); HCA projects to head_dim,
    CSA to 2 * head_dim: a first half (its share of the next entry) and a second half (its
    share of its own window's entry);
  - HCA's entry j pools window j's r tokens: sum over slots of kv * softmax(gate + bias),
    bias the position bias (r, head_dim), a weight per slot and dim;
  - CSA's entry j pools 2r slots: the first halves of window j - 1 (with the first half of
    the bias), then the second halves of window j (with the second half). Entry 0 has no
    window before it: those r slots get weight 0;
  - the pooled row goes through RMSNorm (float32, eps, weight kv_norm), then interleaved RoPE
    on its trailing 2 * len(inv_freq) dims at position r j (the window's start).
The softmax runs in float32 and its weights are cast back to x's dtype before the product,
as HF does. A query at position p may read entries j < (p + 1) // r (visible_entries).
Entry indices come from the state's token count, not from position ids: a request's tokens
sit at positions 0, 1, ... in the order fed in. A batch row given to a new request starts from
initial_state's rows (the state cannot be rewound).
"""
import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jax_flashmla.caches.compressor_state import CompressorState

HIGHEST = jax.lax.Precision.HIGHEST

# The weights' fields -> their names under HF's compressor module (e.g.
# "model.layers.<i>.self_attn.compressor." or "...compressor.indexer.").
HF_NAMES = {"kv_proj": "kv_proj.weight", "gate_proj": "gate_proj.weight",
            "position_bias": "position_bias", "kv_norm": "kv_norm.weight"}


@functools.partial(jax.tree_util.register_dataclass, data_fields=list(HF_NAMES),
                   meta_fields=["eps"])
@dataclasses.dataclass(frozen=True)
class CompressorWeights:
    """One compressor's weights in HF's layout: kv_proj and gate_proj (width, hidden),
    position_bias (r, width) (float32 in HF), kv_norm (head_dim,) (float32 in HF); width is
    head_dim (HCA) or 2 * head_dim (CSA, the indexer's compressor). eps: the RMSNorm's
    (HF's config.rms_norm_eps)."""

    kv_proj: jax.Array
    gate_proj: jax.Array
    position_bias: jax.Array
    kv_norm: jax.Array
    eps: float

    @classmethod
    def from_state_dict(cls, state_dict, eps, prefix=""):
        """From arrays (NumPy or JAX) under HF's names, each prefix + HF_NAMES[field]; other
        names (the indexer's query weights) are left alone."""
        return cls(**{field: jnp.asarray(state_dict[prefix + name])
                      for field, name in HF_NAMES.items()}, eps=float(eps))

    @property
    def ratio(self):
        return self.position_bias.shape[0]

    @property
    def head_dim(self):
        return self.kv_norm.shape[0]

    @property
    def overlap(self):
        """CSA (two halves, overlapping windows) rather than HCA."""
        return self.kv_proj.shape[0] == 2 * self.head_dim


class CompressedEntries(NamedTuple):
    """The entries a call completed, a row a request, in entry order.

    entries: (batch, max_entries, head_dim) in x's dtype, RMS-normed and roped; zeros where
      entry_ids is -1.
    entry_ids: (batch, max_entries) int32, each entry's index in its request (its window's
      start is ratio * index), or -1 for no entry. A request's valid ids come first and are
      consecutive."""

    entries: jax.Array
    entry_ids: jax.Array


def max_entries(ratio, seq_len):
    """The most entries seq_len new tokens can complete: ratio - 1 may wait in the state."""
    return (ratio - 1 + seq_len) // ratio


def visible_entries(positions, ratio):
    """How many of its request's entries a query at each position may read: those whose
    window it has seen to the end, (position + 1) // ratio (HF's causal threshold)."""
    return (positions + 1) // ratio


def initial_state(weights, batch_size, dtype):
    """The state of batch_size new requests whose hidden states come in dtype."""
    proj_dtype = jnp.result_type(dtype, weights.kv_proj.dtype)
    return CompressorState.create(
        batch_size, weights.ratio, weights.head_dim, weights.overlap, proj_dtype,
        biased_gate_dtype=jnp.result_type(proj_dtype, weights.position_bias.dtype))


def compress(weights, state, x, lengths, inv_freq, attention_scaling=1.0):
    """Feeds a batch of requests' new tokens to a compressor (module doc).

    Args:
      weights: CompressorWeights (HCA, CSA or the indexer's).
      state: CompressorState of the batch (initial_state for new requests), its dtypes those
        of x's projections.
      x: (batch, seq_len, hidden) hidden states, seq_len >= 1; request b's new tokens are
        x[b, :lengths[b]], the rest padding (never read into an entry or the state).
      lengths: (batch,) int: each request's new tokens. A length outside [0, seq_len] counts
        as 0: that request completes no entry and its state stays as it was.
      inv_freq: (rope_dim // 2,) float32, the compress RoPE's frequencies (HF's
        compress_inv_freq); attention_scaling: the factor on its cos and sin (1.0 in V4).

    Returns:
      (CompressedEntries with max_entries(ratio, seq_len) rows a request, the new state of the
      same shapes and dtypes as state, so that it can be donated).
    """
    batch, seq_len, _ = x.shape
    if seq_len < 1:
        raise ValueError(f"compress: x must hold at least one token a request; got shape "
                         f"{tuple(x.shape)}")
    ratio, head_dim = weights.ratio, weights.head_dim
    kv = jnp.einsum("bsh,wh->bsw", x, weights.kv_proj, precision=HIGHEST)
    gate = jnp.einsum("bsh,wh->bsw", x, weights.gate_proj, precision=HIGHEST)
    _check_state(weights, state, batch, kv.dtype)
    lengths = jnp.asarray(lengths, jnp.int32)
    fed = jnp.where((lengths >= 0) & (lengths <= seq_len), lengths, 0)
    waiting = state.num_tokens % ratio  # tokens in the unfinished window
    completed = (waiting + fed) // ratio  # entries these tokens complete
    first_entry = state.num_tokens // ratio

    # A request's stream runs from its unfinished window's start: the waiting slots, then the
    # new tokens; stream position t is row t of [window | x] before the new tokens begin and
    # row t - waiting + ratio after.
    joined_kv = jnp.concatenate([state.window_kv, kv], axis=1)
    joined_gate = jnp.concatenate([state.window_gate, gate], axis=1)

    def stream(t):
        rows = jnp.where(t < waiting[:, None], t, t - waiting[:, None] + ratio)
        rows = jnp.clip(rows, 0, ratio + seq_len - 1)[..., None]
        return (jnp.take_along_axis(joined_kv, rows, axis=1),
                jnp.take_along_axis(joined_gate, rows, axis=1))

    num_windows = max_entries(ratio, seq_len)
    windows = jnp.broadcast_to(jnp.arange(num_windows * ratio), (batch, num_windows * ratio))
    win_kv, win_gate = stream(windows)
    win_kv = win_kv.reshape(batch, num_windows, ratio, -1)
    win_gate = win_gate.reshape(batch, num_windows, ratio, -1) + weights.position_bias
    entry_ids = first_entry[:, None] + jnp.arange(num_windows)

    if weights.overlap:
        # Entry j's first r slots: window j - 1's first halves, from this call or, for the
        # call's first window, from the state; entry 0 has none (weight 0, as HF's -inf).
        prev_kv = jnp.concatenate([state.overlap_kv[:, None], win_kv[:, :-1, :, :head_dim]], 1)
        prev_gate = jnp.concatenate([state.overlap_gate[:, None],
                                     win_gate[:, :-1, :, :head_dim]], 1)
        first = (entry_ids == 0)[..., None, None]
        prev_kv = jnp.where(first, jnp.zeros_like(prev_kv), prev_kv)
        prev_gate = jnp.where(first, jnp.full_like(prev_gate, -jnp.inf), prev_gate)
        slots_kv = jnp.concatenate([prev_kv, win_kv[..., head_dim:]], axis=2)
        slots_gate = jnp.concatenate([prev_gate, win_gate[..., head_dim:]], axis=2)
    else:
        slots_kv, slots_gate = win_kv, win_gate

    logits = slots_gate.astype(jnp.float32)
    exp = jnp.exp(logits - logits.max(axis=2, keepdims=True))
    softmax = (exp / exp.sum(axis=2, keepdims=True)).astype(kv.dtype)
    pooled = (slots_kv * softmax).sum(axis=2)
    entries = interleaved_rope(_rms_norm(pooled, weights.kv_norm, weights.eps),
                               entry_ids * ratio, inv_freq, attention_scaling)
    done = jnp.arange(num_windows)[None] < completed[:, None]
    entries = jnp.where(done[..., None], entries, jnp.zeros_like(entries))

    # The new unfinished window: stream positions from the last completed window's end.
    rest = completed[:, None] * ratio + jnp.arange(ratio)
    kept = (rest < (waiting + fed)[:, None])[..., None]
    rest_kv, rest_gate = stream(rest)
    overlap_kv, overlap_gate = state.overlap_kv, state.overlap_gate
    if weights.overlap:
        last = jnp.maximum(completed - 1, 0)[:, None, None, None]
        closed = (completed > 0)[:, None, None]
        last_kv = jnp.take_along_axis(win_kv, last, axis=1)[:, 0, :, :head_dim]
        last_gate = jnp.take_along_axis(win_gate, last, axis=1)[:, 0, :, :head_dim]
        overlap_kv = jnp.where(closed, last_kv, overlap_kv)
        overlap_gate = jnp.where(closed, last_gate, overlap_gate)
    new_state = CompressorState(
        window_kv=jnp.where(kept, rest_kv, jnp.zeros_like(rest_kv)),
        window_gate=jnp.where(kept, rest_gate, jnp.zeros_like(rest_gate)),
        overlap_kv=overlap_kv, overlap_gate=overlap_gate,
        num_tokens=state.num_tokens + fed)
    return CompressedEntries(entries, jnp.where(done, entry_ids, -1)), new_state


def _rms_norm(rows, weight, eps):
    """HF's DeepseekV4RMSNorm: in float32, times the weight, back to rows' dtype."""
    h = rows.astype(jnp.float32)
    h = h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + eps)
    return (weight * h).astype(rows.dtype)


def interleaved_rope(rows, positions, inv_freq, attention_scaling):
    """V4's interleaved RoPE on rows' trailing 2 * len(inv_freq) dims, pairs (x0, x1),
    (x2, x3), ...: cos and sin rounded to rows' dtype, the rotation in float32 (as HF)."""
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq.astype(jnp.float32)
    cos = (jnp.cos(freqs) * attention_scaling).astype(rows.dtype)
    sin = (jnp.sin(freqs) * attention_scaling).astype(rows.dtype)
    cos = jnp.repeat(cos, 2, axis=-1).astype(jnp.float32)
    sin = jnp.repeat(sin, 2, axis=-1).astype(jnp.float32)
    rope_dim = cos.shape[-1]
    rope = rows[..., -rope_dim:]
    pairs = rope.reshape(*rope.shape[:-1], rope_dim // 2, 2)
    turned = jnp.stack([-pairs[..., 1], pairs[..., 0]], axis=-1).reshape(rope.shape)
    rotated = (rope.astype(jnp.float32) * cos + turned.astype(jnp.float32) * sin)
    return jnp.concatenate([rows[..., :-rope_dim], rotated.astype(rows.dtype)], axis=-1)


def _check_state(weights, state, batch, proj_dtype):
    """ValueError unless state fits these weights, the batch and its projections' dtype (at
    trace time: shapes and dtypes only)."""
    need = jax.tree.map(_spec, jax.eval_shape(lambda: initial_state(weights, batch, proj_dtype)))
    got = jax.tree.map(_spec, state)
    if got != need:
        raise ValueError(f"compress: the state does not fit the weights and x: want {need}; "
                         f"got {got}")


def _spec(x):
    return (tuple(x.shape), jnp.dtype(x.dtype))
