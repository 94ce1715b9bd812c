"""PyTorch Lightning ``CheckpointIO`` plugin: Trainer checkpoints as objckpt checkpoints.

``Trainer(plugins=[ObjckptCheckpointIO()], default_root_dir="s3://bucket/run")``
makes every checkpoint Lightning writes (``ModelCheckpoint``,
``trainer.save_checkpoint``) an objckpt checkpoint: tensors in blobs, a JSON
manifest committed last, no pickle unless asked for.  Lightning still
decides names, keeps the top k, removes old ones and finds ``last.ckpt``; it
does that through fsspec (``s3fs`` for ``s3://``), so the pieces that touch
Lightning's view of the bucket are handled here:

* A checkpoint at ``.../epoch=0-step=2.ckpt`` is the prefix
  ``.../epoch=0-step=2.ckpt/`` with ``manifest.json`` under it.  On object
  stores (where a key and a "directory" of the same name coexist) the plugin
  also writes a small JSON *marker object* at the path itself, after the
  manifest commits.  That makes fsspec's ``exists`` / ``modified`` /
  ``isfile`` answer as for a ``.ckpt`` file, which ``ckpt_path="last"`` needs
  (s3fs has no modification time for a prefix).  The marker is a ``torch.save`` file whose
  loading fails with advice (:mod:`objckpt.integrations.lightning_marker`), so
  ``LightningModule.load_from_checkpoint`` on it says to call
  :func:`objckpt.lightning.load_from_checkpoint` instead.  The marker belongs to the
  checkpoint (:mod:`objckpt.ops.owned`): remove, ``objckpt rm`` / ``prune`` and
  :func:`objckpt.delete` delete it first, then the manifest, then the rest; ``objckpt gc``
  removes a marker whose checkpoint is gone.
* objckpt writes behind fsspec's back, so after each save and remove the
  plugin drops fsspec's cached listing of the path, or a later ``exists`` /
  ``ls`` in the same process would answer from a stale cache.

Lightning's own fsspec calls read the endpoint and credentials from the
environment (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``...), never from this
plugin's ``storage_options``: for a non-AWS endpoint set the environment (or
fsspec's config) as well.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import re
import threading
from typing import Any, Callable, Optional, Union

import torch
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.pytorch.callbacks import ModelCheckpoint as _LightningModelCheckpoint

from ..runtime import loop as _runtime
from ..api import async_save as _async_save
from ..api import delete as _delete
from ..api import read as _read
from ..api import save as _save
from ..errors import NotFoundError, ObjckptError
from ..ops.owned import orphaned_marker
from ..save.background import SaveHandle
from ..storage import open_store, split_uri
from .lightning_last import newest_committed
from .lightning_marker import marker_body
from .plain_values import TypeNote, from_plain, to_plain

__all__ = ["ObjckptCheckpointIO", "ModelCheckpoint", "TYPES_KEY"]

log = logging.getLogger(__name__)

#: top-level key of the stored tree holding the type notes (popped again on load)
TYPES_KEY = "__objckpt_lightning__"
FORMAT = 1
#: URI schemes whose stores let an object and a prefix of the same name coexist (marker objects)
OBJECT_STORE_SCHEMES = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss"})

MapLocation = Union[None, str, torch.device, dict[str, Any], Callable[..., Any]]


def _uri(path: Any) -> str:
    return os.fspath(path) if not isinstance(path, str) else path


def _on_object_store(uri: str) -> bool:
    return split_uri(uri)[0] in OBJECT_STORE_SCHEMES


def _fsspec(uri: str) -> Any:
    """The fsspec filesystem Lightning uses for ``uri`` (fsspec caches instances by their
    arguments, and Lightning passes none, so this is the very same object)."""
    from fsspec.core import url_to_fs  # type: ignore[import-untyped]

    return url_to_fs(uri)[0]


def _invalidate_fsspec(uri: str) -> None:
    """Drop fsspec's cached listings of ``uri`` and its parents in Lightning's filesystem."""
    if not _on_object_store(uri):
        return
    try:
        _fsspec(uri).invalidate_cache(uri)
    except Exception as e:  # no s3fs installed, an unknown protocol: nothing of Lightning's is cached then
        log.debug("objckpt: could not invalidate the fsspec cache of %s: %s", uri, e)


def _map_tensors(value: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """``value`` with ``fn`` applied to every tensor, inside the containers and objects
    :func:`from_plain` rebuilds (dicts, lists, tuples, named tuples, sets, dataclasses)."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    t = type(value)
    if t is dict:
        return {k: _map_tensors(v, fn) for k, v in value.items()}
    if t is list:
        return [_map_tensors(v, fn) for v in value]
    if t is tuple:
        return tuple(_map_tensors(v, fn) for v in value)
    if isinstance(value, tuple) and hasattr(value, "_make"):
        return value._make(_map_tensors(v, fn) for v in value)
    if t in (set, frozenset):
        return t(_map_tensors(v, fn) for v in value)
    if isinstance(value, dict):  # OrderedDict, AttributeDict...: the object load just built, values replaced
        for k in list(value):
            value[k] = _map_tensors(value[k], fn)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):  # likewise a fresh object: frozen ones too
            object.__setattr__(value, f.name, _map_tensors(getattr(value, f.name), fn))
    return value


