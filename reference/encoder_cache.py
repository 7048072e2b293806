"""The reference scheduler's encoder cache: where a multimodal model's encoder outputs live.

A request's image (``spec.prefix_hash.MMFeature``: an identifier over prompt positions
``offset .. offset+length-1``) is encoded once, in the step whose tokens first reach it, and its
output (one embedding per placeholder position) stays in the encoder cache until every request
reading it has computed past its last position.  The cache is shared by identifier: a second
request carrying the same image reads the output already there instead of encoding it again.
Its capacity is counted in embeddings; an output no request reads any longer stays cached,
evictable oldest first, until an allocation needs its room.

This is the policy vLLM's ``EncoderCacheManager`` implements (0.33.0
vllm/v1/core/encoder_cache_manager.py:19-300; the same in 0.12.0-0.30.0 for a request whose
images are distinct), written from its contract: ``touch`` (``check_and_update_cache``),
``fits`` (``can_allocate``, which evicts), ``allocate``, ``release`` (``free_encoder_input``)
and ``release_all`` (``free``).
"""

from __future__ import annotations

from collections import OrderedDict

import attrs


@attrs.define
class EncoderCache:
    """Encoder outputs by identifier: their size, the requests reading each, and the ones no
    request reads (evictable, oldest first)."""

    capacity: int  # embeddings
    free_slots: int = attrs.field(init=False)
    freeable_slots: int = attrs.field(init=False)  # free plus what eviction could reclaim
    size: dict[str, int] = attrs.Factory(dict)  # identifier -> embeddings
    readers: dict[str, set[int]] = attrs.Factory(dict)  # identifier -> requests reading it
    unread: OrderedDict[str, int] = attrs.Factory(OrderedDict)  # evictable, oldest first
    held: dict[int, set[int]] = attrs.Factory(dict)  # request -> image indices it reads
    evicted: int = 0  # outputs evicted to make room (a run's count)

    def __attrs_post_init__(self) -> None:
        self.free_slots = self.freeable_slots = self.capacity

    def touch(self, seq: int, index: int, identifier: str) -> bool:
        """Whether image ``identifier`` (the request's ``index``-th) is cached; if so the
        request reads it from now on (an unread output stops being evictable)."""
        if identifier not in self.readers:
            return False
        if not self.readers[identifier]:
            self.freeable_slots -= self.unread.pop(identifier)
        self.readers[identifier].add(seq)
        self.held.setdefault(seq, set()).add(index)
        return True

    def fits(self, embeds: int, budget: int, pending: int) -> bool:
        """Whether an image of ``embeds`` embeddings can be encoded now: within the step's
        remaining encoder ``budget``, and with room for it and the ``pending`` embeddings of
        the request's images already chosen in this step -- evicting unread outputs, oldest
        first, when the free room alone is short."""
        if embeds > budget:
            return False
        need = embeds + pending
        if need <= self.free_slots:
            return True
        if need > self.freeable_slots:
            return False
        while need > self.free_slots:
            identifier, size = self.unread.popitem(last=False)
            del self.readers[identifier]
            del self.size[identifier]
            self.free_slots += size
            self.evicted += 1
        return True

    def allocate(self, seq: int, index: int, identifier: str, embeds: int) -> None:
        """Room for image ``identifier``'s output, read by request ``seq``."""
        self.readers.setdefault(identifier, set())
        self.size.setdefault(identifier, embeds)
        self.readers[identifier].add(seq)
        self.held.setdefault(seq, set()).add(index)
        self.free_slots -= embeds
        self.freeable_slots -= embeds

    def release(self, seq: int, index: int, identifier: str) -> None:
        """Request ``seq`` no longer reads its ``index``-th image; an output nobody reads
        becomes evictable (it stays cached until its room is needed)."""
        indices = self.held.get(seq)
        if indices is not None:
            indices.discard(index)
            if not indices:
                del self.held[seq]
        readers = self.readers.get(identifier)
        if not readers:
            return
        readers.discard(seq)
        if not readers:
            self.unread[identifier] = self.size[identifier]
            self.freeable_slots += self.size[identifier]

    def release_all(self, seq: int, identifiers: dict[int, str]) -> None:
        """Request ``seq`` reads none of its images any longer (finished, preempted, or not
        admitted after all); ``identifiers``: its images' identifiers by index."""
        for index in sorted(self.held.get(seq, ())):
            self.release(seq, index, identifiers[index])

    def reads(self, seq: int) -> frozenset[int]:
        """The image indices request ``seq`` reads from the cache."""
        return frozenset(self.held.get(seq, ()))


__all__ = ["EncoderCache"]
