"""``objckpt.copy`` / ``objckpt cp`` and ``objckpt.diff`` / ``objckpt diff`` on moto S3 and local files."""
from __future__ import annotations

import os
from typing import Any

import pytest
import torch

import objckpt
from objckpt.cli import main
from objckpt.checksum import crc32c
from objckpt.format import keys, rank_index
from objckpt.format.manifest import (Blob, Chunk, ChunkRecord, Manifest, Mesh, RankIndexRef, TensorEntry,
                                     TensorLayout, encode)
from objckpt.storage import open_store
from objckpt.runtime import loop as _runtime

from conftest import assert_same


def _state(seed: int = 0) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {"w": torch.randn(300, 64, generator=g), "b": torch.randn(64, generator=g),
                  "e": torch.randint(0, 9, (5, 0), generator=g), "h": torch.arange(6, dtype=torch.int16)},
        "step": 7, "lr": 0.1,
    }


def _objects(uri: str, opts: Any) -> list[str]:
    st, prefix = open_store(uri, opts)
    return sorted(o.key for o in _runtime.run(st.list(prefix + "/")))


def test_cp_s3_to_local_to_s3(moto_s3: tuple[str, dict[str, Any]], tmp_path: Any,
                              capsys: pytest.CaptureFixture[str]) -> None:
    bucket, opts = moto_s3
    src, mid, dst = f"s3://{bucket}/a/ck", str(tmp_path / "ck"), f"s3://{bucket}/b/ck"
    state = _state()
    state["model"]["tied"] = state["model"]["w"]
    objckpt.save(state, src, storage_options=opts, part_size=16 << 10)
    r1 = objckpt.copy(src, mid, storage_options=opts, dst_storage_options={}, part_size=10_000, memory_bytes=30_000)
    m = objckpt.inspect(src, storage_options=opts)
    assert r1.bytes == m.total_blob_bytes and r1.chunks_verified == sum(len(e.chunks) for e in m.tensors.values())
    assert r1.bytes > 30_000  # several parts, cutting through chunks (their crcs combined from slices)
    args = ["cp", mid, dst, "--endpoint-url", opts["endpoint_url"], "--region", "us-east-1", "--storage-options",
            '{"aws_access_key_id": "testing", "aws_secret_access_key": "testing"}', "--no-progress"]
    assert main(args) == 0
    assert "copied" in capsys.readouterr().out
    ma, mb = objckpt.inspect(src, storage_options=opts), objckpt.inspect(dst, storage_options=opts)
    crcs = lambda m: {k: sorted((c.offsets, c.crc32c) for c in e.chunks) for k, e in m.tensors.items()}  # noqa: E731
    assert crcs(ma) == crcs(mb) and ma.attempt == mb.attempt
    got = objckpt.read(dst, storage_options=opts)
    assert_same(got, state)
    assert got["model"]["tied"] is got["model"]["w"]
    assert objckpt.diff(src, dst, storage_options=opts).equal
    assert main(["diff", src, dst, "--endpoint-url", opts["endpoint_url"], "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("equal:") and "by crc without reading" in out
    # an existing destination is refused, replaced with --overwrite
    assert main(args) == 2
    assert "already exists" in capsys.readouterr().err
    objckpt.save(_state(1), mid, overwrite=True)
    assert main(["cp", mid, dst, "--overwrite", "--endpoint-url", opts["endpoint_url"], "--no-progress"]) == 0
    assert_same(objckpt.read(dst, storage_options=opts), _state(1))
    assert len([k for k in _objects(dst, opts) if "/blobs/" in k]) == len(objckpt.inspect(mid).blobs)  # old ones gone
    # the very same checkpoint again: refused, since rewriting its blobs in place would break it meanwhile
    assert main(["cp", mid, dst, "--overwrite", "--endpoint-url", opts["endpoint_url"], "--no-progress"]) == 2
    assert "already holds this checkpoint" in capsys.readouterr().err
    assert_same(objckpt.read(dst, storage_options=opts), _state(1))


def test_cp_damaged_blob_commits_nothing(tmp_path: Any, moto_s3: tuple[str, dict[str, Any]]) -> None:
    bucket, opts = moto_s3
    src, dst = str(tmp_path / "ck"), f"s3://{bucket}/copy/ck"
    objckpt.save(_state(), src, part_size=16 << 10)
    m = objckpt.inspect(src)
    c = m.tensors["model.w"].chunks[-1]
    with open(os.path.join(src, m.blobs[c.blob].name), "r+b") as f:
        f.seek(c.offset + c.length - 3)
        f.write(b"\x00\x01\x02")
    with pytest.raises(objckpt.CorruptCheckpointError, match=r"model\.w.*crc32c mismatch"):
        objckpt.copy(src, dst, storage_options=opts, part_size=7000)
    assert _objects(dst, opts) == []  # no manifest, and the blobs written are deleted
    assert not os.path.exists(str(tmp_path / "dst"))
    with pytest.raises(objckpt.NotFoundError, match="no checkpoint"):
        objckpt.copy(str(tmp_path / "nothing"), str(tmp_path / "dst"))


def write_v2(root: str, w: torch.Tensor) -> None:
    """A format v2 checkpoint as two ranks holding ``w`` as Shard(0) on a 1-d mesh write it
    (docs/format.md §12): one blob and one rank index object per rank.  Written here, in
    this process, so the test needs no process group."""
    attempt = keys.new_attempt_id()
    rows = w.shape[0] // 2
    blobs, refs = [], []
    for r in range(2):
        data = w[r * rows:(r + 1) * rows].contiguous().numpy().tobytes()
        name = keys.blob_name(attempt, r, 0)
        os.makedirs(os.path.dirname(os.path.join(root, name)), exist_ok=True)
        with open(os.path.join(root, name), "wb") as f:
            f.write(data)
        blobs.append(Blob(name, len(data), r))
        idx = rank_index.encode(attempt, r, [ChunkRecord("w", Chunk((r * rows, 0), (rows, w.shape[1]), 0, 0,
                                                                    len(data), crc32c(data)))])
        iname = keys.index_name(attempt, r)
        with open(os.path.join(root, iname), "wb") as f:
            f.write(idx)
        refs.append(RankIndexRef(iname, len(idx), crc32c(idx)))
    m = Manifest(tensors={"w": TensorEntry("w", "float32", tuple(w.shape), layout=TensorLayout(0, ("S0",)))},
                 blobs=blobs, tree={"w": {"$tensor": "w"}, "step": 3}, attempt=attempt, world_size=2,
                 meshes=[Mesh((2,), (0, 1))], rank_indexes=refs)
    with open(os.path.join(root, keys.MANIFEST_NAME), "wb") as f:
        f.write(encode(m))


def test_cp_multirank_v2_copies_rank_indexes(tmp_path: Any) -> None:
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    w = torch.arange(4000, dtype=torch.float32).reshape(100, 40)
    write_v2(src, w)
    m = objckpt.inspect(src, chunks=False)
    assert len(m.rank_indexes) == 2 and m.tensors["w"].layout is not None
    r = objckpt.copy(src, dst, part_size=5000)
    assert r.objects == 2 + 2 + 1 and r.chunks_verified == 2
    assert sorted(os.listdir(os.path.join(dst, "blobs", m.attempt))) == sorted(
        os.path.basename(n) for n in [*(b.name for b in m.blobs), *(x.name for x in m.rank_indexes)])
    back = objckpt.read(dst)
    assert torch.equal(back["w"], w) and back["step"] == 3
    assert objckpt.diff(src, dst).equal
    # a damaged rank index is refused before anything is written
    idx = os.path.join(src, m.rank_indexes[1].name)
    with open(idx, "r+b") as f:
        f.seek(5)
        f.write(b"\xff")
    with pytest.raises(objckpt.CorruptCheckpointError, match="rank index"):
        objckpt.copy(src, str(tmp_path / "dst2"))
    assert not os.path.exists(os.path.join(str(tmp_path / "dst2"), keys.MANIFEST_NAME))


def test_diff_changed_keys_shapes_and_chunking(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    a, b, c, d = (str(tmp_path / n) for n in "abcd")
    base = _state()
    objckpt.save(base, a, part_size=16 << 10)
    changed = _state()
    changed["model"]["w"][299, 63] += 1.0
    changed["step"] = 8
    objckpt.save(changed, b, part_size=16 << 10)
    r = objckpt.diff(a, b)
    assert not r.equal and r.differing == ["model.w"] and r.decided["model.w"] == "crc"
    assert r.values_differing == ["step"] and r.bytes_read == 0
    assert main(["diff", a, b, "--no-progress"]) == 1
    out = capsys.readouterr().out
    assert "tensor differs: model.w (decided by crc)" in out and "values differ: step" in out

    other = _state()
    del other["model"]["b"]
    other["model"]["new"] = torch.zeros(3)
    other["model"]["h"] = torch.arange(6, dtype=torch.int32)
    objckpt.save(other, c)
    r = objckpt.diff(a, c)
    assert r.only_a == ["model.b"] and r.only_b == ["model.new"]
    assert r.mismatched == ["model.h: int16 [6] vs int32 [6]"]

    objckpt.save(base, d, part_size=40 << 10)  # same values, chunked differently
    r = objckpt.diff(a, d)
    assert r.equal and r.decided["model.w"] == "bytes" and r.bytes_read == 2 * 300 * 64 * 4
    assert r.decided["model.b"] == "crc"  # one chunk either way
    changed_d = _state()
    changed_d["model"]["w"][0, 0] = -5.0
    objckpt.save(changed_d, d, part_size=40 << 10, overwrite=True)
    r = objckpt.diff(a, d, memory_bytes=1)
    assert r.differing == ["model.w"] and r.decided["model.w"] == "bytes"
    assert main(["diff", a, str(tmp_path / "none"), "--no-progress"]) == 2


class _Held:
    """Bytes of parts read from SRC and not yet written at DST: what cp holds in memory."""

    def __init__(self) -> None:
        self.now = self.peak = 0


def test_cp_holds_at_most_memory_bytes_and_reads_in_parallel(tmp_path: Any) -> None:
    import asyncio

    from objckpt.storage import BlobWriter
    from objckpt.testing.stores import CountingStore

    held = _Held()

    class Src(CountingStore):
        async def get_range_into(self, key: str, offset: int, out: memoryview) -> None:
            held.now += len(out)
            held.peak = max(held.peak, held.now)
            await asyncio.sleep(0.002)  # a slow store: parts overlap when they may
            await super().get_range_into(key, offset, out)

    class Dst(CountingStore):
        def open_writer(self, key: str, size: int, num_parts: int = 1) -> BlobWriter:
            inner = super().open_writer(key, size, num_parts)

            class W(BlobWriter):
                async def write_part(self, index: int, offset: int, data: memoryview) -> None:
                    await inner.write_part(index, offset, data)
                    held.now -= len(data)

                async def complete(self) -> None:
                    await inner.complete()

                async def abort(self) -> None:
                    await inner.abort()

            return W()

    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    state = {f"t{i}": torch.randn(64, 1024) for i in range(8)}  # 2 MiB
    objckpt.save(state, src)
    s, d = Src(open_store(src)[0]), Dst(open_store(dst)[0])
    r = objckpt.copy(src, dst, src_store=s, dst_store=d, part_size=64 << 10, memory_bytes=256 << 10)
    assert s.ops["get_range"] == -(-r.bytes // (64 << 10))
    assert (64 << 10) < held.peak <= 256 << 10 and held.now == 0
    assert_same(objckpt.read(dst), state)


def test_cp_spread_layout_follows_the_manifest(tmp_path: Any, moto_s3: tuple[str, dict[str, Any]]) -> None:
    """A spread checkpoint's blobs lie outside its prefix: cp finds them through the
    manifest and places them the same way at DST, S3 -> local -> S3."""
    bucket, opts = moto_s3
    state = {"w": torch.randn(96, 64), "b": torch.arange(300), "step": 9}
    src = f"s3://{bucket}/run/step-1"
    objckpt.save(state, src, storage_options=opts, key_layout="spread", blob_size=8 << 10, part_size=8 << 10)
    local = str(tmp_path / "copy" / "step-1")
    objckpt.copy(src, local, storage_options=opts)
    spread_dirs = [p.name for p in (tmp_path / "copy").iterdir() if p.name.startswith(".spread-")]
    assert spread_dirs, "the copy's blobs must sit under the spread root, as at the source"
    back = f"s3://{bucket}/again/step-1"
    objckpt.copy(local, back, storage_options=opts)
    assert objckpt.diff(src, back, storage_options=opts).equal
    got = objckpt.read(back, storage_options=opts)
    assert torch.equal(got["w"], state["w"]) and torch.equal(got["b"], state["b"]) and got["step"] == 9
    with pytest.raises(ValueError, match="spread key layout"):
        objckpt.copy(src, f"s3://{bucket}/top", storage_options=opts)  # no segment above it for the spread root
    objckpt.delete(back, storage_options=opts)
    assert objckpt.diff(src, local, storage_options=opts).equal  # deleting one copy left the others whole
