"""objckpt.delete: the manifest goes first, then exactly the objects it names."""
from __future__ import annotations

import os
from typing import Any

import pytest
import torch

import objckpt
from objckpt.runtime import loop as _runtime
from objckpt.storage import open_store


def _keys(uri: str, opts: dict[str, Any]) -> list[str]:
    store, prefix = open_store(uri, opts or None)
    return sorted(o.key for o in _runtime.run(store.list(prefix.rstrip("/") + "/")))


def test_delete_removes_only_that_checkpoint(local_or_s3: tuple[str, dict[str, Any]]) -> None:
    base, opts = local_or_s3
    state = {"w": torch.randn(64, 32), "v": torch.randn(64, 32), "b": torch.arange(10), "step": 3}
    objckpt.save(state, base + "/a", storage_options=opts, blob_size=4096)
    objckpt.save(state, base + "/ab", storage_options=opts)  # a sibling whose name extends "a"
    assert len(_keys(base + "/a", opts)) >= 3  # manifest + several blobs

    report = objckpt.delete(base + "/a", storage_options=opts)
    assert report.deleted and not report.manifest_unreadable
    assert _keys(base + "/a", opts) == []
    with pytest.raises(objckpt.NotFoundError):
        objckpt.inspect(base + "/a", storage_options=opts)
    got = objckpt.read(base + "/ab", storage_options=opts)
    assert torch.equal(got["w"], state["w"]) and got["step"] == 3

    with pytest.raises(objckpt.NotFoundError, match="no checkpoint"):
        objckpt.delete(base + "/a", storage_options=opts)


def test_delete_leaves_unnamed_objects_for_gc(tmp_path: Any) -> None:
    uri = str(tmp_path / "ck")
    objckpt.save({"w": torch.ones(8)}, uri)
    stray = tmp_path / "ck" / "blobs" / "20000101T000000-aaaaaaaaaaaa" / "r00000-0000.bin"
    stray.parent.mkdir(parents=True)
    stray.write_bytes(b"x" * 8)  # what a killed save (or one in progress) left: not the manifest's
    objckpt.delete(uri)
    assert not (tmp_path / "ck" / "manifest.json").exists()
    assert stray.exists()
    left = [p for p in (tmp_path / "ck").rglob("*.bin") if p != stray]
    assert left == []


def test_delete_corrupt_manifest_still_removes_it(tmp_path: Any) -> None:
    uri = str(tmp_path / "ck")
    objckpt.save({"w": torch.ones(8)}, uri)
    (tmp_path / "ck" / "manifest.json").write_bytes(b"{not json")
    report = objckpt.delete(uri)
    assert report.manifest_unreadable
    assert not os.path.exists(tmp_path / "ck" / "manifest.json")
