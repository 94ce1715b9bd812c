"""objckpt: fast, safe checkpoints of PyTorch state to object storage.

    objckpt.save(model.state_dict(), "s3://bucket/run/step-100")
    objckpt.load(model.state_dict(), "s3://bucket/run/step-100")
"""
from __future__ import annotations

from ._version import __version__
from .api import async_save, delete, inspect, load, read, save
from .ops.diff import DiffReport, diff
from .manager import CheckpointManager
from .distributed.placements import Shard
from .errors import (
    BlobMissingError,
    BucketNotFoundError,
    CheckpointExistsError,
    CollectiveError,
    CollectiveLoadError,
    CommitReplacedError,
    ConditionalWriteIgnoredError,
    CorruptCheckpointError,
    CredentialsRefusedError,
    DcpDirectoryError,
    ForeignSaveError,
    InvalidURIError,
    MemoryBudgetError,
    MissingKeyError,
    NotFoundError,
    NotS3EndpointError,
    ObjckptError,
    OptimizerMismatchError,
    PlainHttpEndpointError,
    RankLostError,
    RanksDidNotJoinError,
    StateDictMismatchError,
    StorageError,
    StorageTimeoutError,
    TensorChangedError,
    UnsupportedFormatError,
    UnsupportedValueError,
)
from .results import LoadResult, SaveResult
from .tier.errors import DrainError, LocalTierError, TierRestoreError, TierSettingsError
from .tier.settings import TierSettings
from .tier.topology import TopologyError
from .tier.transfer import PeerCopyError
from .save.background import SaveHandle
from .ops.copy import CopyReport, copy

__all__ = [
    "__version__",
    "save",
    "async_save",
    "SaveHandle",
    "load",
    "read",
    "inspect",
    "delete",
    "copy",
    "diff",
    "CopyReport",
    "DiffReport",
    "CheckpointManager",
    "TierSettings",
    "Shard",
    "SaveResult",
    "LoadResult",
    "ObjckptError",
    "DrainError",
    "LocalTierError",
    "PeerCopyError",
    "TierRestoreError",
    "TierSettingsError",
    "TopologyError",
    "NotFoundError",
    "BucketNotFoundError",
    "CheckpointExistsError",
    "CorruptCheckpointError",
    "InvalidURIError",
    "UnsupportedFormatError",
    "DcpDirectoryError",
    "StateDictMismatchError",
    "OptimizerMismatchError",
    "UnsupportedValueError",
    "CollectiveLoadError",
    "RanksDidNotJoinError",
    "TensorChangedError",
    "BlobMissingError",
    "StorageError",
    "NotS3EndpointError",
    "PlainHttpEndpointError",
    "MemoryBudgetError",
    "MissingKeyError",
    "StorageTimeoutError",
    "CredentialsRefusedError",
    "ConditionalWriteIgnoredError",
    "CommitReplacedError",
    "CollectiveError",
    "RankLostError",
    "ForeignSaveError",
]
