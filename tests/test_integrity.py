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
from objckpt.runtime import loop as _runtime
from objckpt.format import keys
from objckpt.format.packed import pack, unpack
from objckpt.format.manifest import load_json, reseal
from objckpt.storage import open_store

def edit_manifest(uri: str, opts: dict[str, Any], edit: Callable[[dict[str, Any]], None]) -> None:
    """Load ``uri``'s manifest JSON, apply ``edit`` to it, reseal it, write it back (plain JSON)."""
    store, prefix = open_store(uri, opts or None)
    mkey = keys.manifest_key(prefix)

    def bad(what: str) -> Exception:
        return AssertionError(what)

    obj = load_json(_runtime.run(store.get(mkey)), bad)
    edit(obj)
    _runtime.run(store.put(mkey, reseal(json.dumps(obj).encode())))


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


# --------------------------------------------------------------------------- item 7: chunks tile the tensor


def _chunked(tmp_path: Any) -> tuple[str, torch.Tensor]:
    """A local checkpoint whose tensor ``w`` is stored as 10 chunks of 40 rows."""
    ck = str(tmp_path / "ck")
    w = torch.arange(40000.0).reshape(400, 100)
    objckpt.save({"w": w, "b": torch.ones(3)}, ck, part_size=16384)
    assert len(objckpt.inspect(ck).tensors["w"].chunks) == 10
    return ck, w


def _set_offsets(index: int, offsets: list[int]) -> Callable[[dict[str, Any]], None]:
    def edit(m: dict[str, Any]) -> None:
        chunks = sorted(m["tensors"]["w"]["chunks"], key=lambda c: c["offsets"])
        chunks[index]["offsets"] = offsets
    return edit


def _assert_all_refuse(ck: str, capsys: pytest.CaptureFixture[str], *named: str) -> None:
    from objckpt.cli import main

    # a non-contiguous template reads through temporaries: each chunk's crc holds, and
    # before the tiling check that load succeeded with rows never written
    for attempt in (lambda: objckpt.load({"w": torch.zeros(100, 400).t(), "b": torch.zeros(3)}, ck),
                    lambda: objckpt.read(ck), lambda: objckpt.read(ck, keys=["w"]),
                    lambda: objckpt.load({"w": torch.zeros(400, 100), "b": torch.zeros(3)}, ck)):
        with pytest.raises(objckpt.errors.CorruptCheckpointError) as e:
            attempt()
        assert "'w'" in str(e.value) and all(n in str(e.value) for n in named), str(e.value)
    assert main(["verify", ck]) != 0
    err = capsys.readouterr().err
    assert "'w'" in err and all(n in err for n in named), err


