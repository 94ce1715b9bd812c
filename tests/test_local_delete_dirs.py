"""Deleting on local files removes only the folders objckpt made (``blobs/<attempt>/``,
``blobs/``, a spread area's folders, and the checkpoint's own folder once empty), never
the folders above the checkpoint: ``/data/runs`` emptied of its last checkpoint stays.

Before, the tidy after a delete climbed towards ``/`` removing every folder it emptied, so
deleting the last checkpoint under ``tmp/a/b/c`` (or gc of a killed save there, or a failed
save's cleanup) removed ``c``, ``b`` and ``a`` too."""
from __future__ import annotations

import glob
import os
import pathlib
from typing import Any

import pytest
import torch

import objckpt
from objckpt.cli import main as cli_main
from objckpt.storage.local import LocalStore
from objckpt.testing.stores import FaultyStore


def _state(v: float) -> dict[str, Any]:
    return {"w": torch.full((8, 4), float(v)), "step": int(v)}


def _user_folders(tmp_path: pathlib.Path) -> pathlib.Path:
    """``a/b/c``, made by the user: every one of them must outlive what objckpt deletes."""
    c = tmp_path / "a" / "b" / "c"
    c.mkdir(parents=True)
    return c


def _cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> int:
    capsys.readouterr()
    return cli_main([*argv, "--no-progress"])


@pytest.mark.parametrize("how", ["api", "api-file-uri", "cli-rm"])
def test_deleting_the_last_checkpoint_keeps_the_users_folders(tmp_path: pathlib.Path, how: str,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    c = _user_folders(tmp_path)
    ck = str(c / "ck")
    objckpt.save(_state(1), ck)
    assert len(glob.glob(os.path.join(ck, "blobs", "*", "*.bin"))) == 1
    if how == "api":
        objckpt.delete(ck)
    elif how == "api-file-uri":
        objckpt.delete("file://" + ck)
    else:
        assert _cli(["rm", ck], capsys) == 0
    assert os.listdir(c) == []  # the checkpoint's folder went with it (objckpt's) ...
    assert c.is_dir()  # ... its parents, the user's, stay
    with pytest.raises(objckpt.NotFoundError):
        objckpt.read(ck)


def test_spread_checkpoint_delete_keeps_the_spread_root(tmp_path: pathlib.Path) -> None:
    """A spread checkpoint keeps its blobs under ``<parent>/.spread-<hh>/``: those folders
    are objckpt's and go; the parent (the spread root, the user's) stays."""
    c = _user_folders(tmp_path)
    ck = str(c / "ck")
    objckpt.save(_state(2), ck, key_layout="spread")
    assert any(n.startswith(".spread-") for n in os.listdir(c))
    objckpt.delete(ck)
    assert c.is_dir() and os.listdir(c) == []


def test_overwrite_then_delete(tmp_path: pathlib.Path) -> None:
    """An overwrite deletes the old attempt's blobs: its attempt folder goes, the checkpoint
    folder and ``blobs/`` stay (they hold the new attempt); a delete then leaves the user's folders."""
    c = _user_folders(tmp_path)
    ck = c / "ck"
    objckpt.save(_state(1), str(ck))
    (old,) = os.listdir(ck / "blobs")
    objckpt.save(_state(2), str(ck), overwrite=True)
    (new,) = os.listdir(ck / "blobs")
    assert new != old and sorted(os.listdir(ck)) == ["blobs", "manifest.json"]
    assert objckpt.read(str(ck))["step"] == 2
    objckpt.delete(str(ck))
    assert c.is_dir() and os.listdir(c) == []


def test_failed_save_cleans_up_inside_the_checkpoint_only(tmp_path: pathlib.Path) -> None:
    """A save that fails while uploading deletes the blobs it wrote (and their folders),
    never the folders it was asked to save under."""
    c = _user_folders(tmp_path)
    faulty = FaultyStore(LocalStore("/"), "complete")
    with pytest.raises(ConnectionError, match="injected fault"):
        objckpt.save(_state(3), str(c / "ck"), store=faulty)
    assert faulty.seen["complete"] >= 1  # it did fail while uploading, with blobs written
    assert c.is_dir() and glob.glob(os.path.join(c, "**", "*.bin"), recursive=True) == []


def test_gc_of_a_killed_save_keeps_the_users_folders(tmp_path: pathlib.Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    c = _user_folders(tmp_path)
    ck = c / "ck"
    objckpt.save(_state(4), str(ck))
    os.unlink(ck / "manifest.json")  # as a save killed before its commit leaves it
    assert _cli(["gc", str(c), "--grace-hours", "0"], capsys) == 0
    assert glob.glob(os.path.join(c, "**", "*.bin"), recursive=True) == []
    assert c.is_dir()


def test_retention_removes_pruned_step_folders_and_keeps_the_root(tmp_path: pathlib.Path) -> None:
    """A guard on the boundary from the other side: a pruned step's folder (the checkpoint's
    own) goes, so empty step folders do not pile up; the manager's root stays."""
    c = _user_folders(tmp_path)
    root = c / "run"
    with objckpt.CheckpointManager(str(root), keep_last=1) as m:
        m.save(1, _state(1))
        m.save(2, _state(2))
        m.wait()
        assert m.steps() == [2]
    assert not (root / m.naming.name(1)).exists() and (root / m.naming.name(2) / "manifest.json").is_file()
    with objckpt.CheckpointManager(str(root)) as m:
        m.delete(step=2)
    assert root.is_dir() and not (root / m.naming.name(2)).exists() and c.is_dir()
