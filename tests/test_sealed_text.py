"""A sealed manifest or rank index carries two checksums (docs/format.md §9.1): ``crc32c_text``,
of the stored bytes before it, which readers check first, and ``crc32c``, of the canonical JSON
of everything else, which survives re-indentation and is what readers that do not know
``crc32c_text`` check.  Intact bytes decode without the canonical re-encoding; any change falls
back to it, so what was an error stays one and what was valid stays valid."""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch

import objckpt
from objckpt.checksum import crc32c
from objckpt.errors import CorruptCheckpointError
from objckpt.format import manifest as mf
from objckpt.format import rank_index
from objckpt.format import sealed_json as sj
from objckpt.format.manifest import Chunk, ChunkRecord


@pytest.fixture
def manifest_bytes(tmp_path: Path) -> bytes:
    objckpt.save({f"layer{i}.w": torch.full((5, 7), float(i)) for i in range(20)} | {"step": 3},
                 str(tmp_path / "ck"))
    return (tmp_path / "ck" / "manifest.json").read_bytes()


@pytest.fixture
def canonical_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    real = sj.canonical

    def counting(obj: Any) -> bytes:
        calls.append(1)
        return real(obj)

    monkeypatch.setattr(sj, "canonical", counting)
    return calls


def test_the_seal_ends_with_the_text_crc_then_the_canonical_crc(manifest_bytes: bytes) -> None:
    tail = re.search(rb',"crc32c_text":(\d+),"crc32c":(\d+)\}$', manifest_bytes)
    assert tail is not None
    assert int(tail.group(1)) == crc32c(manifest_bytes[: tail.start()])
    obj = json.loads(manifest_bytes)  # what a reader without crc32c_text checks: the canonical crc
    stored = obj.pop("crc32c")
    assert stored == crc32c(sj.canonical(obj)) and "crc32c_text" in obj


def test_intact_bytes_decode_without_the_canonical_encoding(manifest_bytes: bytes, canonical_calls: list[int]) -> None:
    m = mf.decode(manifest_bytes, "ck")
    assert len(m.tensors) == 20 and canonical_calls == []


def test_reindented_json_is_still_valid_through_the_canonical_crc(manifest_bytes: bytes,
                                                                  canonical_calls: list[int]) -> None:
    pretty = json.dumps(json.loads(manifest_bytes), indent=2).encode()
    m = mf.decode(pretty, "ck")
    assert len(m.tensors) == 20 and canonical_calls == [1]


def _flip(data: bytes, old: bytes, new: bytes) -> bytes:
    assert data.count(old) >= 1
    return data.replace(old, new, 1)


@pytest.mark.parametrize("edit", ["a value", "the text crc", "the canonical crc"])
def test_any_changed_byte_is_still_refused(manifest_bytes: bytes, edit: str) -> None:
    if edit == "a value":  # a tensor's shape digit (not its chunk's): still valid JSON, still a valid shape
        bad = _flip(manifest_bytes, b'"dtype":"float32","shape":[5,7]', b'"dtype":"float32","shape":[5,8]')
    else:
        tail = re.search(rb'"crc32c_text":(\d+),"crc32c":(\d+)\}$', manifest_bytes)
        assert tail is not None
        group = 1 if edit == "the text crc" else 2
        value = int(tail.group(group))
        bad = manifest_bytes[: tail.start(group)] + str(value ^ 1).encode() + manifest_bytes[tail.end(group):]
    if edit == "the canonical crc":  # the text is proven intact by its own crc: the bytes are the writer's
        assert len(mf.decode(bad, "ck").tensors) == 20
        return
    with pytest.raises(CorruptCheckpointError, match="checksum mismatch"):
        mf.decode(bad, "ck")


def test_a_manifest_sealed_before_the_text_crc_still_decodes(manifest_bytes: bytes,
                                                              canonical_calls: list[int]) -> None:
    obj = json.loads(manifest_bytes)
    obj.pop("crc32c_text")
    body = {k: v for k, v in obj.items() if k != "crc32c"}
    raw = json.dumps(body, separators=(",", ":")).encode()
    old = raw[:-1] + f',"crc32c":{crc32c(sj.canonical(json.loads(raw)))}}}'.encode()  # the earlier seal
    canonical_calls.clear()
    m = mf.decode(old, "ck")
    assert len(m.tensors) == 20 and canonical_calls == [1]
    assert mf.decode(mf.reseal(old), "ck").attempt == m.attempt  # resealed: both crcs again


def test_a_rank_index_takes_the_same_path(canonical_calls: list[int]) -> None:
    recs = [ChunkRecord(f"t{i}", Chunk((0,), (16,), 0, 64 * i, 64, i, ())) for i in range(50)]
    data = rank_index.encode("a", 0, recs)
    canonical_calls.clear()
    kw: dict[str, Any] = dict(attempt="a", rank=0, blobs=[0], blob_sizes=[64 * 50], crc_block=0, require_crc=True)
    assert len(rank_index.decode(data, "idx", **kw)) == 50 and canonical_calls == []
    raw = sj._text(data, ValueError)
    damaged = _flip(raw, b'"t7"', b'"t8"')  # a key renamed: valid JSON, the text crc fails, then the canonical
    with pytest.raises(CorruptCheckpointError, match="checksum mismatch"):
        rank_index.decode(damaged, "idx", **kw)
