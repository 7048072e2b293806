"""Straight-line reproducers of V1 traces whose requests carry extra keys (cache salt, LoRA
adapter, multimodal placement): the file builds the requests with the release's own
``Request``, ``LoRARequest`` and multimodal classes, as the adapter does, and fails under plain
pytest naming prefix-cache-isolation where vLLM gives two domains one block hash.

The traces are the findings' (FINDINGS F-KV9: a LoRA adapter named like another request's salt,
``kvspec check --vllm 0.20.1 --seed 1``; F-KV10: an image identifier equal to a salt,
``kvspec check --vllm 0.10.1.1 --seed 2``), each two admissions.  That the files pass on a
release that tags the keys (0.31.0 for F-KV9, 0.19.1 for F-KV10) is measured by hand in that
release's venv (BENCHMARKS.md, standalone reproducers): a test runs in one release's venv.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from kvspec.spec.config import Config
from kvspec.spec.invariants import Violation
from kvspec.testing.artifacts.reproducer import Reproducer, generate
from kvspec.testing.blockmanager.driver import TraceStep

from .conftest import VLLM, requires_vllm

CONFIG = Config(block_size=1, num_blocks=2, prefix_caching=True)
ISOLATION = [Violation("prefix-cache-isolation", "seq 1 holds a block cached in another domain")]


def _admit(seq: int, extra: dict) -> TraceStep:
    return TraceStep("admit", {"seq": seq, "tokens": [0], "num_new_tokens": 1, "next_token": 0, "extra": extra})


LORA_THEN_SALT = [
    _admit(0, {"cache_salt": None, "lora": "seq0", "mm": []}),
    _admit(1, {"cache_salt": "seq0", "lora": None, "mm": []}),
]
IMAGE_THEN_SALT = [
    _admit(0, {"cache_salt": None, "lora": None, "mm": [["seq0", 0, 1]]}),
    _admit(1, {"cache_salt": "seq0", "lora": None, "mm": []}),
]


def _red(trace: list[TraceStep], tmp_path: Path, built: str) -> str:
    """Write the reproducer of ``trace``'s isolation violation, check it builds ``built`` from
    the release's class, run it under plain pytest; its output."""
    made = generate("v1", CONFIG, trace, ISOLATION, {"vllm_version": VLLM, "focus": None})
    assert isinstance(made, Reproducer), f"a salt/LoRA/mm trace got no straight-line file: {made}"
    assert made.checks == ("prefix-cache-isolation",)
    assert built in made.text and "req1 = Request(" in made.text and "cache_salt='seq0'" in made.text
    path = tmp_path / made.filename
    path.write_text(made.text)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(path)],
        capture_output=True, text=True, cwd=tmp_path, timeout=900, check=False,
    )
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


@requires_vllm("0.12.0", "0.30.0", pin="0.20.1")
def test_fkv9_a_lora_name_equal_to_a_salt_gets_a_file_that_fails(tmp_path):
    out = _red(LORA_THEN_SALT, tmp_path, "LoRARequest(lora_name='seq0'")
    assert "Failed: [prefix-cache-isolation] expected different block hashes" in out


@requires_vllm("0.10.1.1", "0.12.0", pin="0.10.1.1")
def test_fkv10_an_image_identifier_equal_to_a_salt_gets_a_file_that_fails(tmp_path):
    built = "PlaceholderRange(offset=0, length=1)"
    out = _red(IMAGE_THEN_SALT, tmp_path, built)
    assert "Failed: [prefix-cache-isolation] expected different block hashes" in out


@requires_vllm("0.31.0", pin="0.33.0")
@pytest.mark.parametrize("trace", [LORA_THEN_SALT, IMAGE_THEN_SALT], ids=["lora", "image"])
def test_control_tagged_keys_give_no_file(trace):
    made = generate("v1", CONFIG, trace, ISOLATION, {"vllm_version": VLLM, "focus": None})
    assert not isinstance(made, Reproducer)
    assert "found no violation" in made.reason
