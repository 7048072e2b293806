"""A focused run abandons the example where an operation that failed after its own check said
yes broke the target's block accounting.

vLLM 0.6.3's BlockSpaceManagerV2 (FINDINGS F12): ``can_swap_out`` says yes, ``swap_out`` frees
every GPU block (cpu_gpu_block_allocator.py:250-252, naive_block.py:305-307), hands CPU ids to
the table's Block objects one by one (naive_block.py:309-327) and raises NoFreeBlocks when the
CPU pool runs dry, before the table is refreshed (block_manager_v2.py:424-429).  vLLM's
scheduler does not catch that (the engine stops).  A run watching only ``progress`` went on:
the next ``append_slots`` asked the GPU allocator's refcounter about a CPU id and tripped its
assert (common.py:63 ``RefCounter.get``, via :119 ``is_appendable``) -- the "untriaged" crash
of ``python -m bench ttc --findings F15`` (2026-12-03).  The stand-in below is the reference
manager with that swap_out: it drops the GPU blocks under the table, raises NoFreeBlocks, and
crashes on the sequence's next step."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import run_state_machine_as_test
from kvspec.reference.manager import ReferenceManager
from kvspec.spec.config import Config
from kvspec.spec.errors import NoFreeBlocks
from kvspec.spec.interface import BlockCopy
from kvspec.testing import KVCacheMachine
from kvspec.testing.blockmanager.driver import Driver
from kvspec.testing.blockmanager.strategies import configs

CONFIG = Config(block_size=1, num_blocks=4, num_cpu_blocks=1)


class SwapOutNotRolledBack(ReferenceManager):
    """swap_out frees the sequence's GPU blocks under its table, then fails (F12's shape); the
    sequence's next step crashes on a block its pool no longer holds."""

    name = "test-swap-out-not-rolled-back"

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self.poisoned: set[int] = set()

    def swap_out(self, seq_id: int) -> list[BlockCopy]:
        seq = self._running(seq_id)
        for block in seq.table.held():
            self.gpu.decref(block)
        self.poisoned.add(seq_id)
        raise NoFreeBlocks("swap_out: the CPU pool ran dry")

    def reserve(self, seq_id: int, num_new_tokens: int, lookahead: int = 0) -> list[BlockCopy]:
        assert seq_id not in self.poisoned, "a block id the pool does not own"
        return super().reserve(seq_id, num_new_tokens, lookahead)


class SwapOutRefusedCleanly(ReferenceManager):
    """swap_out fails after the check said yes but changes nothing (F6's failed append keeps
    the accounting whole too)."""

    name = "test-swap-out-refused-cleanly"

    def swap_out(self, seq_id: int) -> list[BlockCopy]:
        raise NoFreeBlocks("swap_out: the CPU pool ran dry")


def _failed_swap_out(cls, focus):
    d = Driver(cls(CONFIG), focus=focus)
    d.admit(0, [0, 0], 2)
    d.swap_out(0)
    return d, d.check()


def test_a_failure_that_breaks_the_accounting_out_of_focus_is_noted():
    d, found = _failed_swap_out(SwapOutNotRolledBack, {"progress"})
    assert found == []  # progress is all this run watches
    assert d.accounting_broken is not None and d.accounting_broken.invariant in {"refcount-exact", "conservation"}


@pytest.mark.parametrize(
    ("cls", "focus"),
    [
        (SwapOutRefusedCleanly, {"progress"}),  # the failure left the accounting whole
        (SwapOutNotRolledBack, None),  # every invariant watched: the violation itself ends it
        (SwapOutNotRolledBack, {"refcount-exact", "conservation"}),
    ],
)
def test_nothing_is_noted_when_the_accounting_is_whole_or_watched(cls, focus):
    d, found = _failed_swap_out(cls, focus)
    assert d.accounting_broken is None
    assert bool(found) == (cls is SwapOutNotRolledBack)


def test_a_focused_machine_does_not_search_on_past_the_broken_accounting():
    """Without the rule the machine steps the sequence the failed swap_out left behind and
    meets the stand-in's crash (a consequence of the failure, not a finding of ``progress``)."""
    strategy = configs(block_sizes=st.just(1), max_blocks=4, sliding_window=False, min_cpu_blocks=1)
    run_state_machine_as_test(
        lambda: KVCacheMachine(SwapOutNotRolledBack, strategy, focus={"progress"}),
        settings=settings(settings(), max_examples=100, stateful_step_count=12, derandomize=True, database=None),
    )
