"""Kept for imports of the old path: step timing now lives in :mod:`rankguard.client`."""

from ..client import Clock, StepTimer, StepTiming, timed_allreduce_hook, union_length

__all__ = ["Clock", "StepTimer", "StepTiming", "timed_allreduce_hook", "union_length"]
