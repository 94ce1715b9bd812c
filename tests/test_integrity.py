"""Integrity checks: an overwrite's cleanup, chunk tiling, block crcs (issue items 6, 7, 9).

Manifests are hand-edited through :func:`edit_manifest` only, so a change to how
a manifest is sealed (a checksum over it) is adapted in one place.
"""
from __future__ import annotations

import json
from typing import Any, Callable

import pytest
import torch

import objckpt
from objckpt import _runtime
from objckpt.format import keys
from objckpt.format.manifest import load_json
from objckpt.storage import open_store

#: fields a manifest may carry to seal itself; recomputed after an edit when present
_SEAL_FIELDS = ("checksum", "manifest_crc32c")


def _reseal(obj: dict[str, Any]) -> None:
    """Recompute the manifest's own checksum, if the format has one, after an edit."""
    from objckpt.format import manifest as fmt

    seal = getattr(fmt, "seal", None) or getattr(fmt, "manifest_checksum", None)
    present = [f for f in _SEAL_FIELDS if f in obj]
    if present and seal is not None:
        for f in present:
            obj.pop(f)
        sealed = seal(obj)
        if isinstance(sealed, dict):
            obj.clear()
            obj.update(sealed)
        else:
            obj[present[0]] = sealed


def edit_manifest(uri: str, opts: dict[str, Any], edit: Callable[[dict[str, Any]], None]) -> None:
    """Load ``uri``'s manifest JSON, apply ``edit`` to it, reseal it, write it back (plain JSON)."""
    store, prefix = open_store(uri, opts or None)
    mkey = keys.manifest_key(prefix)

    def bad(what: str) -> Exception:
        return AssertionError(what)

    obj = load_json(_runtime.run(store.get(mkey)), bad)
    edit(obj)
    _reseal(obj)
    _runtime.run(store.put(mkey, json.dumps(obj).encode()))


def _state(step: int) -> dict[str, Any]:
    return {"w": torch.arange(24.0).reshape(6, 4) + step, "step": step}


# --------------------------------------------------------------------------- item 6: overwrite cleanup


def test_overwrite_never_deletes_what_the_old_manifest_wrongly_lists(ckpt_uri: tuple[str, dict[str, Any]]) -> None:
    """An old manifest naming ``manifest.json``, ``../other/x`` or a file beside the
    blob dir as its blobs: the overwrite's cleanup deletes none of them."""
    uri, opts = ckpt_uri
    objckpt.save(_state(1), uri, storage_options=opts)
    store, prefix = open_store(uri, opts or None)
    parent = prefix.rsplit("/", 1)[0]
    outside, beside = f"{parent}/other/x", keys.join(prefix, "notes.txt")
    for k in (outside, beside):
        _runtime.run(store.put(k, b"keep me"))

    def hostile(m: dict[str, Any]) -> None:
        m["blobs"] = [{"name": n, "size": 0, "rank": 0} for n in ("manifest.json", "notes.txt", "../other/x")] + \
            m["blobs"]
        for t in m["tensors"].values():
            for c in t.get("chunks", []):
                c["blob"] += 3

    edit_manifest(uri, opts, hostile)
    objckpt.save(_state(2), uri, storage_options=opts, overwrite=True)
    back = objckpt.read(uri, storage_options=opts)
    assert torch.equal(back["w"], _state(2)["w"]) and back["step"] == 2
    assert _runtime.run(store.get(outside)) == b"keep me" and _runtime.run(store.get(beside)) == b"keep me"


def test_overwrite_still_deletes_the_replaced_blobs(tmp_path: Any) -> None:
    ck = tmp_path / "ck"
    objckpt.save(_state(1), str(ck))
    old = {p for p in (ck / "blobs").rglob("*") if p.is_file()}
    objckpt.save(_state(2), str(ck), overwrite=True)
    assert old and not any(p.exists() for p in old)
