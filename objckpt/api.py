"""The public calls: signatures, documentation, options; the work is in save/ and load/.

The functions are synchronous.  Collectives (only in multi-rank operations)
run in the caller's thread; all storage I/O runs as coroutines on objckpt's
background loop (see :mod:`objckpt.runtime.loop`).
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, Optional

from typing_extensions import Unpack

from .distributed.comm import Comm, LocalComm, background_comm, get_comm
from .ops.delete import DeleteReport, delete_checkpoint
from .distributed.join import join
from .format.manifest import Manifest
from .load.collective import CollectiveReader
from .load.pipeline import load_into
from .load.prepared import PreparedLoad
from .load.session import ReadSession, open_location
from .runtime.memory import COLLECTIVE_BYTES, Budget, host_pool, load_budget
from .options import LoadOptions, ReadStrategy, ReadStrategyName, SaveArgs, split_save_args
from .results import LoadResult, SaveResult
from .save.background import SaveHandle, start_save
from .save.pipeline import save_now
from .runtime import loop as _runtime
from .storage import ObjectStore

__all__ = ["save", "async_save", "load", "read", "inspect", "delete", "SaveResult", "LoadResult", "SaveHandle"]


def _comm(no_dist: bool, process_group: Any) -> Comm:
    """This rank alone with ``no_dist`` (no collective, whatever process group exists), else the group's."""
    return LocalComm() if no_dist else get_comm(process_group)


def save(state_dict: Any, uri: str, **kwargs: Unpack[SaveArgs]) -> SaveResult:
    """Save ``state_dict`` (nested dicts/lists of tensors and plain values) to ``uri``.

    A value with ``state_dict()`` and ``load_state_dict()`` (module, optimizer,
    scheduler, GradScaler, your own object) is saved as its ``state_dict()``:
    ``save({"model": model, "optim": opt, "step": 5}, uri)`` stores the keys
    ``model.<param>``, ``optim.state.0.exp_avg``... as the state dicts would.

    In a torch.distributed job every rank calls it with the same ``uri``: each
    rank writes only its own shards (DTensor, :class:`objckpt.Shard`), plain
    tensors count as replicated and are written once with the work spread over
    the ranks, and rank 0 commits the manifest after every rank succeeded.
    Tensor bytes go to a few large blobs as parallel (multipart) uploads; the
    manifest is written last and conditionally, so the checkpoint appears whole
    or not at all.

    Keyword arguments (all optional, shared with :func:`async_save`):
    ``storage_options`` (endpoint, credentials, concurrency...), ``overwrite``
    (default False: an existing checkpoint raises :class:`CheckpointExistsError`;
    with True the old one stays loadable until the new manifest replaces it),
    ``metadata`` (free-form JSON stored in the manifest), ``allow_pickle``,
    ``process_group``, ``blob_size`` and ``part_size`` (by default per endpoint
    kind, :mod:`objckpt.storage.shape`: 1 GiB in 16 MiB parts; on moto 16 MiB
    blobs of one PUT each; a value given here wins),
    ``staging_bytes`` (512 MiB for the parts that need staging), ``crc_block``
    (bytes per block crc; by default chosen from the chunk sizes, at most 1 MiB), ``store`` (an ObjectStore replacing the backend the URI would
    open; the URI's path is then the prefix).

    ``single_writer=True``: you guarantee that one writer saves under this root (one
    job, never a second one beside it).  Without it a save that may not replace a
    checkpoint first asks whether the store honours the conditional commit (a
    create-only PUT repeated on a probe key, once per store per process; local files
    are never probed) and, on a store that accepts ``If-None-Match: *`` and ignores
    it, raises :class:`~objckpt.errors.ConditionalWriteIgnoredError` on every rank
    before writing anything: there two writers could both be told they committed.
    With it the save goes on (logged once per store).

    ``key_layout="spread"`` (for jobs of thousands of ranks on S3): each rank's
    blobs and rank index go under a hashed prefix below ``spread_root`` (a URI
    or path of an ancestor of ``uri``; default its parent) instead of under
    ``uri``, ``spread_digits`` (default 2: 256 prefixes) hex digits per rank, the
    same at every save, so S3's partitions keep serving later saves; the
    manifest (format v4) records where each object is.  See docs/s3-scale.md.

    ``no_dist=True``: this rank saves alone, with no collective, even when a
    process group exists (e.g. ``if rank == 0: save(..., no_dist=True)``); its
    tensors are saved whole, as a single process would.  Without it every rank
    of the group must call ``save``: a rank whose peers do not join within
    ``collective_timeout`` seconds (default ``$OBJCKPT_COLLECTIVE_TIMEOUT``,
    else 600) raises :class:`RanksDidNotJoinError` instead of hanging.
    """
    opts, where = split_save_args("save", dict(kwargs))
    comm = _comm(opts.no_dist, where["process_group"])
    st, prefix = open_location(uri, where["storage_options"], where["store"])
    return save_now(state_dict, uri, st, prefix, comm, opts, host_pool())


