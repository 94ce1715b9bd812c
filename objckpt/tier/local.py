"""The local tier: a rank's share of a checkpoint in a node-local directory.

A local checkpoint is an ordinary objckpt checkpoint (the one writer,
:func:`objckpt.save`, writes it through a :class:`~objckpt.storage.local.LocalStore`,
with O_DIRECT where asked and where the filesystem allows it), committed by its
manifest like any other, so ``objckpt.load``, ``read``, ``inspect`` and the CLI
read a local step folder by its plain path.

On several nodes each rank writes its blobs (and its rank index) into its own
node's folder; rank 0 commits the manifest into its node's folder.  So that every
node's folder is a checkpoint too, :func:`spread_metadata` then sends the
manifest and the rank indexes (small) to every node; each node's first rank
writes what its folder lacks, the manifest last.  A node's folder then holds the
whole metadata and the blobs of its own ranks (plus the replicas peers sent it,
:mod:`objckpt.tier.peers`): its ranks load their share from it; a restore that
needs other nodes' blobs repairs them from peers first (:mod:`objckpt.tier.restore`).
"""
from __future__ import annotations

import errno
import logging
import os
import secrets
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

from ..distributed.comm import Comm, RankError, TorchComm
from ..format import keys
from ..format import manifest as _manifest
from ..results import IOStats
from ..runtime import loop as _runtime
from ..save.commit import CommitState, commit
from ..storage.local import LocalStore
from ..errors import ObjckptError
from . import step_files as _step_files
from .step_files import files_of, needed_files  # noqa: F401  (the tier's modules take them from here)
from .errors import LocalTierError, local_problem

_log = logging.getLogger("objckpt.manager")


def resolve_dir(template: str, node: str) -> Path:
    """``template`` with ``{node}`` replaced by the node's name, absolute."""
    return Path(os.path.abspath(os.path.expanduser(template.replace("{node}", node))))


def writable_error(root: Path) -> Optional[str]:
    """Why ``root`` cannot hold local checkpoints (None: it can): created if missing,
    then a probe file written and removed."""
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe = root / f".objckpt-probe-{secrets.token_hex(4)}"
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, b"x")
        finally:
            os.close(fd)
            probe.unlink(missing_ok=True)
    except OSError as e:
        return f"local_dir {str(root)!r} is not writable: {e.strerror or e} ({errno.errorcode.get(e.errno or 0, '')})"
    return None


def present(step_dir: Path, names: list[str], hidden: "frozenset[str] | set[str]" = frozenset()) -> list[str]:
    """Those of ``names`` that exist under ``step_dir``, less ``hidden`` (files a restore
    found damaged there: they count as absent, so the plan takes them from elsewhere)."""
    return [n for n in names if n not in hidden and (step_dir / n).is_file()]


@dataclass
class LocalStep:
    """A step folder as this rank sees it on its node."""

    step: int
    needed: list[str]
    present: list[str]

    @property
    def complete(self) -> bool:
        return set(self.needed) <= set(self.present)


def scan(root: Path, parse: Any, keep: Optional[dict[int, tuple[bytes, Optional[_manifest.Manifest]]]] = None,
         *, unlisted: Optional["Unlisted"] = None) -> dict[int, LocalStep]:
    """The committed steps in ``root`` (``parse(name)`` -> step or None per folder name);
    ``keep``, when given, receives each step's manifest as read here (its bytes, and the
    manifest when it was decoded), for a load of that step to take instead of reading it again.

    A step's files come from its file list (:mod:`objckpt.tier.step_files`) when that was
    taken from these very manifest bytes; only a step without one has its manifest decoded.
    ``unlisted``, when given, receives the step folders that are not returned: those whose
    manifest cannot be decoded (damaged) and those without one (their files still count
    towards a step another node's folder commits)."""
    out: dict[int, LocalStep] = {}
    try:
        names = os.listdir(root)
    except OSError:
        return out
    for name in names:
        step = parse(name)
        if step is None:
            continue
        got = read_listed(root / name)
        if got is None:
            if unlisted is not None:
                unlisted.add(step, root / name)
            continue
        data, m, files = got
        if keep is not None:
            keep[step] = (data, m)
        need = list(files.needed)
        out[step] = LocalStep(step, need, present(root / name, need))
    return out