def apply_map_location(value: Any, map_location: MapLocation) -> Any:
    """Move the CPU tensors objckpt read as ``torch.load(map_location=...)`` would.

    objckpt reads every tensor to CPU, so the saved location is ``"cpu"``: a dict
    maps from it, a callable is called as ``fn(storage, "cpu")``."""
    if map_location is None:
        return value
    if isinstance(map_location, (str, torch.device)):
        device = torch.device(map_location)
        return value if device.type == "cpu" else _map_tensors(value, lambda t: t.to(device))
    if isinstance(map_location, dict):
        target = map_location.get("cpu")
        return value if target is None else apply_map_location(value, target)
    if callable(map_location):
        def call(t: torch.Tensor) -> torch.Tensor:
            storage = t.untyped_storage()
            out = map_location(storage, "cpu")
            if out is None or out is storage:
                return t
            if isinstance(out, torch.Tensor):
                return out
            return torch.empty((0,), dtype=t.dtype, device=out.device).set_(out, t.storage_offset(), t.shape,
                                                                              t.stride())
        return _map_tensors(value, call)
    raise TypeError(f"map_location must be None, a str, a torch.device, a dict or a callable, got {map_location!r}")


class ObjckptCheckpointIO(CheckpointIO):
    """Lightning ``CheckpointIO`` that saves, loads and removes objckpt checkpoints.

    ``storage_options``: objckpt's storage options (``endpoint_url``,
    credentials, ``concurrency``...), used for every checkpoint.

    **What is stored without pickle.**  Tensors, str/int/float/bool/None,
    bytes, torch.Size/dtype/device, dicts with str/int/float/bool/None keys,
    lists and tuples are stored as they are.  These are rewritten into that
    plain form and turned back on load (the type is recorded in the manifest,
    under ``__objckpt_lightning__``): dict subclasses (``OrderedDict`` with its
    ``_metadata``, ``defaultdict``, Lightning's ``AttributeDict``), dataclasses,
    enums, named tuples, sets and frozensets, ``pathlib`` paths,
    ``argparse.Namespace``, numpy arrays and scalars.  A class is looked up on
    load only among modules already imported (a checkpoint never makes the
    loader import a module); one that is not there comes back as plain data,
    with a warning.

    **What needs pickle.**  Anything else (an ``nn.Module`` or a function in
    the hyper-parameters, a custom object in a callback's state, dicts with
    tuple keys...) raises :class:`objckpt.UnsupportedValueError` naming the
    key, unless ``allow_pickle=True``: those values alone are then pickled,
    and loading them back needs ``allow_pickle=True`` too (and not
    ``weights_only=True``).

    **Async.**  ``async_save=True`` saves through :func:`objckpt.async_save`:
    ``save_checkpoint`` returns once the tensors are copied to host memory
    (the checkpoint dict's containers were already copied, so Lightning may
    change them), upload and commit continue in the background, in call
    order.  ``remove_checkpoint`` and ``load_checkpoint`` of a path first wait
    for its save in flight; ``teardown`` (end of ``fit``) waits for all, and a
    failed background save raises there or from the next ``save_checkpoint``.
    ``max_in_flight`` saves may upload at once.  Lightning's own
    ``AsyncCheckpointIO`` wrapper also works around this plugin (it saves in a
    thread of its own), but cannot order a remove after a queued save: prefer
    ``async_save=True``.

    Lightning calls ``save_checkpoint`` on global rank 0 only, so saves are
    one-rank objckpt saves (``no_dist``); ``load_checkpoint`` runs on every
    rank and reads without collectives.
    """

    def __init__(self, storage_options: Optional[dict[str, Any]] = None, *, allow_pickle: bool = False,
                 async_save: bool = False, max_in_flight: int = 1) -> None:
        super().__init__()
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be at least 1, got {max_in_flight!r}")
        self.storage_options: dict[str, Any] = dict(storage_options or {})
        self.allow_pickle = allow_pickle
        self.async_save = async_save
        self.max_in_flight = max_in_flight
        self._lock = threading.Lock()
        self._pending: dict[str, list["concurrent.futures.Future[None]"]] = {}
        self._failures: list[BaseException] = []
        self._executor: Optional[concurrent.futures.ThreadPoolExecutor] = None

    # ---- saving -------------------------------------------------------------------------

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Optional[Any] = None) -> None:
        """Save ``checkpoint`` at ``path`` (an existing checkpoint there is replaced).

        ``storage_options`` (Lightning's per-call argument): extra keyword arguments
        for :func:`objckpt.save`, e.g. ``{"metadata": {...}}``."""
        self._raise_failures()
        uri = _uri(path)
        if not isinstance(checkpoint, dict):
            raise TypeError(f"checkpoint for {uri!r} must be a dict, got {type(checkpoint).__name__}")
        if TYPES_KEY in checkpoint:
            raise ValueError(f"checkpoint for {uri!r} has a top-level key {TYPES_KEY!r}, which objckpt reserves")
        if storage_options is not None and not isinstance(storage_options, dict):
            raise TypeError(f"storage_options of save_checkpoint({uri!r}) must be a dict of objckpt.save "
                            f"arguments, got {type(storage_options).__name__}")
        plain = to_plain(checkpoint, allow_pickle=self.allow_pickle)
        tree = dict(plain.value)
        tree[TYPES_KEY] = {"format": FORMAT, "notes": [n.encode() for n in plain.notes]}
        kwargs: dict[str, Any] = {"metadata": {"lightning": {"format": FORMAT}}, **(storage_options or {})}
        kwargs.update(storage_options=self.storage_options, overwrite=True, no_dist=True)
        if not self.async_save:
            with self._saving(uri):
                _save(tree, uri, **kwargs)
                self._committed(uri)
            return
        handle = _async_save(tree, uri, max_in_flight=self.max_in_flight, **kwargs)
        self._track(uri, handle)

    def _saving(self, uri: str) -> "_InFlight":
        return _InFlight(self, uri)

    def _track(self, uri: str, handle: SaveHandle) -> None:
        """Finish an async save in the plugin's thread: wait for the commit, then write the marker."""
        def finish() -> None:
            handle.result()
            self._committed(uri)

        with self._lock:
            if self._executor is None:
                self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="objckpt-lightning")
            fut = self._executor.submit(finish)
            self._pending.setdefault(uri, []).append(fut)
        fut.add_done_callback(lambda f: self._done(uri, f))

    def _done(self, uri: str, fut: "concurrent.futures.Future[None]") -> None:
        with self._lock:
            futs = self._pending.get(uri, [])
            if fut in futs:
                futs.remove(fut)
            if not futs:
                self._pending.pop(uri, None)
            err = fut.exception()
            if err is not None:
                self._failures.append(err)

    def _committed(self, uri: str) -> None:
        """After the manifest is in place: the marker object (object stores), then fsspec's cache."""
        if _on_object_store(uri):
            store, key = open_store(uri, self.storage_options)
            body = marker_body(f"{key}/manifest.json", FORMAT)  # torch.load of it says what to call instead
            _runtime.run(store.put(key, body))
        _invalidate_fsspec(uri)

    def _wait_for(self, uri: str, timeout: Optional[float] = None) -> bool:
        """Block until no save of ``uri`` is in flight (its errors surface elsewhere), ``timeout``
        seconds at most; whether none is left."""
        with self._lock:
            futs = list(self._pending.get(uri, []))
        return not concurrent.futures.wait(futs, timeout=timeout).not_done

    def _raise_failures(self) -> None:
        with self._lock:
            failures, self._failures = self._failures, []
        if failures:
            raise failures[0]

    # ---- loading and removing -----------------------------------------------------------

    def load_checkpoint(self, path: Any, map_location: MapLocation = None,
                        weights_only: Optional[bool] = None) -> dict[str, Any]:
        """The checkpoint at ``path`` as Lightning saved it; tensors on CPU, or where
        ``map_location`` puts them.  ``weights_only=True`` refuses pickled values even
        with ``allow_pickle``.  A missing checkpoint raises :class:`objckpt.NotFoundError`
        (a ``FileNotFoundError``)."""
        uri = _uri(path)
        self._wait_for(uri)
        allow = self.allow_pickle and weights_only is not True
        tree = _read(uri, storage_options=self.storage_options, allow_pickle=allow)
        if not isinstance(tree, dict):
            raise ObjckptError(f"checkpoint {uri!r} is not a Lightning checkpoint (its root is a "
                               f"{type(tree).__name__}, not a dict)")
        types = tree.pop(TYPES_KEY, None)
        notes: list[TypeNote] = []
        if isinstance(types, dict):
            notes = [TypeNote.decode(n, f"checkpoint {uri!r}") for n in types.get("notes", [])]
        value: dict[str, Any] = from_plain(tree, notes, allow_pickle=allow, where=f"checkpoint {uri!r}")
        return apply_map_location(value, map_location)  # type: ignore[no-any-return]

    def remove_checkpoint(self, path: Any) -> None:
        """Delete the checkpoint at ``path`` (after its save in flight, if any) as
        :func:`objckpt.delete` does: the marker, the manifest, then the objects it names
        (:mod:`objckpt.ops.owned`).  A path with no checkpoint is left as it is, as
        Lightning's own plugin does, but for a marker whose checkpoint is gone."""
        uri = _uri(path)
        self._wait_for(uri)
        with self._saving(uri):
            try:
                _delete(uri, storage_options=self.storage_options)
            except NotFoundError:
                log.debug("objckpt: no checkpoint to remove at %s", uri)
                if _on_object_store(uri):
                    store, key = open_store(uri, self.storage_options)
                    if _runtime.run(orphaned_marker(store, key)):
                        _runtime.run(store.delete([key]))
            _invalidate_fsspec(uri)

    def teardown(self) -> None:
        """Wait for every save in flight; raise the first background failure."""
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True)
        self._raise_failures()


