"""Reference variants that misbehave the way broken code does at run time: they hang, allocate
without bound, raise where no scheduler expects it, or answer differently on the same inputs.

``broken.py``'s variants break an invariant; these break the run itself, and each is what one
of the outcomes of ``kvspec check``/``kvspec replay`` must report (``testing.guard`` and the
driver's crash recording): a check that cannot fail is a defect, so every outcome has a variant
that produces it.  ``MISBEHAVING`` maps a name to the variant and the outcome it must end in;
the command line selects them as ``--impl broken:<name>``.
"""

from __future__ import annotations

import attrs
from kvspec.spec.config import Config
from kvspec.spec.errors import NoFreeBlocks
from kvspec.spec.interface import Admission
from kvspec.spec.state import KVState

from .manager import ReferenceManager

CHUNK = 8 * 1024 * 1024  # bytes the runaway variant takes per round


class HangInFree(ReferenceManager):
    """Frees a sequence by spinning forever (a loop whose exit condition never holds)."""

    name = "hang-in-free"

    def free(self, seq_id: int) -> None:
        done = False
        while not done:
            done = seq_id < 0


class RunawayAdmission(ReferenceManager):
    """Admits by taking memory without bound (a growing structure that is never trimmed)."""

    name = "runaway-admission"

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self.hoard: list[bytearray] = []

    def admit(self, seq_id, tokens, num_new_tokens, extra=()):
        while True:
            self.hoard.append(bytearray(CHUNK))  # zero-filled: the pages are touched


class RaiseInConstructor(ReferenceManager):
    """Cannot be built: its constructor raises."""

    name = "raise-in-constructor"

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        raise RuntimeError(f"cannot size the pool for {config.num_blocks} blocks")


class RaiseInObserve(ReferenceManager):
    """Builds, but its state cannot be read: the first observation raises."""

    name = "raise-in-observe"

    def observe(self) -> KVState:
        raise ValueError("block table of a sequence that was never admitted")


class KeyErrorInFree(ReferenceManager):
    """Forgets a multi-block sequence's bookkeeping: freeing it raises KeyError."""

    name = "keyerror-in-free"

    def free(self, seq_id: int) -> None:
        if len(self.seqs[seq_id].table.held()) > 1:
            raise KeyError(seq_id)
        super().free(seq_id)


class AssertInReserve(ReferenceManager):
    """Asserts that no table outgrows two blocks, which a long enough sequence does."""

    name = "assert-in-reserve"

    def reserve(self, seq_id: int, num_new_tokens: int, lookahead: int = 0):
        seq = self._running(seq_id)
        end = seq.num_computed + num_new_tokens + lookahead
        assert end <= 2 * self.config.block_size, f"seq {seq_id} needs more than two blocks"
        return super().reserve(seq_id, num_new_tokens, lookahead)


class RecursionInAppend(ReferenceManager):
    """Walks a sequence's tokens recursively with no base case once it holds two blocks."""

    name = "recursion-in-append"

    def append_token(self, seq_id: int, token: int) -> None:
        if len(self.seqs[seq_id].tokens) >= 2 * self.config.block_size:
            self._walk(0)
        super().append_token(seq_id, token)

    def _walk(self, depth: int) -> int:
        return self._walk(depth + 1) + 1


class FlakyAdmission(ReferenceManager):
    """Answers differently on the same inputs: the first instance built after ``arm()`` admits
    after answering OK only to fail the allocation (NoFreeBlocks); every later one admits."""

    name = "flaky-admission"
    armed = True  # class-wide: the next instance misbehaves

    @classmethod
    def arm(cls) -> None:
        cls.armed = True

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self.misbehaves = FlakyAdmission.armed
        FlakyAdmission.armed = False

    def can_admit(self, seq_id, tokens, num_new_tokens, extra=()):
        if self.misbehaves:
            return Admission.OK
        return super().can_admit(seq_id, tokens, num_new_tokens, extra)

    def admit(self, seq_id, tokens, num_new_tokens, extra=()):
        if self.misbehaves:
            raise NoFreeBlocks("allocation failed after the check said OK")
        return super().admit(seq_id, tokens, num_new_tokens, extra)


@attrs.frozen
class Misbehaving:
    cls: type[ReferenceManager]
    outcome: str  # the run's outcome it must end in: hung, memory, error, nondeterministic
    call: str  # the implementation method that misbehaves ("construct" for the constructor)


MISBEHAVING: dict[str, Misbehaving] = {
    HangInFree.name: Misbehaving(HangInFree, "hung", "free"),
    RunawayAdmission.name: Misbehaving(RunawayAdmission, "memory", "admit"),
    RaiseInConstructor.name: Misbehaving(RaiseInConstructor, "error", "construct"),
    RaiseInObserve.name: Misbehaving(RaiseInObserve, "error", "observe"),
    KeyErrorInFree.name: Misbehaving(KeyErrorInFree, "error", "free"),
    AssertInReserve.name: Misbehaving(AssertInReserve, "error", "reserve"),
    RecursionInAppend.name: Misbehaving(RecursionInAppend, "error", "append_token"),
    FlakyAdmission.name: Misbehaving(FlakyAdmission, "nondeterministic", "admit"),
}
