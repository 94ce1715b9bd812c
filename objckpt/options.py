"""Typed options of the public calls.

``save`` and ``async_save`` share one :class:`SaveOptions`, ``load`` takes one
:class:`LoadOptions`: the pipelines receive one checked object instead of a
dozen loose keyword arguments, and a new option is added in one place.
"""
from __future__ import annotations

import dataclasses
import enum
import json
from dataclasses import dataclass, fields
from typing import Any, Literal, Optional

from typing_extensions import TypedDict

from .runtime.memory import COLLECTIVE_BYTES, positive_bytes

#: the words that turn a switch (an environment variable, a string option) on or off,
#: in any case and with spaces around; one list for every switch of the library
ON_WORDS = ("1", "on", "true", "yes")
OFF_WORDS = ("0", "off", "false", "no")


def switch_word(value: object) -> Optional[bool]:
    """True for an on word, False for an off word (:data:`ON_WORDS`, :data:`OFF_WORDS`),
    None for anything else: each switch decides what an unknown word means."""
    v = str(value).strip().lower()
    return True if v in ON_WORDS else False if v in OFF_WORDS else None


#: the names ``load(read_strategy=...)`` accepts, for type checkers (a misspelt one is a type error)
ReadStrategyName = Literal["auto", "direct", "broadcast", "allgather"]


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


class KeyScheme(str, enum.Enum):
    """How a save names its blobs and rank indexes: under the checkpoint prefix, or spread
    under hashed prefixes (see :mod:`objckpt.format.spread`).  Chosen with ``save(...,
    key_layout=...)``; the argument keeps its name, "layout" in objckpt otherwise means
    :mod:`objckpt.layout` (the v1/v2 strategies).  Was ``KeyLayout``."""

    DEFAULT = "default"  # under <prefix>/blobs/<attempt>/
    SPREAD = "spread"  # under hashed prefixes <root>/.spread-<hh>/..., for jobs of thousands of ranks on S3

    def __str__(self) -> str:
        return self.value

    @classmethod
    def parse(cls, value: "str | KeyScheme") -> "KeyScheme":
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"key_layout must be one of {tuple(s.value for s in cls)}, got {value!r}") from None


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


def _check_timeout(value: Optional[float]) -> None:
    if value is not None and not (isinstance(value, (int, float)) and value > 0):
        raise ValueError(f"collective_timeout must be a positive number of seconds or None, got {value!r}")


