"""Which manager root a local step folder belongs to: an owner record in every step folder.

Why: a step folder is named by its step only (``step-0000000003``), and ``local_dir`` is
often a template many jobs share (``/dev/shm/ckpt``).  Without a record of whose a folder
is, a second job with another root sees the first job's steps as its own: it restores
them, refuses to save their numbers, and its retention deletes them.

So each rank, before its local save writes a byte (:func:`claim`), writes
:data:`OWNER_NAME` into the step folder on its node: the manager's root URI and,
informational, the job's identity where the environment has one (:func:`job_identity`).
Every node whose folder holds any file of the step has a rank that saved it, so every
such folder names its root, also one that never got its manifest; replicas and the
metadata sent to every node land in folders their own node's ranks claimed first.  The
record is written whole (temporary name, then rename); ranks of one node write the same
bytes.  Ownership is the root alone: a restarted job (a new job id) on the same root owns
its steps.

The manager reads its local folder only through :class:`Owned`, the step-name parser
limited to its own root's folders: restore, ``latest_step()``, ``step_tiers()``, local
retention and the removal of newer steps after a restore never see another root's
steps, so never restore, count or delete them; finding them is one WARNING per manager
(:meth:`Owned.survey`).  Saving a step whose folder another root's record names is a
:class:`~objckpt.tier.errors.TierSettingsError` before anything is written
(:meth:`Owned.collision`).

A folder without a record was written by an older release (or is another job's claim
being made).  It is ours only on positive evidence: a drain record of
:mod:`objckpt.tier.backlog` for that folder naming this root (then the manager's first
rank on the node writes the record, adopting it).  Otherwise it is never restored,
counted or deleted, and the warning names it: a job upgraded mid-run restores its newest
drained step instead of an older release's local-only one, rather than risk another
job's weights.
"""
from __future__ import annotations

import contextlib
import enum
import json
import logging
import os
import secrets
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Mapping, Optional

from . import backlog as _backlog
from ..distributed.comm import RankError
from .errors import local_problem

log = logging.getLogger("objckpt.tier")

#: the owner record's name in a step folder (no checkpoint object has it)
OWNER_NAME = ".objckpt-owner.json"
_FORMAT = "objckpt-local-owner"
_VERSION = 1
#: environment variables that identify a job, in the order asked (the first set one wins)
JOB_VARIABLES = ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "PBS_JOBID", "LSB_JOBID")


