"""Bad input: every case a clear error that names the culprit, nothing lost."""
from __future__ import annotations

import json
import os
from typing import Any

import pytest
import torch

import objckpt
from objckpt.format import keys as layout


def _save(tmp_path: Any, **kw: Any) -> tuple[str, dict[str, torch.Tensor]]:
    uri = str(tmp_path / "ck")
    sd = {"enc.weight": torch.randn(64, 32), "enc.bias": torch.randn(32), "step": 3}
    objckpt.save(sd, uri, **kw)
    return uri, sd


def _blob_path(uri: str) -> str:
    m = objckpt.inspect(uri)
    return os.path.join(uri, m.blobs[0].name)


def test_missing_checkpoint(tmp_path: Any) -> None:
    with pytest.raises(objckpt.NotFoundError, match="no checkpoint at"):
        objckpt.read(str(tmp_path / "nothing"))
    with pytest.raises(FileNotFoundError):  # the built-in it means
        objckpt.load({"a": torch.zeros(1)}, str(tmp_path / "nothing"))


def test_missing_blob(tmp_path: Any) -> None:
    uri, _ = _save(tmp_path)
    os.unlink(_blob_path(uri))
    with pytest.raises(objckpt.CorruptCheckpointError, match=r"blob .* is missing .*enc\.(weight|bias)"):
        objckpt.read(uri)


def test_truncated_blob(tmp_path: Any) -> None:
    uri, _ = _save(tmp_path)
    p = _blob_path(uri)
    with open(p, "r+b") as f:
        f.truncate(os.path.getsize(p) - 100)
    with pytest.raises(objckpt.CorruptCheckpointError, match="truncated"):
        objckpt.read(uri)


def test_flipped_byte_names_tensor_blob_offset(tmp_path: Any) -> None:
    uri, sd = _save(tmp_path)
    m = objckpt.inspect(uri)
    c = m.tensors["enc.weight"].chunks[0]
    p = _blob_path(uri)
    with open(p, "r+b") as f:
        f.seek(c.offset + 17)
        b = f.read(1)
        f.seek(c.offset + 17)
        f.write(bytes([b[0] ^ 0x40]))
    with pytest.raises(objckpt.CorruptCheckpointError) as ei:
        objckpt.read(uri)
    msg = str(ei.value)
    assert "'enc.weight'" in msg and "crc32c" in msg and m.blobs[0].name in msg and f"offset {c.offset}" in msg
    # the untouched tensor is still readable on its own
    assert torch.equal(objckpt.read(uri, keys=["enc.bias"])["enc.bias"], sd["enc.bias"])


@pytest.mark.parametrize(
    "content, exc, pattern",
    [
        (b"{not json", objckpt.CorruptCheckpointError, "not valid JSON"),
        (b'{"format": "other", "format_version": 1}', objckpt.CorruptCheckpointError, "format"),
        (b'{"format": "objckpt", "format_version": 1}', objckpt.CorruptCheckpointError, "required field"),
        (b'{"format": "objckpt", "format_version": 99, "blobs": [], "tensors": {}}', objckpt.UnsupportedFormatError,
         "format_version 99"),
    ],
)
def test_malformed_or_future_manifest(tmp_path: Any, content: bytes, exc: type, pattern: str) -> None:
    uri, _ = _save(tmp_path)
    with open(os.path.join(uri, layout.MANIFEST_NAME), "wb") as f:
        f.write(content)
    with pytest.raises(exc, match=pattern) as ei:
        objckpt.read(uri)
    assert layout.MANIFEST_NAME in str(ei.value)


def test_chunk_pointing_past_blob_is_caught(tmp_path: Any) -> None:
    uri, _ = _save(tmp_path)
    path = os.path.join(uri, layout.MANIFEST_NAME)
    obj = json.load(open(path))
    obj["tensors"]["enc.weight"]["chunks"][0]["length"] += 10 ** 9
    json.dump(obj, open(path, "w"))
    with pytest.raises(objckpt.CorruptCheckpointError, match=r"'enc\.weight': chunk #0 malformed"):
        objckpt.inspect(uri)


