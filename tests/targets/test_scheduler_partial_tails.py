"""Partial tails beside vLLM: from 0.30.0 a full-attention group whose blocks are coarser than
the hash unit (a second group of smaller blocks) caches the block holding the prompt's last hash
boundary under that boundary's key (``FullAttentionManager._cache_partial_tail_block``).  Never
hit in these shapes, such a block still counts as cached when freed: it joins the free queue's
tail where an uncached block joins its head, and which cached blocks a later allocation evicts
follows from that.  A campaign met it as a hit vLLM made 2 tokens shorter than the reference
(`kvspec fuzz --vllm 0.33.0 --machine scheduler`, before the reference modelled it).  The
reference marks the same block (``caches_partial_tails``): the free queues agree, cached against
uncached, block for block."""

from __future__ import annotations

import logging

import attrs
from kvspec.spec.groups import Shape
from kvspec.testing.scheduler.driver import SchedulerDriver

from .conftest import requires_vllm

pytestmark = requires_vllm("0.30.0", pin="0.33.0")

# B=2 full attention + a W=4 window group of 1-token blocks (hashes at 1 token), EAGLE drafts.
SHAPE = Shape(
    block_size=2, swa_block_size=1, sliding_window=4, extra_blocks=0, prefix_caching=True,
    num_spec_tokens=3, async_scheduling=False, max_num_batched_tokens=22, max_model_len=24,
    full_sequence_must_fit=False, max_tokens=1, eagle=True,
)
IDLE = (bytes(4), bytes(4))


def _queues(policy_change: dict | None = None, shape: Shape = SHAPE) -> tuple[list[bool], list[bool]]:
    """After a 5- and a 13-token prompt ran to their ends: which free-queue entries hold a
    cached block, vLLM's queue and the reference's, head first."""
    import vllm
    from kvspec.adapters.v1_scheduler import VLLMV1SchedulerAdapter
    from kvspec.reference.policies import declared_for
    from kvspec.reference.scheduler import ReferenceScheduler

    logging.getLogger("vllm").setLevel(logging.ERROR)
    target = VLLMV1SchedulerAdapter(shape)
    policy = attrs.evolve(declared_for(vllm.__version__), **(policy_change or {}))
    reference = ReferenceScheduler(shape, num_blocks=target.num_blocks, policy=policy)
    for scheduler in (target, reference):
        driver = SchedulerDriver.for_shape(scheduler, shape)
        driver.arrive(0, [3, 0, 1, 2, 3], 1)
        driver.arrive(1, [3, 0, 1, 2, 2, 3, 2, 2, 1, 3, 2, 3, 1], 1)
        for _ in range(4):
            driver.step(*IDLE)
        assert not scheduler.live(0) and not scheduler.live(1)
    pool = target.manager.block_pool
    vllm_queue = [b.block_hash is not None for b in pool.free_block_queue.get_all_free_blocks()]
    ref_queue = [
        reference.cache.holds(b) or b in reference.partial_tails for b in reference.free
    ]
    return vllm_queue, ref_queue


def test_the_free_queue_orders_partial_tails_as_vllm_does():
    vllm_queue, ref_queue = _queues()
    assert vllm_queue == ref_queue


def test_without_partial_tails_the_free_queues_differ():
    """The choice is needed: a reference that caches no partial tail puts both prompts' tail
    blocks at the head of its free queue."""
    from kvspec.reference.policies import declared_for

    declared = declared_for("0.33.0").caches_partial_tails
    vllm_queue, ref_queue = _queues({"caches_partial_tails": attrs.evolve(declared, value=False)})
    assert vllm_queue != ref_queue
    assert sum(vllm_queue) == sum(ref_queue) + 2, (vllm_queue, ref_queue)
