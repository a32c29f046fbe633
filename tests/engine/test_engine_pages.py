"""The engine's host-side page bookkeeping: the ref-counted page pool and the prefix cache (no model)."""

from rstar_jax.engine.pages import PagePool
from rstar_jax.engine.prefix import PREFIX_HEAD, PrefixCache


def test_allocation_takes_the_lowest_free_pages_and_counts_one_holder():
    pool = PagePool(6, page_size=4)
    assert pool.allocate(2) == [0, 1] and pool.allocate(1) == [2]
    assert pool.slot_refs == [1, 1, 1, 0, 0, 0] and pool.used == 3 and len(pool.free) == 3
    pool.ref([1], slot=-1)
    assert pool.allocate(1) == [1]  # a freed page is reused before higher ones


def test_a_shared_page_is_freed_only_when_its_last_holder_releases_it():
    pool = PagePool(4, page_size=4)
    pages = pool.allocate(2)
    pool.ref(pages, slot=1)  # a second request shares both
    pool.ref(pages, cache=1)  # and a cached prefix holds them too
    pool.ref(pages, slot=-1)
    assert pool.used == 2 and pool.evictable == 0
    pool.ref(pages, slot=-1)  # only the cached prefix holds them now: evictable, not free
    assert pool.used == 0 and pool.evictable == 2 and all(map(pool.is_evictable, pages))
    assert sorted(pool.free) == [2, 3]
    pool.ref(pages[:1], slot=1)  # a request takes one back over
    assert pool.evictable == 1 and not pool.is_evictable(pages[0])
    pool.ref(pages, cache=-1)
    pool.ref(pages[:1], slot=-1)
    assert sorted(pool.free) == [0, 1, 2, 3] and pool.evictable == 0 and pool.used == 0


def test_shared_prefix_is_the_longest_indexed_page_chain_that_leaves_a_token_to_prefill():
    pool = PagePool(8, page_size=2)
    context = [5, 6, 7, 8, 9, 10, 11]
    pages = pool.allocate(4)
    pool.register(pages, context, 0, len(context))  # three full pages; the partial fourth is not indexed
    assert len(pool.index) == 3
    assert pool.shared_prefix(context + [12]) == pages[:3]
    assert pool.shared_prefix(context[:6]) == pages[:2]  # sharing all six would leave nothing to prefill
    assert pool.shared_prefix([5, 6, 0, 8, 9, 10, 11]) == pages[:1]  # a page's key includes the one before
    assert pool.shared_prefix([6, 5, 7, 8]) == []
    pool.ref(pages, slot=-1)  # freed pages leave the index
    assert pool.index == {} and pool.shared_prefix(context + [12]) == []


def test_register_stops_where_another_page_already_holds_the_prefix():
    pool = PagePool(8, page_size=2)
    context = [1, 2, 3, 4, 5, 6, 7]
    first, second = pool.allocate(3), pool.allocate(3)
    pool.register(first, context, 0, 6)
    pool.register(second, context, 0, 6)  # the same tokens: the first writer stays indexed
    assert sorted(pool.index.values()) == first and pool.shared_prefix(context) == first
    pool.clear_index()
    assert pool.shared_prefix(context) == [] and pool.slot_refs[first[0]] == 1  # references stay


def test_prefix_cache_finds_the_longest_cached_prefix_that_leaves_a_token():
    pool = PagePool(16, page_size=4)
    cache = PrefixCache(pool, share_pages=False)
    short, long = tuple(range(5)), tuple(range(PREFIX_HEAD + 10))
    cache.insert(short, pool.allocate(2))
    cache.insert(long, pool.allocate(2))
    assert cache.lookup(list(range(PREFIX_HEAD + 20))) == long
    assert cache.lookup(list(range(PREFIX_HEAD + 10))) == short  # `long` itself would leave nothing to prefill
    assert cache.lookup(list(range(7))) == short and cache.lookup([0, 1, 9, 3, 4, 5]) is None
    assert cache.lookup(list(short)) is None
    assert pool.cache_refs[:4] == [1, 1, 1, 1] and not pool.index  # cached, not shared


def test_prefix_cache_evicts_least_recently_cached_first_and_keeps_pages_a_request_holds():
    pool = PagePool(8, page_size=4)
    cache = PrefixCache(pool, share_pages=True)

    def finish(tokens):  # a request ends with its KV in two pages, which only the cache then holds
        pages = pool.allocate(2)
        cache.insert(tokens, pages)
        pool.ref(pages, slot=-1)
        return pages

    a, b, c = (1,) * 5, (2,) * 5, (3,) * 5
    assert [finish(tokens) for tokens in (a, b, c)] == [[0, 1], [2, 3], [4, 5]]
    assert list(cache) == [a, b, c] and pool.evictable == 6 and len(pool.index) == 3  # full pages shareable
    assert finish(a) == [6, 7]  # cached again: the newer pages replace the old, now the most recent entry
    assert list(cache) == [b, c, a] and sorted(pool.free) == [0, 1]
    pool.ref(cache[b], slot=1)  # a running request shares b's pages
    cache.evict(4)
    assert list(cache) == [a] and sorted(pool.free) == [0, 1, 4, 5]  # b's pages stayed with the request
    assert pool.slot_refs[2] == 1 and pool.cache_refs[2] == 0 and pool.evictable == 2
    cache.evict(4)  # enough is free: nothing more goes
    assert list(cache) == [a]
    cache.clear()
    assert len(cache) == 0 and sorted(pool.free) == [0, 1, 4, 5, 6, 7] and pool.evictable == 0


def test_take_moves_a_cached_prefix_to_its_taker_without_touching_references():
    pool = PagePool(4, page_size=4)
    cache = PrefixCache(pool, share_pages=False)
    pages = pool.allocate(2)
    cache.insert((7,) * 6, pages)
    pool.ref(pages, slot=-1)
    assert cache.take((7,) * 6) == pages and len(cache) == 0 and cache.lookup([7] * 8) is None
    pool.ref(pages, slot=1, cache=-1)  # the taker's references replace the cache's
    assert pool.slot_refs[:2] == [1, 1] and pool.cache_refs[:2] == [0, 0] and pool.evictable == 0
