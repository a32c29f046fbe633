"""The engine's prefix cache: finished requests' KV pages, kept for the requests that continue them.

A finished request's context tokens key the pages holding their KV, so a later request whose context
starts with them (the next turn of a multi-turn trajectory) takes the pages over and prefills only the
new tokens. Entries hold cached-prefix references in the `PagePool`, and are evicted least recently
cached first when the pool needs room, before any running request is retracted.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator, Mapping, Sequence

from rstar_jax.engine.pages import PagePool

PREFIX_HEAD = 64  # leading tokens that index the prefix cache


class PrefixCache(Mapping[tuple[int, ...], list[int]]):
    """Cached prefix (its tokens) -> the pages holding its KV, iterated least recently cached first.
    A lookup finds its candidates by their first PREFIX_HEAD tokens (all of them for shorter
    prefixes). With `share_pages`, cached pages also enter the pool's index, so running requests can
    share them without taking the entry over."""

    def __init__(self, pool: PagePool, share_pages: bool):
        self._pool = pool
        self._share_pages = share_pages
        self._entries: collections.OrderedDict[tuple[int, ...], list[int]] = collections.OrderedDict()
        self._heads: dict[tuple[int, ...], set[tuple[int, ...]]] = collections.defaultdict(set)
        self._short_lengths: collections.Counter[int] = collections.Counter()

    def __getitem__(self, tokens: tuple[int, ...]) -> list[int]:
        return self._entries[tokens]

    def __iter__(self) -> Iterator[tuple[int, ...]]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def insert(self, tokens: tuple[int, ...], pages: list[int]) -> None:
        """Caches `pages` (they gain a cached-prefix reference) as holding `tokens`' KV."""
        if tokens in self._entries:  # the same prefix again (a repeated request): keep the newer pages
            self._pool.ref(self.take(tokens), cache=-1)
        self._pool.ref(pages, cache=1)
        self._entries[tokens] = pages
        self._heads[tokens[:PREFIX_HEAD]].add(tokens)
        if len(tokens) < PREFIX_HEAD:
            self._short_lengths[len(tokens)] += 1
        if self._share_pages:  # pages filled by decoding become shareable too
            self._pool.register(pages, tokens, 0, len(tokens))

    def lookup(self, context: Sequence[int]) -> tuple[int, ...] | None:
        """The longest cached prefix of `context` that leaves at least one token to prefill."""
        heads = {min(len(context), PREFIX_HEAD)} | {n for n, c in self._short_lengths.items() if c}
        best = None
        for head in heads:
            for key in self._heads.get(tuple(context[:head]), ()):
                if len(key) < len(context) and (best is None or len(key) > len(best)) \
                        and tuple(context[:len(key)]) == key:
                    best = key
        return best

    def take(self, tokens: tuple[int, ...]) -> list[int]:
        """Removes an entry; its pages keep their references (the caller moves or drops them)."""
        head = tokens[:PREFIX_HEAD]
        self._heads[head].discard(tokens)
        if not self._heads[head]:
            del self._heads[head]
        if len(tokens) < PREFIX_HEAD:
            self._short_lengths[len(tokens)] -= 1
        return self._entries.pop(tokens)

    def evict(self, free_pages: int) -> None:
        """Drops entries, least recently cached first, until the pool has `free_pages` free (or none
        is left). Pages a running request also holds stay with it."""
        if len(self._pool.free) >= free_pages:  # the common case, every decode step: nothing to evict
            return
        for tokens in list(self._entries):
            if len(self._pool.free) >= free_pages:
                return
            self._pool.ref(self.take(tokens), cache=-1)

    def clear(self) -> None:
        """Drops every entry, releasing its pages."""
        for tokens in list(self._entries):
            self._pool.ref(self.take(tokens), cache=-1)
