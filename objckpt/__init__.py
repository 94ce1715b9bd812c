"""objckpt: fast, safe checkpoints of PyTorch state to object storage.

    objckpt.save(model.state_dict(), "s3://bucket/run/step-100")
    objckpt.load(model.state_dict(), "s3://bucket/run/step-100")
"""
from __future__ import annotations

from ._version import __version__
from .api import async_save, delete, inspect, load, read, save
from .manager import CheckpointManager
from .distributed.placements import Shard
from .errors import (
    BlobMissingError,
    BucketNotFoundError,
    CheckpointExistsError,
    CollectiveLoadError,
    CorruptCheckpointError,
    NotFoundError,
    ObjckptError,
    RanksDidNotJoinError,
    StateDictMismatchError,
    TensorChangedError,
    UnsupportedFormatError,
    UnsupportedValueError,
)
from .results import LoadResult, SaveResult
from .save.background import SaveHandle

__all__ = [
    "__version__",
    "save",
    "async_save",
    "SaveHandle",
    "load",
    "read",
    "inspect",
    "delete",
    "CheckpointManager",
    "Shard",
    "SaveResult",
    "LoadResult",
    "ObjckptError",
    "NotFoundError",
    "BucketNotFoundError",
    "CheckpointExistsError",
    "CorruptCheckpointError",
    "UnsupportedFormatError",
    "StateDictMismatchError",
    "UnsupportedValueError",
    "CollectiveLoadError",
    "RanksDidNotJoinError",
    "TensorChangedError",
    "BlobMissingError",
]
