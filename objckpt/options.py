"""Typed options of the public calls.

``save`` and ``async_save`` share one :class:`SaveOptions`, ``load`` takes one
:class:`LoadOptions`: the pipelines receive one checked object instead of a
dozen loose keyword arguments, and a new option is added in one place.
"""
from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field
from typing import Any, Optional

from .units import MiB


class ReadStrategy(str, enum.Enum):
    """How ranks that need the same bytes read them (see :mod:`objckpt.load.collective`)."""

    AUTO = "auto"
    DIRECT = "direct"
    BROADCAST = "broadcast"
    ALLGATHER = "allgather"

    def __str__(self) -> str:
        return self.value

    @classmethod
    def parse(cls, value: "str | ReadStrategy") -> "ReadStrategy":
        try:
            return cls(value)
        except ValueError:
            names = tuple(s.value for s in cls)
            raise ValueError(f"read_strategy must be one of {names}, got {value!r}") from None


def check_metadata(metadata: Optional[dict[str, Any]]) -> dict[str, Any]:
    """The user's metadata as a JSON object, or a TypeError saying why it is not one."""
    if metadata is None:
        return {}
    if not isinstance(metadata, dict):
        raise TypeError(f"metadata must be a JSON object (dict), got {type(metadata).__name__}")
    try:
        json.dumps(metadata, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise TypeError(f"metadata must be JSON-serialisable: {e}") from None
    return metadata


@dataclass(frozen=True)
class SaveOptions:
    """Everything a save needs besides the state, the URI and the store."""

    overwrite: bool = False
    metadata: dict[str, Any] = field(default_factory=dict)
    allow_pickle: bool = False
    blob_size: int = 1 << 30
    part_size: int = 16 * MiB
    #: host memory for staging; None: this rank's whole share (async) / 512 MiB (sync)
    staging_bytes: Optional[int] = None
    crc_block: int = 1 * MiB

    def __post_init__(self) -> None:
        object.__setattr__(self, "metadata", check_metadata(self.metadata))
        for name in ("blob_size", "part_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.crc_block < 0:
            raise ValueError(f"crc_block must be 0 (whole-chunk crc only) or positive, got {self.crc_block}")
        if self.staging_bytes is not None and self.staging_bytes <= 0:
            raise ValueError(f"staging_bytes must be positive, got {self.staging_bytes}")


@dataclass(frozen=True)
class LoadOptions:
    """Everything a load needs besides the template, the URI and the store."""

    strict: bool = True
    allow_pickle: bool = False
    read_strategy: ReadStrategy = ReadStrategy.AUTO
    collective_bytes: int = 256 * MiB

    def __post_init__(self) -> None:
        object.__setattr__(self, "read_strategy", ReadStrategy.parse(self.read_strategy))
        if self.collective_bytes <= 0:
            raise ValueError(f"collective_bytes must be positive, got {self.collective_bytes}")