class _InFlight:
    """Marks a synchronous save or remove of one URI as in flight, so a remove or load of the
    same URI from another thread (Lightning's AsyncCheckpointIO saves in one) waits for it."""

    def __init__(self, io: ObjckptCheckpointIO, uri: str) -> None:
        self.io, self.uri = io, uri
        self.fut: "concurrent.futures.Future[None]" = concurrent.futures.Future()

    def __enter__(self) -> None:
        with self.io._lock:
            self.io._pending.setdefault(self.uri, []).append(self.fut)

    def __exit__(self, *exc: Any) -> None:
        with self.io._lock:
            futs = self.io._pending.get(self.uri, [])
            if self.fut in futs:
                futs.remove(self.fut)
            if not futs:
                self.io._pending.pop(self.uri, None)
        self.fut.set_result(None)


def _objckpt_io(trainer: Any) -> Optional[ObjckptCheckpointIO]:
    """The trainer's :class:`ObjckptCheckpointIO`, also inside a wrapper (``AsyncCheckpointIO``), or None."""
    io = getattr(getattr(trainer, "strategy", None), "checkpoint_io", None)
    for _ in range(4):  # wrappers hold the plugin they wrap as .checkpoint_io
        if isinstance(io, ObjckptCheckpointIO) or io is None:
            return io
        io = getattr(io, "checkpoint_io", None)
    return None


