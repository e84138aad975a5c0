"""Host-side page allocator for continuous batching over one PagedKVCache.

A scheduler admits a request (pages for its prompt), grows it a page at a time as it decodes,
and finishes it (its pages go back to the pool). Pages are plain ints in [0, num_pages); the
allocator never touches device memory, so it runs between jitted steps at Python speed.

Invariants (tests/test_allocator.py checks them under random admit/grow/finish sequences):
  - a page is either free or held by exactly one request (or by the caller of allocate), never
    both, never twice: free() refuses a page a request holds, which only finish() frees;
  - a request holds exactly ceil(num_tokens / page_size) pages, in token order;
  - a failed call (PageAllocator.OutOfPagesError, ValueError) changes nothing.
"""
import numpy as np

from jax_flashmla.base.validation import PAGE_SIZE
from jax_flashmla.serving.block_table import block_table_from_pages, pages_for_tokens


class PageAllocator:
    """Pages of a fixed pool, handed to requests.

    Freed pages are reused first (last freed, first reused), so a warm pool keeps touching the
    same memory; a fresh pool hands out pages in ascending order. A call that needs more pages
    than the pool has free raises PageAllocator.OutOfPagesError (a RuntimeError).
    """

    class OutOfPagesError(RuntimeError):
        """Raised when a request needs more pages than the pool has free."""

    def __init__(self, num_pages, page_size=PAGE_SIZE):
        for name, value in (("num_pages", num_pages), ("page_size", page_size)):
            if not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"PageAllocator: {name} must be a positive int; got {value!r}")
        self.num_pages = int(num_pages)
        self.page_size = int(page_size)
        self._free = list(range(self.num_pages - 1, -1, -1))  # a stack: pop() gives page 0 first
        self._is_free = np.ones(self.num_pages, bool)
        self._owner = {}  # page -> the admitted request holding it
        self._pages = {}  # request id -> list of pages in token order
        self._tokens = {}  # request id -> number of tokens

    @property
    def num_free(self):
        return len(self._free)

    @property
    def num_used(self):
        return self.num_pages - len(self._free)

    def allocate(self, n):
        """Takes n free pages; returns them as a list of ints. All or nothing."""
        if not isinstance(n, (int, np.integer)) or n < 0:
            raise ValueError(f"PageAllocator.allocate: n must be an int >= 0; got {n!r}")
        if n > len(self._free):
            raise self.OutOfPagesError(f"PageAllocator: {n} pages requested, "
                                       f"{len(self._free)} of {self.num_pages} free")
        pages = [self._free.pop() for _ in range(n)]
        self._is_free[pages] = False
        return pages

    def free(self, pages):
        """Returns pages from allocate() to the pool. All or nothing: a page that is not
        allocated, or that an admitted request holds (finish() frees those), raises
        ValueError."""
        pages = [int(p) for p in pages]
        held = {p: self._owner[p] for p in pages if p in self._owner}
        if held:
            owners = ", ".join(sorted({repr(r) for r in held.values()}))
            raise ValueError(f"PageAllocator.free: pages {sorted(held)} are held by requests "
                             f"[{owners}]; finish() a request to free its pages")
        self._release(pages)

    def _release(self, pages):
        bad = [p for p in pages if not 0 <= p < self.num_pages or self._is_free[p]]
        if bad or len(set(pages)) != len(pages):
            raise ValueError(f"PageAllocator.free: pages must be distinct and allocated; got "
                             f"{pages} (not allocated: {bad})")
        self._is_free[pages] = True
        self._free.extend(reversed(pages))

    def admit(self, request_id, num_tokens):
        """Registers a request holding num_tokens tokens (its prompt); returns its pages."""
        if request_id in self._pages:
            raise ValueError(f"PageAllocator.admit: request {request_id!r} is already admitted")
        self._check_tokens("admit", num_tokens)
        self._pages[request_id] = self.allocate(pages_for_tokens(num_tokens, self.page_size))
        self._tokens[request_id] = int(num_tokens)
        self._owner.update(dict.fromkeys(self._pages[request_id], request_id))
        return list(self._pages[request_id])

    def grow(self, request_id, new_num_tokens):
        """Extends a request to new_num_tokens tokens; returns the pages added (often none)."""
        old = self._lookup("grow", request_id)
        self._check_tokens("grow", new_num_tokens)
        if new_num_tokens < old:
            raise ValueError(f"PageAllocator.grow: request {request_id!r} holds {old} tokens; "
                             f"new_num_tokens={new_num_tokens} would shrink it")
        held = self._pages[request_id]
        added = self.allocate(pages_for_tokens(new_num_tokens, self.page_size) - len(held))
        held.extend(added)
        self._tokens[request_id] = int(new_num_tokens)
        self._owner.update(dict.fromkeys(added, request_id))
        return added

    def finish(self, request_id):
        """Forgets a request and frees its pages; returns how many were freed."""
        self._lookup("finish", request_id)
        pages = self._pages.pop(request_id)
        del self._tokens[request_id]
        for page in pages:
            del self._owner[page]
        self._release(pages)
        return len(pages)

    def pages(self, request_id):
        """The request's pages in token order (a copy)."""
        self._lookup("pages", request_id)
        return list(self._pages[request_id])

    def num_tokens(self, request_id):
        return self._lookup("num_tokens", request_id)

    @property
    def requests(self):
        """Ids of the admitted requests, in admission order."""
        return list(self._pages)

    def block_table(self, request_ids, max_pages):
        """np.int32 (len(request_ids), max_pages) table of their pages, PAD_PAGE (-1) after."""
        return block_table_from_pages([self.pages(r) for r in request_ids], max_pages)

    def seq_lens(self, request_ids):
        """np.int32 (len(request_ids),) of their token counts."""
        return np.array([self.num_tokens(r) for r in request_ids], np.int32)

    def _lookup(self, where, request_id):
        if request_id not in self._tokens:
            raise ValueError(f"PageAllocator.{where}: unknown request {request_id!r}")
        return self._tokens[request_id]

    def _check_tokens(self, where, num_tokens):
        if not isinstance(num_tokens, (int, np.integer)) or num_tokens < 0:
            raise ValueError(f"PageAllocator.{where}: the token count must be an int >= 0; "
                             f"got {num_tokens!r}")

