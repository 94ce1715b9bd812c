"""objckpt: fast, safe checkpoints of PyTorch state to object storage.

    objckpt.save(model.state_dict(), "s3://bucket/run/step-100")
    objckpt.load(model.state_dict(), "s3://bucket/run/step-100")
"""
from __future__ import annotations

__version__ = "0.1.0"

from .errors import (  # noqa: E402
    CheckpointExistsError,
    CollectiveLoadError,
    CorruptCheckpointError,
    NotFoundError,
    ObjckptError,
    StateDictMismatchError,
    UnsupportedFormatError,
    UnsupportedValueError,
)
from .api import LoadResult, SaveResult, inspect, load, read, save  # noqa: E402
from .sharding import Shard  # noqa: E402
from .async_save import SaveHandle, async_save  # noqa: E402

__all__ = [
    "save",
    "async_save",
    "SaveHandle",
    "load",
    "read",
    "inspect",
    "Shard",
    "SaveResult",
    "LoadResult",
    "ObjckptError",
    "NotFoundError",
    "CheckpointExistsError",
    "CorruptCheckpointError",
    "UnsupportedFormatError",
    "StateDictMismatchError",
    "UnsupportedValueError",
    "CollectiveLoadError",
]
