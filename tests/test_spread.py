"""The spread key layout: hashed prefixes above the checkpoint (format v4).

Pure tests of the key function (even spread, keys that parse back to their
owner), then real saves on local files and moto S3 (single process and 2 gloo
ranks), gc / delete / overwrite cleanup that remove spread objects and nothing
else, and hostile manifests that try to name objects outside the namespace.
"""
from __future__ import annotations

import collections
import json
import pathlib
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import objckpt
from objckpt.runtime import loop as _runtime
from objckpt.errors import CorruptCheckpointError, UnsupportedFormatError
from objckpt.format import manifest as mf
from objckpt.format import spread
from objckpt.format import tables
from objckpt.ops.gc import collect_garbage
from objckpt.storage import open_store

from conftest import assert_same
from mp import run_multiprocess


def _blob0(o: dict[str, Any], **edit: str) -> None:
    """Change the first blob of manifest JSON ``o`` (its name or spread) in the form it is
    stored in: a v5 table (its names and buckets then listed in full) or v4's list."""
    if isinstance(o["blobs"], list):
        o["blobs"][0].update(edit)
        return
    table = tables.decode_blobs(o["blobs"], o["attempt"], o.get("spread_up", 0), AssertionError, lambda e, w: None)
    names, buckets = [b.name for b in table], [b.spread for b in table]
    names[0], buckets[0] = edit.get("name", names[0]), edit.get("spread", buckets[0])
    o["blobs"].update(name=names, spread=buckets)


def _expected_version(m: mf.Manifest, without_blocks: int) -> int:
    """The version the format (docs/format.md §9) says a writer stores ``m`` as: v5 when block
    crcs may be stored (a chunk has some, or chunks live in rank indexes and ``crc_block`` is
    set), else ``without_blocks``."""
    blocks = any(c.block_crc32c for t in m.tensors.values() for c in t.chunks)
    return mf.PACKED_VERSION if blocks or (m.rank_indexes and m.crc_block) else without_blocks

OLD = "20200101T000000-0123456789ab"  # an attempt id far older than gc's grace
SEG = st.text("abcdefghij-_0123456789", min_size=1, max_size=6)


# ----------------------------------------------------------------------------- pure: the key function


@settings(max_examples=200, deadline=None)
@given(digits=st.integers(1, 3), start=st.integers(0, 1 << 20), count=st.integers(1, 5000))
def test_any_run_of_ranks_fills_the_buckets_evenly(digits: int, start: int, count: int) -> None:
    counts = collections.Counter(spread.spread_bucket(r, digits) for r in range(start, start + count))
    n = 16**digits
    assert all(spread.is_bucket(b) and len(b) == digits for b in counts)
    low = count // n
    assert set(counts.values()) <= {low, low + 1}
    assert len(counts) == min(count, n)


def test_16384_ranks_over_256_prefixes_64_each() -> None:
    counts = collections.Counter(spread.spread_bucket(r, 2) for r in range(16384))
    assert len(counts) == 256 and set(counts.values()) == {64}
    # neighbours land far apart: ranks 0 and 1 in opposite halves of the key range, where S3 splits first
    assert [spread.spread_bucket(r, 2) for r in range(4)] == ["00", "80", "40", "c0"]


@settings(max_examples=200, deadline=None)
@given(segs=st.lists(SEG, min_size=1, max_size=5), data=st.data(), rank=st.integers(0, 99999),
       digits=st.integers(1, 4))
def test_spread_keys_parse_back_to_their_owner(segs: list[str], data: Any, rank: int, digits: int) -> None:
    prefix = "/".join(segs)
    up = data.draw(st.integers(1, len(segs)))
    place = spread.Placement(prefix, rank, up, digits)
    for name in (place.blob_name(OLD, 3), place.index_name(OLD)):
        key = place.key(name)
        root = "/".join(segs[: len(segs) - up])
        assert key.startswith((root + "/" if root else "") + spread.MARK + spread.spread_bucket(rank, digits) + "/")
        parsed = spread.parse_key(key)
        assert parsed == spread.SpreadKey(prefix, name, place.bucket, up)
        assert spread.is_spread_name(name, OLD)