def job_identity(env: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """The job's identity where its launcher gives one (``"SLURM_JOB_ID=123"``), else None;
    the only reader of these variables.  torchrun's default run id ``none`` is none."""
    env = os.environ if env is None else env
    for name in JOB_VARIABLES:
        value = env.get(name, "").strip()
        if value and value != "none":
            return f"{name}={value}"
    return None


def canonical_root(root: str) -> str:
    """``root`` as ownership compares it: a local path absolute (a relative root given from
    another working directory, or ``~``, is the same folder), a URI without a trailing ``/``."""
    if "://" in root:
        return root.rstrip("/")
    return os.path.abspath(os.path.expanduser(root))


@dataclass(frozen=True)
class Owner:
    """Whose a step folder is: a manager root; ``job`` is informational (messages only)."""

    root: str
    job: Optional[str] = None

    def __str__(self) -> str:
        return repr(self.root) + (f" (job {self.job})" if self.job else "")


def read(step_dir: Path) -> Optional[Owner]:
    """The folder's owner record; None when it has none.  A record that cannot be read or
    parsed is an owner nobody is (never this manager): such a folder is left alone."""
    try:
        data = (step_dir / OWNER_NAME).read_bytes()
    except FileNotFoundError:
        return None
    except OSError as e:
        return Owner(f"<unreadable owner record: {e.strerror or e}>")
    try:
        doc = json.loads(data)
        if doc.get("format") != _FORMAT or not isinstance(doc.get("root"), str):
            raise ValueError("not an owner record")
        return Owner(doc["root"], doc.get("job") if isinstance(doc.get("job"), str) else None)
    except (ValueError, AttributeError) as e:
        return Owner(f"<unreadable owner record: {e}>")


def write(step_dir: Path, owner: Owner) -> None:
    """Write ``owner``'s record into ``step_dir`` (made if missing), whole: a temporary
    name of this writer's own, then a rename (ranks of one node may write it at once)."""
    data = json.dumps({"format": _FORMAT, "version": _VERSION, "root": owner.root, "job": owner.job},
                      sort_keys=True).encode()
    if not step_dir.exists():  # the folder appears with its record in it: never seen without one
        step_dir.parent.mkdir(parents=True, exist_ok=True)
        made = step_dir.parent / f".{step_dir.name}.owner-{secrets.token_hex(6)}"
        try:
            made.mkdir()
            (made / OWNER_NAME).write_bytes(data)
            os.rename(made, step_dir)
            return
        except OSError:
            pass  # another rank of the node made it first (or a file is in the way): written below
        finally:
            shutil.rmtree(made, ignore_errors=True)
    step_dir.mkdir(parents=True, exist_ok=True)
    tmp = step_dir / f"{OWNER_NAME}.tmp-{secrets.token_hex(6)}"
    try:
        tmp.write_bytes(data)
        os.replace(tmp, step_dir / OWNER_NAME)
    finally:
        tmp.unlink(missing_ok=True)


@dataclass
class Claim:
    """A rank's owner record written before its save: ``created`` when the claim made the
    folder (then :meth:`undo` removes both when the save is refused after all); ``error``:
    why it could not be written ("" when it was)."""

    step_dir: Path
    created: bool
    error: str = ""

    @property
    def problem(self) -> Optional[RankError]:
        """This rank's reason not to save, for the save's all-gather (None: the record is there)."""
        return local_problem(self.error) if self.error else None

    def undo(self) -> None:
        """Leave the folder as before the claim (best effort): removed where the claim made
        it, or where it holds nothing but the record (another rank of the node made it and
        may not have undone its claim yet: whichever rank returns first, the folder is gone
        when it returns, on every rank of the node)."""
        if not self.created:
            try:
                if set(os.listdir(self.step_dir)) - {OWNER_NAME}:
                    return  # it held files before this save: only the record stays (as a save would leave it)
            except OSError:
                return
        (self.step_dir / OWNER_NAME).unlink(missing_ok=True)
        try:
            self.step_dir.rmdir()  # only when empty: another rank's record may still be there
        except OSError:
            pass


@contextlib.contextmanager
def undone_if_refused(claim: Optional[Claim]) -> Iterator[None]:
    """Around the refusal of a save: a claim it made is undone when the block raises."""
    try:
        yield
    except BaseException:
        if claim is not None:
            claim.undo()
        raise


def claim(step_dir: Path, owner: Owner) -> Claim:
    """Write ``owner``'s record into ``step_dir`` before a save writes there (call
    :meth:`Owned.collision` first: this never checks whose the folder is)."""
    created = not step_dir.exists()
    try:
        write(step_dir, owner)
    except OSError as e:
        return Claim(step_dir, created, f"cannot write the owner record {str(step_dir / OWNER_NAME)!r}: "
                                        f"{e.strerror or e}")
    return Claim(step_dir, created)


class Verdict(enum.Enum):
    """Whose a step folder is, as this manager sees it."""

    OURS = "ours"
    #: its record names another root (or cannot be read)
    FOREIGN = "foreign"
    #: no record and no evidence that it is ours (an older release's, or a claim being made)
    UNKNOWN = "unknown"


@dataclass
class Survey:
    """The step folders of a local folder that are not this manager's."""

    #: another root's owner -> its steps there
    foreign: dict[Owner, list[int]] = field(default_factory=dict)
    #: steps whose folder has no owner record nor evidence of being ours
    unknown: list[int] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.foreign or self.unknown)