class ModelCheckpoint(_LightningModelCheckpoint):
    """Lightning's ``ModelCheckpoint``, with ``ckpt_path="last"`` working on remote paths.

    Lightning (2.6) finds ``last.ckpt`` by listing the checkpoint directory with
    fsspec, whose object-store listings drop the protocol (``bucket/run/last.ckpt``);
    the candidate then resolves to a local path and is never found, so
    ``fit(ckpt_path="last")`` silently starts from scratch.  It also lists with the
    filesystem picked in ``__init__``, a local one when ``dirpath`` is left to
    default to ``default_root_dir``.  This subclass lists with the directory's own
    filesystem and keeps the protocol; everything else is Lightning's.

    With :class:`ObjckptCheckpointIO` (also inside Lightning's ``AsyncCheckpointIO``),
    ``"last"`` is the newest *committed* checkpoint of the directory, whatever its name
    (:mod:`objckpt.integrations.lightning_last`): after a job killed with async saves in
    flight, ``last.ckpt`` may lag the step's top-k checkpoint, which committed first.
    """

    def _find_last_checkpoints(self, trainer: Any) -> set[str]:
        resolve = getattr(self, "_ModelCheckpoint__resolve_ckpt_dir", None)
        ckpt_dir = str(resolve(trainer) if resolve is not None else self.dirpath or "")
        io = _objckpt_io(trainer)
        if io is not None and ckpt_dir:
            newest = newest_committed(ckpt_dir, extension=self.FILE_EXTENSION, last_name=self.CHECKPOINT_NAME_LAST,
                                      tree_key=TYPES_KEY, storage_options=io.storage_options)
            return {newest} if newest is not None else set()
        if "://" not in ckpt_dir or ckpt_dir.startswith("file://"):
            return super()._find_last_checkpoints(trainer)
        fs = _fsspec(ckpt_dir)
        if not fs.exists(ckpt_dir):
            return set()
        pattern = re.compile(rf"^{re.escape(self.CHECKPOINT_NAME_LAST)}(-(\d+))?{re.escape(self.FILE_EXTENSION)}$")
        names = fs.ls(ckpt_dir, detail=False)
        return {fs.unstrip_protocol(p) for p in names if pattern.match(p.rstrip("/").rsplit("/", 1)[-1])}
