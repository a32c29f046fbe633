"""The engine's KV page pool: which pages are free, who holds the others, and which full pages can be shared.

Pages are reference counted by two kinds of holders, running requests and cached prefixes, so a page
several requests share (or a request and a cached prefix) is freed only when its last holder lets it
go, and a page only cached prefixes hold counts as evictable room. Full pages are indexed by (the page
before, their tokens), a prefix tree over the pool, so a request whose context starts with pages
another holder wrote can take them instead of prefilling them again. The index lives here because a
page leaves it exactly when it is freed. Host-side bookkeeping only: the KV itself is on the device.
"""

from __future__ import annotations

from typing import Sequence

PageKey = tuple[int, tuple[int, ...]]  # (the page before, or -1 for the first, the page's tokens)


class PagePool:
    """`num_pages` pages of `page_size` tokens. `free` is a stack whose pop() takes the lowest page;
    `slot_refs` / `cache_refs` count each page's running-request and cached-prefix holders;
    `evictable` counts pages held by cached prefixes only; `index` maps a full page's key to it."""

    def __init__(self, num_pages: int, page_size: int):
        self.num_pages = num_pages
        self.page_size = page_size
        self.free = list(range(num_pages - 1, -1, -1))
        self.slot_refs = [0] * num_pages
        self.cache_refs = [0] * num_pages
        self.evictable = 0
        self.index: dict[PageKey, int] = {}
        self._keys: dict[int, PageKey] = {}  # indexed page -> its key

    @property
    def used(self) -> int:
        """Pages a running request holds (a shared page counts once)."""
        return self.num_pages - len(self.free) - self.evictable

    def allocate(self, count: int) -> list[int]:
        """Takes `count` free pages (the caller checked there are enough) for one running request each."""
        pages = [self.free.pop() for _ in range(count)]
        self.ref(pages, slot=1)
        return pages

    def ref(self, pages: Sequence[int], slot: int = 0, cache: int = 0) -> None:
        """Adds `slot` running-request and `cache` cached-prefix references to each page (negative to
        release); a page left with none goes back to the free stack and out of the index."""
        freed = []
        for page in pages:
            was = self.slot_refs[page] == 0 and self.cache_refs[page] > 0
            self.slot_refs[page] += slot
            self.cache_refs[page] += cache
            held, cached = self.slot_refs[page], self.cache_refs[page]
            self.evictable += (held == 0 and cached > 0) - was
            if held == 0 and cached == 0:
                freed.append(page)
                key = self._keys.pop(page, None)
                if key is not None:
                    del self.index[key]
        self.free.extend(reversed(freed))

    def is_evictable(self, page: int) -> bool:
        return self.slot_refs[page] == 0 and self.cache_refs[page] > 0

    def register(self, pages: Sequence[int], context: Sequence[int], start: int, end: int) -> None:
        """Indexes the full pages among those holding context[start:end] (just written), so later
        requests can share them. Stops where the chain leaves the index: another page already holds
        that prefix, and pages after it could never be reached."""
        size = self.page_size
        for j in range(start // size, end // size):
            page = pages[j]
            if page in self._keys:
                continue
            parent = pages[j - 1] if j else -1
            if j and parent not in self._keys:
                return
            key = (parent, tuple(context[j * size:(j + 1) * size]))
            if self.index.setdefault(key, page) != page:
                return
            self._keys[page] = key

    def shared_prefix(self, context: Sequence[int]) -> list[int]:
        """The indexed pages holding the longest page-aligned prefix of `context` that leaves at
        least one token to prefill (its logits give the first sample)."""
        size, pages, parent = self.page_size, [], -1
        for j in range((len(context) - 1) // size):
            page = self.index.get((parent, tuple(context[j * size:(j + 1) * size])))
            if page is None:
                break
            pages.append(page)
            parent = page
        return pages

    def clear_index(self) -> None:
        """Makes every page unshareable (their KV came from old weights); references stay."""
        self.index.clear()
        self._keys.clear()
