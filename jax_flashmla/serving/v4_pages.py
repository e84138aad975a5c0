"""The tables of DeepSeek-V4 layer caches (jax_flashmla.caches.v4_layer.V4LayerCache) of a
batch of decode rows, their pages from one PageAllocator.

Each request in a row holds, under allocator ids of its own:
  - (request, "window"): its window ring, ring_pages pages from the moment it joins (a ring
    of 64 * ring_pages >= sliding_window slots, overwritten as it goes);
  - (request, ratio) for each compressor ratio (CSA's, HCA's): the pages of its compressed
    entries, one entry per `ratio` tokens, 64 a page, grown as its tokens complete entries.
    A CSA layer's index keys sit in its own index-key pages at the same page numbers.
Every layer holds its own arrays (window, compressed, index_keys) of the allocator's
num_pages pages, so one page number serves all layers of a kind, as one block table serves
all the layers of a paged MLA model. window_table and compressed_tables are the rows' tables
(-1 where a row holds no page) for the caches' window_table and compressed_table.
"""
import numpy as np

from jax_flashmla.base.validation import PAGE_SIZE
from jax_flashmla.serving.block_table import pages_for_tokens

WINDOW = "window"


class V4PageTables:
    """The window and entry pages of the requests in a batch's rows (module doc).

    Args:
      allocator: the PageAllocator the pages come from (other requests may use it too).
      batch_size: the decode rows.
      sliding_window: the layers' window (V4Config.sliding_window).
      ratios: the compressor ratios of the layers (e.g. {csa_ratio, hca_ratio}; none for a
        model of sliding layers only).
      max_tokens: the most tokens a request will hold, which sizes the entry tables.
    """

    def __init__(self, allocator, batch_size, sliding_window, ratios, max_tokens):
        for name, value in (("batch_size", batch_size), ("sliding_window", sliding_window),
                            ("max_tokens", max_tokens)):
            if not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"V4PageTables: {name} must be a positive int; got {value!r}")
        ratios = sorted(set(ratios))
        if any(not isinstance(r, (int, np.integer)) or r < 1 for r in ratios):
            raise ValueError(f"V4PageTables: ratios must be positive ints; got {ratios!r}")
        self.allocator = allocator
        self.ring_pages = pages_for_tokens(sliding_window, PAGE_SIZE)
        self.max_tokens = int(max_tokens)
        self.window_table = np.full((batch_size, self.ring_pages), -1, np.int32)
        # At least a page a row: a table of width 0 would hold no entry slot at all.
        self.compressed_tables = {
            r: np.full((batch_size, max(1, pages_for_tokens(max_tokens // r, PAGE_SIZE))), -1,
                       np.int32) for r in ratios}
        self._rows = {}  # request -> its row

    @staticmethod
    def request_pages(sliding_window, ratios, num_tokens):
        """The pages a request of num_tokens tokens holds (pages_for) in tables of this window
        and these compressor ratios, before any V4PageTables exists: to size a pool."""
        return (pages_for_tokens(sliding_window, PAGE_SIZE)
                + sum(pages_for_tokens(num_tokens // r, PAGE_SIZE) for r in set(ratios)))

    def pages_for(self, num_tokens):
        """The pages a request of num_tokens tokens holds: its ring and its entries'."""
        return self.request_pages(self.ring_pages * PAGE_SIZE, self.compressed_tables,
                                  num_tokens)

    def held(self, request):
        """The pages the request holds now."""
        return sum(len(self.allocator.pages((request, kind))) for kind in self._kinds())

    def admit(self, request, row):
        """A request joins batch row `row` (free): its ring's pages are allocated and its row
        of the tables set (no entries yet). All or nothing."""
        if request in self._rows:
            raise ValueError(f"V4PageTables.admit: request {request!r} is already admitted")
        if row in self._rows.values() or not 0 <= row < len(self.window_table):
            raise ValueError(f"V4PageTables.admit: row must be a free row in [0, "
                             f"{len(self.window_table)}); got {row!r}")
        self.window_table[row] = self.allocator.admit((request, WINDOW),
                                                      self.ring_pages * PAGE_SIZE)
        for r, table in self.compressed_tables.items():
            self.allocator.admit((request, r), 0)
            table[row] = -1
        self._rows[request] = row

    def grow(self, request, num_tokens):
        """The request now holds num_tokens tokens: pages for the entries they complete are
        allocated and written into its row. Returns how many pages were added. All or
        nothing."""
        row = self._row("grow", request)
        if not isinstance(num_tokens, (int, np.integer)) or not 0 <= num_tokens <= self.max_tokens:
            raise ValueError(f"V4PageTables.grow: num_tokens must be an int in [0, "
                             f"{self.max_tokens}] (max_tokens); got {num_tokens!r}")
        needed = sum(pages_for_tokens(num_tokens // r, PAGE_SIZE)
                     - len(self.allocator.pages((request, r))) for r in self.compressed_tables)
        if needed > self.allocator.num_free:  # check first: grow each kind or none
            raise self.allocator.OutOfPagesError(
                f"V4PageTables.grow: {needed} pages needed, {self.allocator.num_free} free")
        added = 0
        for r, table in self.compressed_tables.items():
            added += len(self.allocator.grow((request, r), num_tokens // r))
            pages = self.allocator.pages((request, r))
            table[row, :len(pages)] = pages
        return added

    def finish(self, request):
        """The request leaves its row: its pages go back to the allocator, its row of the
        tables to -1. Returns how many pages were freed."""
        row = self._row("finish", request)
        freed = sum(self.allocator.finish((request, kind)) for kind in self._kinds())
        self.window_table[row] = -1
        for table in self.compressed_tables.values():
            table[row] = -1
        del self._rows[request]
        return freed

    def _kinds(self):
        return [WINDOW, *self.compressed_tables]

    def _row(self, where, request):
        if request not in self._rows:
            raise ValueError(f"V4PageTables.{where}: unknown request {request!r}")
        return self._rows[request]
