"""torch.distributed.checkpoint storage plugin that writes and reads the objckpt format.

``dcp.save(sd, storage_writer=objckpt.dcp.StorageWriter(uri))`` keeps DCP's
planning (flattening, DTensor/ShardedTensor write items, dedup of replicated
tensors) and replaces its storage: every rank packs its write items' bytes
into its own blobs (parallel multipart uploads, crc32c per chunk and per
block, exactly as :func:`objckpt.save` does), and the coordinator commits an
objckpt manifest last, with a conditional PUT.  Nothing is pickled: DCP's
``Metadata`` is not stored at all; :meth:`StorageReader.read_metadata` rebuilds it
from the manifest.  So the same checkpoint reads with ``dcp.load`` (any world
size and layout), with :func:`objckpt.load` and with :func:`objckpt.read`, and the
reader reads what :func:`objckpt.save` wrote (v1 or v2 manifests, one or many
ranks), fetching only the byte ranges each rank's shards overlap.

Why the reader reports one whole-tensor chunk per tensor: DCP matches each
destination shard against the stored chunks to make read items; objckpt can
read any box of a tensor however it was chunked, so one chunk keeps DCP's
matching linear and lets objckpt's own planner choose the ranges.
"""
from __future__ import annotations

import dataclasses
import io
import logging
import math
import os
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch.distributed.checkpoint import metadata as dmeta
from torch.distributed.checkpoint import planner as dplan
from torch.distributed.checkpoint import storage as dstore
from torch.futures import Future

from .. import _runtime
from ..errors import CheckpointExistsError, ObjckptError, UnsupportedFormatError, UnsupportedValueError
from ..format import keys
from ..format.dtypes import dtype_name, itemsize
from ..format.manifest import Blob, Chunk, Manifest, TensorEntry
from ..layout.base import WRITER
from ..layout.gathered import check_coverage
from ..load.fill import FillTarget
from ..memory import Budget, host_pool
from ..planning import crc_blocks
from ..planning.pack import TensorSpec, plan_save
from ..results import IOStats
from ..save.commit import CommitState, commit, delete_quietly
from ..save.upload import write_plan
from ..storage import ObjectStore, split_uri
from ..storage.shape import save_sizes, shape_for
from ..units import MiB
from .dcp_tree import META_KEY, DcpView, TensorRef, dcp_view, plain_value, tree_from_flat, value_bytes
from .reading import OpenCheckpoint, open_uri

log = logging.getLogger("objckpt.dcp")

__all__ = ["StorageWriter", "StorageReader"]

_SCHEMES = ("s3", "s3a", "file", "memory")


def _valid_uri(checkpoint_id: Any) -> bool:
    if not isinstance(checkpoint_id, (str, os.PathLike)):
        return False
    s = os.fspath(checkpoint_id)
    if not s:
        return False
    if "://" not in s:
        return True  # a local path
    scheme = split_uri(s)[0]
    return scheme in _SCHEMES or scheme.startswith("fsspec+")


@dataclass(frozen=True)
class _RankPlan:
    """What the coordinator tells each rank in the global plan (``SavePlan.storage_data``)."""

    attempt: str
    rank: int
    crc_block: int


def _item_bytes(it: dplan.WriteItem) -> int:
    """Bytes of a tensor write item's box."""
    td = it.tensor_data
    return math.prod(td.chunk.sizes) * itemsize(td.properties.dtype) if td is not None else 0


@dataclass(frozen=True)
class _ChunkOut:
    """One stored chunk of a write item, global offsets; ``blob`` numbers the rank's own blobs."""

    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    blob: int
    offset: int
    length: int
    crc32c: int
    block_crc32c: tuple[int, ...]


@dataclass(frozen=True)
class _TensorOut:
    """``WriteResult.storage_data`` of a tensor item (the rank's blobs ride on its first one)."""

    rank: int
    chunks: tuple[_ChunkOut, ...]
    blobs: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True)
class _BytesOut:
    """``WriteResult.storage_data`` of a non-tensor item: DCP's torch.save bytes, sent to the coordinator."""

    raw: bytes