def test_spread_root_must_be_a_plain_ancestor() -> None:
    assert spread.up_for("run1/step-100", None) == 1
    assert spread.up_for("run1/step-100", "") == 2
    assert spread.up_for("team/run1/step-100", "team") == 2
    for bad_prefix, root in [("", None), ("run1/.spread-3a/x", None), ("run1/step", "run1/step"),
                             ("run1/step", "run2"), ("run1/step", "run1/step/deeper")]:
        with pytest.raises(ValueError):
            spread.up_for(bad_prefix, root)
    # a key that only looks spread (default names, marks in the wrong place) has no spread owner
    for key in ["run/.spread-3a/ck/blobs/A/r00000-0000.bin", "run/.spread-3a/spread/A/r00000-0000.bin",
                "run/.spread-3g/ck/spread/A/r00000-0000.bin", "run/.spread-3a/ck/spread/A/manifest.json",
                "run/.spread-3a/x/.spread-00/ck/spread/A/r0-0.bin", "run/.spread-3a/../spread/A/r0-0.bin"]:
        assert spread.parse_key(key) is None, key


# ----------------------------------------------------------------------------- real saves


def _state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(300, 40, generator=g), "b": torch.randn(7, generator=g).to(torch.bfloat16),
            "step": seed}


@pytest.fixture(params=["local", "s3"])
def run_root(request: pytest.FixtureRequest, tmp_path: pathlib.Path) -> tuple[str, dict[str, Any]]:
    """The URI of a run directory (checkpoints go under it) and storage options."""
    if request.param == "local":
        return str(tmp_path / "run"), {}
    bucket, opts = request.getfixturevalue("moto_s3")
    return f"s3://{bucket}/run", opts


def _keys(uri: str, opts: dict[str, Any], under: str = "") -> list[str]:
    store, prefix = open_store(uri, opts)
    base = prefix if not under else under
    return sorted(o.key for o in _runtime.run(store.list(base)))


def _put(uri: str, opts: dict[str, Any], key: str, data: bytes = b"x") -> None:
    store, _ = open_store(uri, opts)
    _runtime.run(store.put(key, data))


def test_spread_round_trip_and_where_objects_live(run_root: tuple[str, dict[str, Any]]) -> None:
    root, opts = run_root
    uri = f"{root}/step-1"
    state = _state(1)
    res = objckpt.save(state, uri, storage_options=opts, key_layout="spread", blob_size=8 << 10, part_size=8 << 10)
    assert res.files == ()  # spread outside the checkpoint: not named as its files
    assert_same(objckpt.read(uri, storage_options=opts), state)
    tmpl = {"w": torch.zeros(300, 40), "b": torch.zeros(7, dtype=torch.bfloat16), "step": 0}
    objckpt.load(tmpl, uri, storage_options=opts)
    assert_same(tmpl, state)
    m = objckpt.inspect(uri, storage_options=opts)
    assert m.format_version == _expected_version(m, 4) and m.spread_up == 1 and len(m.blobs) > 1
    assert all(b.spread == "00" and b.name.startswith(f"spread/{m.attempt}/") for b in m.blobs)
    _, prefix = open_store(uri, opts)
    run_prefix = prefix.rsplit("/", 1)[0]
    # every blob under <run>/.spread-00/step-1/..., nothing but the manifest under the checkpoint prefix
    assert _keys(uri, opts, prefix + "/") == [f"{prefix}/manifest.json"]
    want = sorted(f"{run_prefix}/.spread-00/step-1/{b.name}" for b in m.blobs)
    assert _keys(uri, opts, f"{run_prefix}/.spread-") == want
    # the default layout is unchanged: v3, blobs under the prefix, no spread fields in the JSON
    plain = objckpt.save(state, f"{root}/plain", storage_options=opts)
    assert plain.files and list(plain.files) == [b.name for b in objckpt.inspect(f"{root}/plain",
                                                                                storage_options=opts).blobs]
    plain_m = objckpt.inspect(f"{root}/plain", storage_options=opts)
    raw = json.loads(mf.reseal(json.dumps(mf.to_json_obj(plain_m)).encode()))
    assert raw["format_version"] == _expected_version(plain_m, 3) and "spread_up" not in raw and all("spread" not in b for b in raw["blobs"])


