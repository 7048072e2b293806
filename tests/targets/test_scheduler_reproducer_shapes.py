"""A scheduler reproducer writes the model folder of its own shape: the tiny Llama's config.json
for a text shape, and the tiny BLIP-2 (config, tokenizer, image-processor configs) for a
multimodal one, whose ``ModelConfig`` loads a tokenizer (``skip_tokenizer_init`` is off there).

A fixed trace on a copy of 0.33.0's scheduler with the one-slot-short bug planted
(kvspec/testing/planted.py ``SHORT``): one request of ten tokens, three steps of a three-token
budget, the third scheduling position 8 past a four-slot table.  The file is written in a
process that imports the copy, then must fail on the copy naming ``admission-soundness`` and
pass on the release.  Runs in the 0.33.0 venv (``kvspec test-targets 0.33.0``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from kvspec.testing.planted import SCHEDULER, SHORT

from .conftest import requires_vllm

pytestmark = requires_vllm("0.33.0", "0.33.0")

SHAPE = {
    "block_size": 2,
    "swa_block_size": 1,
    "sliding_window": None,
    "extra_blocks": 0,
    "prefix_caching": False,
    "num_spec_tokens": 0,
    "async_scheduling": False,
    "max_num_batched_tokens": 3,
    "max_model_len": 16,
    "full_sequence_must_fit": False,
    "max_tokens": 2,
}
PROMPT = [0] * 10
STEP = {"accept": "00000000", "tokens": "00000000"}
TRACE = [
    {"op": "arrive", "args": {"seq": 0, "tokens": PROMPT, "max_tokens": 1}, "outcome": "ok"},
    *({"op": "step", "args": STEP, "outcome": ""} for _ in range(3)),
]
WRITE = """
import json, sys
from pathlib import Path
from kvspec.spec.groups import Shape
from kvspec.testing.artifacts.report import trace_from_json
from kvspec.testing.scheduler.reproducer import generate
shape, trace, out = json.loads(sys.argv[1]), json.loads(sys.argv[2]), Path(sys.argv[3])
made = generate(Shape(**shape), trace_from_json(trace), [], {"vllm_version": "0.33.0",
                "focus": ["admission-soundness"]})
if not hasattr(made, "text"):
    sys.exit(f"no reproducer: {made}")
(out / made.filename).write_text(made.text)
print(made.filename)
"""


@pytest.fixture(scope="module")
def copy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import vllm

    root = tmp_path_factory.mktemp("short")
    shutil.copytree(Path(vllm.__file__).parent, root / "vllm", ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    path = root / "vllm" / SCHEDULER
    path.write_text(SHORT.plant(path.read_text()))
    return root


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return {**env, **extra}


@pytest.mark.parametrize("mm_item_tokens", [None, 2], ids=["text", "multimodal"])
def test_the_reproducer_fails_on_the_copy_and_passes_on_the_release(copy, tmp_path, mm_item_tokens):
    shape = {**SHAPE, "mm_item_tokens": mm_item_tokens}
    args = [sys.executable, "-c", WRITE, json.dumps(shape), json.dumps(TRACE), str(tmp_path)]
    made = subprocess.run(args, capture_output=True, text=True, env=_env(PYTHONPATH=str(copy)), check=False)
    assert made.returncode == 0, made.stdout[-2000:] + made.stderr[-3000:]
    path = tmp_path / made.stdout.split()[-1]
    plain = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(path)]
    env = {k: v for k, v in _env().items() if k != "KVSPEC_CHECKOUT"}
    on_copy = subprocess.run(plain, capture_output=True, text=True, cwd=tmp_path, check=False,
                             env={**env, "PYTHONPATH": str(copy)})
    assert on_copy.returncode == 1 and "[admission-soundness]" in on_copy.stdout, on_copy.stdout[-3000:]
    on_release = subprocess.run(plain, capture_output=True, text=True, cwd=tmp_path, check=False, env=env)
    assert on_release.returncode == 0, on_release.stdout[-3000:]
