"""Local filesystem faults are objckpt errors naming the file and the cause.

A full disk, a read-only filesystem, a file where a directory should be and a
directory where a file should be used to escape as bare ``OSError`` s (and as
tracebacks from ``objckpt rm`` / ``verify``); a full disk also left
``manifest.json.tmp-*`` behind.  Each is now a :class:`StorageError` (still an
``OSError`` with the same ``errno``) or, for a read of a path that is not a
file, a :class:`NotFoundError`; temporaries are removed; the previous
checkpoint still loads.

The full disk and the read-only filesystem run twice: simulated (the store's
``os`` calls refuse, for paths under the test's directory only; always runs)
and on a real tmpfs (a tiny one filled up, one remounted read-only; where this
process may mount, e.g. as root in a container).  The other faults are real
files on the ordinary test filesystem.
"""
from __future__ import annotations

import errno
import glob
import os
from typing import Any, Callable, Iterator

import pytest
import torch

import objckpt
from objckpt import cli
from objckpt.errors import BlobMissingError, StorageError

from fs_faults import fill_up, mounted_tmpfs, refuse_writes_under, remount_read_only


def _state(seed: int, n: int = 20_000) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(n, generator=g), "b": torch.randn(64, generator=g), "step": seed}


def _loads_as(uri: str, want: dict[str, Any]) -> None:
    out = {"w": torch.zeros_like(want["w"]), "b": torch.zeros(64), "step": -1}
    objckpt.load(out, uri)
    assert torch.equal(out["w"], want["w"]) and torch.equal(out["b"], want["b"]) and out["step"] == want["step"]


def _leftovers(root: str) -> list[str]:
    return sorted(p for p in glob.glob(os.path.join(root, "**", "*"), recursive=True) if ".tmp-" in p)


@pytest.fixture(params=["simulated", "tmpfs"])
def disk(request: pytest.FixtureRequest, tmp_path: Any) -> Iterator[tuple[str, str]]:
    """(mode, directory): a directory on a real tiny tmpfs, or a plain one whose faults are simulated."""
    if request.param == "tmpfs":
        with mounted_tmpfs(str(tmp_path / "fs"), size=4 << 20) as root:
            if root is None:
                pytest.skip("cannot mount a tmpfs here (not root); the simulated variant covers the code")
            yield "tmpfs", root
    else:
        root = str(tmp_path / "fs")
        os.makedirs(root)
        yield "simulated", root


def _refuse(mode: str, root: str, code: int, monkeypatch: pytest.MonkeyPatch) -> Callable[[], None]:
    """Make ``root`` refuse writes with ``code``; returns how to undo it."""
    if mode == "tmpfs":
        if code == errno.ENOSPC:
            fill_up(root, leave=0)
            return lambda: os.unlink(os.path.join(root, "filler"))
        remount_read_only(root, True)
        return lambda: remount_read_only(root, False)
    refuse_writes_under(monkeypatch, root, code)
    return monkeypatch.undo


def _assert_named(e: BaseException, code: int, words: str, path_part: str) -> None:
    assert isinstance(e, StorageError) and isinstance(e, OSError), type(e)
    assert e.errno == code, (e.errno, str(e))
    assert words in str(e) and errno.errorcode[code] in str(e), str(e)
    assert path_part in str(e), str(e)