def test_older_reader_refuses_a_spread_checkpoint(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    uri = str(tmp_path / "run" / "ck")
    objckpt.save(_state(2), uri, key_layout="spread")
    monkeypatch.setattr(mf, "MAX_VERSION", 3)  # what the previous release knows
    with pytest.raises(UnsupportedFormatError, match="format_version [45].*versions 1 to 3"):
        objckpt.read(uri)


def test_bad_spread_options_fail_before_writing(tmp_path: pathlib.Path) -> None:
    for kw, msg in [({"spread_root": str(tmp_path / "elsewhere")}, "ancestor"),
                    ({"spread_digits": 5}, "spread_digits"), ({"key_layout": "hashed"}, "key_layout"),
                    ({"spread_root": "s3://bucket/run"}, "same store")]:
        with pytest.raises(ValueError, match=msg):
            objckpt.save(_state(1), str(tmp_path / "run" / "ck"), key_layout=kw.pop("key_layout", "spread"), **kw)
    assert not (tmp_path / "run").exists()


def save_and_load_spread(rank: int, world: int, uri: str, opts: dict[str, Any], root: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    full = torch.arange(64 * 24, dtype=torch.float32).reshape(64, 24)
    state = {"w": distribute_tensor(full, mesh, [Shard(0)]), "rep": torch.ones(5, 3) * 7, "step": 9}
    try:  # ranks that disagree on where objects go: refused on every rank before anything is written
        objckpt.save(state, uri + "-mixed", storage_options=opts, key_layout="spread" if rank else "default")
        mixed: Any = "saved"
    except ValueError as e:
        mixed = "different key_layout or spread_root" in str(e)
    objckpt.save(state, uri, storage_options=opts, key_layout="spread", spread_root=root)
    tmpl = {"w": distribute_tensor(torch.zeros(64, 24), mesh, [Shard(1)]), "rep": torch.zeros(5, 3), "step": 0}
    objckpt.load(tmpl, uri, storage_options=opts)
    return {"w": torch.equal(tmpl["w"].full_tensor(), full), "rep": torch.equal(tmpl["rep"], state["rep"]),
            "step": tmpl["step"], "mixed_refused": mixed}


def test_two_ranks_spread_v2_manifest_on_s3(moto_s3: Any) -> None:
    bucket, opts = moto_s3
    uri = f"s3://{bucket}/team/run/step-5"
    out = run_multiprocess(2, save_and_load_spread, uri, opts, f"s3://{bucket}")  # root: the bucket itself
    assert out == [{"w": True, "rep": True, "step": 9, "mixed_refused": True}] * 2
    m = objckpt.inspect(uri, storage_options=opts, chunks=False)
    assert m.format_version == _expected_version(m, 4) and m.spread_up == 3 and m.world_size == 2 and m.meshes
    assert [r.spread for r in m.rank_indexes] == ["00", "80"]
    assert {(b.rank, b.spread) for b in m.blobs} == {(0, "00"), (1, "80")}
    keys = _keys(uri, opts, ".spread-")  # at the bucket root, one bucket per rank
    assert keys == sorted(m.object_keys("team/run/step-5"))
    assert {k.split("/")[0] for k in keys} == {".spread-00", ".spread-80"}
    full = torch.arange(64 * 24, dtype=torch.float32).reshape(64, 24)
    assert torch.equal(objckpt.read(uri, ["w"], storage_options=opts)["w"], full)
    # gc of the checkpoint prefix finds leftovers at the root its manifest records (3 levels up)
    stale = f".spread-80/team/run/step-5/spread/{OLD}/r00001.index.json"
    _put(uri, opts, stale)
    store, _ = open_store(uri, opts)
    r = _runtime.run(collect_garbage(store, "team/run/step-5", now=4e9))
    assert r.deleted == [stale] and r.checkpoints == 1
    assert _keys(uri, opts, ".spread-") == keys


# ----------------------------------------------------------------------------- gc, delete, overwrite


def test_gc_delete_and_overwrite_touch_only_their_own_spread_objects(run_root: tuple[str, dict[str, Any]]) -> None:
    root, opts = run_root
    a, b, c = f"{root}/a", f"{root}/b", f"{root}/c"
    objckpt.save(_state(1), a, storage_options=opts, key_layout="spread")
    objckpt.save(_state(2), b, storage_options=opts, key_layout="spread")
    objckpt.save(_state(3), c, storage_options=opts)  # default layout beside them
    store, run_prefix = open_store(root, opts)
    stale_a = f"{run_prefix}/.spread-80/a/spread/{OLD}/r00001-0000.bin"  # a killed save's leftover of a
    orphan_d = f"{run_prefix}/.spread-00/d/spread/{OLD}/r00000.index.json"  # a checkpoint that never committed
    for key in (stale_a, orphan_d):
        _put(root, opts, key)
    b_keys = objckpt.inspect(b, storage_options=opts).object_keys(f"{run_prefix}/b")

    # gc of one checkpoint finds its spread leftovers in the parent's spread area, and nothing else
    r = _runtime.run(collect_garbage(store, f"{run_prefix}/a", now=4e9))
    assert r.deleted == [stale_a] and r.checkpoints == 1
    # gc of the run: the orphan goes, every committed object stays
    r = _runtime.run(collect_garbage(store, run_prefix, now=4e9))
    assert r.deleted == [orphan_d] and r.checkpoints == 3
    # gc run inside a spread area cannot read the owners' manifests: it leaves their objects alone
    r = _runtime.run(collect_garbage(store, f"{run_prefix}/.spread-00", now=4e9))
    assert r.deleted == [] and r.checkpoints == 0

    # overwrite: a's old spread objects go, the new ones and b's stay
    old_a = objckpt.inspect(a, storage_options=opts).object_keys(f"{run_prefix}/a")
    objckpt.save(_state(4), a, storage_options=opts, key_layout="spread", overwrite=True)
    new_a = objckpt.inspect(a, storage_options=opts).object_keys(f"{run_prefix}/a")
    left = set(_keys(root, opts, run_prefix + "/"))
    assert not set(old_a) & left and set(new_a) <= left and set(b_keys) <= left

    # delete a: its manifest and spread objects; b and c read as before
    rep = objckpt.delete(a, storage_options=opts)
    assert sorted(rep.deleted) == sorted(new_a)
    left = set(_keys(root, opts, run_prefix + "/"))
    assert not any("/a/" in k or k.endswith("/a/manifest.json") for k in left)
    assert set(b_keys) <= left
    assert_same(objckpt.read(b, storage_options=opts), _state(2))
    assert_same(objckpt.read(c, storage_options=opts), _state(3))


def _hostile(tmp_path: pathlib.Path, edit: Any) -> tuple[str, str]:
    """A spread checkpoint at run/evil whose manifest ``edit`` changed (resealed)."""
    uri = str(tmp_path / "run" / "evil")
    objckpt.save(_state(5), uri, key_layout="spread")
    path = tmp_path / "run" / "evil" / "manifest.json"
    obj = json.loads(path.read_text())
    edit(obj)
    path.write_bytes(mf.reseal(json.dumps(obj).encode()))
    return uri, str(tmp_path / "run")


@pytest.mark.parametrize("what, edit", [
    ("up above the root", lambda o: o.update(spread_up=40)),
    ("another checkpoint's object", lambda o: _blob0(o, name="spread/" + OLD + "/r00000-0000.bin")),
    ("dotdot", lambda o: _blob0(o, name="spread/../../victim/r00000-0000.bin")),
    ("bucket with a path", lambda o: _blob0(o, spread="00/../../victim")),
    ("blobs name in a bucket", lambda o: _blob0(o, name="blobs/" + o["attempt"] + "/r00000-0000.bin")),
    ("manifest name", lambda o: _blob0(o, name="spread/" + o["attempt"] + "/manifest.json")),
    ("no spread_up", lambda o: o.pop("spread_up")),
    ("spread in v3", lambda o: o.update(format_version=3)),
])
def test_hostile_spread_manifest_is_corrupt_and_touches_nothing(tmp_path: pathlib.Path, what: str,
                                                                edit: Any) -> None:
    victim = str(tmp_path / "run" / "victim")
    objckpt.save(_state(6), victim, key_layout="spread")
    uri, root = _hostile(tmp_path, edit)
    # objects a hostile manifest might aim at: the victim's, a stale attempt of its own, the bucket root
    store, run_prefix = open_store(root)
    decoy = f"{run_prefix}/.spread-00/evil/spread/{OLD}/r00000-0000.bin"
    _put(root, {}, decoy)
    before = _keys(root, {}, run_prefix + "/")
    with pytest.raises(CorruptCheckpointError):
        objckpt.read(uri)
    with pytest.raises(CorruptCheckpointError):
        objckpt.inspect(uri)
    r = _runtime.run(collect_garbage(store, run_prefix, now=4e9))
    assert r.unreadable == [f"{run_prefix}/evil/manifest.json"] and r.deleted == [], what
    rep = objckpt.delete(uri)
    assert rep.manifest_unreadable and rep.deleted == [], what
    assert _keys(root, {}, run_prefix + "/") == [k for k in before if not k.endswith("evil/manifest.json")]
    assert_same(objckpt.read(victim), _state(6))


def test_schema_accepts_spread_manifests_and_refuses_bad_spread_fields(tmp_path: pathlib.Path) -> None:
    import jsonschema

    validator = jsonschema.Draft202012Validator(json.loads(
        (pathlib.Path(mf.__file__).with_name("manifest.schema.json")).read_text()))
    uri = str(tmp_path / "run" / "ck")
    objckpt.save(_state(7), uri, key_layout="spread")
    good = json.loads((tmp_path / "run" / "ck" / "manifest.json").read_text())
    assert not list(validator.iter_errors(good))
    attempt = good["attempt"]
    for edit in [lambda o: _blob0(o, spread="zz"),
                 lambda o: _blob0(o, name="spread/../r00000-0000.bin"),
                 lambda o: _blob0(o, name=f"spread/{attempt}/manifest.json"),
                 lambda o: o.update(format_version=3),
                 lambda o: o.update(spread_up=0)]:
        bad = json.loads(json.dumps(good))
        edit(bad)
        assert list(validator.iter_errors(bad)), bad["blobs"]


def test_overwrite_between_layouts_and_async_spread_save(tmp_path: pathlib.Path) -> None:
    """Overwrite cleanup removes the replaced attempt's objects whichever layout either side used."""
    uri = str(tmp_path / "run" / "ck")
    objckpt.save(_state(1), uri)  # default
    objckpt.async_save(_state(2), uri, key_layout="spread", overwrite=True).result(timeout=120)
    spread_files = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file())
    m = objckpt.inspect(uri)
    assert m.format_version == _expected_version(m, 4)  # and the old blobs/ are gone: the listing holds only these
    assert spread_files == sorted(["run/ck/manifest.json"] + [f"run/.spread-00/ck/{b.name}" for b in m.blobs])
    assert_same(objckpt.read(uri), _state(2))
    objckpt.save(_state(3), uri, overwrite=True)  # back to the default layout
    assert not any(p.is_file() for p in (tmp_path / "run" / ".spread-00").rglob("*"))
    assert objckpt.inspect(uri).format_version == _expected_version(objckpt.inspect(uri), 3)
    assert_same(objckpt.read(uri), _state(3))