class StorageWriter(dstore.StorageWriter):
    """A DCP ``StorageWriter`` that writes an objckpt checkpoint at ``uri``.

    ``uri``: any objckpt URI (``s3://bucket/run/step-100``, a local path, ``memory://``,
    ``fsspec+...``), or None and pass ``checkpoint_id=`` to ``dcp.save``.
    ``overwrite`` (default False): an existing checkpoint is an error
    (:class:`CheckpointExistsError`, raised before anything is uploaded); with True it is
    replaced atomically.  ``metadata``: free-form JSON stored in the manifest.
    ``blob_size``, ``part_size``, ``crc_block``, ``staging_bytes`` as for :func:`objckpt.save`:
    sizes left as None follow the endpoint (single-PUT blobs on moto, multipart
    elsewhere), the crc block is chosen by the coordinator from every rank's items.

    A save that fails on any rank commits nothing (DCP calls ``finish`` only when
    every rank's ``write_data`` succeeded); the failing rank deletes its blobs, and
    the blobs other ranks wrote are unreferenced garbage for ``objckpt gc``.
    """

    def __init__(self, uri: Optional[str | os.PathLike] = None, *,
                 storage_options: Optional[dict[str, Any]] = None, overwrite: bool = False,
                 metadata: Optional[dict[str, Any]] = None, blob_size: Optional[int] = None,
                 part_size: Optional[int] = None, crc_block: Optional[int] = None, staging_bytes: int = 512 * MiB,
                 store: Optional[ObjectStore] = None) -> None:
        super().__init__()
        self.uri: Optional[str] = os.fspath(uri) if uri is not None else None
        self.storage_options = dict(storage_options or {})
        self.overwrite = overwrite
        self.metadata = dict(metadata or {})
        self.blob_size, self.part_size, self.crc_block = blob_size, part_size, crc_block
        self.staging_bytes = staging_bytes
        self._store = store
        self._chosen_block = crc_block if crc_block is not None else crc_blocks.MAX_BLOCK
        self.is_coordinator = False
        self.rank = 0
        self.stats = IOStats()

    # -- DCP protocol -----------------------------------------------------------------
    @property
    def checkpoint_id(self) -> Optional[str]:
        return self.uri

    def reset(self, checkpoint_id: Optional[str | os.PathLike] = None) -> None:
        """A new save begins; ``checkpoint_id`` (if given) is its URI."""
        if checkpoint_id is not None:
            self.uri = os.fspath(checkpoint_id)
        self.stats = IOStats()

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return _valid_uri(checkpoint_id)

    def storage_meta(self) -> Optional[dmeta.StorageMeta]:
        return dmeta.StorageMeta(checkpoint_id=self.uri)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        self.rank = int(kwargs.get("rank", 0) or 0)
        if kwargs.get("use_collectives", True) is False:
            raise UnsupportedValueError(
                "objckpt.dcp.StorageWriter commits one manifest for all ranks, after every rank's "
                "blobs are up; dcp.save(use_collectives=False) is not supported")
        self._require_uri()

    def prepare_local_plan(self, plan: dplan.SavePlan) -> dplan.SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[dplan.SavePlan]) -> list[dplan.SavePlan]:
        """Coordinator: refuse an existing checkpoint before anything is uploaded; pick the attempt id."""
        uri = self._require_uri()
        st, prefix = self._open()
        exists = _runtime.run(st.head(keys.manifest_key(prefix))) is not None
        if exists and not self.overwrite:
            raise CheckpointExistsError(
                f"a checkpoint already exists at {uri!r}; pass overwrite=True to objckpt.dcp.StorageWriter")
        attempt = keys.new_attempt_id()
        self._chosen_block = self.crc_block if self.crc_block is not None else crc_blocks.for_boxes(
            (_item_bytes(it) for p in plans for it in p.items if it.type != dplan.WriteItemType.BYTE_IO),
            self.part_size)
        return [dataclasses.replace(p, storage_data=_RankPlan(attempt, r, self._chosen_block))
                for r, p in enumerate(plans)]

    def write_data(self, plan: dplan.SavePlan, planner: dplan.SavePlanner) -> Future[list[dstore.WriteResult]]:
        """Upload this rank's tensor items into its blobs; non-tensor items go to the coordinator."""
        info = plan.storage_data
        if not isinstance(info, _RankPlan):
            raise ObjckptError("objckpt.dcp.StorageWriter: the global plan carries no attempt id "
                               "(was prepare_global_plan skipped?)")
        results: list[dstore.WriteResult] = []
        tensor_items = []
        for it in plan.items:
            if it.type == dplan.WriteItemType.BYTE_IO:
                data = planner.resolve_data(it)
                raw = (data.getvalue() if isinstance(data, io.BytesIO)
                       else bytes(data.read()))  # type: ignore[union-attr,attr-defined]
                results.append(dstore.WriteResult(index=it.index, size_in_bytes=len(raw), storage_data=_BytesOut(raw)))
            else:
                tensor_items.append(it)
        results.extend(self._write_tensors(info, tensor_items, planner))
        fut: Future[list[dstore.WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: dmeta.Metadata, results: list[list[dstore.WriteResult]]) -> None:
        """Coordinator: build the manifest from every rank's results and commit it, last and conditionally."""
        uri = self._require_uri()
        st, prefix = self._open()
        written = [keys.join(prefix, name) for rr in results for wr in rr
                   if isinstance(wr.storage_data, _TensorOut) for name, _ in wr.storage_data.blobs]
        try:
            m, _ = self._manifest(metadata, results, prefix)
        except Exception:
            delete_quietly(st, written)  # nothing will reference them
            raise
        errors: list[BaseException] = []
        status = commit(st, prefix, m, self.overwrite, uri, written, self.stats, errors)
        if status.state == CommitState.OK:
            return
        if status.state == CommitState.EXISTS:
            raise CheckpointExistsError(status.message)
        raise ObjckptError(status.message) from (errors[0] if errors else None)

    # -- helpers ------------------------------------------------------------------------
    def _require_uri(self) -> str:
        if not self.uri:
            raise ObjckptError("objckpt.dcp.StorageWriter has no URI: pass one, or checkpoint_id= to dcp.save")
        return self.uri

    def _open(self) -> tuple[ObjectStore, str]:
        return open_uri(self._require_uri(), self.storage_options, self._store)

    def __getstate__(self) -> dict[str, Any]:
        """Picklable for DCP's process-based async save: the store is reopened there."""
        state = dict(self.__dict__)
        state["_store"] = None
        return state

    def _write_tensors(self, info: _RankPlan, items: list[dplan.WriteItem],
                       planner: dplan.SavePlanner) -> list[dstore.WriteResult]:
        if not items:
            return []
        st, prefix = self._open()
        tensors: dict[str, torch.Tensor] = {}
        specs = []
        for i, it in enumerate(items):
            t = planner.resolve_data(it)
            if not isinstance(t, torch.Tensor):
                raise UnsupportedValueError(f"DCP write item {it.index.fqn!r} resolved to {type(t).__name__}, "
                                            "not a tensor")
            t = t.detach()
            dtype_name(t.dtype, it.index.fqn)  # refuse dtypes the format has no name for, naming the key
            tensors[str(i)] = t
            specs.append(TensorSpec(str(i), tuple(t.shape), itemsize(t.dtype)))
        blob_size, part_size = save_sizes(self.blob_size, self.part_size, _runtime.run(shape_for(st)))
        plan = plan_save(specs, blob_bytes=blob_size, part_bytes=max(part_size, st.min_part_size),
                         chunk_bytes=part_size, max_part_bytes=st.max_part_size)
        names = [keys.blob_name(info.attempt, info.rank, b.index) for b in plan.blobs]
        blob_keys = [keys.join(prefix, n) for n in names]
        crcs = _runtime.run(write_plan(st, blob_keys, plan, tensors, host_pool(), Budget(self.staging_bytes),
                                       self.stats, zero_copy=True, crc_block=info.crc_block))
        per_item: dict[int, list[_ChunkOut]] = {i: [] for i in range(len(items))}
        for c in plan.chunks:
            i = int(c.key)
            td = items[i].tensor_data  # a tensor item's global box; absent only for a whole plain tensor
            base = tuple(td.chunk.offsets) if td is not None else (0,) * len(c.offsets)
            offs = tuple(b + o for b, o in zip(base, c.offsets))
            k = crcs[c]
            per_item[i].append(_ChunkOut(offs, tuple(c.shape), c.blob, c.offset, c.length, k.total, k.blocks))
        blobs = tuple((n, b.size) for n, b in zip(names, plan.blobs))
        out = []
        for i, it in enumerate(items):
            t = tensors[str(i)]
            data = _TensorOut(info.rank, tuple(per_item[i]), blobs if i == 0 else ())
            out.append(dstore.WriteResult(index=it.index, size_in_bytes=t.numel() * t.element_size(),
                                          storage_data=data))
        return out

    def _manifest(self, md: dmeta.Metadata, results: list[list[dstore.WriteResult]],
                  prefix: str) -> tuple[Manifest, list[str]]:
        entries: dict[str, TensorEntry] = {}
        for fqn, smd in md.state_dict_metadata.items():
            if isinstance(smd, dmeta.TensorStorageMetadata):
                entries[fqn] = TensorEntry(fqn, dtype_name(smd.properties.dtype, fqn), tuple(smd.size))
        blobs: list[Blob] = []
        raw_values: dict[str, bytes] = {}
        attempt = ""
        for r, rank_results in enumerate(results):
            base = len(blobs)
            for wr in rank_results:
                sd = wr.storage_data
                if isinstance(sd, _BytesOut):
                    raw_values[wr.index.fqn] = sd.raw
                    continue
                if not isinstance(sd, _TensorOut) or wr.index.fqn not in entries:
                    raise ObjckptError(f"DCP write result for {wr.index.fqn!r} is not one objckpt's writer made")
                for name, size in sd.blobs:
                    blobs.append(Blob(name, size, r))
                    attempt = keys.attempt_of(name)
                for c in sd.chunks:
                    entries[wr.index.fqn].chunks.append(Chunk(c.offsets, c.shape, base + c.blob, c.offset, c.length,
                                                              c.crc32c, c.block_crc32c))
        for e in entries.values():
            _tidy_chunks(e)
            check_coverage(e)  # never commit a tensor whose chunks do not tile it
        flat: dict[str, Any] = {}
        torch_save: list[str] = []
        for fqn, smd in md.state_dict_metadata.items():
            if fqn in entries:
                flat[fqn] = TensorRef(fqn)
            elif fqn in raw_values:
                value, plain = plain_value(raw_values[fqn])
                flat[fqn] = value
                if not plain:
                    torch_save.append(fqn)
        if torch_save:
            log.warning("DCP values %s are not plain data: stored as their torch.save bytes (objckpt.read "
                        "returns bytes for them; their keys are listed in metadata[%r])", torch_save[:10], META_KEY)
        meta = dict(self.metadata)
        meta[META_KEY] = {"torch_save": torch_save}
        m = Manifest(tensors=entries, blobs=blobs, tree=tree_from_flat(flat, md.planner_data), metadata=meta,
                     attempt=attempt or keys.new_attempt_id(), world_size=max(1, len(results)), writer=WRITER,
                     crc_block=self._chosen_block)
        return m, [keys.join(prefix, b.name) for b in blobs]


def _tidy_chunks(e: TensorEntry) -> None:
    """Drop the empty chunks of ranks that hold nothing of a non-empty tensor; an empty
    tensor keeps one empty chunk covering it (docs/format.md §4)."""
    if math.prod(e.shape) == 0:
        first = e.chunks[0] if e.chunks else Chunk((0,) * len(e.shape), e.shape, 0, 0, 0, 0)
        if not e.chunks:
            raise ObjckptError(f"DCP wrote no chunk of the empty tensor {e.key!r}")
        e.chunks[:] = [Chunk((0,) * len(e.shape), tuple(e.shape), first.blob, first.offset, 0, 0)]
        return
    e.chunks[:] = sorted((c for c in e.chunks if c.length), key=lambda c: c.offsets)


class StorageReader(dstore.StorageReader):
    """A DCP ``StorageReader`` over an objckpt checkpoint (written by this plugin or by
    :func:`objckpt.save`, any world size, format v1 to v3).

    ``read_metadata`` is one GET of the manifest; ``read_data`` fetches, per rank, only
    the byte ranges that overlap the boxes DCP asks for (crc32c-checked), straight into
    the destination tensors where they can land as they are.  ``allow_pickle``: read
    values that ``objckpt.save(allow_pickle=True)`` pickled (unpickling runs code)."""

    def __init__(self, uri: Optional[str | os.PathLike] = None, *,
                 storage_options: Optional[dict[str, Any]] = None, store: Optional[ObjectStore] = None,
                 allow_pickle: bool = False) -> None:
        super().__init__()
        self.uri: Optional[str] = os.fspath(uri) if uri is not None else None
        self.storage_options = dict(storage_options or {})
        self._store = store
        self.allow_pickle = allow_pickle
        self._ckpt: Optional[OpenCheckpoint] = None
        self._view: Optional[DcpView] = None
        self.rank = 0

    @property
    def checkpoint_id(self) -> Optional[str]:
        return self.uri

    def reset(self, checkpoint_id: Optional[str | os.PathLike] = None) -> None:
        if checkpoint_id is not None:
            self.uri = os.fspath(checkpoint_id)
        self._ckpt, self._view = None, None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return _valid_uri(checkpoint_id)

    def read_metadata(self) -> dmeta.Metadata:  # type: ignore[override]
        """DCP's Metadata, rebuilt from the manifest (nothing pickled is read)."""
        if not self.uri:
            raise ObjckptError("objckpt.dcp.StorageReader has no URI: pass one, or checkpoint_id= to dcp.load")
        ck = self._ckpt = OpenCheckpoint(self.uri, self.storage_options, self._store)
        view = self._view = self._view_for(ck, ck.manifest.tree)
        sdm: dict[str, Any] = {}
        for fqn, (_key, dtype, shape) in view.tensors.items():
            size = torch.Size(shape)
            chunk = dmeta.ChunkStorageMetadata(offsets=torch.Size([0] * len(shape)), sizes=size)
            sdm[fqn] = dmeta.TensorStorageMetadata(dmeta.TensorProperties(dtype=dtype), size, [chunk])
        for fqn in view.values:
            sdm[fqn] = dmeta.BytesStorageMetadata()
        return dmeta.Metadata(state_dict_metadata=sdm, planner_data=view.mappings,
                              storage_meta=dmeta.StorageMeta(checkpoint_id=self.uri, load_id=ck.manifest.attempt))

    def _view_for(self, ck: OpenCheckpoint, tree: Any) -> DcpView:
        dcp_meta = ck.manifest.metadata.get(META_KEY)
        torch_save = set(dcp_meta.get("torch_save", [])) if isinstance(dcp_meta, dict) else set()
        return dcp_view(tree, lambda k: (ck.dtype(k), ck.shape(k)), torch_save, repr(self.uri), self.allow_pickle)

    def set_up_storage_reader(self, metadata: dmeta.Metadata, is_coordinator: bool, *args: Any,
                              **kwargs: Any) -> None:
        self.rank = int(kwargs.get("rank", 0) or 0)
        ck = self._ckpt
        if ck is None:
            raise ObjckptError("objckpt.dcp.StorageReader: read_metadata was not called first")
        trees = ck.manifest.rank_trees
        if trees and self.rank < len(trees):  # ranks saved different values: this rank's own
            self._view = self._view_for(ck, trees[self.rank])

    def prepare_local_plan(self, plan: dplan.LoadPlan) -> dplan.LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[dplan.LoadPlan]) -> list[dplan.LoadPlan]:
        return plans

    def read_data(self, plan: dplan.LoadPlan, planner: dplan.LoadPlanner) -> Future[None]:
        ck, view = self._ckpt, self._view
        if ck is None or view is None:
            raise ObjckptError("objckpt.dcp.StorageReader: read_metadata was not called first")
        targets: list[FillTarget] = []
        items: list[tuple[dplan.ReadItem, torch.Tensor]] = []
        for it in plan.items:
            fqn = it.storage_index.fqn
            if it.type == dplan.LoadItemType.BYTE_IO:
                if fqn not in view.values:
                    raise UnsupportedFormatError(f"checkpoint {self.uri!r} has no value {fqn!r}")
                planner.load_bytes(it, io.BytesIO(value_bytes(fqn, view, ck.read)))
                continue
            if fqn not in view.tensors:
                raise UnsupportedFormatError(f"checkpoint {self.uri!r} has no tensor {fqn!r}")
            key = view.tensors[fqn][0]
            base = tuple(it.storage_index.offset or ()) or (0,) * len(it.lengths)
            box = (tuple(b + o for b, o in zip(base, it.storage_offsets)), tuple(it.lengths))
            dest = planner.resolve_tensor(it).detach()
            targets.append(FillTarget(key, box, dest))
            items.append((it, dest))
        ck.fill(targets)
        for it, dest in items:
            planner.commit_tensor(it, dest)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut
