"""FINDINGS F-KV10: up to 0.12.0 the V1 prefix cache folds a multimodal item's identifier into a
block's hash as a bare string, beside a cache salt that is a bare string too, so a request
salted "X" and a request whose image has the identifier "X" key the same tokens alike and
share blocks across the two domains.

0.10.1.1 ``_gen_mm_extra_hash_keys`` appends ``mm_hashes[i]`` (kv_cache_utils.py:458; 0.10.2
:478; 0.12.0 appends ``mm_feature.identifier``, :434) and ``generate_block_hash_extra_keys``
appends ``request.cache_salt`` as it is (0.10.1.1 :508).  0.19.1 keys an item as
``(identifier, offset - start)`` (kv_cache_utils.py:440), a tuple no salt string equals.  The
trace is the default run's (``kvspec check --vllm 0.10.1.1 --seed 2``: two admissions).  The
violation names the domains it confused (``cache_salt`` and ``mm``), which tells it from F-KV9
(a LoRA name against a salt, the same kind) on 0.12.0, where both occur.
"""

from __future__ import annotations

from kvspec.adapters.v1 import VLLMV1Adapter
from kvspec.spec.config import Config
from kvspec.spec.prefix_hash import ExtraKeys, MMFeature
from kvspec.spec.violation import Violation
from kvspec.testing.blockmanager.driver import Driver

from .conftest import requires_vllm


def _image_then_salt() -> list[Violation]:
    d = Driver(VLLMV1Adapter(Config(block_size=1, num_blocks=2, prefix_caching=True)))
    assert d.admit(0, [0], 1, 0, ExtraKeys(mm=(MMFeature("seq0", 0, 1),)))
    assert not [v for v in d.check() if v.invariant == "prefix-cache-isolation"]
    assert d.admit(1, [0], 1, 0, ExtraKeys("seq0"))
    return [v for v in d.check() if v.invariant == "prefix-cache-isolation"]


@requires_vllm("0.10.1.1", "0.12.0", pin="0.12.0")
def test_fkv10_a_salt_equal_to_an_image_identifier_shares_its_block():
    found = [v for v in _image_then_salt() if v.kind == "cross-domain-key"]
    assert found, "F-KV10 no longer reproduces: " + repr(_image_then_salt())
    assert found[0].domains == ("cache_salt", "mm"), found


@requires_vllm("0.19.1", pin="0.33.0")
def test_fkv10_control_from_0_19_1_the_item_is_keyed_with_its_offset():
    assert _image_then_salt() == []
