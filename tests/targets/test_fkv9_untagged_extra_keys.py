"""FINDINGS F-KV9: from 0.12.0 to 0.30.0 the V1 prefix cache folds a LoRA adapter's name and a
cache salt into a block's hash as bare strings, so a request salted "X" and a request of the
adapter named "X" key the same tokens alike and share blocks across the two domains
(vllm-project/vllm#44701).

0.20.1 ``_gen_lora_extra_hash_keys`` returns ``[lora_request.lora_name]`` (kv_cache_utils.py:472)
and ``generate_block_hash_extra_keys`` appends ``request.cache_salt`` as it is (:522-530; 0.30.0
the same at :571, 621-629); 0.31.0 tags each extra key with its kind: ``("lora", name, path)``,
``("cache_salt", salt)`` (kv_cache_utils.py:567-584, 636-647; 0.33.0 at :590-607, 658-669).  The traces are the default
run's (``kvspec check --vllm 0.20.1 --seed 1``: two admissions) and a hit across the domains,
replayed through the V1 adapter.  vLLM's own Scheduler shows the same keys as one block hash
learned for two keys with equal tokens in a LoRA and a salted domain (``prefix-cache-consistency``,
the scheduler part of the default runs on 0.12.0, 0.20.1 and 0.30.0).
"""

from __future__ import annotations

from kvspec.adapters.v1 import VLLMV1Adapter
from kvspec.spec.config import Config
from kvspec.spec.groups import Shape
from kvspec.spec.prefix_hash import ExtraKeys
from kvspec.spec.violation import Violation
from kvspec.targets.registry import parse
from kvspec.testing.blockmanager.driver import Driver
from kvspec.testing.scheduler.driver import SchedulerDriver

from .conftest import VLLM, requires_vllm

CONFIG = Config(block_size=1, num_blocks=8, prefix_caching=True)


def _isolation(driver: Driver) -> list[str]:
    return [v.message for v in driver.check() if v.invariant == "prefix-cache-isolation"]


def _cached_tokens(driver: Driver) -> int:
    return int(driver.trace[-1].outcome.split(" cached tokens")[0].rsplit(" ", 1)[-1])


def _salted_after_adapter(salt: str) -> tuple[Driver, int, list[str]]:
    """seq 0: ``[0, 0]`` under the adapter "seq0"; then seq 1: ``[0, 0, 0]`` salted ``salt``.
    Returns the driver, seq 1's cached tokens and the isolation violations after it."""
    d = Driver(VLLMV1Adapter(CONFIG))
    assert d.admit(0, [0, 0], 2, 0, ExtraKeys(lora="seq0"))
    assert not _isolation(d)
    assert d.admit(1, [0, 0, 0], 3, 0, ExtraKeys(salt))
    return d, _cached_tokens(d), _isolation(d)


@requires_vllm("0.12.0", "0.30.0", pin="0.30.0")
def test_fkv9_the_default_runs_trace_shares_a_block_across_domains():
    d = Driver(VLLMV1Adapter(Config(block_size=1, num_blocks=2, prefix_caching=True)))
    assert d.admit(0, [0], 1, 0, ExtraKeys(lora="seq0"))
    assert not _isolation(d)
    assert d.admit(1, [0], 1, 0, ExtraKeys("seq0"))
    found = _isolation(d)
    assert found and "in another domain" in found[0], "F-KV9 no longer reproduces: " + repr(found)


@requires_vllm("0.12.0", "0.30.0", pin="0.30.0")
def test_fkv9_a_salted_request_hits_the_blocks_of_the_adapter_named_like_its_salt():
    # The salt joins the first block's key only (``start_token_idx == 0``), the adapter's name
    # every block's: block 0 keys alike in both domains, block 1 does not.
    _, hit, found = _salted_after_adapter("seq0")
    assert hit == 1 and found, f"F-KV9 no longer reproduces: {hit} cached tokens, {found}"


@requires_vllm("0.12.0", pin="0.30.0")
def test_fkv9_control_a_salt_unlike_the_adapters_name_misses():
    _, hit, found = _salted_after_adapter("seq1")
    assert hit == 0 and not found


@requires_vllm("0.31.0", pin="0.33.0")
def test_fkv9_control_031_on_tags_the_keys_apart():
    _, hit, found = _salted_after_adapter("seq0")
    assert hit == 0 and not found


def _scheduler_collisions(salt: str) -> list[Violation]:
    """vLLM's own Scheduler (full attention, B=2, prefix caching): ``[0, 0]`` arrives under the
    adapter "seq1", then ``[0, 0]`` salted ``salt`` (the default run's trace on 0.30.0,
    ``--seed 2``); the prefix-cache-consistency violations after the two arrivals."""
    from kvspec.adapters.v1_scheduler import VLLMV1SchedulerAdapter

    shape = Shape(
        block_size=2, swa_block_size=2, sliding_window=None, extra_blocks=4, prefix_caching=True,
        num_spec_tokens=0, async_scheduling=False, max_num_batched_tokens=16, max_model_len=16,
        full_sequence_must_fit=False, max_tokens=1,
    )
    driver = SchedulerDriver(VLLMV1SchedulerAdapter(shape))
    driver.arrive(0, (0, 0), 1, ExtraKeys(lora="seq1"))
    driver.arrive(1, (0, 0), 1, ExtraKeys(salt))
    return [v for v in driver.check() if v.invariant == "prefix-cache-consistency"]


@requires_vllm("0.12.0", "0.30.0", pin="0.30.0")
def test_fkv9_scheduler_form_one_hash_stands_for_a_lora_name_and_an_equal_salt():
    found = _scheduler_collisions("seq1")
    assert found and found[0].kind == "domain-collision", "F-KV9's scheduler form is gone: " + repr(found)
    # The requests whose blocks the hash stood for (the picture marks them), and what it confused.
    assert (found[0].seqs, found[0].domains) == ((0, 1), ("cache_salt", "lora")), found
    assert (found[0].expected, found[0].observed) == ("lora=seq1", "cache_salt=seq1"), found


@requires_vllm("0.12.0", pin="0.30.0")
def test_fkv9_scheduler_form_control_another_salt_or_031_on():
    assert _scheduler_collisions("seq2") == []
    if parse(VLLM) >= parse("0.31.0"):
        assert _scheduler_collisions("seq1") == []
