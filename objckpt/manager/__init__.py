"""Checkpoint management: :class:`CheckpointManager`, the latest-step index, retention."""
from __future__ import annotations

from .index import StepIndex, step_name
from .manager import CheckpointManager
from .retention import RetentionPolicy

__all__ = ["CheckpointManager", "RetentionPolicy", "StepIndex", "step_name"]
