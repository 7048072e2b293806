"""FINDINGS F16 on vLLM 0.6.3's BlockSpaceManagerV1: with prefix caching, a block that holds
generated tokens never serves a hit to a prompt with the same tokens.

``Sequence.hash_of_block`` hashes ``SequenceData.get_prefix_token_ids``, which keeps the prompt
and the output tokens apart (sequence.py:284-293, 537-545): the block of ``[0 | 3]`` (prompt 0,
generated 3) is cached under another hash than the block of the prompt ``[0, 3]``.  Both are
cached and computed; only the second is found.  A missed hit costs compute, not correctness.
"""

from __future__ import annotations

import logging

from kvspec.spec.config import Config

from .conftest import requires_vllm

pytestmark = requires_vllm("0.6.3", "0.6.3", pin="0.6.3")

CONFIG = Config(block_size=1, num_blocks=5, prefix_caching=True)


def _hit_after(first_prompt: list[int], next_token: int, steps: int) -> tuple[int, object]:
    """Admit ``first_prompt`` as seq 0 (sampling ``next_token``), run ``steps`` decode steps,
    then admit ``[0, 3, 0]`` as seq 1; returns seq 1's cached tokens and the state before it."""
    logging.getLogger("vllm").setLevel(logging.ERROR)
    from kvspec.adapters.legacy import make_legacy
    from kvspec.testing.blockmanager.driver import Driver

    driver = Driver(make_legacy(CONFIG, "v1"))
    driver.admit(0, first_prompt, len(first_prompt), next_token=next_token)
    for _ in range(steps):
        driver.step(0, 1, next_token=0)
    before = driver.impl.observe()
    driver.admit(1, [0, 3, 0], 3)
    outcome = driver.trace[-1].outcome
    return int(outcome.split(" cached tokens")[0].rsplit(" ", 1)[-1]), before


def test_v1_manager_misses_a_cached_prefix_that_holds_generated_tokens():
    hit, before = _hit_after([0], next_token=3, steps=1)  # seq 0: prompt [0], generated 3 then 0
    assert len(before.gpu.cached) == 2 and before.gpu.computed >= {b for _, b in before.gpu.cached}
    assert hit == 1, "the block holding the generated token 3 now serves the hit: F16 no longer reproduces"


def test_control_the_same_tokens_as_a_prompt_hit():
    hit, _ = _hit_after([0, 3], next_token=0, steps=0)  # [0, 3] as a prompt: both blocks hit
    assert hit == 2
