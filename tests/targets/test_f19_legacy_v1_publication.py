"""FINDINGS F19 on vLLM 0.5.4's BlockSpaceManagerV1: with prefix caching, the last full block a
sequence has computed is not marked computed, so no later request can hit it.

``mark_blocks_as_computed`` runs ``compute_full_blocks_in_seq``, which marks the blocks before
``seq.get_len() // block_size - 1`` (0.5.4 block_manager_v1.py:664-674): the last full block is
left out, and ``get_all_computed_blocks`` stops at the first block not computed (:676-686).  It is
marked only once the sequence has filled the next block too; a sequence that ends first never
publishes it.  0.6.2 counts ``num_computed_tokens + token_chunk_size`` instead (0.6.2
block_manager_v1.py:684-700) and publishes it.  A missed hit costs compute, not correctness.
"""

from __future__ import annotations

import logging

from kvspec.spec.config import Config

from .conftest import requires_vllm

CONFIG = Config(block_size=1, num_blocks=8, prefix_caching=True)


def _hit_after(prompt: list[int], steps: int) -> int:
    """Admit ``prompt`` as seq 0, run ``steps`` decode steps, then admit ``[0, 0, 0, 0]`` as
    seq 1; returns seq 1's cached tokens."""
    logging.getLogger("vllm").setLevel(logging.ERROR)
    from kvspec.adapters.legacy import make_legacy
    from kvspec.testing.blockmanager.driver import Driver

    driver = Driver(make_legacy(CONFIG, "v1"))
    driver.admit(0, prompt, len(prompt), next_token=0)
    for _ in range(steps):
        driver.step(0, 1, next_token=0)
    driver.admit(1, [0, 0, 0, 0], 4)
    outcome = driver.trace[-1].outcome
    return int(outcome.split(" cached tokens")[0].rsplit(" ", 1)[-1])


@requires_vllm("0.4.0", "0.5.4", pin="0.5.4")
def test_f19_the_last_full_block_a_prompt_computed_is_not_found():
    # seq 0's prefill computed blocks [0] and [0, 0]; seq 1 may hit both (its last token is
    # recomputed, so blocks 0 and 1 of its 4 count): only the first is marked computed.
    assert _hit_after([0, 0], steps=0) == 1, "the prompt's last full block now serves the hit: F19 is gone"


@requires_vllm("0.4.0", "0.5.4", pin="0.5.4")
def test_f19_control_the_block_is_found_once_the_next_block_is_full():
    assert _hit_after([0, 0], steps=1) == 2


@requires_vllm("0.6.2", "0.6.3", pin="0.6.3")
def test_f19_control_later_releases_publish_the_last_full_block():
    assert _hit_after([0, 0], steps=0) == 2
