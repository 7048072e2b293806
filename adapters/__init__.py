"""The adapters: vLLM's block managers and V1 scheduler behind the spec's interfaces (the only
code that imports vllm).

vLLM keeps on-disk caches under ``VLLM_CACHE_ROOT`` (default ``~/.cache/vllm``) whose file names
do not carry the release: the model registry's inspection of a model class
(``modelinfos/<module>-<class>.json``, checked against the model file's hash, 0.33.0
vllm/model_executor/models/registry.py:1012-1085) is recomputed in a subprocess on every miss,
about a minute of a scheduler run.  Two releases sharing one file evict each other on every
alternation, so each target venv gets a cache root of its own unless the user chose one.
``KVSPEC_VLLM_CACHE_ROOT`` marks a root kvspec chose: a process started from another interpreter
(``kvspec check --vllm X`` re-executes in the release's venv) inherits the variable, and a root
kvspec chose for the parent is replaced by this interpreter's own.

A lean venv with a CPU build of torch has no triton (``targets/lean.py``).  vLLM then logs an
error at import for its vendored ``triton_kernels`` (0.12.0-0.33.0
vllm/model_executor/layers/fused_moe/config.py: ``logger.error("Failed to import Triton
kernels ...")``) and torch a warning (torch/_library/triton.py); both describe kvspec's venv, not
the code under test, and kvspec never runs a kernel.  Where triton is absent those two records,
and only those, are dropped.

The scheduler adapter's model folder has a tokenizer, which vLLM's ``ModelConfig`` loads; a
reproducer's verification then forks, and Hugging Face ``tokenizers`` warns on stderr that it
disables its thread pool in the child ("The current process just got forked ...").  kvspec never
tokenizes in parallel: ``TOKENIZERS_PARALLELISM`` is off unless the user set it.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
from pathlib import Path

VLLM_CACHE_ENV = "VLLM_CACHE_ROOT"

CHOSEN_BY_KVSPEC_ENV = "KVSPEC_VLLM_CACHE_ROOT"

if VLLM_CACHE_ENV not in os.environ or os.environ[VLLM_CACHE_ENV] == os.environ.get(CHOSEN_BY_KVSPEC_ENV):
    os.environ[VLLM_CACHE_ENV] = os.environ[CHOSEN_BY_KVSPEC_ENV] = str(Path(sys.prefix) / "vllm-cache")

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

_ABSENT_TRITON_RECORDS = {
    "vllm.model_executor.layers.fused_moe.config": "Failed to import Triton kernels",
    "torch._library.triton": "Triton not available",
}


class _AbsentTritonFilter(logging.Filter):
    """Drops the one record of its logger that says triton is missing."""

    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefix)


def _quiet_absent_triton() -> None:
    if importlib.util.find_spec("triton") is not None:
        return
    for name, prefix in _ABSENT_TRITON_RECORDS.items():
        logging.getLogger(name).addFilter(_AbsentTritonFilter(prefix))


_quiet_absent_triton()