@dataclass
class Unlisted:
    """The step folders :func:`scan` does not return, and why (a restore's plan uses both)."""

    #: step -> why its folder's manifest cannot be decoded (a damaged copy: taken from elsewhere)
    damaged: dict[int, str] = field(default_factory=dict)
    #: step -> the files of a folder without a manifest (a node the metadata never reached)
    loose: dict[int, tuple[str, ...]] = field(default_factory=dict)

    def add(self, step: int, step_dir: Path) -> None:
        try:
            data = (step_dir / keys.MANIFEST_NAME).read_bytes()
        except FileNotFoundError:
            self.loose[step] = tuple(folder_files(step_dir))
            return
        except OSError as e:
            self.damaged[step] = f"{keys.MANIFEST_NAME} cannot be read: {e.strerror or e}"
            return
        try:
            _manifest.decode(data, str(step_dir / keys.MANIFEST_NAME))
            self.damaged[step] = f"{keys.MANIFEST_NAME} changed while it was read"
        except Exception as e:  # noqa: BLE001 - the reason is reported, the copy taken from elsewhere
            self.damaged[step] = f"{type(e).__name__}: {e}"


def folder_files(step_dir: Path) -> list[str]:
    """Every final file under ``step_dir``, relative (no temporaries of a copy, no file list)."""
    out: list[str] = []
    for dirpath, _dirs, names in os.walk(step_dir):
        for name in names:
            if _TEMP_MARK in name or ".tmp-" in name or name == _step_files.FILES_NAME:
                continue
            out.append((Path(dirpath) / name).relative_to(step_dir).as_posix())
    return sorted(out)


#: marks a file a peer copy is still writing (objckpt.tier.transfer.TEMP_MARK; not imported:
#: the transfer module imports the wire, far above this one)
_TEMP_MARK = ".objckpt-tmp-"


def read_listed(step_dir: Path) -> Optional[tuple[bytes, Optional[_manifest.Manifest], _step_files.StepFiles]]:
    """A committed local step's manifest bytes, its manifest when it had to be decoded (no
    usable file list), and its files; None when the folder holds no readable manifest."""
    path = step_dir / keys.MANIFEST_NAME
    try:
        data = path.read_bytes()
    except OSError:
        return None
    files = _step_files.read(step_dir, data)
    if files is not None:
        return data, None, files
    try:
        m = _manifest.decode(data, str(path))
    except Exception:  # noqa: BLE001 - an unreadable manifest is no local checkpoint
        return None
    return data, m, _step_files.of_manifest(m)


def committed_steps(root: Path, parse: Any) -> list[int]:
    """The steps in ``root`` whose folder holds a manifest, ascending (``parse`` as for
    :func:`scan`): what local retention counts after every save, without reading and
    decoding each step's manifest as :func:`scan` does (a large model's is megabytes)."""
    try:
        names = os.listdir(root)
    except OSError:
        return []
    steps = ((parse(n), n) for n in names)
    return sorted(s for s, n in steps if s is not None and (root / n / keys.MANIFEST_NAME).is_file())


@dataclass(frozen=True)
class _Sent:
    """What one rank adds to the spread's all-gather: rank index files (name -> bytes) or
    why it could not read them."""

    files: dict[str, bytes]
    problem: Optional[RankError] = None


@dataclass(frozen=True)
class NodeLeaders:
    """Each node's first rank in a gloo group of their own (``comm`` on those ranks, None on
    the others): the rank indexes then go only to the ranks that write them.  A node's first
    rank reads its node's indexes from its own folder (its ranks wrote them there), so only
    the first ranks exchange them: each receives the world's indexes once, where an
    all-gather over every rank sends every rank all of them (the world size squared)."""

    comm: Optional[Comm]


