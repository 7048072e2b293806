"""The reference scheduler's prefix cache (reference/prefix_cache.py): the three hit rules on
small cached layouts, the sliding-window caching mask, and hits through the scheduler (a
request admitted at its prefix hit shares the hit blocks, and eviction follows the free queue)."""

from __future__ import annotations

from kvspec.reference.policies import declared_for
from kvspec.reference.prefix_cache import chunk_hit, full_hit, replay_boundaries, sparse_window_mask, window_hit
from kvspec.reference.scheduler import ReferenceScheduler
from kvspec.spec.groups import Shape


def _lookup(layout: list[int | None]):
    return lambda i: layout[i] if i < len(layout) else None


def test_full_attention_hits_the_run_from_block_zero():
    assert full_hit(_lookup([4, 5, None, 7]), 4) == [4, 5]
    assert full_hit(_lookup([4, 5, 6]), 2) == [4, 5]


def test_a_window_hits_the_last_run_long_enough_for_the_window():
    # Window 5 in blocks of 2: ceil(4 / 2) = 2 consecutive blocks end a hit.
    assert window_hit(_lookup([None, None, 8, 3, None, 9]), 6, 2, 5, 2, False) == [None, None, 8, 3]
    # No run of 2: the run from block 0 is a hit even if shorter.
    assert window_hit(_lookup([6, None, 8, None]), 4, 2, 5, 2, False) == [6]
    # With an EAGLE drop the run needs a block more, which is then dropped.
    assert window_hit(_lookup([1, 2, 3, None]), 4, 2, 5, 2, True) == [1, 2]
    # A hit whose end is not a multiple of the alignment (4 tokens) is not taken.
    assert window_hit(_lookup([1, 2, 3, None]), 4, 2, 3, 4, False) == [None, 2]


def test_chunked_local_hits_from_the_last_chunk():
    # Chunk 4, blocks of 2, 7 tokens at most: the chunk of position 7 starts at 4 (block 2).
    assert chunk_hit(_lookup([None, None, 5, None]), 7 // 2, 4 // 2) == [None, None, 5]


def test_a_window_group_caches_only_blocks_a_hit_can_use():
    # Hits at multiples of 8 tokens, window 3 in blocks of 2: one block before each multiple.
    assert sparse_window_mask(0, 8, 2, 3, 8, False) == [False, False, False, True] * 2
    # A window as long as the alignment needs every block.
    assert sparse_window_mask(0, 4, 2, 9, 8, False) == [True] * 4


def test_a_sparse_retention_keeps_only_the_tails_it_names():
    # Hits at multiples of 4 tokens, window 3 in blocks of 2 (a tail of one block).
    # Retention 0: only the tails before the boundaries (token 13 aligns down to 12: block 5).
    assert sparse_window_mask(0, 8, 2, 3, 4, False, 0, ()) == [False] * 8
    assert sparse_window_mask(0, 8, 2, 3, 4, False, 0, (13,)) == [False] * 5 + [True, False, False]
    # Every 8 tokens: blocks 3 and 7, and the boundary's (5 aligns down to 4: block 1).
    assert sparse_window_mask(0, 8, 2, 3, 4, False, 8, (5,)) == [False, True, False, True, False, False, False, True]
    # An EAGLE drop needs a block more and shifts the tail a block on: blocks 3-4 and 7-8.
    assert sparse_window_mask(2, 8, 2, 3, 4, True, 8, ()) == [False, True, True, False, False, True]
    # Dense (None) ignores the boundaries: a tail before every multiple of 4.
    assert sparse_window_mask(0, 4, 2, 3, 4, False, None, (1,)) == [False, True, False, True]


def test_replay_boundaries_are_the_prompt_less_one_or_the_aligned_ends_below():
    assert replay_boundaries(9, 4, False) == (8,)
    assert replay_boundaries(9, 4, True) == (4,)
    assert replay_boundaries(8, 4, True) == (0, 4)


SHAPE = Shape(
    block_size=2, swa_block_size=2, sliding_window=None, extra_blocks=0, prefix_caching=True,
    num_spec_tokens=0, async_scheduling=False, max_num_batched_tokens=16, max_model_len=16,
    full_sequence_must_fit=False, max_tokens=1,
)


def _serve(ref: ReferenceScheduler, seq: int, tokens: list[int]):
    ref.add(seq, tokens, 1)
    plan = ref.schedule()
    ref.update(plan, {s.seq_id: [0] for s in plan.scheduled})
    return plan


def test_a_request_starts_at_its_hit_and_shares_the_hit_blocks():
    ref = ReferenceScheduler(SHAPE)
    ref.add(0, [1, 1, 1, 1, 1], 2)
    first = ref.schedule()
    ref.update(first, {0: [0]})
    ref.add(1, [1, 1, 1, 1, 2], 1)
    plan = ref.schedule()
    assert [(s.seq_id, s.start, s.num_tokens) for s in plan.scheduled] == [(0, 5, 1), (1, 4, 1)], plan
    assert ref.reqs[1].tables[0][:2] == ref.reqs[0].tables[0][:2] and ref.hits == 1


def test_eviction_follows_the_releases_free_queue():
    """An uncached freed block goes to the queue's head under 0.33.0's policy (reused before the
    cached blocks behind it), to its tail under 0.12.0's (so a cached block goes first)."""
    starts = {}
    for release in ("0.12.0", "0.33.0"):
        ref = ReferenceScheduler(SHAPE, policy=declared_for(release))
        for seq, tokens in enumerate(([1, 1, 1, 1], [5], [7] * 12)):
            _serve(ref, seq, tokens)
        starts[release] = _serve(ref, 3, [1, 1, 1, 1, 2]).scheduled[0].start
    assert starts == {"0.12.0": 2, "0.33.0": 4}, starts