def async_save(state_dict: Any, uri: str, *, lazy: bool = False, max_in_flight: int = 1,
               **kwargs: Unpack[SaveArgs]) -> SaveHandle:
    """Save like :func:`save` (same keyword arguments), returning once the state
    is staged in host memory (at once with ``lazy=True``); upload and commit
    continue in the background.  See :mod:`objckpt.save.background` for the contract.

    ``max_in_flight``: how many saves may stage and upload at once (a new call first
    waits for the oldest beyond that).  ``staging_bytes``: host memory for staging;
    by default this rank's whole share of the state, else staging and upload are
    pipelined part by part within the budget (and the call returns when the last
    part is staged).  A given ``staging_bytes`` is a hard limit (for :func:`save`
    too): a part to stage larger than it raises
    :class:`~objckpt.errors.MemoryBudgetError` before anything is written.
    """
    opts, where = split_save_args("async_save", dict(kwargs))
    comm = _comm(opts.no_dist, where["process_group"])
    # before background_comm, whose first call creates a gloo group (a collective) on NCCL jobs
    join(comm, f"async save to {uri!r}", opts.collective_timeout)
    bg_comm = background_comm(comm, where["process_group"])
    st, prefix = open_location(uri, where["storage_options"], where["store"])
    return start_save(state_dict, uri, st, prefix, comm, bg_comm, opts, lazy=lazy, max_in_flight=max_in_flight)


def inspect(
    uri: str, *, storage_options: Optional[dict[str, Any]] = None, store: Optional[ObjectStore] = None,
    chunks: bool = True,
) -> Manifest:
    """The checkpoint's manifest: keys, dtypes, shapes, chunks, blobs, metadata.

    A multi-rank checkpoint in format v2 keeps its chunk records in one index
    object per rank; ``chunks=True`` fetches them all so every tensor lists its
    chunks, ``chunks=False`` returns the manifest alone (one GET)."""
    return ReadSession(uri, storage_options, store).inspect(chunks)


def read(
    uri: str,
    keys: "str | Iterable[str] | None" = None,
    *,
    storage_options: Optional[dict[str, Any]] = None,
    allow_pickle: bool = False,
    store: Optional[ObjectStore] = None,
    no_dist: bool = False,
) -> Any:
    """Tensors (on CPU) and values of a checkpoint, without a template.

    ``keys=None`` returns the whole saved structure (nested as it was saved,
    tied tensors tied again, sharded tensors assembled whole).  With ``keys``,
    returns ``{key: value}`` for just those keys and fetches only their bytes; a
    key may also be a subtree or key prefix (``"optim"``, ``"model.layers.0"``),
    whose value is then the nested subtree under it (keys relative to it), or a
    glob pattern (``*``, ``?``, ``[...]``; ``fnmatch`` rules, case-sensitive, ``*``
    crossing dots): ``read(uri, "model.*lora*")`` returns every matching leaf under
    its own key and fetches only the matching tensors' bytes.  A key or pattern that
    selects nothing is a :class:`MissingKeyError` naming it.  A single string is one
    key (``read(uri, "optim")`` is ``read(uri, ["optim"])``).
    ``read`` never communicates with other ranks; ``no_dist`` is accepted for
    symmetry with :func:`load` and changes nothing.
    """
    del no_dist  # read is always this rank alone
    if isinstance(keys, str):
        keys = [keys]  # not its characters
    return ReadSession(uri, storage_options, store).read_tree(keys, allow_pickle)


