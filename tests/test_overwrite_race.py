"""A read or load that meets a blob deleted by a concurrent overwrite starts over
from the new manifest; with the manifest unchanged, a missing blob is damage.

The interleaving is made deterministic by a store wrapper that overwrites the
checkpoint right after the reader fetched the old manifest.
"""
from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import pytest
import torch

import objckpt
from objckpt.errors import BlobMissingError, CorruptCheckpointError
from objckpt.storage import open_store
from objckpt.testing.stores import CountingStore


def _state(v: float) -> dict[str, Any]:
    return {"a": torch.full((256, 64), v), "b": torch.arange(1000.0) + v, "step": int(v)}


_WRITER = """
import sys, torch, objckpt
v = float(sys.argv[2])
objckpt.save({"a": torch.full((256, 64), v), "b": torch.arange(1000.0) + v, "step": int(v)}, sys.argv[1],
             overwrite=True)
"""


class OverwriteAfterManifest(CountingStore):
    """Another process overwrites the checkpoint (new version ``v``, old blobs deleted)
    once, right after this reader's first manifest GET."""

    def __init__(self, uri: str, v: float) -> None:
        super().__init__(open_store(uri)[0])
        self.uri, self.v, self.fired = uri, v, False

    async def get(self, key: str) -> bytes:
        data = await super().get(key)
        if key.endswith("manifest.json") and not self.fired:
            self.fired = True
            subprocess.run([sys.executable, "-c", _WRITER, self.uri, str(self.v)], check=True, timeout=120)
        return data


def test_load_racing_an_overwrite_loads_the_new_version(tmp_path: Any) -> None:
    uri = str(tmp_path / "ck")
    objckpt.save(_state(1.0), uri)
    store = OverwriteAfterManifest(uri, 2.0)
    tmpl = {"a": torch.zeros(256, 64), "b": torch.zeros(1000), "step": 0}
    objckpt.load(tmpl, uri, store=store)
    assert store.fired
    want = _state(2.0)
    assert torch.equal(tmpl["a"], want["a"]) and torch.equal(tmpl["b"], want["b"]) and tmpl["step"] == 2
    assert store.ops["get"] >= 2  # the manifest was fetched again


def test_read_racing_an_overwrite_reads_the_new_version(tmp_path: Any) -> None:
    uri = str(tmp_path / "ck")
    objckpt.save(_state(1.0), uri)
    store = OverwriteAfterManifest(uri, 3.0)
    back = objckpt.read(uri, store=store)
    assert store.fired
    assert torch.equal(back["a"], _state(3.0)["a"]) and back["step"] == 3


def _delete_a_blob(ck: str) -> None:
    blobs = [os.path.join(d, f) for d, _, fs in os.walk(os.path.join(ck, "blobs")) for f in fs if f.endswith(".bin")]
    assert blobs
    os.remove(blobs[0])


def test_missing_blob_with_unchanged_manifest_is_damage_and_load_says_template_touched(tmp_path: Any) -> None:
    uri = str(tmp_path / "ck")
    objckpt.save(_state(1.0), uri)
    _delete_a_blob(uri)
    with pytest.raises(CorruptCheckpointError, match="is missing"):
        objckpt.read(uri)
    tmpl = {"a": torch.zeros(256, 64), "b": torch.zeros(1000), "step": 0}
    with pytest.raises(BlobMissingError, match="template may be partially overwritten") as ei:
        objckpt.load(tmpl, uri)
    assert ei.value.template_modified  # type: ignore[attr-defined]
    assert tmpl["step"] == 0  # non-tensor values are only set once every tensor is in