@dataclass(frozen=True)
class SaveOptions:
    """Everything a save needs besides the state, the URI and the store."""

    overwrite: bool = False
    metadata: Optional[dict[str, Any]] = None
    allow_pickle: bool = False
    #: None: chosen per endpoint kind (objckpt.storage.shape): 1 GiB / 16 MiB parts on AWS S3 and
    #: every other store, 16 MiB blobs of one PUT each on moto; a value given here always wins
    blob_size: Optional[int] = None
    part_size: Optional[int] = None
    #: host memory for staging; None: this rank's whole share (async) / 512 MiB (sync)
    staging_bytes: Optional[int] = None
    #: bytes per block crc (0: whole-chunk crcs only); None: chosen per save from the chunk sizes,
    #: at most 1 MiB, so resharded reads fetch little beyond what they need (objckpt.planning.crc_blocks)
    crc_block: Optional[int] = None
    #: this rank alone: no collectives even in a process group (e.g. a save on rank 0 only)
    no_dist: bool = False
    #: seconds to wait for the other ranks to join (None: $OBJCKPT_COLLECTIVE_TIMEOUT, else 600)
    collective_timeout: Optional[float] = None
    #: "spread": blobs and rank indexes under hashed prefixes (docs/s3-scale.md)
    key_layout: KeyScheme = KeyScheme.DEFAULT
    #: spread layout: URI or path of an ancestor of the checkpoint shared by the job's saves (None: its parent)
    spread_root: Optional[str] = None
    #: spread layout: hex digits of the hashed prefix (1 to 4: 16 to 65,536 prefixes)
    spread_digits: int = 2
    #: the caller guarantees one writer per root (one job, never a second one beside it): a store
    #: that accepts ``If-None-Match: *`` and ignores it (probed once per store) is then used, with
    #: one log line, instead of refused with ConditionalWriteIgnoredError.  objckpt still reads
    #: each commit back, but two writers there could both be told they committed
    #: (docs/reliability.md, "What objckpt requires of a store")
    single_writer: bool = False

    def checked(self) -> "SaveOptions":
        """These options, checked (metadata made a JSON object).  The save calls it
        inside its first exchange, so a bad option on one rank fails every rank
        together instead of leaving the others waiting."""
        for name in ("blob_size", "part_size"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.crc_block is not None and self.crc_block < 0:
            raise ValueError(f"crc_block must be 0 (whole-chunk crc only) or positive, got {self.crc_block}")
        if self.staging_bytes is not None and self.staging_bytes <= 0:
            raise ValueError(f"staging_bytes must be positive, got {self.staging_bytes}")
        _check_timeout(self.collective_timeout)
        if not (isinstance(self.spread_digits, int) and 1 <= self.spread_digits <= 4):
            raise ValueError(f"spread_digits must be 1 to 4, got {self.spread_digits!r}")
        return dataclasses.replace(self, metadata=check_metadata(self.metadata),
                                   key_layout=KeyScheme.parse(self.key_layout))


@dataclass(frozen=True)
class LoadOptions:
    """Everything a load needs besides the template, the URI and the store."""

    strict: bool = True
    allow_pickle: bool = False
    read_strategy: ReadStrategy = ReadStrategy.AUTO
    collective_bytes: int = COLLECTIVE_BYTES
    #: this rank alone: no collectives even in a process group (e.g. a load on rank 0 only)
    no_dist: bool = False
    #: seconds to wait for the other ranks to join (None: $OBJCKPT_COLLECTIVE_TIMEOUT, else 600)
    collective_timeout: Optional[float] = None
    #: convert between floating dtypes (an fp32 checkpoint into a bf16 template...); off: a mismatch is an error
    cast: bool = False
    #: the load's one memory budget: cast temporaries, collective batches, read temporaries and the
    #: device ring together stay within it, and a piece that cannot fit is a MemoryBudgetError naming
    #: it.  None: each part its default (objckpt.runtime.memory: 256 MiB each, ``collective_bytes``
    #: for the batches, about 1 GiB in all), and a piece larger than its part is read alone
    memory_bytes: Optional[int] = None
    #: load another kind of optimizer's state (an AdamW checkpoint into SGD) instead of refusing
    #: it with an OptimizerMismatchError (objckpt.load.optimizer_match)
    allow_optimizer_change: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "read_strategy", ReadStrategy.parse(self.read_strategy))
        if self.collective_bytes <= 0:
            raise ValueError(f"collective_bytes must be positive, got {self.collective_bytes}")
        positive_bytes(self.memory_bytes, "memory_bytes", optional=True)
        _check_timeout(self.collective_timeout)


class SaveArgs(TypedDict, total=False):
    """The keyword arguments ``save`` and ``async_save`` share (see :func:`objckpt.save`)."""

    storage_options: Optional[dict[str, Any]]
    overwrite: bool
    metadata: Optional[dict[str, Any]]
    allow_pickle: bool
    process_group: Any
    blob_size: Optional[int]
    part_size: Optional[int]
    staging_bytes: Optional[int]
    crc_block: Optional[int]
    no_dist: bool
    collective_timeout: Optional[float]
    key_layout: "str | KeyScheme"
    spread_root: Optional[str]
    spread_digits: int
    single_writer: bool
    store: Any  # an objckpt.storage.ObjectStore


#: arguments of SaveArgs that say where and with whom, not how
_WHERE = ("storage_options", "process_group", "store")


def split_save_args(fn: str, kwargs: dict[str, Any]) -> tuple[SaveOptions, dict[str, Any]]:
    """The :class:`SaveOptions` in ``kwargs`` and the rest (storage options,
    process group, store); an unknown name is a TypeError naming ``fn``."""
    known = set(SaveArgs.__annotations__)
    unknown = sorted(set(kwargs) - known)
    if unknown:
        raise TypeError(f"{fn}() got unexpected keyword argument(s) {unknown}; it takes {sorted(known)}")
    names = {f.name for f in fields(SaveOptions)}
    opts = {k: v for k, v in kwargs.items() if k in names}
    return SaveOptions(**opts), {k: kwargs.get(k) for k in _WHERE}


def __getattr__(name: str) -> Any:
    """``KeyLayout``: the old name of :class:`KeyScheme`, still importable, with a DeprecationWarning."""
    if name == "KeyLayout":
        import warnings

        warnings.warn("objckpt.options.KeyLayout is deprecated: use KeyScheme", DeprecationWarning, stacklevel=2)
        return KeyScheme
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