def load(
    state_dict: Any,
    uri: str,
    *,
    storage_options: Optional[dict[str, Any]] = None,
    strict: bool = True,
    allow_pickle: bool = False,
    process_group: Any = None,
    store: Optional[ObjectStore] = None,
    read_strategy: "ReadStrategyName | ReadStrategy" = "auto",
    collective_bytes: int = COLLECTIVE_BYTES,
    no_dist: bool = False,
    collective_timeout: Optional[float] = None,
    cast: bool = False,
    memory_bytes: Optional[int] = None,
    allow_optimizer_change: bool = False,
) -> LoadResult:
    """Fill ``state_dict``'s tensors in place (any device) from the checkpoint.

    Tensors may be plain (the whole tensor is loaded), DTensors (each rank
    fills its local shard) or :class:`objckpt.Shard`; the checkpoint may have
    been saved with any other layout and world size.  Each rank fetches only
    the bytes that overlap what it holds.  Non-tensor values in dicts and lists
    are replaced by the saved ones (per rank, when ranks saved different
    values).  Global shape must match exactly, and dtype too unless
    ``cast=True``, which converts between floating dtypes (an fp32 checkpoint
    into a bf16 template: each such tensor is read into a temporary of the
    stored dtype, then copied; a rank reading alone holds at most 256 MiB of
    such temporaries at a time).  With ``strict`` (the default) keys missing from
    the checkpoint or not in ``state_dict`` are an error naming them (and the key
    prefix one side has and the other lacks, with the fix); otherwise they are
    reported in the result, but a load that matches no tensor of the checkpoint,
    or none of a Stateful value's tensors, is still an error (before any byte is
    read).  Keys that differ only by the prefix torch's wrappers add
    (``_orig_mod.``, ``module.``, ``_checkpoint_wrapped_module.``) on every key of
    one side are matched without it (see :mod:`objckpt.load.key_match`).

    Stateful values (anything with ``state_dict()`` and ``load_state_dict()``:
    modules, optimizers, schedulers...) are loaded through them: their current
    ``state_dict()`` is the template, then ``load_state_dict()`` receives it
    filled.  A freshly built optimizer's missing per-parameter state is created
    from the checkpoint (see :mod:`objckpt.state` for the rule).  A checkpoint of another
    kind of optimizer (an AdamW checkpoint into SGD: each side's param groups, or the
    per-parameter state where the template has some, have names the other lacks) is
    refused with :class:`~objckpt.errors.OptimizerMismatchError` before anything is
    loaded, where torch would load it silently; ``allow_optimizer_change=True`` loads it
    anyway (see :mod:`objckpt.load.optimizer_match`).  The same optimizer built with
    other hyperparameter values loads, and takes the stored values.

    ``read_strategy`` says how ranks that need the same bytes (replicated
    tensors, the DP groups of a DP x TP layout) read them: ``"direct"`` (each
    rank from storage), ``"broadcast"`` (one member of each replica group
    reads, then broadcasts), ``"allgather"`` (each member reads a disjoint
    share, then all-gather) or ``"auto"`` (a cost model picks per group;
    ``"direct"`` without a process group).  Every rank must pass the same
    value.  Collectives run in batches of at most ``collective_bytes``; a
    failed read on any rank makes every rank raise.  See
    :mod:`objckpt.load.collective`.

    ``no_dist=True``: this rank loads alone (every tensor read directly, no
    collective) even when a process group exists.  Without it every rank must
    call ``load``; one whose peers do not join within ``collective_timeout``
    seconds raises :class:`RanksDidNotJoinError` (as :func:`save`).

    ``memory_bytes``: one budget for the memory the load itself holds (cast
    temporaries, collective batches, read temporaries, the pinned ring into GPU
    memory): together they stay within it, each part taking less when the others
    hold more, and a single piece that cannot fit raises
    :class:`~objckpt.errors.MemoryBudgetError` naming the budget.  None (the
    default): each part its own default (256 MiB each, ``collective_bytes`` for
    the batches), a tensor larger than that read alone.
    """
    return load_session(state_dict, lambda: ReadSession(uri, storage_options, store), uri, strict=strict,
                        allow_pickle=allow_pickle, process_group=process_group, read_strategy=read_strategy,
                        collective_bytes=collective_bytes, no_dist=no_dist,
                        collective_timeout=collective_timeout, cast=cast, memory_bytes=memory_bytes,
                        allow_optimizer_change=allow_optimizer_change)


