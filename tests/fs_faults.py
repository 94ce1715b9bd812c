"""Real and simulated filesystem faults for tests: a tiny tmpfs, filled up or made read-only,
and ``os`` calls that refuse writes under one directory.

Mounting needs root (or CAP_SYS_ADMIN); where it is refused, :func:`mounted_tmpfs`
yields None and the callers fall back to :func:`refuse_writes_under`.
"""
from __future__ import annotations

import contextlib
import errno
import os
import subprocess
from typing import Any, Iterator, Optional

import pytest


def _mount(*args: str) -> bool:
    try:
        return subprocess.run(["mount", *args], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


@contextlib.contextmanager
def mounted_tmpfs(path: str, size: int) -> Iterator[Optional[str]]:
    """A fresh tmpfs of ``size`` bytes at ``path`` (None where this process may not mount)."""
    os.makedirs(path, exist_ok=True)
    if not _mount("-t", "tmpfs", "-o", f"size={size}", "tmpfs", path):
        yield None
        return
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", path], capture_output=True, timeout=30)


def remount_read_only(path: str, read_only: bool) -> None:
    assert _mount("-o", f"remount,{'ro' if read_only else 'rw'}", path), f"cannot remount {path}"


def fill_up(root: str, leave: int) -> None:
    """Fill the filesystem of ``root`` with ``root/filler`` until ``leave`` bytes are free."""
    st = os.statvfs(root)
    free = st.f_bavail * st.f_frsize
    with open(os.path.join(root, "filler"), "wb") as f:
        f.write(b"\0" * max(free - leave, 0))
    st = os.statvfs(root)
    assert st.f_bavail * st.f_frsize == leave, (st.f_bavail * st.f_frsize, leave)


_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC


def refuse_writes_under(monkeypatch: pytest.MonkeyPatch, root: str, code: int, only: str = "") -> None:
    """Every call of ``os`` that would change something under ``root`` fails with ``code``
    (``EROFS``, ``ENOSPC``...), as the kernel would on such a filesystem.  ``only``: refuse
    just the data writes into files whose path contains it (a disk that fills up mid-file)."""
    root = os.path.abspath(root)
    strerror = os.strerror(code)

    def under(path: Any) -> bool:
        try:
            return os.path.abspath(os.fsdecode(path)).startswith(root + os.sep)
        except TypeError:
            return False

    def fd_path(fd: int) -> str:
        try:
            return os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            return ""

    def guard(name: str, *path_args: int, flags_arg: Optional[int] = None) -> None:
        real = getattr(os, name)

        def refusing(*a: Any, **kw: Any) -> Any:
            if flags_arg is not None and not (a[flags_arg] & _WRITE_FLAGS):
                return real(*a, **kw)
            for i in path_args:
                if i < len(a) and under(a[i]):
                    raise OSError(code, strerror, os.fsdecode(a[i]))
            return real(*a, **kw)

        monkeypatch.setattr(os, name, refusing)

    def guard_fd(name: str) -> None:
        real = getattr(os, name)

        def refusing(fd: int, *a: Any, **kw: Any) -> Any:
            p = fd_path(fd)
            if under(p) and (not only or only in p):
                raise OSError(code, strerror)
            return real(fd, *a, **kw)

        monkeypatch.setattr(os, name, refusing)

    for name in ("write", "pwrite", "pwritev"):
        guard_fd(name)
    if only:
        return
    guard("open", 0, flags_arg=1)
    for name in ("mkdir", "unlink", "rmdir", "remove"):
        guard(name, 0)
    for name in ("replace", "rename", "link"):
        guard(name, 0, 1)
    guard_fd("ftruncate")
    guard_fd("fsync")
    _ = errno  # the codes come from the caller (errno.EROFS, errno.ENOSPC)
