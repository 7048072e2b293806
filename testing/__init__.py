"""The stateful machines and the driver they share, for kvspec's suite and downstream ones."""

from .driver import Driver, SpecViolation, TraceStep, replay
from .machine import STATS, Features, KVCacheMachine, RunStats

__all__ = ["STATS", "Driver", "Features", "KVCacheMachine", "RunStats", "SpecViolation", "TraceStep", "replay"]
