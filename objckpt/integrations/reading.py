"""One checkpoint opened for reading piece by piece: the bridges' common reader.

:func:`objckpt.read` fetches the manifest on every call; the DCP reader, the
converters and the exporter read one tensor (or one box) at a time, so they
keep the manifest and its chunk resolver (format v2: the rank indexes already
fetched) in one :class:`OpenCheckpoint` and fill caller-given tensors from it.
Every read is a resharding read: only the byte ranges overlapping the box are
fetched, and every byte is checked against its crc32c.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from ..runtime import loop as _runtime
from ..format.dtypes import dtype_from_name
from ..format.manifest import Manifest
from ..layout import resolver_for
from ..load.fill import FillTarget, fill_boxes
from ..load.pipeline import fetch_manifest
from ..runtime.memory import Budget
from ..planning.boxes import whole
from ..results import IOStats
from ..storage import ObjectStore, open_store, split_uri

#: temporaries one fill may hold (pieces that cannot land in place): small, so a
#: converter's memory stays near one tensor
FILL_BUDGET = Budget(64 << 20)


def open_uri(uri: str, storage_options: Optional[dict[str, Any]],
             store: Optional[ObjectStore] = None) -> tuple[ObjectStore, str]:
    """The store and key prefix of ``uri`` (``store`` replaces the one the URI names)."""
    if store is None:
        return open_store(uri, storage_options)
    return store, split_uri(uri)[2].strip("/")


class OpenCheckpoint:
    """A committed checkpoint: its manifest, read once, and ranged reads of any box."""

    def __init__(self, uri: str, storage_options: Optional[dict[str, Any]] = None,
                 store: Optional[ObjectStore] = None) -> None:
        self.uri = uri
        self.store, self.prefix = open_uri(uri, storage_options, store)
        self.stats = IOStats()
        self.manifest: Manifest = _runtime.run(fetch_manifest(self.store, self.prefix, uri, self.stats))
        self._resolver = resolver_for(self.manifest, self.store, self.prefix)

    def stored_key(self, key: str) -> str:
        """The key whose chunks hold ``key``'s bytes (itself, or its alias target)."""
        return self.manifest.tensors[key].alias_of or key

    def dtype(self, key: str) -> torch.dtype:
        return dtype_from_name(self.manifest.tensors[key].dtype, key)

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.manifest.tensors[key].shape)

    def fill(self, targets: Sequence[FillTarget]) -> None:
        """Fill each target's ``dest`` with its box (keys may be aliases)."""
        real = [FillTarget(self.stored_key(t.key), t.box, t.dest) for t in targets if t.dest.numel()]
        if real:
            fill_boxes(self.store, self.prefix, self.manifest, real, self.stats, budget=FILL_BUDGET,
                       resolver=self._resolver)

    def read(self, key: str) -> torch.Tensor:
        """The whole tensor ``key`` as a new CPU tensor."""
        out = torch.empty(self.shape(key), dtype=self.dtype(key))
        self.fill([FillTarget(key, whole(out.shape), out)])
        return out