def node_leaders(comm: Comm, nodes: Sequence[str], timeout: float) -> Optional[NodeLeaders]:
    """Collective over every rank of ``comm`` (from the thread that will not interleave
    collectives with it): the group of each node's first rank, ``timeout`` seconds per
    operation.  None where every rank is its node's first (the plain all-gather is the same)."""
    firsts = sorted({nodes.index(n) for n in nodes})
    if len(firsts) == len(nodes) or not isinstance(comm, TorchComm):
        return None
    import datetime

    import torch.distributed as dist

    members = comm.global_ranks()
    leads = [members[r] for r in firsts]
    key = (id(dist.group.WORLD), members, tuple(leads))
    group = _leader_groups.get(key)  # one per job and set of first ranks, made alike on every rank
    if group is None:
        group = _leader_groups[key] = dist.new_group(leads, backend="gloo",
                                                     timeout=datetime.timedelta(seconds=timeout))
    return NodeLeaders(TorchComm(group) if comm.rank in firsts else None)


#: the nodes' first ranks' groups made so far (a second manager of the same job reuses its group)
_leader_groups: dict[tuple[int, tuple[int, ...], tuple[int, ...]], Any] = {}


def spread_metadata(comm: Comm, step_dir: Path, nodes: list[str], rank: int,
                    leaders: Optional[NodeLeaders] = None) -> Optional[_manifest.Manifest]:
    """After rank 0 committed into its node's folder: every node's folder gets the manifest
    and every rank index, the manifest last; returns the step's manifest (None on a
    single node, where there is nothing to send, and on the ranks that neither write a
    folder nor send indexes: only those decode it, a large one taking ~0.1 s).

    Collective over ``comm`` (objckpt's own tier group: never the training's), always
    the same operations on every rank whatever fails: a broadcast of the manifest, an
    all-gather of the rank indexes (over ``leaders`` when given, every rank passing one:
    only the nodes' first ranks, each sending its node's indexes), an all-gather of each
    rank's outcome.  A failure on any rank (rank 0 cannot read its manifest, a rank an
    index, a node's first rank cannot write its folder: unwritable, full) is a
    :class:`LocalTierError` on every rank at once, naming the rank, its node and the
    path; each node's first rank then removes the step from its folder (manifest first),
    so the failed save leaves no step on any node, a failing node never shows it complete
    (its manifest is written last), and the previous steps are untouched.  Only a rank
    that stops answering makes the others wait, until the group's collective timeout (a
    :class:`~objckpt.errors.CollectiveError`)."""
    if len(set(nodes)) <= 1:
        return None
    here = f"rank {rank} on node {nodes[rank]!r}"
    first = nodes.index(nodes[rank]) == rank
    mpath = step_dir / keys.MANIFEST_NAME
    sent: tuple[Optional[bytes], Optional[RankError]] = (None, None)
    if rank == 0:
        try:
            sent = (mpath.read_bytes(), None)
        except OSError as e:
            sent = (None, _problem(here, f"reading the committed manifest {str(mpath)!r}", e))
    mdata, problem = comm.broadcast_object(sent, 0)
    m: Optional[_manifest.Manifest] = None
    # the ranks whose indexes this rank sends: its own, or as a node's first rank its node's
    senders = [rank] if leaders is None else [r for r, n in enumerate(nodes) if n == nodes[rank]] if first else []
    if mdata is not None and (first or senders):  # the others neither write nor send: no decode
        try:
            m = _manifest.decode(mdata, str(mpath))
        except Exception as e:  # noqa: BLE001 - the same bytes on every deciding rank: the same verdict
            problem = _problem(here, f"decoding the manifest of {str(step_dir)!r}", e)
    mine = _Sent({}, problem)
    if m is not None and senders:
        name = ""
        try:
            for name in (n for r in senders for n in files_of(m, r) if n.endswith(".index.json")):
                mine.files[name] = (step_dir / name).read_bytes()
        except OSError as e:
            mine = _Sent({}, _problem(here, f"reading the rank index {str(step_dir / name)!r}", e))
    if leaders is None:
        everyone: list[_Sent] = comm.all_gather_object(mine)
    elif leaders.comm is not None:
        everyone = leaders.comm.all_gather_object(mine)
    else:  # not a node's first rank: it writes nothing, it only learns the outcome
        everyone = [mine]
    failed = next((x.problem for x in everyone if x.problem is not None), None)
    outcome = mine.problem
    if first and failed is None and mdata is not None:
        outcome = _fill_node_folder(step_dir, everyone, mdata, here, m)
    outcomes: list[Optional[RankError]] = comm.all_gather_object(outcome or failed)
    problems = list(dict.fromkeys(p.text for p in outcomes if p is not None))  # one rank's problem once
    if not problems:
        return m
    undone = ""
    if first:
        try:
            delete_step(step_dir)
        except LocalTierError as e:
            undone = f"; removing the step from {str(step_dir)!r} failed too: {e}"
    shown = "; ".join(problems[:4]) + (f"; and {len(problems) - 4} more" if len(problems) > 4 else "")
    raise LocalTierError(f"the step at {str(step_dir)!r} could not be written to every node's folder ({shown}): "
                         f"it was removed from every node's folder, the previous steps are untouched{undone}")


