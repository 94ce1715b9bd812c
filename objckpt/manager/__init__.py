"""Checkpoint management: :class:`CheckpointManager`, the latest-step index, retention, step names."""
from __future__ import annotations

from .index import StepIndex
from .manager import CheckpointManager
from .naming import StepFormatError, StepNaming, SwappedArgumentsError, step_name
from .retention import RetentionPolicy, StepOrderError

__all__ = ["CheckpointManager", "RetentionPolicy", "StepFormatError", "StepIndex", "StepNaming", "StepOrderError",
           "SwappedArgumentsError", "step_name"]