def load_session(
    state_dict: Any,
    session: Callable[[], ReadSession],
    uri: str,
    *,
    strict: bool = True,
    allow_pickle: bool = False,
    process_group: Any = None,
    read_strategy: "ReadStrategyName | ReadStrategy" = "auto",
    collective_bytes: int = COLLECTIVE_BYTES,
    no_dist: bool = False,
    collective_timeout: Optional[float] = None,
    cast: bool = False,
    memory_bytes: Optional[int] = None,
    prepared: Optional[PreparedLoad] = None,
    allow_optimizer_change: bool = False,
) -> LoadResult:
    """:func:`load` from the session ``session()`` opens on ``uri``'s checkpoint (opened
    inside the ranks' guard, so a failure to open it reaches every rank): the seam a
    caller that has already read the manifest uses to hand it over
    (:class:`~objckpt.load.session.ReadSession`'s ``held``; the tiered restore), with the
    load it prepared from it (``prepared``: taken where it serves, see
    :func:`~objckpt.load.pipeline.load_into`)."""
    comm = _comm(no_dist, process_group)
    join(comm, f"load of {uri!r}", collective_timeout)
    # a bad option on one rank must still reach the others' first exchange: parse inside the guard
    strategy = read_strategy if read_strategy in tuple(ReadStrategy) else ReadStrategy.AUTO
    reader = CollectiveReader(comm, ReadStrategy(strategy), Budget(max(collective_bytes, 1)))
    with reader.failing_together(uri):
        opts = LoadOptions(strict, allow_pickle, read_strategy, collective_bytes,  # type: ignore[arg-type]
                           no_dist, collective_timeout, cast, memory_bytes, allow_optimizer_change)
        reader.memory = load_budget(opts.memory_bytes, opts.collective_bytes)  # the load's one budget
        return load_into(state_dict, session(), reader, opts, prepared)


def delete(uri: str, *, storage_options: Optional[dict[str, Any]] = None,
           store: Optional[ObjectStore] = None) -> DeleteReport:
    """Delete the checkpoint at ``uri`` and every object it owns (:mod:`objckpt.ops.owned`):
    the Lightning plugin's marker at ``uri`` first, when there is one, then its manifest
    (the checkpoint stops existing at once, never half-visible), then the blobs and index
    objects that manifest names.  :class:`NotFoundError` when no checkpoint is committed there.
    Objects the manifest does not name (a killed save's leftovers) are ``gc``'s.
    Not a collective: call it from one rank."""
    st, prefix = open_location(uri, storage_options, store)
    return _runtime.run(delete_checkpoint(st, prefix, uri))
