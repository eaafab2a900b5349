"""Prefix cache: a radix tree over FULL pages of token ids, so a new request reuses the K/V of
the longest prefix an earlier (or running) sequence already computed.

- A node is one full page: key = the page's page_size token ids, child per next page. Its page
  id holds the target's K/V and the draft's context K/V of those positions (both pools share
  page ids and positions), so a hit skips the draft's context too.
- Ownership: a page inserted into the tree belongs to the tree; it goes back to the allocator
  exactly once, when its node is evicted. A sequence pins the nodes of its path (refs); a
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
from typing import Callable


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
    def __init__(self, page_size: int, free_pages: Callable[[list[int]], None],
                 snapshot_slots: list[int] = (), needs_snapshots: bool = False) -> None:
        """free_pages: hands evicted pages back to the allocator. snapshot_slots: the state-pool
        slots reserved for snapshots (hybrid targets); needs_snapshots: a hit must end at a node
        with a snapshot (the recurrent state cannot be rebuilt from K/V pages)."""
        self.page_size = page_size
        self._free_pages = free_pages
        self.root = PrefixNode((), 0, None, 0)
        self.needs_snapshots = needs_snapshots
        self._free_snapshots: deque[int] = deque(snapshot_slots)
        self._snapshot_nodes: dict[int, PrefixNode] = {}           # slot → node holding it
        self._clock = itertools.count(1)
        self.num_nodes = 0
        self.num_evictable = 0           # unpinned nodes (pages the allocator can get back)
        self.queries = 0                 # prompt tokens looked up (metrics)
        self.hits = 0                    # prompt tokens served from the cache (metrics)

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

    # -- insert -----------------------------------------------------------------------------

    def insert(self, path: list[PrefixNode], tokens: list[int], block_table: list[int],
               num_full_pages: int) -> None:
        """Extend a sequence's pinned path with its pages [len(path), num_full_pages), now full.

        tokens/block_table are the sequence's; path is pinned by it and grows in place. Where a
        node for the same page of tokens exists already (another sequence computed it at the
        same time), the sequence keeps its own page private (freed with the sequence) and pins
        the existing node, so the path still reaches the pages after it."""
        parent, now = (path[-1] if path else self.root), next(self._clock)
        for i in range(len(path), num_full_pages):
            key = tuple(tokens[i * self.page_size:(i + 1) * self.page_size])
            node = parent.children.get(key)
            if node is None:
                node = PrefixNode(key, block_table[i], parent, parent.depth + 1)
                parent.children[key] = node
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
        heap = [(n.last_used, id(n), n) for n in self._nodes() if n.refs == 0 and not n.children]
        heapq.heapify(heap)
        freed: list[int] = []
        while heap and len(freed) < num_pages:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            self._remove(node)
            freed.append(node.page)
            if parent is not self.root and parent.refs == 0 and not parent.children:
                heapq.heappush(heap, (parent.last_used, id(parent), parent))
        self._free_pages(freed)
        return len(freed)

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
            if not self._snapshot_nodes:
                return None
            oldest = min(self._snapshot_nodes.values(), key=lambda n: n.last_used)
            self._release_snapshot(oldest)
        return self._free_snapshots.popleft()

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
            assert all(n.refs >= c.refs for c in n.children.values()), "a child pinned more than its parent"
        held = {n.snapshot for n in nodes if n.snapshot is not None}
        assert held == set(self._snapshot_nodes), "snapshot bookkeeping"
        assert not held & set(self._free_snapshots), "a snapshot slot both free and held"
