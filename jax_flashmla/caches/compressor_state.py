"""What DeepSeek-V4's KV compressors carry from one call to the next, a request a row.

A compressor of ratio r turns every r tokens of a request (a window) into one compressed
entry (jax_flashmla.ops.compressor). Between calls it keeps, as HF transformers'
DeepseekV4HCACache / DeepseekV4CSACache do:
  - the unfinished window: the kv and gate projections of the tokens after the last closed
    window, the gate without its position bias;
  - for CSA only, the overlap: the first half of the last closed window's projections (the
    half that the next entry pools), its gate with the position bias added;
  - how many tokens the request has fed in, so also its entry count (num_tokens // r) and how
    many of the unfinished window's slots hold tokens (num_tokens % r).
Fixed shapes, so a state passes through jit, scan and donation; a batch of requests is a batch
of rows.
"""
import dataclasses
import functools

import jax
import jax.numpy as jnp

FIELDS = ["window_kv", "window_gate", "overlap_kv", "overlap_gate", "num_tokens"]


@functools.partial(jax.tree_util.register_dataclass, data_fields=FIELDS, meta_fields=[])
@dataclasses.dataclass(frozen=True)
class CompressorState:
    """A batch of requests' compressor state.

    Attributes:
      window_kv: (batch, r, width) the projection dtype: slot i holds token r * entry_count + i
        of the request for i < num_tokens % r, zeros after. width is head_dim (HCA) or
        2 * head_dim (CSA: the two halves side by side, as HF projects them).
      window_gate: (batch, r, width), like window_kv, the gate projections without bias.
      overlap_kv: (batch, r, head_dim) the projection dtype: CSA's first half of the last
        closed window (zeros before the first); None for HCA.
      overlap_gate: (batch, r, head_dim): its gate plus the first half of the position bias, in
        their promoted dtype (float32 for HF's float32 bias); None for HCA.
      num_tokens: (batch,) int32, the tokens each request has fed in.
    """

    window_kv: jax.Array
    window_gate: jax.Array
    overlap_kv: jax.Array | None
    overlap_gate: jax.Array | None
    num_tokens: jax.Array

    @classmethod
    def create(cls, batch_size, ratio, head_dim, overlap, dtype, biased_gate_dtype=jnp.float32):
        """The state of batch_size requests that have fed in nothing: zeros. overlap: CSA
        (True) or HCA (False). dtype: the projections'; biased_gate_dtype: a gate's plus the
        position bias's."""
        # Every field its own buffer, so that the state can be donated.
        window = (batch_size, ratio, 2 * head_dim if overlap else head_dim)
        half = (batch_size, ratio, head_dim)
        return cls(
            window_kv=jnp.zeros(window, dtype),
            window_gate=jnp.zeros(window, dtype),
            overlap_kv=jnp.zeros(half, dtype) if overlap else None,
            overlap_gate=jnp.zeros(half, biased_gate_dtype) if overlap else None,
            num_tokens=jnp.zeros((batch_size,), jnp.int32))

    @property
    def ratio(self):
        return self.window_kv.shape[1]

    @property
    def entry_count(self):
        """(batch,) int32: the entries each request has completed."""
        return self.num_tokens // self.ratio
