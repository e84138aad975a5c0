"""What one DeepSeek-V4 attention layer keeps of a batch of requests between calls.

A V4 layer reads, for a query at position p, its sliding window (the tokens at positions
p - W + 1 .. p, W the config's sliding_window) and, in HCA and CSA layers, its request's
compressed entries (one a window of r tokens, jax_flashmla.ops.compressor). Both sit in
FlashMLA's MODEL1 FP8 pages (V4KVCache):
  - the window is a ring: each request owns ring_pages pages, R = 64 * ring_pages >= W slots,
    and the token at position t lives in ring slot t % R, page window_table[b, (t % R) // 64],
    offset t % 64. A new token overwrites the one R positions before it, which no later query
    reads (R >= W). The ring holds a request's last R tokens, whatever its length.
  - compressed entry e of request b lives at token_slots(compressed_table, e): the table lists
    the request's pages in entry order, as a paged KV cache's block table lists a request's
    tokens; the request can hold 64 * max_pages entries.
  - the compressor's unfinished window (and CSA's overlap) in a CompressorState.
  - CSA only, the lightning indexer's: its keys of the entries, 128 FP8 dims each, in an
    IndexKeyCache with as many pages as the compressed cache, entry e at the same slot as in
    `compressed` (one table, compressed_table, names both: the indexer's selections are then
    slots of the compressed cache as they come), and its own compressor's CompressorState.
num_tokens counts the tokens each request has fed in, so it is also the position of its next
token. A pytree: it passes through jit, scan and donation.

A server batching requests of different lengths keeps one V4LayerCache of its decode rows a
layer: a request joining a row starts it afresh (with_new_request), a chunk of one request's
prompt runs on its row alone (batch_row, then with_batch_row puts the row and the pages it
wrote back), and the tables list the pages its allocator gave each request
(jax_flashmla.serving.V4PageTables).
"""
import dataclasses
import functools

import jax
import jax.numpy as jnp

from jax_flashmla.base.validation import PAGE_SIZE
from jax_flashmla.caches.compressor_state import CompressorState
from jax_flashmla.caches.index_keys import IndexKeyCache
from jax_flashmla.caches.paged import token_slots
from jax_flashmla.caches.v4 import V4KVCache

FIELDS = ["window", "window_table", "num_tokens", "compressed", "compressed_table",
          "compressor", "index_keys", "index_compressor"]
# The fields a batch row of which is one request's; the others are pages, shared by the rows.
ROW_FIELDS = ["window_table", "num_tokens", "compressed_table", "compressor", "index_compressor"]
# The row fields that a request that has fed in nothing holds zeros in (initial_state's).
STATE_FIELDS = ["num_tokens", "compressor", "index_compressor"]


@functools.partial(jax.tree_util.register_dataclass, data_fields=FIELDS, meta_fields=[])
@dataclasses.dataclass(frozen=True)
class V4LayerCache:
    """A batch of requests' cache of one V4 attention layer (module doc).

    Attributes:
      window: V4KVCache holding the rings.
      window_table: (batch, ring_pages) int32, each request's ring pages.
      num_tokens: (batch,) int32, the tokens each request has fed in.
      compressed: V4KVCache of the compressed entries; None in a sliding layer.
      compressed_table: (batch, max_pages) int32, each request's entry pages; None in a
        sliding layer.
      compressor: CompressorState of the layer's compressor; None in a sliding layer.
      index_keys: IndexKeyCache of the indexer's keys, paged as `compressed` (module doc);
        None outside a CSA layer.
      index_compressor: CompressorState of the indexer's compressor; None outside a CSA layer.
    """

    window: V4KVCache
    window_table: jax.Array
    num_tokens: jax.Array
    compressed: V4KVCache | None = None
    compressed_table: jax.Array | None = None
    compressor: CompressorState | None = None
    index_keys: IndexKeyCache | None = None
    index_compressor: CompressorState | None = None

    @property
    def ring_size(self):
        """R: the ring's slots a request (a multiple of 64)."""
        return self.window_table.shape[1] * PAGE_SIZE

    @property
    def entry_capacity(self):
        """The compressed entries a request's table can hold (0 in a sliding layer)."""
        return 0 if self.compressed_table is None else self.compressed_table.shape[1] * PAGE_SIZE

    def window_slots(self, positions):
        """int32 slots in `window` of token positions (batch, ...) int32: ring slot p % R of
        each request's pages; -1 for p < 0."""
        return token_slots(self.window_table,
                           jnp.where(positions < 0, -1, positions % self.ring_size))

    def entry_slots(self, entry_ids):
        """int32 slots in `compressed` (and `index_keys`) of entry indices (batch, ...) int32;
        -1 where an index is < 0 or past the request's table."""
        return token_slots(self.compressed_table, entry_ids)

    def batch_row(self, row):
        """The cache of batch row `row` (an int, or a traced int32 scalar) alone: a batch of
        one over the same pages."""
        return dataclasses.replace(self, **{
            name: jax.tree.map(lambda a: jax.lax.dynamic_slice_in_dim(a, row, 1, 0),
                               getattr(self, name)) for name in ROW_FIELDS})

    def with_batch_row(self, row, one):
        """This cache with batch row `row` replaced by `one`, a batch of one of batch_row's
        shapes, whose pages (window, compressed, index_keys) it takes: one request's call on
        its row alone, put back."""
        rows = {name: jax.tree.map(lambda a, b: jax.lax.dynamic_update_slice_in_dim(a, b, row, 0),
                                   getattr(self, name), getattr(one, name))
                for name in ROW_FIELDS}
        return dataclasses.replace(one, **rows)

    def with_new_request(self, row):
        """This cache with batch row `row` (an int, or a traced int32 scalar) as a new
        request's: nothing fed in (num_tokens 0, the compressors' states zero). Its pages keep
        what they hold: a request reads only the rows and entries it wrote."""
        fresh = {name: jax.tree.map(lambda a: a.at[row].set(0), getattr(self, name))
                 for name in STATE_FIELDS}
        return dataclasses.replace(self, **fresh)
