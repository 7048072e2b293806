"""Proposed fixes, measured without editing the files they belong to.

Each patch replaces one function of kvspec at run time, in the benchmark's process only, to
measure what the fix proposed in BENCHMARKS.md would buy.  None of them changes what is
checked; ``strategies`` changes how hypothesis draws prompts and chunk sizes (the same
distributions' supports, built from cached strategies instead of fresh ones per draw).

    signatures   adapters/v1.py, adapters/legacy.py ``_params``: ``inspect.signature`` of the
                 same vLLM functions on every request/sequence built -> memoised.
    lifetimes    spec/kv_memory.py ``ended_lifetimes``: every block on the free list counts as
                 "died now" after every operation, so ``Driver._advance`` pops B shadow cells
                 for all free blocks each time (O(N*B) per step) -> only blocks that were not
                 already free-and-uncached before the operation.
    strategies   testing/strategies.py ``prompts`` and testing/machine.py ``_chunk`` build new
                 ``one_of``/``map``/``sampled_from`` strategies on every draw, each validated
                 anew -> draw plain integers from cached strategies.
"""

from __future__ import annotations

import functools
from typing import Any

PATCHES = ("signatures", "lifetimes", "strategies")


def apply(names: list[str] | tuple[str, ...]) -> list[str]:
    done = []
    for name in names:
        if name not in PATCHES:
            raise ValueError(f"unknown what-if patch {name!r}")
        globals()[f"_patch_{name}"]()
        done.append(name)
    return done


def _patch_signatures() -> None:
    import importlib

    for mod_name in ("kvspec.adapters.v1", "kvspec.adapters.legacy"):
        mod = importlib.import_module(mod_name)
        original = mod._params
        if not hasattr(original, "cache_info"):
            mod._params = functools.cache(original)


def _patch_lifetimes() -> None:
    from kvspec.spec import kv_memory
    from kvspec.spec.state import Device
    from kvspec.testing import driver

    def ended_lifetimes(before, after):
        dead: set = set()
        for device in Device:
            pool_after = after.pool(device)
            pool_before = before.pool(device)
            if pool_after is None:
                continue
            if (pool_before is not None and pool_before.epochs is not None
                    and pool_after.epochs is not None):
                for block, epoch in pool_after.epochs.items():
                    if pool_before.epochs.get(block) != epoch:
                        dead.add((device, block))
            cached_after = pool_after.cached_key_of()
            # A block already free and uncached before the operation had its content dropped
            # when it got there: nothing of it is left to drop.
            already = set()
            if pool_before is not None:
                cached_before = pool_before.cached_key_of()
                already = {b for b in pool_before.free if b not in cached_before}
            for block in pool_after.free:
                if block not in cached_after and block not in already:
                    dead.add((device, block))
            if pool_before is None:
                continue
            cached_before = pool_before.cached_key_of()
            for block, key in cached_before.items():
                unreferenced = pool_before.refcounts.get(block, 0) == 0
                if unreferenced and cached_after.get(block) != key:
                    dead.add((device, block))
        return dead

    kv_memory.ended_lifetimes = ended_lifetimes
    driver.ended_lifetimes = ended_lifetimes


def _patch_strategies() -> None:
    from hypothesis import strategies as st
    from kvspec.testing import machine, strategies

    ints = functools.cache(lambda lo, hi: st.integers(lo, hi))
    token_lists = functools.cache(
        lambda lo, hi: st.lists(st.integers(0, strategies.ALPHABET - 1), min_size=lo, max_size=hi)
    )

    @st.composite
    def prompts(draw, earlier, block_size: int, max_len: int) -> tuple[int, ...]:
        if not earlier:
            return tuple(draw(token_lists(1, max_len)))
        base = earlier[draw(ints(0, len(earlier) - 1))]
        if draw(st.booleans()):
            cut = draw(ints(0, len(base) // block_size)) * block_size
        else:
            cut = draw(ints(0, len(base)))
        tail = draw(token_lists(0, max_len))
        prompt = (base[:cut] + tuple(tail))[:max_len]
        return prompt or tuple(draw(token_lists(1, max_len)))

    def _chunk(self, data, remaining: int) -> int:
        B = self.d.config.block_size
        kind = data.draw(ints(0, 2), label="num_new_tokens kind")
        if kind == 0:
            return remaining
        if kind == 1:
            return B
        return data.draw(ints(1, max(1, 2 * B)), label="num_new_tokens")

    strategies.prompts = prompts
    machine.prompts = prompts
    machine.KVCacheMachine._chunk = _chunk


def describe(names: list[str] | tuple[str, ...]) -> str:
    return ", ".join(names) if names else "none"


__all__: list[Any] = ["PATCHES", "apply", "describe"]
