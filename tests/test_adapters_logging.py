"""The records a lean venv without triton makes vLLM and torch log are dropped, and nothing else."""

from __future__ import annotations

import logging

from kvspec.adapters import _ABSENT_TRITON_RECORDS, _AbsentTritonFilter


def _record(name: str, msg: str) -> logging.LogRecord:
    return logging.LogRecord(name, logging.ERROR, __file__, 1, msg, None, None)


def test_the_absent_triton_record_is_dropped_and_others_of_its_logger_kept() -> None:
    for name, prefix in _ABSENT_TRITON_RECORDS.items():
        quiet = _AbsentTritonFilter(prefix)
        assert not quiet.filter(_record(name, prefix + " ... Error: No module named 'triton'"))
        assert quiet.filter(_record(name, "Cannot get 1 free blocks from the pool"))