def test_wrong_dtype_or_shape_on_load(tmp_path: Any) -> None:
    uri, sd = _save(tmp_path)
    target = {"enc.weight": torch.zeros(64, 32, dtype=torch.float16), "enc.bias": torch.zeros(31), "step": 0}
    with pytest.raises(objckpt.StateDictMismatchError) as ei:
        objckpt.load(target, uri)
    msg = str(ei.value)
    assert "'enc.weight'" in msg and "torch.float16" in msg and "'enc.bias'" in msg and "[31]" in msg
    assert torch.count_nonzero(target["enc.bias"]) == 0  # nothing half-loaded


def test_missing_and_unexpected_keys(tmp_path: Any) -> None:
    uri, sd = _save(tmp_path)
    target = {"enc.weight": torch.zeros(64, 32), "dec.weight": torch.zeros(3)}
    with pytest.raises(objckpt.StateDictMismatchError, match=r"'dec\.weight'.*'enc\.bias'"):
        objckpt.load(target, uri)
    res = objckpt.load(target, uri, strict=False)
    assert res.missing_keys == ["dec.weight"] and set(res.unexpected_keys) == {"enc.bias", "step"}
    assert torch.equal(target["enc.weight"], sd["enc.weight"])


def test_read_unknown_key(tmp_path: Any) -> None:
    uri, _ = _save(tmp_path)
    with pytest.raises(KeyError, match="nope"):
        objckpt.read(uri, keys=["nope"])


@pytest.mark.parametrize(
    "value, pattern",
    [
        ({"opt": {"fn": lambda x: x}}, r"'opt\.fn'.*function"),
        ({"a": {1.5j: 1}}, r"dict key"),
        ({"s": torch.randn(3).to_sparse()}, r"'s'.*layout"),
        ({"m": torch.empty(3, device="meta")}, r"'m'.*meta"),
        ({"obj": object()}, r"'obj'.*object"),
    ],
)
def test_unsupported_values_name_the_key(tmp_path: Any, value: Any, pattern: str) -> None:
    uri = str(tmp_path / "bad")
    with pytest.raises(objckpt.UnsupportedValueError, match=pattern):
        objckpt.save(value, uri)
    with pytest.raises(objckpt.NotFoundError):
        objckpt.inspect(uri)  # nothing committed


def test_metadata_must_be_json(tmp_path: Any) -> None:
    with pytest.raises(TypeError, match="metadata"):
        objckpt.save({"a": torch.zeros(1)}, str(tmp_path / "m"), metadata={"x": object()})


@pytest.mark.parametrize("state", [{1: 1, "1": 2}, {"a.b": 1, "a": {"b": torch.ones(1)}}, {"": torch.ones(1)}])
def test_colliding_or_empty_keys(tmp_path: Any, state: Any) -> None:
    with pytest.raises(objckpt.UnsupportedValueError, match="key"):
        objckpt.save(state, str(tmp_path / "c"))


def test_lost_commit_reply_is_not_mistaken_for_a_race(tmp_path: Any) -> None:
    """The manifest PUT lands but its reply is lost and the retry sees 412: the save
    succeeded and its blobs must stay."""
    from objckpt.errors import PreconditionFailed
    from objckpt.storage import open_store
    from objckpt.testing.stores import CountingStore

    real, _ = open_store(str(tmp_path / "c"))

    class LostReply(CountingStore):
        async def put(self, key: str, data: Any, *, if_absent: bool = False) -> None:
            await super().put(key, data, if_absent=if_absent)
            if key.endswith("manifest.json"):
                raise PreconditionFailed("retry of a PUT that had landed")

    sd = {"w": torch.randn(50, 4)}
    objckpt.save(sd, str(tmp_path / "c"), store=LostReply(real))
    assert torch.equal(objckpt.read(str(tmp_path / "c"))["w"], sd["w"])
