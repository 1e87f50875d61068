"""Continuous batching policy: which requests run each step, pure and table-tested."""

from mlxd.scheduler.schedule import Budget, Chunk, Running, StepPlan, Waiting, schedule

__all__ = ["Budget", "Chunk", "Running", "StepPlan", "Waiting", "schedule"]
