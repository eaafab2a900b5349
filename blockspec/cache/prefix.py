"""Prefix cache: a radix tree over FULL pages of token ids, so a new request reuses the K/V of
the longest prefix an earlier (or running) sequence already computed.

- A node is one full page: key = the page's page_size token ids (an image's rows: ids derived
  from the image's content, Request.prompt_keys), child per next page. Its page
  id holds the target's K/V and the draft's context K/V of those positions (both pools share
  page ids and positions), so a hit skips the draft's context too.
- Ownership: pages are reference counted (cache/manager.py). The tree holds one reference on
  each node's page, dropped exactly once, when the node is evicted; a sequence using a cached
  page holds its own reference (its block table) and pins the nodes of its path (refs); a
  pinned node is never evicted. Pins propagate up (a sequence pins its whole path), so every
  unpinned node's subtree is unpinned and eviction of leaves can reach all of them.
- Eviction is LRU over unpinned leaves (a match touches its whole path, so a parent is never
  older than its children); it runs only when the allocator is short of pages.
- Pages are immutable once in the tree: a hit always stops at a page boundary strictly before
  the last prompt position (that one is recomputed for its logits and features), and every
  later write of the reusing sequence lands in its own pages.
- Hybrid targets: a node may hold a snapshot (a recurrent-state slot: conv window + SSM state
  after the node's last position). A hybrid hit ends at the deepest node with a snapshot;
  snapshots live in a bounded pool of slots and are evicted LRU (and with their node).
"""
from __future__ import annotations

import heapq
import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from blockspec.cache.manager import CacheManager, PageAllocator

if TYPE_CHECKING:
    from blockspec.engine.sequence import Sequence


@dataclass(eq=False)
class PrefixNode:
    key: tuple[int, ...]                 # the page's token ids (empty for the root)
    page: int                            # page id (0 for the root: it holds no page)
    parent: PrefixNode | None
    depth: int                           # pages from the root: this node is page depth − 1
    children: dict[tuple[int, ...], PrefixNode] = field(default_factory=dict)
    refs: int = 0                        # running sequences that pin this node
    last_used: int = 0
    snapshot: int | None = None          # recurrent-state slot after this node's last position


@dataclass
class PrefixHit:
    """What a lookup found: nodes of the reusable path (page i = nodes[i].page) and, for a
    hybrid target, the snapshot slot holding the state after the last of them."""
    nodes: list[PrefixNode]
    snapshot: int | None = None
    matched_pages: int = 0               # pages matched before a hybrid hit was cut to its snapshot

    def num_tokens(self, page_size: int) -> int:
        return len(self.nodes) * page_size


