"""A block pool: refcounts, a free list, and (optionally) a prefix cache with LRU eviction.

The pool never decides *whether* an operation fits -- the manager checks ``available()``
first, so a refused operation changes nothing.
"""

from __future__ import annotations

from collections import OrderedDict, deque

from kvspec.spec.errors import NoFreeBlocks
from kvspec.spec.events import CacheEvent, EventKind
from kvspec.spec.prefix_hash import PrefixKey
from kvspec.spec.state import PoolView


class BlockPool:
    def __init__(self, num_blocks: int, prefix_caching: bool = False) -> None:
        self.num_blocks = num_blocks
        self.prefix_caching = prefix_caching
        self.refcount = [0] * num_blocks
        self.epoch = [0] * num_blocks  # allocations so far: a block's content lives one epoch
        self.free: deque[int] = deque(range(num_blocks))
        # Unreferenced blocks kept for their content, least recently released first.
        self.evictable: OrderedDict[int, None] = OrderedDict()
        self.cache: dict[PrefixKey, int] = {}
        self.key_of: dict[int, PrefixKey] = {}
        self.events: list[CacheEvent] = []  # every change of the cache map, in order

    def available(self) -> int:
        return len(self.free) + len(self.evictable)

    def allocate(self) -> int:
        """A block with no content: a free one, else the least recently released cached one."""
        if self.free:
            block = self.free.popleft()
        elif self.evictable:
            block, _ = self.evictable.popitem(last=False)
            self._evict(block)
        else:
            raise NoFreeBlocks("no free or evictable block")
        self.refcount[block] = 1
        self.epoch[block] += 1
        return block

    def _evict(self, block: int) -> None:
        self._drop_entry(block)

    def _supersede(self, block: int) -> None:
        """A partial entry's block is promoted: the shorter key is retired."""
        self._drop_entry(block)

    def _drop_entry(self, block: int) -> None:
        key = self.key_of.pop(block)
        del self.cache[key]
        self.events.append(CacheEvent(EventKind.REMOVED, (key,)))

    def incref(self, block: int) -> None:
        if self.refcount[block] == 0:
            del self.evictable[block]  # a cache hit revives an evictable block
        self.refcount[block] += 1

    def decref(self, block: int) -> None:
        assert self.refcount[block] > 0, f"block {block} freed twice"
        self.refcount[block] -= 1
        if self.refcount[block] == 0:
            if block in self.key_of:
                self.evictable[block] = None
            else:
                self.free.append(block)

    def lookup(self, key: PrefixKey) -> int | None:
        return self.cache.get(key) if self.prefix_caching else None

    def register(self, key: PrefixKey, block: int) -> None:
        """Publish a computed block (full, or a partial tail); a key already published keeps
        its first block; a longer key supersedes the block's partial one."""
        if not self.prefix_caching:
            return
        old = self.key_of.get(block)
        if old is not None and len(old.chain) < len(key.chain):
            self._supersede(block)
        if key not in self.cache and block not in self.key_of:
            self.cache[key] = block
            self.key_of[block] = key
            self.events.append(CacheEvent(EventKind.STORED, (key,)))

    def reset_cache(self) -> None:
        self.cache.clear()
        self.key_of.clear()
        while self.evictable:
            block, _ = self.evictable.popitem(last=False)
            self.free.append(block)
        if self.prefix_caching:
            self.events.append(CacheEvent(EventKind.CLEARED))

    def view(self) -> PoolView:
        cached = tuple((key, block) for key, block in self.cache.items())
        return PoolView(
            ids=tuple(range(self.num_blocks)),
            refcounts=dict(enumerate(self.refcount)),
            free=tuple(self.free),
            evictable=tuple(self.evictable),
            cached=cached,
            computed=frozenset(self.key_of),
            epochs=dict(enumerate(self.epoch)),
            events=tuple(self.events) if self.prefix_caching else None,
            usage=self.usage(),
        )

    def usage(self) -> float:
        """The share of the pool in use: every block neither free nor evictable."""
        if not self.num_blocks:
            return 0.0
        return 1.0 - (len(self.free) + len(self.evictable)) / self.num_blocks
