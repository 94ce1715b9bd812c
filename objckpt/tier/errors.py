"""The errors of the tiered checkpoints: refused settings, an unusable local directory."""
from __future__ import annotations

from ..errors import ObjckptError, StorageError


class TierSettingsError(ObjckptError, ValueError):
    """The tier settings are impossible (replicas >= world size) or differ between ranks."""


class LocalTierError(StorageError):
    """The local directory cannot hold this checkpoint (not writable, not enough space)."""


class TierRestoreError(ObjckptError, FileNotFoundError):
    """No step is complete in any tier for every rank."""


class DrainError(ObjckptError, OSError):
    """A drain did not commit (a rank's upload failed, or the commit did): nothing is in object storage."""