def _problem(where: str, doing: str, e: BaseException) -> RankError:
    why = getattr(e, "strerror", None) or str(e) or type(e).__name__
    return local_problem(f"{where}: {doing} failed: {type(e).__name__}: {why}")


def _fill_node_folder(step_dir: Path, everyone: list[_Sent], mdata: bytes, here: str,
                      m: Optional[_manifest.Manifest] = None) -> Optional[RankError]:
    """A node's first rank: write the rank indexes its folder lacks, then the manifest (last,
    only when everything else is there, through the one conditional manifest write:
    :func:`objckpt.save.commit.commit`, ``m`` its decoded form when known); the problem, or None."""
    store = LocalStore(str(step_dir))
    name = ""
    try:
        for part in everyone:
            for name, data in part.files.items():
                if not (step_dir / name).is_file():
                    _runtime.run(store.put(name, data))
        name = keys.MANIFEST_NAME
        if not (step_dir / name).is_file():
            errors: list[BaseException] = []
            meta = m if m is not None else _manifest.decode(mdata, str(step_dir / name))
            status = commit(store, "", meta, False, str(step_dir), [], IOStats(), errors, data=mdata)
            if status.state is not CommitState.OK:  # the same step's manifest already there is OK
                raise errors[-1] if errors else LocalTierError(status.message)
    except (OSError, ObjckptError) as e:
        return _problem(here, f"writing {str(step_dir / name)!r}", e)
    return None


def received_metadata(step_dir: Path, segments: dict[str, list[tuple[int, Any]]]) -> dict[str, bytes]:
    """Of the files a restore received from peers for ``step_dir`` (store keys -> pieces), the
    metadata (manifest, rank indexes) whole, name -> bytes, when the folder holds files of the
    step but not its manifest (a node the step's metadata never reached); {} otherwise (a
    replaced node's folder, absent, stays as it is: the next save's replication fills it)."""
    if (step_dir / keys.MANIFEST_NAME).exists() or not folder_files(step_dir):
        return {}
    prefix = step_dir.absolute().as_posix().strip("/") + "/"
    out: dict[str, bytes] = {}
    for key, pieces in segments.items():
        name = key[len(prefix):] if key.startswith(prefix) else ""
        if (name == keys.MANIFEST_NAME or name.endswith(".index.json")) and len(pieces) == 1 and pieces[0][0] == 0:
            out[name] = pieces[0][1].numpy().tobytes()
    return out if keys.MANIFEST_NAME in out else {}


def write_back_metadata(step_dir: Path, files: dict[str, bytes]) -> None:
    """After a restore that read it through a peer's copy: write the step's metadata (``files``:
    the rank indexes its folder lacks, then the manifest, last) into ``step_dir``, so later
    restores and drains see the step there.  A failure is a warning: the restore is done."""
    problem = _fill_node_folder(step_dir, [_Sent({n: d for n, d in files.items() if n != keys.MANIFEST_NAME})],
                                files[keys.MANIFEST_NAME], f"the node folder {str(step_dir)!r}")
    if problem is not None:
        _log.warning("objckpt: %s (the restore is done; the step's metadata is not written back)", problem.text)
    else:
        _log.info("objckpt: wrote the metadata of %s back (its node lacked it)", step_dir)


def delete_step(step_dir: Path) -> None:
    """Remove a local step: its manifest first (it stops being a checkpoint at once), then the rest."""
    try:
        (step_dir / keys.MANIFEST_NAME).unlink()
    except FileNotFoundError:
        pass
    except OSError as e:
        raise LocalTierError(f"cannot delete the local checkpoint {str(step_dir)!r}: {e.strerror or e}") from e
    shutil.rmtree(step_dir, ignore_errors=True)

