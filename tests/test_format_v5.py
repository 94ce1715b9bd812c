"""Format v5: packed columns.  Block crcs stored as one base64 string of little-endian
uint32 per chunk (in the manifest and the rank indexes), the blob and rank-index tables as
packed columns with names implied by the key scheme; and the checkpoints of the release
before it (v3, lists) still read, verify and reshard."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import zstandard

import objckpt
from objckpt.errors import CorruptCheckpointError, UnsupportedFormatError
from objckpt.format import packed as block_crcs
from objckpt.format import tables
from objckpt.format import manifest as mf
from objckpt.format.sealed_json import load_json, reseal

DATA = Path(__file__).with_name("data")


def _text(path: Path) -> bytes:
    raw = path.read_bytes()
    return zstandard.ZstdDecompressor().decompress(raw, max_output_size=1 << 30) if raw[:4] == mf.ZSTD_MAGIC else raw


def _old_single() -> dict[str, Any]:
    """What tests/data/v3_block_lists holds (written by the release before v5, same seed)."""
    g = torch.Generator().manual_seed(3)
    return {"w": torch.randn(40, 100, generator=g), "b": torch.randn(7, generator=g).to(torch.bfloat16), "step": 12}


def _old_sharded() -> torch.Tensor:
    """The global value of ``sharded`` in tests/data/v3_rank_indexes (2 ranks, Shard(0))."""
    return torch.randn(64, 96, generator=torch.Generator().manual_seed(5))


def test_pack_round_trip_and_only_the_canonical_spelling() -> None:
    for blocks in ([], [0], [(1 << 32) - 1, 1, 2], list(range(1000, 1065))):
        assert block_crcs.unpack(block_crcs.pack(blocks), len(blocks)) == tuple(blocks)
    good = block_crcs.pack([1])  # "AQAAAA=="
    for bad in (good[:-1], good + "=", " " + good[1:], good[:6] + "B=",  # other padding bits: same bytes
                good.replace("A", "-", 1), 7, [1], None):
        assert block_crcs.unpack(bad, 1) is None, bad
    assert block_crcs.unpack(good, 2) is None  # the wrong count


def test_a_new_save_writes_v5_with_packed_strings_and_reads_back(tmp_path: Path) -> None:
    state = _old_single()
    ck = tmp_path / "ck"
    objckpt.save(state, str(ck), crc_block=1024)
    obj = json.loads(_text(ck / "manifest.json"))
    assert obj["format_version"] == mf.PACKED_VERSION == 5
    packed = obj["tensors"]["w"]["chunks"][0]["block_crc32c"]
    assert isinstance(packed, str) and len(packed) == 4 * -(-4 * 16 // 3)  # 16,000 bytes: 16 blocks
    m = objckpt.inspect(str(ck))
    assert len(m.tensors["w"].chunks[0].block_crc32c) == 16
    got = objckpt.read(str(ck))
    assert torch.equal(got["w"], state["w"]) and torch.equal(got["b"], state["b"]) and got["step"] == 12
    # a partial read (rows 7..23 of 40) verifies whole blocks against the packed crcs
    part = {"w": objckpt.Shard(torch.zeros(16, 100), (40, 100), (7, 0))}
    res = objckpt.load(part, str(ck), strict=False)
    assert torch.equal(part["w"].local, state["w"][7:23]) and res.bytes < 16000


def test_a_release_that_reads_up_to_v4_refuses_v5_by_its_version(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    ck = tmp_path / "ck"
    objckpt.save(_old_single(), str(ck), crc_block=1024)
    monkeypatch.setattr(mf, "MAX_VERSION", 4)
    with pytest.raises(UnsupportedFormatError, match="format_version 5.*versions 1 to 4"):
        objckpt.read(str(ck))


def test_a_save_without_block_crcs_stays_v3(tmp_path: Path) -> None:
    """Only what needs v5 is written as v5: an older release still reads the rest."""
    ck = tmp_path / "ck"
    objckpt.save({"w": torch.arange(10.0)}, str(ck))  # 40 bytes: no block crcs
    assert json.loads(_text(ck / "manifest.json"))["format_version"] == 3


def _edit(ck: Path, fn: Any) -> None:
    obj = load_json(_text(ck / "manifest.json"), AssertionError)
    fn(obj)
    (ck / "manifest.json").write_bytes(reseal(json.dumps(obj).encode()))


@pytest.mark.parametrize("case", ["string in a v4 manifest", "wrong count", "not canonical", "not base64"])
def test_hostile_packed_crcs_are_refused(tmp_path: Path, case: str) -> None:
    ck = tmp_path / "ck"
    objckpt.save(_old_single(), str(ck), crc_block=1024)

    def edit(obj: dict[str, Any]) -> None:
        chunk = obj["tensors"]["w"]["chunks"][0]
        if case == "string in a v4 manifest":  # v4's list of blobs, so that only the packed crcs are wrong
            table = tables.decode_blobs(obj["blobs"], obj["attempt"], 0, AssertionError, lambda e, w: None)
            obj.update(format_version=4, blobs=[{"name": b.name, "size": b.size, "rank": b.rank} for b in table])
        elif case == "wrong count":
            chunk["block_crc32c"] = block_crcs.pack(list(range(15)))
        elif case == "not canonical":
            chunk["block_crc32c"] = chunk["block_crc32c"][:-4] + "\n" + chunk["block_crc32c"][-3:]
        else:
            chunk["block_crc32c"] = "*" * len(chunk["block_crc32c"])

    _edit(ck, edit)
    with pytest.raises(CorruptCheckpointError, match="tensor 'w': chunk #0 malformed"):
        objckpt.read(str(ck))


def test_a_changed_packed_crc_is_found_by_verify(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    state = _old_single()
    objckpt.save(state, str(ck), crc_block=1024)

    def edit(obj: dict[str, Any]) -> None:
        chunk = obj["tensors"]["w"]["chunks"][0]
        blocks = list(block_crcs.unpack(chunk["block_crc32c"], 16) or ())
        blocks[3] ^= 1
        chunk["block_crc32c"] = block_crcs.pack(blocks)

    _edit(ck, edit)
    out = subprocess.run([sys.executable, "-m", "objckpt", "verify", str(ck)], capture_output=True, text=True)
    assert out.returncode != 0 and "block 3" in out.stdout + out.stderr


def test_v3_checkpoint_with_block_crc_lists_reads_and_verifies(tmp_path: Path) -> None:
    """tests/data/v3_block_lists: written by the release before v5 (block crcs as lists)."""
    ck = tmp_path / "ck"
    shutil.copytree(DATA / "v3_block_lists", ck)
    obj = json.loads(_text(ck / "manifest.json"))
    assert obj["format_version"] == 3 and isinstance(obj["tensors"]["w"]["chunks"][0]["block_crc32c"], list)
    want = _old_single()
    got = objckpt.read(str(ck))
    assert torch.equal(got["w"], want["w"]) and torch.equal(got["b"], want["b"]) and got["step"] == 12
    tmpl = {"w": torch.empty(40, 100), "b": torch.empty(7, dtype=torch.bfloat16), "step": 0}
    objckpt.load(tmpl, str(ck))
    assert torch.equal(tmpl["w"], want["w"]) and tmpl["step"] == 12
    # a new process: the CLI checks every block crc of the list form
    out = subprocess.run([sys.executable, "-m", "objckpt", "verify", str(ck)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "block crc(s)" in out.stdout


def test_v3_rank_indexes_with_block_crc_lists_reshard_to_one_rank(tmp_path: Path) -> None:
    """tests/data/v3_rank_indexes: 2 ranks, format v3, block crcs as lists in the rank
    indexes; one process loads it (a resharding read through both indexes)."""
    ck = tmp_path / "ck"
    shutil.copytree(DATA / "v3_rank_indexes", ck)
    assert json.loads(_text(ck / "manifest.json"))["format_version"] == 3
    tmpl = {"sharded": torch.zeros(64, 96), "rep": torch.zeros(300), "step": 0}
    objckpt.load(tmpl, str(ck))
    assert torch.equal(tmpl["sharded"], _old_sharded())
    assert torch.equal(tmpl["rep"], torch.arange(300, dtype=torch.float32)) and tmpl["step"] == 4
    m = objckpt.inspect(str(ck))
    assert m.format_version == 3 and m.crc_block == 1024 and len(m.rank_indexes) == 2
    # rows 20..44: the end of rank 0's chunk and the start of rank 1's, each verified by block
    part = {"sharded": objckpt.Shard(torch.zeros(24, 96), (64, 96), (20, 0))}
    res = objckpt.load(part, str(ck), strict=False)
    assert torch.equal(part["sharded"].local, _old_sharded()[20:44]) and res.bytes < 64 * 96 * 4


def test_packed_crcs_shrink_the_manifest_of_many_small_tensors(tmp_path: Path) -> None:
    """The bound behind the format change: 800 tensors of 16 KiB with 1 KiB blocks.  Lists
    of integers spent ~11 characters per block crc; packed ones spend 16/3."""
    g = torch.Generator().manual_seed(0)
    state = {f"t{i}": torch.randn(4096, generator=g) for i in range(800)}
    ck = tmp_path / "ck"
    objckpt.save(state, str(ck), crc_block=1024)
    text = _text(ck / "manifest.json")
    obj = json.loads(text)
    n_blocks = sum(len(block_crcs.unpack(c["block_crc32c"], 16) or ()) for t in obj["tensors"].values()
                   for c in t["chunks"])
    assert n_blocks == 800 * 16
    as_lists = json.dumps({**obj, "tensors": {k: {**t, "chunks": [
        {**c, "block_crc32c": list(block_crcs.unpack(c["block_crc32c"], 16) or ())} for c in t["chunks"]]}
        for k, t in obj["tensors"].items()}}, separators=(",", ":"))
    assert len(text) - len(as_lists) < -5 * n_blocks  # at least 5 characters saved per block crc
    assert b"block_crc32c\":[" not in text


# ------------------------------------------------------------------ the blob and rank-index tables

def _many_ranks_manifest(world: int) -> mf.Manifest:
    """A v2 manifest of ``world`` ranks, each with one blob and its index (as a save builds it)."""
    from objckpt.format import keys

    mesh = mf.Mesh((world,), tuple(range(world)))
    t = mf.TensorEntry("w", "float32", (world * 4, 8), layout=mf.ShardSpec(0, ("S0",)))
    att = "20261129T000000-0123456789ab"
    blobs = [mf.Blob(keys.blob_name(att, r, 0), 128 + r, r) for r in range(world)]
    refs = [mf.RankIndexRef(keys.index_name(att, r), 300 + r, (r * 2654435761) % (1 << 32)) for r in range(world)]
    return mf.Manifest({"w": t}, blobs, {"w": {"__tensor__": "w"}}, attempt=att, world_size=world, meshes=[mesh],
                       rank_indexes=refs, crc_block=1024)


def test_tables_are_columns_with_implied_names_and_decode_lazily(monkeypatch: pytest.MonkeyPatch) -> None:
    m = _many_ranks_manifest(4096)
    data = mf.encode(m, compress=False)
    obj = json.loads(data)
    assert obj["format_version"] == 5 and set(obj["blobs"]) == {"rank", "size"}  # no names: all implied
    assert set(obj["rank_indexes"]) == {"size", "crc32c"}
    assert len(json.dumps(obj["blobs"])) + len(json.dumps(obj["rank_indexes"])) < 4096 * 40  # was ~190 a rank
    made = {"n": 0}
    for cls in (tables.BlobTable, tables.IndexTable):
        orig = cls._entry
        monkeypatch.setattr(cls, "_entry", lambda self, i, orig=orig: (made.__setitem__("n", made["n"] + 1),
                                                                        orig(self, i))[1])
    back = mf.decode(data)
    assert made["n"] == 0  # decoded and checked as columns: no entry made
    assert back.blobs[4095] == m.blobs[4095] and back.rank_indexes[7] == m.rank_indexes[7] and made["n"] == 2
    assert back.blobs == m.blobs and back.rank_indexes == m.rank_indexes  # every entry, names implied
    assert back.index_key("ck", 3) == "ck/" + m.rank_indexes[3].name


def test_tables_keep_names_that_differ_from_the_key_scheme() -> None:
    m = _many_ranks_manifest(4)
    m.blobs[2] = mf.Blob("blobs/other/place.bin", 130, 2)
    obj = json.loads(mf.encode(m, compress=False))
    assert obj["blobs"]["name"][2] == "blobs/other/place.bin"
    assert mf.decode(mf.encode(m)).blobs == m.blobs


@pytest.mark.parametrize("case, match", [
    ("lengths differ", "columns of different lengths"),
    ("size too large", "size is too large"),
    ("not packed", "column 'size' missing or not packed"),
    ("dotdot name", "not a plain path"),
    ("attempt with a slash", "not one safe path segment"),
    ("bad bucket", "not a hex bucket"),
    ("table in v4", "'rank_indexes' missing"),
    ("unknown column", "not a v5 table"),
])
def test_hostile_tables_are_refused(case: str, match: str) -> None:
    m = _many_ranks_manifest(4)
    obj = json.loads(mf.encode(m, compress=False))
    b = obj["blobs"]
    if case == "lengths differ":
        b["rank"] = block_crcs.pack([0, 1, 2])
    elif case == "size too large":
        b["size"] = block_crcs.pack([1, 2, 3, 1 << 62], 8)
    elif case == "not packed":
        b["size"] = [128, 129, 130, 131]
    elif case == "dotdot name":
        b["name"] = [f"blobs/{obj['attempt']}/r{r:05d}-0000.bin" for r in range(3)] + ["blobs/../../victim"]
    elif case == "attempt with a slash":
        obj["attempt"] = "x/../../victim"
        obj["rank_indexes"]["name"] = [r.name for r in m.rank_indexes]  # so that only the blobs' names are implied
    elif case == "bad bucket":
        b["spread"] = ["", "zz", "", ""]
        obj["spread_up"] = 1
    elif case == "table in v4":
        obj["format_version"] = 4
    else:
        b["owner"] = "me"
    with pytest.raises(CorruptCheckpointError, match=match):
        mf.decode(reseal(json.dumps(obj).encode()))


def test_a_two_rank_save_writes_tables_and_reshards_to_one_rank(tmp_path: Path) -> None:
    """Real processes: 2 gloo ranks save DTensor shards (v5 tables, names implied), one
    process loads the whole tensor through both rank indexes."""
    from mp import run_multiprocess

    uri = str(tmp_path / "ck")
    run_multiprocess(2, _save_sharded, uri)
    obj = json.loads(_text(tmp_path / "ck" / "manifest.json"))
    assert obj["format_version"] == 5 and set(obj["blobs"]) == {"rank", "size"}
    assert set(obj["rank_indexes"]) == {"size", "crc32c"}
    tmpl = {"sharded": torch.zeros(64, 96), "step": 0}
    objckpt.load(tmpl, uri)
    assert torch.equal(tmpl["sharded"], _old_sharded()) and tmpl["step"] == 4
    m = objckpt.inspect(uri)
    assert [b.rank for b in m.blobs] == [0, 1] and all(b.name.startswith(f"blobs/{m.attempt}/") for b in m.blobs)


def _save_sharded(rank: int, world: int, uri: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    objckpt.save({"sharded": distribute_tensor(_old_sharded(), mesh, [Shard(0)]), "step": 4}, uri, crc_block=1024)


def test_v4_spread_checkpoint_with_lists_reads(tmp_path: Path) -> None:
    """tests/data/v4_spread_lists: a spread checkpoint of the release before v5 (v4, its blobs
    and block crcs as lists, the blob under run/.spread-00/)."""
    shutil.copytree(DATA / "v4_spread_lists", tmp_path / "d")
    ck = tmp_path / "d" / "run" / "ck"
    obj = json.loads(_text(ck / "manifest.json"))
    assert obj["format_version"] == 4 and isinstance(obj["blobs"], list) and obj["blobs"][0]["spread"] == "00"
    got = objckpt.read(str(ck))
    want = torch.randn(30, 64, generator=torch.Generator().manual_seed(4))
    assert torch.equal(got["w"], want) and got["step"] == 3
    out = subprocess.run([sys.executable, "-m", "objckpt", "verify", str(ck)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_decoded_block_crcs_stay_packed_until_read(tmp_path: Path) -> None:
    """A v5 decode keeps each chunk's block crcs as their bytes (a whole-chunk read never
    needs them); read one by one, sliced, iterated or compared, they are the values."""
    ck = tmp_path / "ck"
    state = _old_single()
    objckpt.save(state, str(ck), crc_block=1024)
    blocks = objckpt.inspect(str(ck)).tensors["w"].chunks[0].block_crc32c
    assert isinstance(blocks, block_crcs.PackedCrcs) and len(blocks) == 16
    values = tuple(blocks)
    assert blocks == values and values == blocks and hash(blocks) == hash(values) and blocks[-1] == values[15]
    assert blocks[2:4] == values[2:4] and list(blocks) == list(values)
    with pytest.raises(IndexError):
        blocks[16]
    # written back unchanged (a copy re-encodes a decoded manifest)
    assert block_crcs.pack(blocks) == block_crcs.pack(values)
