"""Typed exceptions for operations the spec rejects, and for bad input."""

from __future__ import annotations


class KVSpecError(Exception):
    """Base class of every error kvspec raises on purpose."""


class ConfigError(KVSpecError, ValueError):
    """A configuration the spec cannot describe (block size 0, negative window, ...)."""


class Rejected(KVSpecError):
    """An implementation refused an operation; the state must be unchanged."""


class NoFreeBlocks(Rejected):
    """An allocation needed more blocks than the pool could give."""


class NotAdmitted(Rejected):
    """An admission or slot reservation was refused (the scheduler must wait or preempt)."""


class Unsupported(KVSpecError):
    """The implementation declares it lacks this operation (never faked)."""
