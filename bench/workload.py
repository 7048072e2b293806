"""A fixed, deterministic scheduler workload for the scale benchmark.

Hypothesis draws small configurations on purpose (small counterexamples); to see how the cost
of a step grows with realistic sizes the scale benchmark drives the ``Driver`` through one
plain schedule instead: admit ``seqs`` sequences whose prompts share their first half (so the
prefix cache has something to hit), prefill them in chunks of ``chunk`` tokens, then decode
round-robin for ``decode`` rounds, then free everything.  The same trace is then replayed raw.
"""

from __future__ import annotations

import random
from typing import Any


def prompts(point: dict[str, Any]) -> list[list[int]]:
    rng = random.Random(point.get("seed", 0))
    length = point["prompt_len"]
    shared = [rng.randrange(32000) for _ in range(length // 2)]
    return [shared + [rng.randrange(32000) for _ in range(length - len(shared))]
            for _ in range(point["seqs"])]


def scheduler_workload(driver: Any, point: dict[str, Any]) -> None:
    chunk = point.get("chunk", 512)
    rng = random.Random(point.get("seed", 0) + 1)
    live: list[int] = []
    for seq_id, prompt in enumerate(prompts(point)):
        if not driver.admit(seq_id, prompt, chunk, next_token=rng.randrange(32000)):
            continue
        live.append(seq_id)
        _check(driver)
        # Prefill the rest of the prompt chunk by chunk, as a chunked-prefill scheduler does.
        while driver.seqs[seq_id].num_computed < len(prompt):
            if not driver.step(seq_id, chunk, next_token=rng.randrange(32000)):
                break
            _check(driver)
    for _ in range(point.get("decode", 16)):
        for seq_id in live:
            driver.step(seq_id, 1, next_token=rng.randrange(32000))
            _check(driver)


def _check(driver: Any) -> None:
    found = driver.check()
    if found:
        raise AssertionError("\n".join(map(str, found[:5])))