class Owned:
    """``parse`` (a step folder's name -> step, None: no step folder) limited to the step
    folders of ``owner``'s root under ``folder``: what the manager passes to the local
    tier's listings (:func:`objckpt.tier.local.scan`, ``committed_steps``), so that
    another root's steps are invisible to its restores and its retention.  ``loud``: this
    rank says what it finds (a node's first rank; the others would say the same)."""

    def __init__(self, folder: Path, parse: Callable[[str], Optional[int]], owner: Owner, loud: bool = True) -> None:
        self.folder = folder
        self.parse = parse
        self.owner = owner
        self.loud = loud
        self._warned = False

    @classmethod
    def surveyed(cls, folder: Path, parse: Callable[[str], Optional[int]], root: str, first: bool) -> "Owned":
        """A manager's filter for ``root`` (with this job's identity), after one survey of
        ``folder`` (``first``: this rank is its node's first: it warns and adopts)."""
        owned = cls(folder, parse, Owner(canonical_root(root), job_identity()), loud=first)
        owned.survey(adopt=first)
        return owned

    def __call__(self, name: str) -> Optional[int]:
        step = self.parse(name)
        if step is None or self.verdict(name)[0] is Verdict.OURS:
            return step
        if not self._warned:  # found after the survey at the start: say it once, the whole picture
            self.survey()
        return None

    def verdict(self, name: str) -> tuple[Verdict, Optional[Owner]]:
        """Whose the folder ``name`` is, and the owner its record names (None: no record)."""
        found = read(self.folder / name)
        if found is not None:
            return (Verdict.OURS if canonical_root(found.root) == self.owner.root else Verdict.FOREIGN), found
        dest = _backlog.destination(self.folder, name)
        if dest is not None and canonical_root(dest) == self.owner.root:
            return Verdict.OURS, None  # an older release's step, recorded as due for this root
        return Verdict.UNKNOWN, None

    def survey(self, adopt: bool = False) -> Survey:
        """Every step folder that is not this root's (one warning per manager, when ``loud``);
        with ``adopt``, a folder proven ours without a record (see the module docstring)
        gets one."""
        out = Survey()
        try:
            names = sorted(os.listdir(self.folder))
        except OSError:
            return out
        for name in names:
            step = self.parse(name)
            if step is None:
                continue
            verdict, found = self.verdict(name)
            if verdict is Verdict.OURS and found is None and adopt:
                try:
                    write(self.folder / name, self.owner)
                except OSError as e:
                    log.warning("objckpt: cannot write the owner record of %s: %s", self.folder / name, e)
            elif verdict is Verdict.FOREIGN and found is not None:
                out.foreign.setdefault(found, []).append(step)
            elif verdict is Verdict.UNKNOWN:
                out.unknown.append(step)
        if out and not self._warned:
            self._warned = True  # quiet ranks too: no survey again per folder found
            if self.loud:
                log.warning("objckpt: %s", self.describe(out))
        return out

    def describe(self, found: Survey) -> str:
        parts = [f"step(s) {sorted(steps)} of root {owner}" for owner, steps in found.foreign.items()]
        if found.unknown:
            parts.append(f"step(s) {sorted(found.unknown)} with no owner record (written by an older objckpt "
                         "release, or by another job)")
        return (f"the local folder {str(self.folder)!r} holds step folders that are not this manager's "
                f"(root {self.owner}): {'; '.join(parts)}. This manager never restores, counts or deletes them. "
                + ADVICE)

    def collision(self, step_dir: Path) -> Optional[str]:
        """Why this root's step must not be saved into ``step_dir`` (None: it may): its owner
        record names another root.  A folder without a record is left to the usual checks
        (its manifest: an existing step; none: an older release's leftover, claimed)."""
        found = read(step_dir)
        if found is None or canonical_root(found.root) == self.owner.root:
            return None
        return (f"the step folder {str(step_dir)!r} belongs to root {found}, not to this manager's root "
                f"{self.owner}: two jobs save into the same local_dir; nothing of the other root's is touched. "
                + ADVICE)


#: what to do about step folders of other roots in a local folder
ADVICE = ("Give each job a local_dir of its own, e.g. with the job in the path "
          "(local_dir='/dev/shm/ckpt/<job>/{node}').")
