"""The ``disk`` kind of the fault campaign: local filesystem faults during saves and deletes.

A full disk (during a blob or during the manifest), a read-only filesystem, a
file where a directory should be and a directory where the manifest should be,
each met by one of ``save``, ``overwrite``, ``async_save``, ``delete`` and a
manager's ``save``.  Judged like every kind (:mod:`testkit.campaign`):
an objckpt error that names the cause (its errno's name) and a file, no
``*.tmp-*`` left, and the previous checkpoint bit-exact afterwards is
``detected``; an operation that could complete (a delete on a full disk) and
did is ``ok``; a built-in error, a leftover, or damage is ``FAILED``.

Full disks and read-only filesystems are real where this process may mount a
tmpfs (root in a container): a tiny tmpfs filled up, or remounted read-only.
Elsewhere they are simulated: the ``os`` calls that would change something
under the trial's directory fail with the errno the kernel gives
(:func:`refusing_calls`); the tests use the same simulation.
"""
from __future__ import annotations

import contextlib
import errno
import glob
import os
import random
import shutil
import subprocess
import tempfile
from typing import Any, Callable, Iterator, Optional

from .campaign import DETECTED, FAILED, OK, Trial, make_state, same, timed

FAULTS = ["enospc-manifest", "enospc-blob", "erofs", "enotdir", "eisdir-manifest"]
OPS = ["save", "overwrite", "async_save", "delete", "manager"]
#: the operations each fault can meet (a delete needs no new space and writes no manifest)
OPS_FOR = {"enospc-manifest": OPS[:3] + ["manager"], "enospc-blob": OPS[:3] + ["manager"], "erofs": OPS,
           "enotdir": ["save", "async_save", "delete", "manager"], "eisdir-manifest": OPS[:3] + ["manager"]}
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC


def refusing_calls(root: str, code: int, only: str = "") -> dict[str, Callable[..., Any]]:
    """Replacements for the ``os`` functions that would change something under ``root``:
    each fails with ``code`` (``EROFS``, ``ENOSPC``...) as the kernel would on such a
    filesystem.  ``only``: refuse just the data writes into files whose path contains it
    (a disk that fills up in the middle of that file)."""
    root = os.path.abspath(root)
    text = os.strerror(code)

    def under(path: Any) -> bool:
        try:
            return os.path.abspath(os.fsdecode(path)).startswith(root + os.sep)
        except TypeError:
            return False

    def by_path(real: Callable[..., Any], *path_args: int, flags_arg: Optional[int] = None) -> Callable[..., Any]:
        def refusing(*a: Any, **kw: Any) -> Any:
            if flags_arg is None or a[flags_arg] & _WRITE_FLAGS:
                for i in path_args:
                    if i < len(a) and under(a[i]):
                        raise OSError(code, text, os.fsdecode(a[i]))
            return real(*a, **kw)
        return refusing

    def by_fd(real: Callable[..., Any]) -> Callable[..., Any]:
        def refusing(fd: int, *a: Any, **kw: Any) -> Any:
            try:
                p = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                p = ""
            if under(p) and (not only or only in p):
                raise OSError(code, text)
            return real(fd, *a, **kw)
        return refusing

    out: dict[str, Callable[..., Any]] = {n: by_fd(getattr(os, n)) for n in ("write", "pwrite", "pwritev")}
    if only:
        return out
    out["open"] = by_path(os.open, 0, flags_arg=1)
    out.update({n: by_path(getattr(os, n), 0) for n in ("mkdir", "unlink", "rmdir", "remove")})
    out.update({n: by_path(getattr(os, n), 0, 1) for n in ("replace", "rename", "link")})
    out.update({n: by_fd(getattr(os, n)) for n in ("ftruncate", "fsync")})
    return out


@contextlib.contextmanager
def refused_writes(root: str, code: int, only: str = "") -> Iterator[None]:
    """:func:`refusing_calls` in force for the ``with`` block."""
    patches = refusing_calls(root, code, only)
    saved = {n: getattr(os, n) for n in patches}
    for n, f in patches.items():
        setattr(os, n, f)
    try:
        yield
    finally:
        for n, f in saved.items():
            setattr(os, n, f)