def test_a_shifted_chunk_is_refused(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    """Rows 120..160 moved one row down: every crc still valid, row 120 never
    written, row 160 written twice.  Read, load and verify must all refuse."""
    ck, _ = _chunked(tmp_path)
    assert objckpt.read(ck, keys=["w"])  # fine before the edit
    edit_manifest(ck, {}, _set_offsets(3, [121, 0]))
    _assert_all_refuse(ck, capsys, "[121, 0]", "overlap")


def test_a_chunk_outside_the_tensor_is_refused(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    ck, _ = _chunked(tmp_path)
    edit_manifest(ck, {}, _set_offsets(9, [361, 0]))
    _assert_all_refuse(ck, capsys)  # decode refuses it already; the tiling check would name [361, 0]


def test_a_chunk_moved_sideways_is_refused(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    """A chunk shifted along dim 1 (stays inside the rows, leaves the shape): refused."""
    ck, _ = _chunked(tmp_path)
    edit_manifest(ck, {}, _set_offsets(4, [160, 1]))
    _assert_all_refuse(ck, capsys)


def test_tiling_finds_overlaps_and_gaps_among_many_chunks() -> None:
    """Unit cases of the pure check (rows, columns, grids, 3-d, 0-d) at 100k+ chunks."""
    from objckpt.planning.tiling import tiling_defect

    rows = [((i, 0), (1, 8)) for i in range(100_000)]
    cols = [((0, j), (8, 1)) for j in range(100_000)]
    grid = [((i * 2, j * 3), (2, 3)) for i in range(300) for j in range(400)]
    assert tiling_defect(rows[::-1], ((0, 0), (100_000, 8))) is None
    assert tiling_defect(cols, ((0, 0), (8, 100_000))) is None
    assert tiling_defect(grid, ((0, 0), (600, 1200))) is None
    assert tiling_defect([((), ())], ((), ())) is None
    cube = [((i, j, k), (1, 2, 2)) for i in range(4) for j in (0, 2) for k in (0, 2)]
    assert tiling_defect(cube, ((0, 0, 0), (4, 4, 4))) is None
    cube[5] = ((1, 2, 1), (1, 2, 2))
    assert tiling_defect(cube, ((0, 0, 0), (4, 4, 4))).kind in ("overlap", "outside")  # type: ignore[union-attr]
    grid[12345] = ((grid[12345][0][0], grid[12345][0][1] + 1), (2, 3))
    d = tiling_defect(grid, ((0, 0), (600, 1200)))
    assert d is not None and d.kind == "overlap" and grid[12345] in d.boxes
    cols[500] = ((0, 501), (8, 1))
    d = tiling_defect(cols, ((0, 0), (8, 100_000)))
    assert d is not None and d.kind == "overlap" and {b[0] for b in d.boxes} == {(0, 501)}
    assert tiling_defect(rows[:-1], ((0, 0), (100_000, 8))).kind == "gap"  # type: ignore[union-attr]
    assert tiling_defect([((), ()), ((), ())], ((), ())).kind == "overlap"  # type: ignore[union-attr]


# --------------------------------------------------------------------------- item 9: verify checks block crcs


def _blocked(tmp_path: Any) -> tuple[str, dict[str, Any]]:
    """A local checkpoint whose tensor ``w`` (3 MiB) is one chunk of 3 crc blocks of 1 MiB,
    plus tensors of other dtypes stored in chunks with blocks."""
    ck = str(tmp_path / "ck")
    state = {"w": torch.arange(3 * 262144, dtype=torch.float32).reshape(768, 1024),
             "h": torch.arange(1 << 20, dtype=torch.float32).to(torch.bfloat16).reshape(1024, 1024),
             "c": torch.randn(300000, dtype=torch.complex64), "flag": torch.ones(5, dtype=torch.bool)}
    objckpt.save(state, ck, crc_block=1 << 20)
    m = objckpt.inspect(ck)
    assert m.crc_block == 1 << 20 and [len(c.block_crc32c) for c in m.tensors["w"].chunks] == [3]
    return ck, state


def test_verify_checks_every_block_crc(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    from objckpt.cli import main

    ck, state = _blocked(tmp_path)
    assert main(["verify", ck]) == 0
    assert "block crc(s)" in capsys.readouterr().out

    def flip(m: dict[str, Any]) -> None:
        chunk = m["tensors"]["w"]["chunks"][0]
        blocks = list(unpack(chunk["block_crc32c"], 3))  # v5: packed
        blocks[1] ^= 0x10
        chunk["block_crc32c"] = pack(blocks)

    edit_manifest(ck, {}, flip)
    assert torch.equal(objckpt.read(ck)["w"], state["w"])  # a full read checks the chunk crc only: fine
    assert main(["verify", ck]) != 0
    err = capsys.readouterr().err
    assert "'w'" in err and "block 1" in err and "[0, 0]" in err, err
    with pytest.raises(objckpt.errors.CorruptCheckpointError):  # what verify warns of: a partial load fails
        objckpt.load({"w": objckpt.Shard(torch.zeros(256, 1024), (768, 1024), (256, 0))}, ck, strict=False)


def test_verify_refuses_block_crcs_that_do_not_combine_to_the_chunk_crc(tmp_path: Any) -> None:
    from objckpt.ops.verify import verify_block_crcs
    from objckpt.checksum import combine_blocks, block_crcs

    ck, state = _blocked(tmp_path)
    m = objckpt.inspect(ck)
    got = objckpt.read(ck)
    assert verify_block_crcs(m, lambda k: got[k]) >= 3
    c = m.tensors["w"].chunks[0]
    data = memoryview(state["w"].reshape(-1).view(torch.uint8).numpy())
    total, blocks = block_crcs(data, 1 << 20)
    assert combine_blocks(blocks, len(data), 1 << 20) == total == c.crc32c
    m.tensors["w"].chunks[0] = type(c)(c.offsets, c.shape, c.blob, c.offset, c.length, c.crc32c ^ 1,
                                       c.block_crc32c)
    with pytest.raises(objckpt.errors.CorruptCheckpointError, match="combine"):
        verify_block_crcs(m, lambda k: got[k])


def _v2_checkpoint(ck: Any, second_row: int) -> torch.Tensor:
    """A one-rank format-v2 checkpoint on local files whose one piece (all of ``w``,
    4 x 3) is stored as two chunks of 2 rows, the second one at row ``second_row``."""
    from objckpt.checksum import crc32c
    from objckpt.format import rank_index
    from objckpt.format.manifest import (Blob, Chunk, ChunkRecord, Manifest, Mesh, RankIndexRef, TensorEntry,
                                         TensorLayout, encode)

    w = torch.arange(12.0).reshape(4, 3)
    data = w.reshape(-1).view(torch.uint8).numpy().tobytes()
    attempt = keys.new_attempt_id()
    records = [ChunkRecord("w", Chunk((0, 0), (2, 3), 0, 0, 24, crc32c(data[:24]))),
               ChunkRecord("w", Chunk((second_row, 0), (2, 3), 0, 24, 24, crc32c(data[24:])))]
    index = rank_index.encode(attempt, 0, records)
    blob, iname = keys.blob_name(attempt, 0, 0), keys.index_name(attempt, 0)
    m = Manifest({"w": TensorEntry("w", "float32", (4, 3), layout=TensorLayout(0, ("S0",)))},
                 [Blob(blob, len(data), 0)], {"w": {"$tensor": "w"}}, attempt=attempt, world_size=1,
                 meshes=[Mesh((1,), (0,))], rank_indexes=[RankIndexRef(iname, len(index), crc32c(index))],
                 format_version=2)
    for name, body in ((blob, data), (iname, index), (keys.MANIFEST_NAME, encode(m))):
        (ck / name).parent.mkdir(parents=True, exist_ok=True)
        (ck / name).write_bytes(body)
    return w


def test_v2_pieces_must_be_tiled_by_their_chunks(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    """v2: a rank index whose second chunk starts one row early (row 3 never written,
    row 1 twice, every crc valid) is refused by read, load and verify."""
    from objckpt.cli import main

    good, bad = tmp_path / "good", tmp_path / "bad"
    w = _v2_checkpoint(good, 2)
    assert torch.equal(objckpt.read(str(good))["w"], w) and main(["verify", str(good)]) == 0
    _v2_checkpoint(bad, 1)
    for attempt in (lambda: objckpt.load({"w": torch.zeros(3, 4).t()}, str(bad)), lambda: objckpt.read(str(bad)),
                    lambda: objckpt.load({"w": torch.zeros(4, 3)}, str(bad))):
        with pytest.raises(objckpt.errors.CorruptCheckpointError, match=r"'w'.*\[1, 0\].*overlap"):
            attempt()
    assert main(["verify", str(bad)]) != 0 and "[1, 0]" in capsys.readouterr().err
