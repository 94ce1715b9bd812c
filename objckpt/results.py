"""What a save or a load reports back, and the I/O counters behind it."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from .logs import Timings


@dataclass
class IOStats:
    """Requests made and bytes moved by one rank in one operation."""

    requests: int = 0
    bytes: int = 0
    #: seconds per phase, filled by the pipeline that owns these counters
    timings: Timings = field(default_factory=Timings)

    def add(self, nbytes: int, requests: int = 1) -> None:
        self.requests += requests
        self.bytes += nbytes


@dataclass
class SaveResult:
    uri: str
    bytes: int  # tensor bytes this rank uploaded (blob sizes, padding included)
    seconds: float
    requests: int  # requests this rank made
    tensors: int
    blobs: int  # blobs this rank wrote
    manifest_bytes: int = 0
    #: seconds of each phase: describe, plan, stage, upload, commit
    timings: Timings = field(default_factory=Timings)
    #: the objects this rank wrote (its blobs, then its rank index), as the manifest names them
    #: (relative to the checkpoint); empty when they are spread outside it.  The local tier
    #: replicates and drains these without decoding the manifest to find them.
    files: tuple[str, ...] = ()

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds else 0.0


@dataclass
class LoadResult:
    uri: str
    bytes: int  # bytes this rank fetched from storage (manifest included)
    seconds: float
    requests: int
    tensors: int
    missing_keys: list[str] = field(default_factory=list)
    unexpected_keys: list[str] = field(default_factory=list)
    received_bytes: int = 0  # bytes this rank received from other ranks (collective reads)
    strategy: str = "direct"  # how replicated tensors were read: direct, broadcast, allgather ("+"-joined if mixed)
    #: seconds of each phase: manifest, plan, fetch, fill
    timings: Timings = field(default_factory=Timings)
    #: CheckpointManager.load: the step loaded (with a local tier or without; None for
    #: objckpt.load).  With a local tier also where this rank's share came from ("local",
    #: "peer": repaired from other nodes, "object": object storage), and every rank's source
    #: (see docs/tiering.md); "" / {} otherwise
    step: Optional[int] = None
    source: str = ""
    tiers: dict[int, str] = field(default_factory=dict)
    #: (a local tier) the damaged copies the restore passed over, each naming the rank, the
    #: source, the file and why (see docs/tiering.md); [] when none
    skipped: list[str] = field(default_factory=list)

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds else 0.0