def _mount(*args: str) -> bool:
    try:
        return subprocess.run(["mount", *args], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


@contextlib.contextmanager
def mounted_tmpfs(path: str, size: int) -> Iterator[Optional[str]]:
    """A fresh tmpfs of ``size`` bytes at ``path``; None where this process may not mount."""
    os.makedirs(path, exist_ok=True)
    if not _mount("-t", "tmpfs", "-o", f"size={size}", "tmpfs", path):
        yield None
        return
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", path], capture_output=True, timeout=30)


def remount_read_only(path: str, read_only: bool) -> None:
    if not _mount("-o", f"remount,{'ro' if read_only else 'rw'}", path):
        raise OSError(errno.EPERM, f"cannot remount {path}")


def fill_up(root: str, leave: int) -> None:
    """Fill the filesystem of ``root`` with ``root/filler`` until ``leave`` bytes are free."""
    st = os.statvfs(root)
    with open(os.path.join(root, "filler"), "wb") as f:
        f.write(b"\0" * max(st.f_bavail * st.f_frsize - leave, 0))


def leftovers(root: str) -> list[str]:
    """Temporary files (``*.tmp-*``) anywhere under ``root``."""
    return sorted(p for p in glob.glob(os.path.join(root, "**", "*"), recursive=True) if ".tmp-" in p)


def blob_pages(state: Any, scratch: str) -> int:
    """The bytes a save of ``state`` needs for its blobs on a filesystem of 4 KiB pages
    (measured: saved once to ``scratch``, on the ordinary disk)."""
    import objckpt

    objckpt.save(state, scratch)
    sizes = [os.path.getsize(p) for p in glob.glob(os.path.join(scratch, "blobs", "*", "*"))]
    return sum(-(-n // 4096) * 4096 for n in sizes)


def disk_trial(seed: int, fault: Optional[str] = None, op: Optional[str] = None, *, real: bool = True) -> Trial:
    """One local-disk fault during one operation (see the module docstring)."""
    rng = random.Random(seed)
    fault = fault or rng.choice(FAULTS)
    op = op or rng.choice(OPS_FOR[fault])
    params: dict[str, Any] = {"fault": fault, "op": op, "seed": seed}

    def body() -> Trial:
        work = tempfile.mkdtemp(prefix="objckpt-campaign-")
        try:
            with mounted_tmpfs(os.path.join(work, "fs"), 8 << 20) as mnt:
                use_real = real and mnt is not None and fault in ("enospc-manifest", "enospc-blob", "erofs")
                params["filesystem"] = ("tmpfs" if use_real else "simulated") if fault.startswith(("enospc", "erofs")) \
                    else "real files"
                return _disk_body(mnt or os.path.join(work, "fs"), fault, op, seed, use_real, params,
                                  os.path.join(work, "scratch"))
        finally:
            shutil.rmtree(work, ignore_errors=True)

    return timed("disk", params, body)


def _disk_body(root: str, fault: str, op: str, seed: int, real: bool, params: dict[str, Any],
               scratch: str) -> Trial:
    import objckpt

    old, new = make_state(seed), make_state(seed + 1)
    uri = os.path.join(root, "ck")
    run = os.path.join(root, "run")
    target = {"save": os.path.join(root, "new"), "async_save": os.path.join(root, "new")}.get(op, uri)
    objckpt.save(old, uri)
    with objckpt.CheckpointManager(run, keep_last=2) as m:
        m.save(1, old)
    code = {"enospc-manifest": errno.ENOSPC, "enospc-blob": errno.ENOSPC, "erofs": errno.EROFS,
            "enotdir": errno.ENOTDIR, "eisdir-manifest": errno.EISDIR}[fault]
    if fault == "enotdir":  # the operation's directory is a file
        target = run = os.path.join(root, "blocker", "x")
        with open(os.path.join(root, "blocker"), "w") as f:
            f.write("a file")
        uri_for_delete = target
    else:
        uri_for_delete = uri
    if fault == "eisdir-manifest":  # a directory named like the manifest of a fresh target
        target = os.path.join(root, "new")
        run_step = os.path.join(run, "step-0000000002")
        os.makedirs(os.path.join(target, "manifest.json"))
        os.makedirs(os.path.join(run_step, "manifest.json"))

    def operate() -> None:
        if op in ("save", "overwrite"):
            objckpt.save(new, target, overwrite=op == "overwrite")
        elif op == "async_save":
            objckpt.async_save(new, target).result(timeout=120)
        elif op == "delete":
            objckpt.delete(uri_for_delete)
        else:
            with objckpt.CheckpointManager(run, keep_last=2) as m2:
                m2.save(2, new)

    error: Optional[BaseException] = None
    with contextlib.ExitStack() as undo:
        if fault.startswith("enospc"):
            if real:  # blob: no room at all; manifest: room for the blob's pages only
                room = 0 if fault == "enospc-blob" else blob_pages(new, scratch)
                fill_up(root, room)
                undo.callback(os.unlink, os.path.join(root, "filler"))
            else:
                undo.enter_context(refused_writes(root, code, only=".tmp-" if fault == "enospc-manifest" else ""))
        elif fault == "erofs":
            if real:
                remount_read_only(root, True)
                undo.callback(remount_read_only, root, False)
            else:
                undo.enter_context(refused_writes(root, code))
        try:
            operate()
        except BaseException as e:  # noqa: BLE001 - judged below
            error = e
        left = leftovers(root)
    return _judge_disk(params, op, code, error, left, uri, old, new, run, target)


def _judge_disk(params: dict[str, Any], op: str, code: int, error: Optional[BaseException], left: list[str],
                uri: str, old: Any, new: Any, run: str, target: str) -> Trial:
    import objckpt
    from objckpt.errors import NotFoundError, ObjckptError

    if error is not None and not isinstance(error, ObjckptError):
        return Trial("disk", params, FAILED, f"built-in error: {type(error).__name__}: {error}", faults=1)
    name = errno.errorcode[code]
    if error is not None and (name not in str(error) and not isinstance(error, NotFoundError)):
        return Trial("disk", params, FAILED, f"the error does not name the cause {name}: {error}", faults=1)
    if left:
        return Trial("disk", params, FAILED, f"temporary files left: {left[:3]}", faults=1)
    try:  # the previous checkpoint (or, where the operation succeeded, its result)
        back = objckpt.read(uri)
    except NotFoundError:
        if not (op == "delete" and error is None):
            return Trial("disk", params, FAILED, "the previous checkpoint is gone", faults=1)
    else:
        if not (same(old, back) or (error is None and op == "overwrite" and same(new, back))):
            return Trial("disk", params, FAILED, "the previous checkpoint does not read bit-exact", faults=1)
    steps = objckpt.CheckpointManager(run).steps() if os.path.isdir(run) else []
    for s in steps:
        got = objckpt.read(os.path.join(run, f"step-{s:010d}"))
        if not same(old if s == 1 else new, got):
            return Trial("disk", params, FAILED, f"manager step {s} does not read bit-exact", faults=1)
    if error is None:
        return Trial("disk", params, OK, f"{op} completed despite the fault (it needs no new space)", faults=1)
    return Trial("disk", params, DETECTED, f"{type(error).__name__}: {str(error)[:300]}", faults=1)