class PrefixCache:
    def __init__(self, page_size: int, pages: PageAllocator, snapshot_slots: list[int] = (),
                 needs_snapshots: bool = False) -> None:
        """pages: the reference-counted allocator (the tree increfs what it caches, frees what
        it evicts). snapshot_slots: state-pool slots reserved for snapshots (hybrid targets);
        needs_snapshots: a hit must end at a node with a snapshot (the recurrent state cannot be
        rebuilt from K/V pages)."""
        self.page_size = page_size
        self.pages = pages
        self.root = PrefixNode((), 0, None, 0)
        self.needs_snapshots = needs_snapshots
        self._free_snapshots: deque[int] = deque(snapshot_slots)
        self._snapshot_nodes: dict[int, PrefixNode] = {}           # slot → node holding it
        self._restoring: set[int] = set()    # snapshots a sequence resumes from at its next forward
        self._clock = itertools.count(1)
        self.num_nodes = 0
        self.num_evictable = 0           # unpinned nodes (pages the allocator can get back)
        self.queries = 0                 # prompt tokens looked up (metrics)
        self.hits = 0                    # prompt tokens served from the cache (metrics)
        self.num_evicted = 0             # pages evicted so far
        self._leaves: list[tuple[int, int, PrefixNode]] = []       # eviction candidates (a heap): _candidate
        self._filed = itertools.count()

    # -- lookup -----------------------------------------------------------------------------

    def match(self, tokens: list[int], max_tokens: int) -> PrefixHit:
        """The longest cached path of full pages over tokens[:max_tokens]; on a hybrid target cut
        back to its deepest snapshot. Touches the path (LRU); pins nothing."""
        now, node, path = next(self._clock), self.root, []
        for i in range(max_tokens // self.page_size):
            child = node.children.get(tuple(tokens[i * self.page_size:(i + 1) * self.page_size]))
            if child is None:
                break
            child.last_used = now
            path.append(child)
            node = child
        matched = len(path)
        if not self.needs_snapshots:
            return PrefixHit(path, matched_pages=matched)
        while path and path[-1].snapshot is None:
            path.pop()
        return PrefixHit(path, path[-1].snapshot if path else None, matched)

    def record_query(self, num_prompt_tokens: int, num_hit_tokens: int) -> None:
        self.queries += num_prompt_tokens
        self.hits += num_hit_tokens

    # -- pins -------------------------------------------------------------------------------

    def pin(self, nodes: list[PrefixNode]) -> None:
        for node in nodes:
            if node.refs == 0:
                self.num_evictable -= 1
            node.refs += 1

    def unpin(self, nodes: list[PrefixNode]) -> None:
        for node in nodes:
            if node.refs <= 0:
                raise RuntimeError("prefix cache: unpinning a node nobody pinned")
            node.refs -= 1
            if node.refs == 0:
                self.num_evictable += 1
                if not node.children:
                    self._candidate(node)

    # -- insert -----------------------------------------------------------------------------

    def insert(self, path: list[PrefixNode], tokens: list[int], block_table: list[int],
               num_full_pages: int, tokens_from: int = 0) -> None:
        """Extend a sequence's pinned path with its pages [len(path), num_full_pages), now full.

        tokens/block_table are the sequence's (tokens may start at position tokens_from: only
        the new pages' are needed); path is pinned by it and grows in place. Where a
        node for the same page of tokens exists already (another sequence computed it at the
        same time), the sequence keeps its own page private (freed with the sequence) and pins
        the existing node, so the path still reaches the pages after it."""
        parent, now = (path[-1] if path else self.root), next(self._clock)
        for i in range(len(path), num_full_pages):
            start = i * self.page_size - tokens_from
            key = tuple(tokens[start:start + self.page_size])
            node = parent.children.get(key)
            if node is None:
                node = PrefixNode(key, block_table[i], parent, parent.depth + 1)
                parent.children[key] = node
                self.pages.incref([node.page])
                self.num_nodes += 1
                node.refs = 1
            else:
                self.pin([node])
            node.last_used = now
            path.append(node)
            parent = node

    @staticmethod
    def owns(path: list[PrefixNode], index: int, page: int) -> bool:
        """Whether block `index` of a sequence with this path is a tree page (not its own)."""
        return index < len(path) and path[index].page == page

    # -- eviction ---------------------------------------------------------------------------

    def evict(self, num_pages: int) -> int:
        """Free up to num_pages unpinned pages, least recently used leaves first; returns how
        many were freed."""
        if num_pages <= 0 or self.num_evictable == 0:
            return 0
        freed: list[int] = []
        while self._leaves and len(freed) < num_pages:
            last_used, _, node = heapq.heappop(self._leaves)
            if node.refs or node.children or node.parent.children.get(node.key) is not node:
                continue                 # pinned, or a parent again, or gone: filed anew when evictable
            if last_used != node.last_used:
                self._candidate(node)    # touched by a lookup since it was filed
                continue
            parent = node.parent
            self._remove(node)
            freed.append(node.page)
            if parent is not self.root and parent.refs == 0 and not parent.children:
                self._candidate(parent)
        self.pages.free(freed)
        self.num_evicted += len(freed)
        return len(freed)

    def _candidate(self, node: PrefixNode) -> None:
        """File an unpinned leaf for eviction. The heap persists across evictions (a scan of the
        whole tree per eviction made every page a sequence grew into cost the tree's size once the
        pool was full: ~10 ms a step at 256 sequences); entries are checked when popped, and it is
        rebuilt from the tree when stale entries outnumber the nodes."""
        if len(self._leaves) > 4 * self.num_nodes + 64:
            self._leaves = [(n.last_used, next(self._filed), n) for n in self._nodes()
                            if n.refs == 0 and not n.children and n is not node]
            heapq.heapify(self._leaves)
        heapq.heappush(self._leaves, (node.last_used, next(self._filed), node))

    def _remove(self, node: PrefixNode) -> None:
        del node.parent.children[node.key]
        self.num_nodes -= 1
        self.num_evictable -= 1
        if node.snapshot is not None:
            self._release_snapshot(node)

    def _nodes(self):
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def clear(self) -> int:
        """Evict every unpinned page (tests, shutdown); returns how many."""
        return self.evict(self.num_nodes)

    # -- snapshots (hybrid targets) ---------------------------------------------------------

    @property
    def num_snapshot_slots(self) -> int:
        return len(self._free_snapshots) + len(self._snapshot_nodes)

    def take_snapshot_slot(self) -> int | None:
        """A free snapshot slot, evicting the least recently used snapshot if none is free;
        None when the pool has no slots at all."""
        if not self._free_snapshots:
            held = [n for slot, n in self._snapshot_nodes.items() if slot not in self._restoring]
            if not held:
                return None
            self._release_snapshot(min(held, key=lambda n: n.last_used))
        return self._free_snapshots.popleft()

    def protect(self, slot: int) -> None:
        """A sequence resumes from this snapshot at its next forward: not evicted until then."""
        self._restoring.add(slot)

    def unprotect(self, slot: int) -> None:
        self._restoring.discard(slot)

    def give_back_snapshot_slot(self, slot: int) -> None:
        self._free_snapshots.append(slot)

    def attach_snapshot(self, node: PrefixNode, slot: int) -> None:
        """node's state (already copied into slot) is now cached; a node keeps one snapshot
        (the state after a given prefix is the same whoever computed it)."""
        if node.snapshot is not None:
            self._free_snapshots.append(slot)
            return
        node.snapshot = slot
        self._snapshot_nodes[slot] = node

    def _release_snapshot(self, node: PrefixNode) -> None:
        slot = node.snapshot
        node.snapshot = None
        del self._snapshot_nodes[slot]
        self._free_snapshots.append(slot)

    # -- invariants (tests) -----------------------------------------------------------------

    def check(self) -> None:
        """Raise if the bookkeeping is inconsistent: counts, pins up the path, snapshots."""
        nodes = list(self._nodes())
        assert len(nodes) == self.num_nodes, (len(nodes), self.num_nodes)
        assert sum(n.refs == 0 for n in nodes) == self.num_evictable
        assert len({n.page for n in nodes}) == len(nodes), "a page in two nodes"
        for n in nodes:
            assert n.parent.children[n.key] is n and n.depth == n.parent.depth + 1
            assert len(n.key) == self.page_size, "a node whose key is not a full page"
            assert all(n.refs >= c.refs for c in n.children.values()), "a child pinned more than its parent"
        filed = {id(entry[2]) for entry in self._leaves}
        assert all(id(n) in filed for n in nodes if n.refs == 0 and not n.children), "an evictable leaf not filed"
        held = {n.snapshot for n in nodes if n.snapshot is not None}
        assert held == set(self._snapshot_nodes), "snapshot bookkeeping"
        assert not held & set(self._free_snapshots), "a snapshot slot both free and held"


class PrefixCacheManager(CacheManager):
    """The cache manager with a prefix cache: admission starts a sequence from its longest
    cached prefix, its full pages join the tree as they fill, and cached pages nobody uses
    count as free (evicted, least recently used first, when a sequence needs them).

    Tensors stay the runner's: a hybrid sequence carries the slots to copy (restore_from before
    its next forward, snapshot_into after a prefill chunk, pending_slot at page boundaries in
    decode); this class only decides which, and files the snapshots in the tree."""

    def __init__(self, num_pages: int, page_size: int, num_state_slots: int = 0,
                 snapshot_slots: list[int] = ()) -> None:
        super().__init__(num_pages, page_size, num_state_slots)
        self.prefix = PrefixCache(page_size, self.pages, list(snapshot_slots) if num_state_slots else [],
                                  needs_snapshots=self.has_states)

    @property
    def num_free_pages(self) -> int:
        return self.pages.num_free + self.prefix.num_evictable

    @property
    def usage(self) -> float:
        """Cached pages nobody uses count as free (vLLM does the same)."""
        return 1.0 - self.num_free_pages / self.num_usable_pages

    def grow(self, seq: Sequence, num_positions: int) -> None:
        self.prefix.evict(self.pages_needed(seq, num_positions) - self.pages.num_free)
        super().grow(seq, num_positions)

    def release(self, seq: Sequence) -> None:
        self._settle_snapshots(seq)
        super().release(seq)                        # drops seq's reference on every page it held
        self.prefix.unpin(seq.prefix_path)
        seq.prefix_path = []

    # -- admission --------------------------------------------------------------------------

    def take_hit(self, seq: Sequence) -> PrefixHit:
        """Pin the longest cached prefix of seq's full pages, short of its last position (always
        recomputed: the first token's logits and the draft's features come from it); on a hybrid
        target the hit ends at the deepest snapshot. Its pages start seq's block table. Undo with
        drop_hit when seq is not admitted after all."""
        hit = self.prefix.match(seq.key_tokens, seq.prefill_len - 1)
        self.prefix.pin(hit.nodes)
        seq.prefix_path = list(hit.nodes)
        seq.block_table = [node.page for node in hit.nodes]
        self.pages.incref(seq.block_table)
        seq.num_cached = hit.num_tokens(self.page_size)
        if self.has_states:     # chunk ends that get a snapshot: where the tree branches, the prompt's last page
            seq.snapshot_points = tuple(sorted({hit.matched_pages * self.page_size,
                                                seq.prefill_len // self.page_size * self.page_size} - {0}))
        return hit

    def drop_hit(self, seq: Sequence) -> None:
        self.pages.free(seq.block_table)
        self.prefix.unpin(seq.prefix_path)
        seq.prefix_path, seq.block_table, seq.num_cached, seq.snapshot_points = [], [], 0, ()

    def admit(self, seq: Sequence, hit: PrefixHit) -> None:
        """After the state slot is claimed: resume a hybrid hit from its snapshot, take the slot
        this sequence keeps its latest page-boundary state in, count the lookup."""
        if hit.snapshot is not None:
            seq.restore_from = seq.protected = hit.snapshot
            self.prefix.protect(hit.snapshot)
        if self.has_states and seq.pending_slot is None:
            seq.pending_slot = self.prefix.take_snapshot_slot()
        if seq.num_preemptions == 0:
            seq.request.stats.cached_tokens = seq.num_cached
            self.prefix.record_query(len(seq.request.prompt_ids), seq.num_cached)

    # -- while it runs ----------------------------------------------------------------------

    def chunk_length(self, seq: Sequence, length: int) -> int:
        """A hybrid prefill chunk stops at the next snapshot point, and takes a snapshot slot
        when it ends on a page boundary whose node has no snapshot yet."""
        if not self.has_states:
            return length
        end = seq.num_cached + length
        for point in seq.snapshot_points:
            if seq.num_cached < point < end:
                end = point
                break
        if end % self.page_size == 0 and seq.snapshot_into is None and not self._has_snapshot(seq, end):
            seq.snapshot_into = self.prefix.take_snapshot_slot()
        return end - seq.num_cached

    def _has_snapshot(self, seq: Sequence, num_tokens: int) -> bool:
        depth = num_tokens // self.page_size
        return depth <= len(seq.prefix_path) and seq.prefix_path[depth - 1].snapshot is not None

    def publish(self, seq: Sequence, after_prefill: bool) -> None:
        """After a forward: seq's newly full pages join the tree (shareable at once); after a
        prefill chunk the state the runner copied to snapshot_into is filed under its page."""
        num_valid = min(seq.num_cached, seq.num_tokens)     # a cut at a stop id leaves fed drafts past it
        num_full = num_valid // self.page_size
        if num_full > len(seq.prefix_path):
            start = len(seq.prefix_path) * self.page_size
            self.prefix.insert(seq.prefix_path, token_range(seq, start, num_full * self.page_size), seq.block_table,
                               num_full, tokens_from=start)
        if not after_prefill:
            return
        if seq.restore_from is None and seq.protected is not None:
            self.prefix.unprotect(seq.protected)
            seq.protected = None
        if seq.snapshot_into is not None:
            self._file_snapshot(seq, seq.snapshot_into, seq.num_cached)
            seq.snapshot_into = None

    def _file_snapshot(self, seq: Sequence, slot: int, num_tokens: int) -> None:
        depth = num_tokens // self.page_size
        node = seq.prefix_path[depth - 1] if 0 < depth <= len(seq.prefix_path) else None
        if node is not None and num_tokens % self.page_size == 0 and node.snapshot is None:
            self.prefix.attach_snapshot(node, slot)
        else:
            self.prefix.give_back_snapshot_slot(slot)

    def _settle_snapshots(self, seq: Sequence) -> None:
        """seq ends or is preempted: its state at its latest page boundary becomes that page's
        snapshot (the next turn's prefix: prompt + answer); unused slots go back."""
        if seq.pending_slot is not None:
            if seq.pending_boundary is not None:
                self._file_snapshot(seq, seq.pending_slot, seq.pending_boundary)
            else:
                self.prefix.give_back_snapshot_slot(seq.pending_slot)
        if seq.snapshot_into is not None:
            self.prefix.give_back_snapshot_slot(seq.snapshot_into)
        if seq.protected is not None:
            self.prefix.unprotect(seq.protected)
        seq.pending_slot = seq.pending_boundary = seq.snapshot_into = seq.protected = seq.restore_from = None


def token_range(seq: Sequence, start: int, end: int) -> list[int]:
    """seq.key_tokens[start:end] without building the whole list (a long context, every page)."""
    prompt, output = seq.request.prompt_keys, seq.request.output_ids
    if end <= len(prompt):
        return prompt[start:end]
    tail = output[max(0, start - len(prompt)):end - len(prompt)]
    return prompt[start:] + tail if start < len(prompt) else tail


def snapshot_slot_ids(max_num_seqs: int, num_snapshots: int) -> list[int]:
    """State-pool slots of the snapshots: after the sequences' 1 … max_num_seqs (0: padding)."""
    return list(range(max_num_seqs + 1, max_num_seqs + 1 + num_snapshots))
