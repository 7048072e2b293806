"""A sequence's block table, with sliding-window rotation.

Slot i holds positions i*B .. i*B+B-1.  With a sliding window the table drops (marks
``DROPPED``) every slot before the first block the current step still needs and releases
that block to the pool; new positions always get fresh blocks.  A full block is therefore
never overwritten in place: rotation recycles a block only through the pool, as a new
identity -- the SlidingWindowBlockTable the seed issue asks for.
"""

from __future__ import annotations

from kvspec.spec.state import DROPPED, Slot

from .pool import BlockPool


class BlockTable:
    def __init__(self, slots: list[Slot] | None = None) -> None:
        self.slots: list[Slot] = slots if slots is not None else []
        self.first_live = 0  # every slot before this index is DROPPED

    def held(self) -> list[int]:
        return [b for b in self.slots[self.first_live :] if b is not DROPPED]

    def droppable(self, first_needed: int) -> list[int]:
        """Blocks that dropping every slot before ``first_needed`` would release."""
        return [b for b in self.slots[self.first_live : first_needed] if b is not DROPPED]

    def drop_before(self, first_needed: int, pool: BlockPool) -> None:
        for i in range(self.first_live, min(first_needed, len(self.slots))):
            block = self.slots[i]
            if block is not DROPPED:
                self.slots[i] = DROPPED
                pool.decref(block)
        self.first_live = max(self.first_live, min(first_needed, len(self.slots)))

    def grow_to(self, num_slots: int, pool: BlockPool) -> None:
        while len(self.slots) < num_slots:
            self.slots.append(pool.allocate())

    def fork(self, pool: BlockPool) -> BlockTable:
        for block in self.held():
            pool.incref(block)
        child = BlockTable(list(self.slots))
        child.first_live = self.first_live
        return child

    def release(self, pool: BlockPool) -> None:
        # Tail first, so the evictor keeps a sequence's prefix longest.
        for block in reversed(self.held()):
            pool.decref(block)
        self.slots = [DROPPED] * len(self.slots)
        self.first_live = len(self.slots)
