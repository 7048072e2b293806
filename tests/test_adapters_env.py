"""Each target venv keeps vLLM's on-disk caches apart from every other release's
(adapters/__init__.py): a shared model-info cache is evicted on every alternation of releases."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def _cache_root(env: dict[str, str]) -> str:
    code = "import os, kvspec.adapters; print(os.environ['VLLM_CACHE_ROOT'])"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout


def test_a_venv_gets_a_vllm_cache_root_of_its_own():
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_CACHE_ROOT", "KVSPEC_VLLM_CACHE_ROOT")}
    assert Path(_cache_root(env).strip()) == Path(sys.prefix) / "vllm-cache"


def test_a_root_kvspec_chose_for_the_parent_interpreter_is_not_inherited(tmp_path):
    """``kvspec check --vllm X`` imports the adapters in the core venv, then re-executes in the
    release's venv: the child must not keep the core venv's cache root (a cold, shared cache
    made every scheduler run re-inspect the model in a subprocess, a minute under load)."""
    parent = str(tmp_path / "core-venv" / "vllm-cache")
    env = {**os.environ, "VLLM_CACHE_ROOT": parent, "KVSPEC_VLLM_CACHE_ROOT": parent}
    assert Path(_cache_root(env).strip()) == Path(sys.prefix) / "vllm-cache"


def test_a_cache_root_the_user_chose_is_kept(tmp_path):
    env = {**os.environ, "VLLM_CACHE_ROOT": str(tmp_path)}
    assert _cache_root(env).strip() == str(tmp_path)


def _tokenizers_parallelism(env: dict[str, str]) -> str:
    code = "import os, kvspec.adapters; print(os.environ['TOKENIZERS_PARALLELISM'])"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout


def test_tokenizers_parallelism_is_off_unless_the_user_chose():
    """A reproducer's verification forks after vLLM loaded the shape's tokenizer: with the pool
    off, Hugging Face tokenizers has nothing to warn about in the child."""
    env = {k: v for k, v in os.environ.items() if k != "TOKENIZERS_PARALLELISM"}
    assert _tokenizers_parallelism(env).strip() == "false"
    assert _tokenizers_parallelism({**env, "TOKENIZERS_PARALLELISM": "true"}).strip() == "true"
