"""FINDINGS F4 on vLLM 0.6.3's own legacy ``Scheduler``: prefix caching with chunked prefill
hands out blocks that no sequence computed.

BlockSpaceManagerV2's ``mark_blocks_as_computed`` marks every block ``allocate`` touched, the
whole prompt, once the first chunk is scheduled (prefix_caching_block.py:515-520; the scheduler
calls it for every scheduled group at the end of ``schedule()``, scheduler.py:1341-1343).  A
request aborted after its first chunk frees those blocks into the evictor still marked computed,
so a later request with the same prefix is scheduled with them as its cached prefix, and the
model runner skips computing exactly those positions (model_runner.py:505-550): it attends to
KV that was never written.  The test drives the real ``Scheduler`` (CPU only: no model runs)
and plays the engine's part between steps the way ``LLMEngine`` does (the scheduled chunk is
added to the group's computed tokens; a group past its prompt gets one sampled token).
"""

from __future__ import annotations

import logging

import pytest

from .conftest import requires_vllm

pytestmark = requires_vllm("0.6.3", "0.6.3", pin="0.6.3")

BLOCK = 2
BUDGET = 8  # max_num_batched_tokens; prefix caching + chunking needs a multiple of BLOCK
PROMPT_A = list(range(100, 120))  # 20 tokens, 10 blocks
SHARED = 16  # B shares A's first 16 tokens (8 full blocks)


def _scheduler():
    from vllm.config import CacheConfig, SchedulerConfig
    from vllm.core.scheduler import Scheduler

    cache = CacheConfig(block_size=BLOCK, gpu_memory_utilization=0.9, swap_space=0, cache_dtype="auto",
                        enable_prefix_caching=True)
    cache.num_gpu_blocks, cache.num_cpu_blocks = 64, 0
    sched = SchedulerConfig(max_num_batched_tokens=BUDGET, max_num_seqs=8, max_model_len=64,
                            enable_chunked_prefill=True)
    return Scheduler(sched, cache, None)


def _group(rid: int, tokens: list[int]):
    from vllm.inputs import LLMInputs
    from vllm.sampling_params import SamplingParams
    from vllm.sequence import Sequence, SequenceGroup

    seq = Sequence(rid, LLMInputs(prompt_token_ids=tokens), block_size=BLOCK)
    return SequenceGroup(request_id=str(rid), seqs=[seq], arrival_time=float(rid),
                         sampling_params=SamplingParams(max_tokens=8))


def _step(scheduler) -> dict[str, tuple[int, int, int]]:
    """One ``schedule()`` and the engine's bookkeeping after it: request id -> (computed tokens
    before the step, chunk, cached-prefix tokens the model runner is told to skip)."""
    from vllm.sequence import Logprob

    metadata, out, _ = scheduler.schedule()
    cached = {m.request_id: len(m.computed_block_nums or []) * BLOCK for m in metadata}
    rows = {}
    for scheduled in out.scheduled_seq_groups:
        group = scheduled.seq_group
        seq = group.get_seqs()[0]
        rows[group.request_id] = (seq.data.get_num_computed_tokens(), scheduled.token_chunk_size,
                                  cached[group.request_id])
        group.update_num_computed_tokens(scheduled.token_chunk_size)
        if not group.is_prefill():
            seq.append_token_id(0, {0: Logprob(0.0)})
    return rows


@pytest.mark.parametrize("abort_a", [True, False], ids=["a-aborted-after-its-first-chunk", "a-runs-on"])
def test_f4_a_later_request_is_served_blocks_nobody_computed(abort_a: bool) -> None:
    logging.getLogger("vllm").setLevel(logging.ERROR)
    s = _scheduler()
    s.add_seq_group(_group(0, [7, 7, 7]))  # a decoding request, so A's chunks are rounded to blocks
    _step(s)
    s.add_seq_group(_group(1, PROMPT_A))
    first = _step(s)
    assert first["1"][:2] == (0, 6), first  # A: positions 0-5 only
    if abort_a:
        s.abort_seq_group("1")
    s.add_seq_group(_group(2, [*PROMPT_A[:SHARED], 999]))
    rows = _step(s)
    if abort_a:
        # B is scheduled with A's 8 shared blocks as its cached prefix; A wrote positions 0-5.
        assert rows["2"][2] == SHARED, rows
    else:
        # Control: while A runs, its chunk takes the budget first (rounded down to whole blocks)
        # and B, budgeted for its whole prompt, hits included, does not fit in what is left.
        assert "2" not in rows, rows
        assert rows["1"][:2] == (6, 6), rows