def test_full_disk_during_manifest_write_keeps_old_and_leaves_no_temporary(
        disk: tuple[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    mode, root = disk
    old, new = _state(1), _state(2)
    uri = os.path.join(root, "ck")
    objckpt.save(old, uri)
    if mode == "tmpfs":  # room for the new blob (80 KiB), none for the manifest
        blob = new["w"].nbytes + new["b"].nbytes
        fill_up(root, leave=-(-blob // 4096) * 4096)
        undo = lambda: os.unlink(os.path.join(root, "filler"))  # noqa: E731
    else:
        refuse_writes_under(monkeypatch, root, errno.ENOSPC, only=".tmp-")  # the manifest's temporary only
        undo = monkeypatch.undo
    for target, overwrite in ((os.path.join(root, "new"), False), (uri, True)):
        with pytest.raises(StorageError) as ei:
            objckpt.save(new, target, overwrite=overwrite)
        _assert_named(ei.value, errno.ENOSPC, "no space left", os.path.join(target, "manifest.json"))
        assert "writing the manifest" in str(ei.value)
        assert _leftovers(root) == []  # no manifest.json.tmp-*
        assert not os.path.exists(os.path.join(root, "new", "manifest.json"))
    undo()
    _loads_as(uri, old)
    assert len(os.listdir(os.path.join(uri, "blobs"))) == 1  # the failed attempts' blobs are gone
    objckpt.save(new, uri, overwrite=True)  # space again: the same call now works
    _loads_as(uri, new)


def test_read_only_filesystem_every_write_is_named(disk: tuple[str, str], monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    mode, root = disk
    old = _state(3)
    uri = os.path.join(root, "ck")
    objckpt.save(old, uri)
    mgr_root = os.path.join(root, "run")
    with objckpt.CheckpointManager(mgr_root, keep_last=1) as m:
        m.save(1, old)
    undo = _refuse(mode, root, errno.EROFS, monkeypatch)
    try:
        calls: dict[str, Callable[[], Any]] = {
            "save": lambda: objckpt.save(_state(4), os.path.join(root, "other")),
            "overwrite": lambda: objckpt.save(_state(4), uri, overwrite=True),
            "async_save": lambda: objckpt.async_save(_state(4), os.path.join(root, "async")).result(timeout=60),
            "delete": lambda: objckpt.delete(uri),
        }

        def manager_save() -> None:
            with objckpt.CheckpointManager(mgr_root, keep_last=1) as m2:
                m2.save(2, _state(4))

        calls["manager save"] = manager_save
        for name, call in calls.items():
            with pytest.raises(StorageError) as ei:
                call()
            _assert_named(ei.value, errno.EROFS, "read-only", root)
        _loads_as(uri, old)  # reads still work; nothing changed
        assert objckpt.CheckpointManager(mgr_root).latest_step() == 1
        for argv in (["rm", uri], ["rm", os.path.join(mgr_root, "step-0000000001")]):
            code, err = _cli(argv, capsys)
            assert code == 2 and err.startswith("objckpt: error: ") and "read-only" in err, err
    finally:
        undo()
    _loads_as(uri, old)
    assert _leftovers(root) == []


def _cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """The command line's exit status and stderr (in this process: an escaping exception fails the test)."""
    capsys.readouterr()
    code = cli.main([*argv, "--no-progress"])
    return code, capsys.readouterr().err


def test_file_where_a_directory_should_be(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file")
    for call in (lambda: objckpt.save(_state(6), str(blocker / "ck")),
                 lambda: objckpt.async_save(_state(6), str(blocker / "ck2")).result(timeout=60),
                 lambda: objckpt.CheckpointManager(str(blocker / "run")).save(1, _state(6))):
        with pytest.raises(StorageError) as ei:
            call()
        assert ei.value.errno == errno.ENOTDIR
        assert f"{blocker} is a file where a directory should be (ENOTDIR)" in str(ei.value), str(ei.value)
    assert blocker.read_text() == "a file"
    with pytest.raises(objckpt.NotFoundError):  # nothing can be stored under a file: nothing is there
        objckpt.load(_state(0), str(blocker / "ck"))
    code, err = _cli(["rm", str(blocker / "ck")], capsys)
    assert code == 2 and err.startswith("objckpt: error: no checkpoint at "), err


def test_directory_where_a_blob_should_be(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    uri = str(tmp_path / "ck")
    objckpt.save(_state(7), uri)
    (blob,) = glob.glob(os.path.join(uri, "blobs", "*", "*"))
    os.unlink(blob)
    os.mkdir(blob)
    with pytest.raises(BlobMissingError, match="is missing"):
        objckpt.load(_state(0), uri)
    code, err = _cli(["verify", uri], capsys)
    assert code == 2 and err.startswith("objckpt: error: blob ") and "is missing" in err, err
    code, err = _cli(["rm", uri], capsys)
    assert code == 2  # the manifest goes; the directory is named, left alone
    assert f"deleting {blob} failed: a directory is where a file should be (EISDIR)" in err, err
    assert os.path.isdir(blob) and not os.path.exists(os.path.join(uri, "manifest.json"))


def test_directory_where_the_manifest_or_a_new_blob_should_be(tmp_path: Any) -> None:
    uri = str(tmp_path / "ck")
    os.makedirs(os.path.join(uri, "manifest.json"))  # not a checkpoint: a directory named like its manifest
    with pytest.raises(objckpt.NotFoundError):
        objckpt.inspect(uri)
    with pytest.raises(StorageError) as ei:
        objckpt.save(_state(8), uri)
    assert ei.value.errno == errno.EISDIR and "a directory is where a file should be" in str(ei.value)
    assert os.path.join(uri, "manifest.json") in str(ei.value)
    assert _leftovers(str(tmp_path)) == [] and os.listdir(os.path.join(uri, "manifest.json")) == []


def test_device_error_while_verifying_is_named(tmp_path: Any, monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    uri = str(tmp_path / "ck")
    objckpt.save(_state(9), uri)
    real_preadv = os.preadv

    def failing(fd: int, buffers: Any, offset: int, *a: Any) -> int:
        if os.readlink(f"/proc/self/fd/{fd}").endswith(".bin"):
            raise OSError(errno.EIO, "Input/output error")
        return real_preadv(fd, buffers, offset, *a)

    monkeypatch.setattr(os, "preadv", failing)
    code, err = _cli(["verify", uri], capsys)
    assert code == 2 and err.startswith("objckpt: error: ") and "an I/O error of the device (EIO)" in err, err
