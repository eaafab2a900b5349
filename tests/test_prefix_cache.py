"""The prefix cache's radix tree without a model: match / insert / pin / evict invariants, every
page freed exactly once, LRU order, snapshots bounded and evicted with their nodes."""
from __future__ import annotations

import random

import pytest
import torch

from blockspec.cache import CacheManager, PageAllocator, PrefixCacheManager
from blockspec.cache.prefix import PrefixCache
from blockspec.config import EngineConfig
from blockspec.engine.request import Request
from blockspec.engine.sequence import Sequence
from blockspec.sampling import SamplingParams

PAGE = 4


class Seq:
    """A sequence as the cache manager holds it: tokens, block table (one reference per page),
    pinned path."""

    def __init__(self, cache: PrefixCache, pages: PageAllocator, tokens: list[int]) -> None:
        self.cache, self.pages, self.tokens = cache, pages, tokens
        hit = cache.match(tokens, len(tokens) - 1)
        cache.pin(hit.nodes)
        self.path = list(hit.nodes)
        self.hit = hit.num_tokens(PAGE)
        self.block_table = [n.page for n in self.path]
        pages.incref(self.block_table)
        self.block_table += pages.allocate(-(-len(tokens) // PAGE) - len(self.path))

    def publish(self) -> None:
        self.cache.insert(self.path, self.tokens, self.block_table, len(self.tokens) // PAGE)

    def release(self) -> None:
        self.pages.free(self.block_table)
        self.cache.unpin(self.path)


def make(num_pages: int = 64, snapshots: tuple[int, ...] = (),
         hybrid: bool = False) -> tuple[PrefixCache, PageAllocator]:
    """A cache over a reference-counted allocator: a double free raises DoubleFreeError."""
    pages = PageAllocator(num_pages)
    return PrefixCache(PAGE, pages, list(snapshots), needs_snapshots=hybrid), pages


def test_match_stops_at_full_pages_and_before_the_last_position():
    cache, pages = make()
    a = Seq(cache, pages, list(range(10)))          # pages [0..3] [4..7], 2 left in a partial page
    assert a.hit == 0
    a.publish()
    cache.check()
    assert cache.num_nodes == 2
    assert cache.match(list(range(10)), 9).num_tokens(PAGE) == 8
    assert cache.match(list(range(8)), 7).num_tokens(PAGE) == 4      # never the whole prompt
    assert cache.match([0, 1, 2, 3, 4, 5, 99, 7, 8], 8).num_tokens(PAGE) == 4   # differs mid-page 2
    b = Seq(cache, pages, list(range(9)) + [50, 51])
    assert b.hit == 8 and b.block_table[:2] == a.block_table[:2]
    assert cache.root.children[(0, 1, 2, 3)].refs == 2
    cache.check()


def test_every_page_freed_exactly_once():
    cache, pages = make(num_pages=40)
    rng = random.Random(0)
    live: list[Seq] = []
    prefixes = [[rng.randrange(50) for _ in range(12)] for _ in range(3)]
    for step in range(300):
        if live and (rng.random() < 0.45 or pages.num_free + cache.num_evictable < 8):
            seq = live.pop(rng.randrange(len(live)))
            seq.publish()
            seq.release()
        else:
            tokens = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(1, 14))]
            short = -(-len(tokens) // PAGE) - pages.num_free
            cache.evict(short + PAGE)         # the pool needs room: unpinned leaves go first
            if -(-len(tokens) // PAGE) > pages.num_free:
                continue
            live.append(Seq(cache, pages, tokens))
            if rng.random() < 0.5:
                live[-1].publish()           # pages shareable while it runs
        cache.check()
    for seq in live:
        seq.release()
    cache.clear()
    cache.check()
    assert cache.num_nodes == 0
    assert pages.num_free == 39, "a page lost"
    assert sorted(pages._free) == list(range(1, 40)) and not any(pages._refs)


def test_every_eviction_takes_a_least_recently_used_leaf():
    """Over random admissions, publications, releases and lookups, each page evicted is an
    unpinned leaf of the oldest last use among them (the eviction heap persists across calls:
    its stale entries must never decide)."""
    cache, pages = make(num_pages=40)
    rng = random.Random(1)
    live: list[Seq] = []
    prefixes = [[rng.randrange(50) for _ in range(12)] for _ in range(3)]
    evicted = 0
    for step in range(300):
        if live and (rng.random() < 0.45 or pages.num_free + cache.num_evictable < 8):
            seq = live.pop(rng.randrange(len(live)))
            seq.publish()
            seq.release()
            continue
        tokens = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(1, 14))]
        if rng.random() < 0.3:
            cache.match(tokens, len(tokens) - 1)       # a lookup touches a path, pins nothing
        for _ in range(max(0, -(-len(tokens) // PAGE) - pages.num_free + PAGE)):
            leaves = [n for n in cache._nodes() if n.refs == 0 and not n.children]
            if not leaves:
                break
            assert cache.evict(1) == 1
            remaining = {id(n) for n in cache._nodes()}
            gone = [n for n in leaves if id(n) not in remaining]
            assert len(gone) == 1 and gone[0].last_used == min(n.last_used for n in leaves)
            evicted += 1
        if -(-len(tokens) // PAGE) <= pages.num_free:
            live.append(Seq(cache, pages, tokens))
        cache.check()
    assert evicted > 50


def test_pinned_pages_are_never_evicted():
    cache, pages = make()
    a = Seq(cache, pages, list(range(13)))
    a.publish()
    assert cache.num_evictable == 0
    assert cache.evict(100) == 0
    a.release()
    assert cache.num_evictable == 3
    b = Seq(cache, pages, list(range(9)) + [7])      # pins the first two pages
    assert b.hit == 8
    assert cache.evict(100) == 1                     # only the third page was free to go
    assert cache.match(list(range(13)), 12).num_tokens(PAGE) == 8
    cache.check()


def test_a_leaf_filed_for_eviction_then_pinned_again_is_never_evicted():
    """a's three pages are cached and unpinned (its leaf filed for eviction); b then hits all
    three and pins them: an eviction while b holds them takes only c's unpinned pages, never
    theirs, and each of them is evictable again (and evicted once) when b lets go."""
    cache, pages = make()
    for tokens in (list(range(13)), [50] * 9):       # a's, then c's
        cached = Seq(cache, pages, tokens)
        cached.publish()
        cached.release()
    b = Seq(cache, pages, list(range(13)) + [99])
    assert b.hit == 12 and cache.num_evictable == 2
    assert cache.evict(100) == 2                     # c's two pages, none of b's
    assert cache.match(list(range(13)), 12).num_tokens(PAGE) == 12
    assert all(pages.refcount(page) == 2 for page in b.block_table[:3])      # the tree's and b's
    cache.check()
    b.release()
    assert cache.evict(100) == 3 and pages.num_free == pages.num_pages - 1
    cache.check()


def test_eviction_is_lru_over_leaves():
    cache, pages = make()
    old, new = Seq(cache, pages, [1] * 8 + [2]), Seq(cache, pages, [3] * 8 + [4])
    for seq in (old, new):
        seq.publish()
        seq.release()
    cache.match([1] * 8 + [2], 8)                    # touch old: new is now the least recent
    assert cache.evict(1) == 1
    assert cache.match([3] * 8, 8).num_tokens(PAGE) == 4       # new's leaf went first, its root stays
    assert cache.match([1] * 8, 8).num_tokens(PAGE) == 8
    assert cache.evict(1) == 1                       # new's first page is now the oldest leaf
    assert cache.match([3] * 8, 8).num_tokens(PAGE) == 0
    assert cache.match([1] * 8, 8).num_tokens(PAGE) == 8
    cache.check()


def test_concurrent_duplicates_keep_their_own_pages():
    cache, pages = make()
    tokens = list(range(9))
    a, b = Seq(cache, pages, tokens), Seq(cache, pages, tokens)     # both missed: computed twice
    a.publish()
    b.publish()
    assert [n.page for n in b.path] == a.block_table[:2] != b.block_table[:2]
    cache.check()
    b.release()                                      # its own copies go back, the tree's stay
    assert pages.refcount(b.block_table[0]) == 0 and pages.refcount(a.block_table[0]) == 2
    a.release()
    cache.clear()
    assert pages.num_free == 63 and not any(pages._refs)


def test_hybrid_hit_ends_at_the_deepest_snapshot():
    cache, pages = make(snapshots=(101, 102), hybrid=True)
    a = Seq(cache, pages, list(range(17)))
    a.publish()                                      # four full pages
    assert cache.match(list(range(17)), 16).nodes == []          # no snapshot: no hit
    slot = cache.take_snapshot_slot()
    cache.attach_snapshot(a.path[1], slot)           # state after 8 positions
    hit = cache.match(list(range(17)), 16)
    assert hit.num_tokens(PAGE) == 8 and hit.snapshot == slot
    cache.attach_snapshot(a.path[3], cache.take_snapshot_slot())
    assert cache.match(list(range(17)), 16).num_tokens(PAGE) == 16
    assert cache.match(list(range(15)), 14).num_tokens(PAGE) == 8   # past the match: the one before
    cache.check()


def test_snapshot_pool_is_bounded_and_lru():
    cache, pages = make(snapshots=(7,), hybrid=True)
    a, b = Seq(cache, pages, [1] * 5), Seq(cache, pages, [2] * 5)
    for seq in (a, b):
        seq.publish()
    cache.attach_snapshot(a.path[0], cache.take_snapshot_slot())
    assert cache.match([1] * 5, 4).snapshot == 7
    cache.attach_snapshot(b.path[0], cache.take_snapshot_slot())   # the only slot moves to b
    assert cache.match([1] * 5, 4).nodes == [] and cache.match([2] * 5, 4).snapshot == 7
    cache.check()
    b.release()
    cache.evict(1)                                   # b's page goes, and its snapshot with it
    assert cache.num_snapshot_slots == 1 and cache.take_snapshot_slot() == 7
    cache.check()


def test_unpin_without_pin_is_an_error():
    cache, pages = make()
    a = Seq(cache, pages, list(range(5)))
    a.publish()
    a.release()
    with pytest.raises(RuntimeError, match="nobody pinned"):
        cache.unpin(a.path)


def test_token_range_is_a_slice_of_prompt_keys_and_output():
    from types import SimpleNamespace
    from blockspec.cache.prefix import token_range
    seq = SimpleNamespace(request=SimpleNamespace(prompt_keys=list(range(10)), output_ids=list(range(100, 107))))
    tokens = list(range(10)) + list(range(100, 107))
    for start in range(0, 18):
        for end in range(start, 18):
            assert token_range(seq, start, end) == tokens[start:end], (start, end)


# -- the scheduler with PrefixCacheManager, no model -------------------------------------------

def simulate_prefix_scheduler(check_pages: bool = False):
    """Sequences sharing prefixes, in a pool small enough that cached pages are evicted and
    running sequences preempted, stepped by hand as the engine would. check_pages: after every
    step each page's reference count is the number of block tables holding it plus one if the
    tree caches it, and the free list holds exactly the pages nobody references."""
    from collections import Counter
    from blockspec.engine.scheduler import FirstToken, Scheduler

    num_pages, page = 24, 4
    cache = PrefixCacheManager(num_pages, page)
    config = EngineConfig(max_model_len=256, max_num_seqs=6, page_size=page, num_pages=num_pages, block_size=4,
                          max_prefill_tokens=16, max_num_batched_tokens=32)
    scheduler = Scheduler(config, cache, 4)
    rng = random.Random(1)
    systems = [[rng.randrange(1, 99) for _ in range(18)] for _ in range(2)]
    seqs = []
    for i in range(14):
        prompt = rng.choice(systems) + [rng.randrange(1, 99) for _ in range(rng.randrange(1, 10))]
        seqs.append(Sequence(Request(f"s{i}", prompt, SamplingParams(max_tokens=rng.randrange(4, 20)), frozenset(),
                                     256), torch.device("cpu")))

    def check() -> None:
        cache.prefix.check()
        held = Counter(p for s in scheduler.running for p in s.block_table)
        tree = {n.page for n in cache.prefix._nodes()}
        for p in range(1, num_pages):
            assert cache.pages.refcount(p) == held[p] + (p in tree), p
        assert sorted(cache.pages._free) == [p for p in range(1, num_pages) if cache.pages.refcount(p) == 0]

    pending = list(seqs)
    for step in range(2000):
        if pending:
            scheduler.add(pending.pop(0))
        batch = scheduler.schedule()
        for seq, length in batch.prefill:
            seq.num_cached += length
            done = not seq.is_prefilling and not seq.request.output_ids
            scheduler.postprocess_prefill(seq, FirstToken(rng.randrange(1, 99)) if done else None)
        for seq, k in zip(batch.decode, batch.num_drafts):
            accepted = rng.randrange(0, k + 1)
            scheduler.postprocess_decode(seq, accepted, [rng.randrange(1, 99) for _ in range(accepted + 1)], None, k)
        for seq in list(scheduler.running) + scheduler.unservable:
            if seq.request.is_finished or seq in scheduler.unservable:
                scheduler.finish(seq)
        if check_pages:
            check()
        if not pending and not scheduler.has_work:
            break
    return scheduler, cache, seqs


def test_scheduler_with_the_prefix_cache_accounts_every_page_exactly():
    """The simulation above, every page accounted after every step; at the end every page is
    back exactly once."""
    scheduler, cache, seqs = simulate_prefix_scheduler(check_pages=True)
    num_pages = cache.pages.num_pages
    assert all(s.request.is_finished for s in seqs)
    assert sum(s.num_preemptions for s in seqs) > 0 and cache.prefix.num_evicted > 0
    assert cache.prefix.hits > 0
    cache.prefix.clear()
    assert cache.pages.num_free == num_pages - 1 and not any(cache.pages._refs)


# -- issue 36: what the prefix cache and the pool promise -----------------------------------------

def sequence(name: str, tokens: list[int]) -> Sequence:
    return Sequence(Request(name, tokens, SamplingParams(max_tokens=8), frozenset(), 256), torch.device("cpu"))


def cached_and_released(cache: PrefixCacheManager, name: str, tokens: list[int]) -> Sequence:
    """A sequence whose whole prompt was computed, published to the tree, then ended."""
    seq = sequence(name, tokens)
    cache.admit(seq, cache.take_hit(seq))
    cache.grow(seq, len(tokens))
    seq.num_cached = len(tokens)
    cache.publish(seq, after_prefill=True)
    cache.release(seq)
    return seq


def test_growing_evicts_only_the_pages_the_free_list_cannot_cover():
    cache = PrefixCacheManager(num_pages=13, page_size=4)        # 12 usable pages
    cached_and_released(cache, "old", list(range(1, 25)))      # 6 pages in the tree, nobody's
    assert cache.prefix.num_evictable == 6 and cache.pages.num_free == 6
    seq = sequence("new", list(range(100, 132)))
    cache.grow(seq, 20)                                          # 5 pages: the free list covers them
    assert cache.prefix.num_evicted == 0 and cache.pages.num_free == 1
    cache.grow(seq, 32)                                          # 3 more, 1 free: exactly 2 evicted
    assert cache.prefix.num_evicted == 2 and cache.prefix.num_nodes == 4
    assert len(seq.block_table) == 8 and cache.pages.num_free == 0
    cache.prefix.check()


def test_the_least_recently_used_of_several_snapshots_is_evicted():
    cache, pages = make(snapshots=(7, 8, 9), hybrid=True)
    seqs = [Seq(cache, pages, [token] * 5) for token in (1, 2, 3)]
    for seq in seqs:
        seq.publish()
        cache.attach_snapshot(seq.path[0], cache.take_snapshot_slot())
    slots = [seq.path[0].snapshot for seq in seqs]
    assert sorted(slots) == [7, 8, 9]
    cache.match([1] * 5, 4)                          # touched: 2's is now the oldest, then 3's
    assert cache.take_snapshot_slot() == slots[1] and seqs[1].path[0].snapshot is None
    assert seqs[0].path[0].snapshot == slots[0] and seqs[2].path[0].snapshot == slots[2]
    assert cache.take_snapshot_slot() == slots[2] and seqs[0].path[0].snapshot == slots[0]
    cache.check()


@pytest.mark.parametrize("prefix_cache", [False, True])
def test_kv_cache_usage_is_exactly_0_empty_and_1_full(prefix_cache):
    """Usage counts the usable pages only (page 0, the padding page, is never handed out); with
    the prefix cache, cached pages nobody uses count as free."""
    cache = PrefixCacheManager(5, 4) if prefix_cache else CacheManager(5, 4)
    assert cache.usage == 0.0
    seq = sequence("a", list(range(1, 17)))
    cache.grow(seq, 8)
    assert cache.usage == 0.5
    cache.grow(seq, 16)
    assert cache.usage == 1.0 and cache.num_free_pages == 0
    if prefix_cache:
        seq.num_cached = 16
        cache.publish(seq, after_prefill=True)
    cache.release(seq)
    assert cache.usage == 0.0 and cache.num_free_pages == 4
    if prefix_cache:                                  # the same prompt again: 3 pages pinned, 1 grown
        again = sequence("b", list(range(1, 17)))
        cache.admit(again, cache.take_hit(again))
        assert again.num_cached == 12 and cache.usage == 0.75
        cache.grow(again, 16)
        assert cache.usage == 1.0 and cache.prefix.num_evicted == 1


def test_a_preempted_sequence_is_looked_up_once():
    """Re-admitted after a preemption, a sequence's prefix lookup is not counted again and its
    usage keeps the first admission's hit: queries = the prompts' lengths, hits = the sum of
    cached_tokens, each below its prompt's length."""
    scheduler, cache, seqs = simulate_prefix_scheduler()
    assert sum(s.num_preemptions for s in seqs) > 0 and not scheduler.unservable
    assert cache.prefix.queries == sum(len(s.request.prompt_ids) for s in seqs)
    assert cache.prefix.hits == sum(s.request.stats.cached_tokens for s in seqs) > 0
    assert all(s.request.stats.cached_tokens < len(s.request.prompt_ids) for s in seqs)
