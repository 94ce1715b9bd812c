"""Write an objckpt checkpoint from a source that yields one tensor at a time.

:func:`objckpt.save` takes a whole state in memory.  A converter reads its
source (a DCP directory, a torch.save file, safetensors files) tensor by tensor,
so it hands save/ the tensors' keys, dtypes and shapes up front and each
tensor's bytes when they are due (:func:`objckpt.save.source.stream_pieces`: the
same packing, chunks, crc32c and manifest as ``save``; ``load(key)`` is asked
for a tensor when its first chunk comes up and ``release(key)`` called once it
is staged; at most ``window`` parts upload at once, so memory stays at one
tensor plus ``window`` parts).  The manifest is committed last, conditionally,
as every save does.  This module only adapts the converters' interface.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch

from ..errors import UnsupportedValueError
from ..format import keys
from ..results import IOStats
from ..save.source import (PackSizes, SourcePiece, SourceTarget, commit_pieces, crc_block_for, refuse_existing,
                           stream_pieces)
from ..storage import ObjectStore
from ..load.session import open_location


@dataclass(frozen=True)
class SourceTensor:
    """A tensor a source will produce: its key in the checkpoint, dtype and shape."""

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]


@dataclass(frozen=True)
class WriteOptions:
    """How the streamed checkpoint is packed and committed (the ``save`` options that apply)."""

    overwrite: bool = False
    metadata: dict[str, Any] = field(default_factory=dict)
    #: None: by the endpoint's shape (single-PUT blobs on moto, multipart elsewhere), as ``save``
    blob_size: Optional[int] = None
    part_size: Optional[int] = None
    #: None: chosen from the tensors' sizes, as ``save`` does
    crc_block: Optional[int] = None
    window: int = 2


@dataclass(frozen=True)
class StreamResult:
    """What a streamed write stored."""

    uri: str
    tensors: int
    nbytes: int
    blobs: int


def write_checkpoint(uri: str, sources: Sequence[SourceTensor], load: Callable[[str], torch.Tensor], tree: Any, *,
                     storage_options: Optional[dict[str, Any]] = None, store: Optional[ObjectStore] = None,
                     release: Optional[Callable[[str], None]] = None,
                     opts: WriteOptions = WriteOptions()) -> StreamResult:
    """Write ``sources`` (in order) and the encoded ``tree`` as a checkpoint at ``uri``.

    ``tree`` names each tensor by its key (``{"$tensor": key}``, docs/format.md §7).
    An existing checkpoint is refused before anything is uploaded unless
    ``opts.overwrite``; a failure aborts the uploads, deletes finished blobs and
    commits nothing."""
    twice = [k for k, n in collections.Counter(s.key for s in sources).items() if n > 1]
    if twice:
        raise UnsupportedValueError(f"the source names tensor(s) {twice[:10]} more than once")
    st, prefix = open_location(uri, storage_options, store)
    refuse_existing(st, prefix, uri, opts.overwrite)
    pieces = [SourcePiece(s.key, s.dtype, tuple(s.shape)) for s in sources]
    target = SourceTarget(st, prefix, uri, keys.new_attempt_id())
    crc_block = crc_block_for((p.nbytes for p in pieces), opts.crc_block, opts.part_size)
    stats = IOStats()
    out = stream_pieces(target, pieces, load, sizes=PackSizes(opts.blob_size, opts.part_size), crc_block=crc_block,
                        stats=stats, window=opts.window, release=release)
    commit_pieces(target, {s.key: (s.dtype, tuple(s.shape)) for s in sources}, [out], tree,
                  metadata=opts.metadata, crc_block=crc_block, overwrite=opts.overwrite, stats=stats)
    return StreamResult(uri, len(sources), sum(b.size for b in out.blobs), len(out.blobs))
