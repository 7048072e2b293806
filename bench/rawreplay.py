"""Replay a recorded trace with the implementation's operations alone: the target's own cost.

``RawDriver`` performs exactly the implementation calls ``kvspec.testing.Driver`` performs for
each trace step (admission check, admit, commit, append_token, reserve, fork, free, swap,
reset), in the same order and with the same arguments, and nothing else: no ``observe()``, no
shadow KV memory, no invariant, no hypothesis.  ``strip_observation`` also switches off what
the adapters keep only so that ``observe()`` can answer (the hash -> PrefixKey dictionary, the
V1 allocation-epoch counter), so what remains is the scheduler-side calls into vLLM.

Each step's outcome (admitted / refused) is compared with the one recorded: a replay that
diverged would be measuring a different run.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from kvspec.spec.errors import Rejected
from kvspec.spec.interface import Admission, Capability
from kvspec.spec.prefix_hash import ExtraKeys


def strip_observation(impl: Any) -> Any:
    """Turn off the adapter's observation-only bookkeeping (no effect on vLLM's state)."""
    if hasattr(impl, "_learn_hashes"):  # adapters/v1.py: hash -> PrefixKey for observe()
        impl._learn_hashes = lambda *_a, **_k: None
    if hasattr(impl, "_learn"):  # adapters/legacy.py: the same for the legacy hashes
        impl._learn = lambda *_a, **_k: None
    manager = getattr(impl, "_manager", None)
    pool = getattr(manager, "block_pool", None)
    if pool is not None and "get_new_blocks" in vars(pool):
        del pool.get_new_blocks  # adapters/v1.py _count_allocations wraps it per instance
    return impl


class _Seq:
    __slots__ = ("computed", "status", "tokens")

    def __init__(self, tokens: list[int], computed: int) -> None:
        self.tokens = tokens
        self.computed = computed
        self.status = "running"


class RawDriver:
    """The Driver's calls into the implementation, without any checking."""

    def __init__(self, impl: Any) -> None:
        self.impl = impl
        self.check_admission = Capability.ADMISSION_CHECK in impl.capabilities
        self.lookahead = (
            impl.config.max_lookahead if Capability.LOOKAHEAD in impl.capabilities else 0
        )
        self.seqs: dict[int, _Seq] = {}
        self.mismatches = 0

    def _compute(self, seq_id: int, seq: _Seq, start: int, end: int, next_token: int) -> None:
        if end > start:
            self.impl.commit(seq_id, end - start)
        seq.computed = end
        if end == len(seq.tokens):
            self.impl.append_token(seq_id, next_token)
            seq.tokens.append(next_token)

    def admit(self, seq_id: int, tokens: list[int], k: int, next_token: int, extra: Any = ()) -> bool:
        impl = self.impl
        if self.check_admission and impl.can_admit(seq_id, tokens, k, extra) is not Admission.OK:
            return False
        try:
            hit = impl.admit(seq_id, tokens, k, extra)
        except Rejected:
            return False
        seq = _Seq(list(tokens), hit)
        self.seqs[seq_id] = seq
        self._compute(seq_id, seq, hit, min(hit + max(1, k), len(tokens)), next_token)
        return True

    def step(self, seq_id: int, k: int, next_token: int) -> bool:
        seq = self.seqs[seq_id]
        start = seq.computed
        k = max(1, min(k, len(seq.tokens) - start))
        try:
            self.impl.reserve(seq_id, k, self.lookahead)
        except Rejected:
            return False
        self._compute(seq_id, seq, start, start + k, next_token)
        return True

    def apply(self, op: str, a: dict[str, Any], recorded: str) -> None:
        ok: bool | None = None
        if op == "admit":
            extra = ExtraKeys.from_json(a.get("extra"))  # the request's cache domain
            ok = self.admit(a["seq"], a["tokens"], a["num_new_tokens"], a.get("next_token", 0), extra)
        elif op == "step":
            ok = self.step(a["seq"], a["num_new_tokens"], a.get("next_token", 0))
        elif op == "fork":
            self.impl.fork(a["parent"], a["child"])
            parent = self.seqs[a["parent"]]
            child = _Seq(list(parent.tokens), parent.computed)
            self.seqs[a["child"]] = child
        elif op == "free":
            # A sequence whose admission was refused waits in the scheduler's queue and may be
            # dropped from there: nothing of it is in the block manager.
            seq = self.seqs.pop(a["seq"], None)
            if seq is not None and seq.status != "waiting":
                self.impl.free(a["seq"])
        elif op == "preempt":
            self.impl.free(a["seq"])
            seq = self.seqs[a["seq"]]
            seq.status, seq.computed = "waiting", 0
        elif op in ("swap_out", "swap_in"):
            try:
                getattr(self.impl, op)(a["seq"])
                ok = True
            except Rejected:
                ok = False
        elif op == "reset_prefix_cache":
            self.impl.reset_prefix_cache()
        else:
            raise ValueError(f"unknown operation {op!r}")
        if ok is not None and ok != _recorded_ok(op, recorded):
            self.mismatches += 1


def _recorded_ok(op: str, outcome: str) -> bool:
    if op in ("admit", "readmit"):
        return "admitted" in outcome
    return outcome.startswith("ok")


def replay_raw(impl: Any, trace: Iterable[dict[str, Any]]) -> RawDriver:
    # A re-admission is recorded as an ``admit`` carrying all of the sequence's tokens.
    driver = RawDriver(impl)
    for step in trace:
        driver.apply(step["op"], step["args"], step.get("outcome", ""))
    return driver
