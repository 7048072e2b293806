"""The straight-line writer on a trace whose requests carry extra keys (testing/artifacts/straight_line.py),
without vLLM: a recorded trace of two requests in two domains (a LoRA adapter, a cache salt)
whose block hashes an untagged hasher makes equal.  The written file must check what vLLM's
state shows (the two requests' block hashes), fail while the hasher folds the domains together
and pass once it tags them.  The same on vLLM's own classes: tests/targets/
test_straight_line_extra_keys.py."""

from __future__ import annotations

import sys
import types
from typing import Any

import attrs
import pytest
from kvspec.adapters.recording import Recorder
from kvspec.spec.config import Config
from kvspec.spec.invariants import Violation
from kvspec.spec.prefix_hash import ExtraKeys, HashCollision, key_of
from kvspec.testing.artifacts import straight_line
from kvspec.testing.artifacts.reproducer import NotReproducible, generate
from kvspec.testing.blockmanager.driver import TraceStep

MODULE = "kvspec_fake_engine"


class Request:
    """Hashes its tokens with its salt or adapter name folded in bare (``TAGGED`` False: vLLM
    0.12.0-0.30.0's untagged extra keys) or tagged with their kind."""

    __module__ = MODULE

    def __init__(self, request_id: str, prompt_token_ids: list[int], cache_salt: Any = None, lora: Any = None):
        self.request_id = request_id
        self.all_token_ids = list(prompt_token_ids)
        tagged = sys.modules[MODULE].TAGGED
        extra = [(kind, v) if tagged else v for kind, v in (("lora", lora), ("salt", cache_salt)) if v]
        self.block_hashes = [hash((tuple(self.all_token_ids[: i + 1]), *extra)) for i in range(len(self.all_token_ids))]


@attrs.define
class Adapter:
    """What the writer reads of an adapter: its requests with their domains and the hashes it
    learned for two keys."""

    held: list[tuple[Any, ExtraKeys]]
    hash_collisions: list[HashCollision]

    def requests(self) -> list[tuple[Any, ExtraKeys]]:
        return self.held


@pytest.fixture
def engine(monkeypatch):
    module = types.ModuleType(MODULE)
    module.Request = Request
    module.TAGGED = False
    monkeypatch.setitem(sys.modules, MODULE, module)
    return module


def _recording(violations: list[Violation]) -> tuple[straight_line.Recording, list[TraceStep]]:
    """Two admissions of ``[0]``: seq 0 under the adapter "x", seq 1 salted "x"."""
    rec = Recorder()
    domains = (ExtraKeys(lora="x"), ExtraKeys("x"))
    held = []
    for seq, extra in enumerate(domains):
        rec.op_index = seq + 1
        kwargs = {"request_id": f"seq{seq}-{seq}", "prompt_token_ids": [0], "cache_salt": extra.cache_salt,
                  "lora": extra.lora}
        held.append((rec.construct(Request, kwargs, "req")._real, extra))
    (first, _), (second, _) = held
    collisions = [HashCollision(h, key_of([0], 1, domains[0]), key_of([0], 1, domains[1]))
                  for h in first.block_hashes if h in second.block_hashes]
    driver = types.SimpleNamespace(impl=types.SimpleNamespace(inner=Adapter(held, collisions)),
                                   config=Config(block_size=1, num_blocks=2, prefix_caching=True))
    trace = [TraceStep("admit", {"seq": s, "tokens": [0], "num_new_tokens": 1, "extra": d.to_json()})
             for s, d in enumerate(domains)]
    return straight_line.Recording(rec, tuple(violations), None, len(trace), driver, "v1"), trace


def _run(text: str) -> None:
    namespace: dict[str, Any] = {}
    exec(compile(text, "test_reproducer.py", "exec"), namespace)
    namespace["test_prefix_cache_isolation"]()


def test_a_salt_and_lora_trace_gets_a_file_that_fails_untagged_and_passes_tagged(engine):
    isolation = Violation("prefix-cache-isolation", "seq 1 holds a block cached in another domain")
    recording, trace = _recording([isolation])
    text, checks = straight_line.write(recording, trace, title="t", config=recording.driver.config)
    assert checks == ("prefix-cache-isolation",)
    assert "req1 = Request(request_id='seq1-1', prompt_token_ids=[0], cache_salt='x', lora=None)" in text
    assert "if req0.block_hashes[0] == req1.block_hashes[0]:" in text
    with pytest.raises(pytest.fail.Exception, match=r"\[prefix-cache-isolation\] expected different block hashes"):
        _run(text)
    engine.TAGGED = True  # the fix: each extra key tagged with its kind
    _run(text)


def test_without_a_collision_no_file_is_written(engine):
    engine.TAGGED = True
    recording, trace = _recording([Violation("prefix-cache-isolation", "x")])
    with pytest.raises(straight_line.NotStraightLine):
        straight_line.write(recording, trace, title="t", config=recording.driver.config)


def test_only_shadow_memory_invariants_get_no_file_before_any_replay():
    trace = [TraceStep("admit", {"seq": 0, "tokens": [1], "num_new_tokens": 1}, "ok")]
    made = generate("v1", Config(block_size=4, num_blocks=4), trace, [Violation("kv-readback", "x")], {})
    assert isinstance(made, NotReproducible) and "shadow KV memory" in made.reason
