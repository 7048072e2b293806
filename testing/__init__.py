"""The stateful machines, for kvspec's suite and downstream ones: ``blockmanager/`` (one block
manager driven as vLLM's scheduler would), ``scheduler/`` (vLLM's own scheduler driven as its
worker would), ``artifacts/`` (what a verdict leaves behind), and here what both share."""

from kvspec.testing.blockmanager.driver import Driver, SpecViolation, TraceStep, replay
from kvspec.testing.blockmanager.machine import STATS, Features, KVCacheMachine, RunStats

__all__ = ["STATS", "Driver", "Features", "KVCacheMachine", "RunStats", "SpecViolation", "TraceStep", "replay"]
