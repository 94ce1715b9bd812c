"""objckpt.dcp: DCP's save/async_save/load through objckpt's StorageWriter/StorageReader.

Real DCP, real gloo processes, real moto S3 over HTTP.  A checkpoint written by
``dcp.save`` at world 2 (DTensors sharded two ways, a replicated DTensor, a plain
tensor, plain values) is read back by ``dcp.load`` at world 3 into a different
layout, by ``objckpt.load`` at world 3, and by ``objckpt.read`` in one process;
``dcp.load`` also reads what ``objckpt.save`` wrote (one rank, as a format v1 manifest;
two ranks, as a format v2 manifest with layouts and rank indexes); and ``objckpt export``
of a two-rank sharded Llama loads with ``from_pretrained``.
"""
from __future__ import annotations

import datetime
import json
import warnings
from typing import Any

import pytest
import torch

import objckpt
from conftest import assert_same
from mp import run_multiprocess

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _full() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {
        "row": torch.randn(10, 6, generator=g),
        "col": torch.randn(5, 7, generator=g).to(torch.bfloat16),
        "rep": torch.arange(4, dtype=torch.int64) * 3,
        "plain": torch.randn(6, generator=g, dtype=torch.float64),
    }


VALUES = {"step": 11, "sched": {"lr": 0.5, "milestones": [1, 2]}, "odd": ("tuple", 3)}


def _state(mesh: Any, placements: dict[str, Any]) -> dict[str, Any]:
    from torch.distributed.tensor import distribute_tensor

    full = _full()
    model = {k: distribute_tensor(full[k], mesh, [placements[k]]) for k in ("row", "col", "rep")}
    model["plain"] = full["plain"]
    return {"model": model, **{k: (dict(v) if isinstance(v, dict) else v) for k, v in VALUES.items()}}


def _save_world2(rank: int, world: int, uris: dict[str, str], opts: dict[str, Any],
                 llama: dict[str, torch.Tensor]) -> bool:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard

    from objckpt.dcp import StorageWriter

    mesh = init_device_mesh("cpu", (world,))
    sd = _state(mesh, {"row": Shard(0), "col": Shard(1), "rep": Replicate()})
    dcp.save(sd, storage_writer=StorageWriter(uris["dcp"], storage_options=opts))
    fut = dcp.async_save(sd, storage_writer=StorageWriter(storage_options=opts), checkpoint_id=uris["async"])
    fut.result()
    objckpt.save(sd, uris["objckpt2"], storage_options=opts)
    # a sharded training state for test_convert_export's HF export (saved here: one spawn less)
    from torch.distributed.tensor import distribute_tensor

    objckpt.save({"model": {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in llama.items()}, "step": 1},
                 uris["llama"], storage_options=opts)
    # a second save to the same URI is refused on every rank, before anything is uploaded
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        dcp.save(sd, storage_writer=StorageWriter(uris["dcp"], storage_options=opts))
    except CheckpointException as e:
        assert "already exists" in str(e), str(e)
    else:
        raise AssertionError("a second dcp.save to the same URI did not fail")
    return True


def _check_loaded(sd: dict[str, Any], where: str) -> None:
    full = _full()
    for k, t in sd["model"].items():
        got = t.full_tensor() if hasattr(t, "full_tensor") else t
        assert got.dtype == full[k].dtype and torch.equal(got, full[k]), (where, k)
    for k, v in VALUES.items():
        assert sd[k] == v and type(sd[k]) is type(v), (where, k, sd[k])


def _load_world3(rank: int, world: int, uris: dict[str, str], opts: dict[str, Any]) -> bool:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    from objckpt.dcp import StorageReader

    mesh = init_device_mesh("cpu", (world,))
    for name in ("dcp", "async", "objckpt2"):
        sd = _state(mesh, {"row": Shard(1), "col": Shard(0), "rep": Shard(0)})
        for t in sd["model"].values():
            (t.to_local() if hasattr(t, "to_local") else t).zero_()
        sd.update(step=0, sched={"lr": 0.0, "milestones": []}, odd=None)
        dcp.load(sd, storage_reader=StorageReader(uris[name], storage_options=opts))
        _check_loaded(sd, name)
    # objckpt.load reads what the DCP writer wrote, resharded to this world
    sd = _state(mesh, {"row": Shard(0), "col": Shard(1), "rep": Shard(0)})
    for t in sd["model"].values():
        (t.to_local() if hasattr(t, "to_local") else t).zero_()
    sd.update(step=0, sched=None, odd=None)
    objckpt.load(sd, uris["dcp"], storage_options=opts)
    _check_loaded(sd, "objckpt.load")
    return True


def _rewrite_as(uri: str, opts: dict[str, Any], version: int) -> None:
    """Turn a committed manifest into an older (unsealed) format version, as older objckpt wrote it."""
    from objckpt.runtime import loop as _runtime
    from objckpt.storage import open_store

    st, prefix = open_store(uri, opts)
    key = f"{prefix}/manifest.json"
    obj = json.loads(_runtime.run(st.get(key)))
    obj.pop("crc32c")
    obj["format_version"] = version
    m = objckpt.inspect(uri, storage_options=opts, chunks=False)  # v5's packed columns, as lists again
    obj["blobs"] = [{"name": b.name, "size": b.size, "rank": b.rank} for b in m.blobs]
    if "rank_indexes" in obj:
        obj["rank_indexes"] = [{"name": r.name, "size": r.size, "crc32c": r.crc32c} for r in m.rank_indexes]
    for k, t in obj["tensors"].items():
        for c, parsed in zip(t.get("chunks", []), m.tensors[k].chunks):
            if c.get("block_crc32c"):
                c["block_crc32c"] = list(parsed.block_crc32c)
    _runtime.run(st.put(key, json.dumps(obj).encode()))
    assert objckpt.inspect(uri, storage_options=opts, chunks=False).format_version == version


def test_dcp_save_world2_load_world3_and_objckpt_read(moto_s3: tuple[str, dict[str, Any]], tmp_path: Any) -> None:
    from test_convert_export import _check_hf_dir, _tiny_llama

    bucket, opts = moto_s3
    uris = {n: f"s3://{bucket}/run/{n}" for n in ("dcp", "async", "objckpt2", "llama")}
    model = _tiny_llama()
    llama = {k: v.detach().clone() for k, v in model.state_dict().items()}
    assert run_multiprocess(2, _save_world2, uris, opts, llama) == [True, True]
    _rewrite_as(uris["objckpt2"], opts, 2)  # the reader on a format v2 manifest (layouts + rank indexes)
    assert run_multiprocess(3, _load_world3, uris, opts) == [True, True, True]
    expected = {"model": _full(), **VALUES}
    for name in ("dcp", "async"):
        got = objckpt.read(uris[name], storage_options=opts)
        assert_same(expected, got)
        m = objckpt.inspect(uris[name], storage_options=opts)
        assert m.world_size == 2 and {b.rank for b in m.blobs} == {0, 1}  # each rank wrote its own blobs
        assert m.metadata["objckpt.dcp"] == {"torch_save": []}
    assert objckpt.inspect(uris["objckpt2"], storage_options=opts, chunks=False).rank_indexes  # a v2-style layout
    # objckpt export from the 2-rank DTensor-sharded checkpoint: from_pretrained gets the same model
    from objckpt.cli import main as cli

    assert objckpt.inspect(uris["llama"], storage_options=opts, chunks=False).world_size == 2
    out = tmp_path / "hf"
    assert cli(["export", uris["llama"], str(out), "--prefix", "model.", "--endpoint-url", opts["endpoint_url"]]) == 0
    _check_hf_dir(out, model)


class _Opaque:
    """Not plain data: DCP stores it as torch.save bytes, and so do we."""

    def __init__(self, x: int) -> None:
        self.x = x

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Opaque) and other.x == self.x


def test_single_process_values_and_objckpt_save_checkpoint(moto_s3: tuple[str, dict[str, Any]]) -> None:
    import torch.distributed.checkpoint as dcp

    from objckpt.dcp import StorageReader, StorageWriter

    bucket, opts = moto_s3
    uri = f"s3://{bucket}/one/ck"
    day = datetime.date(2026, 11, 24)
    sd = {"w": torch.randn(300, 5), "e": torch.empty(0, 3), "s": torch.tensor(2.5), "when": day,
          "obj": _Opaque(4), "nested": {"a": [torch.ones(2), "x"]}}
    dcp.save(sd, storage_writer=StorageWriter(uri, storage_options=opts, part_size=1024), no_dist=True)
    got = objckpt.read(uri, storage_options=opts)
    assert torch.equal(got["w"], sd["w"]) and got["e"].shape == (0, 3) and got["s"].item() == 2.5
    assert torch.equal(got["nested"]["a"][0], torch.ones(2)) and got["nested"]["a"][1] == "x"
    m = objckpt.inspect(uri, storage_options=opts)
    assert sorted(m.metadata["objckpt.dcp"]["torch_save"]) == ["obj", "when"]
    assert isinstance(got["when"], bytes) and isinstance(got["obj"], bytes)  # said so in the metadata
    assert len(m.tensors["w"].chunks) > 1  # cut into part-size chunks, each with its crc32c
    tmpl = {"w": torch.zeros(300, 5), "e": torch.empty(0, 3), "s": torch.tensor(0.0), "when": None, "obj": None,
            "nested": {"a": [torch.zeros(2), ""]}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(tmpl, storage_reader=StorageReader(uri, storage_options=opts), no_dist=True)
    assert torch.equal(tmpl["w"], sd["w"]) and tmpl["s"].item() == 2.5
    assert tmpl["when"] == day and tmpl["obj"] == _Opaque(4) and tmpl["nested"]["a"][1] == "x"

    # the reader on a one-process objckpt.save checkpoint (format v1 chunks), a narrow read
    src = uri + "-saved"
    state = {"model": {"w": torch.randn(64, 8), "tied": None}, "step": 3, "hp": [0.9, 0.99]}
    state["model"]["tied"] = state["model"]["w"]
    objckpt.save(state, src, storage_options=opts, part_size=256)
    _rewrite_as(src, opts, 1)  # the reader on a format v1 manifest (inline chunks, unsealed)
    tmpl2 = {"model": {"w": torch.zeros(64, 8), "tied": torch.zeros(64, 8)}, "step": 0, "hp": None}
    reader = StorageReader(src, storage_options=opts)
    dcp.load(tmpl2, storage_reader=reader, no_dist=True)
    assert torch.equal(tmpl2["model"]["w"], state["model"]["w"]) and torch.equal(tmpl2["model"]["tied"],
                                                                                 state["model"]["w"])
    assert tmpl2["step"] == 3 and tmpl2["hp"] == [0.9, 0.99]
    pickled = uri + "-pickled"  # a value objckpt.save pickled: refused unless the reader opts in
    objckpt.save({"w": torch.ones(3), "obj": _Opaque(9)}, pickled, storage_options=opts, allow_pickle=True)
    from torch.distributed.checkpoint.api import CheckpointException

    with pytest.raises(CheckpointException, match="allow_pickle=True"):
        dcp.load({"w": torch.zeros(3), "obj": None}, storage_reader=StorageReader(pickled, storage_options=opts),
                 no_dist=True)
    tmpl3: dict[str, Any] = {"w": torch.zeros(3), "obj": None}
    dcp.load(tmpl3, storage_reader=StorageReader(pickled, storage_options=opts, allow_pickle=True), no_dist=True)
    assert tmpl3["obj"] == _Opaque(9) and torch.equal(tmpl3["w"], torch.ones(3))
    before = reader._ckpt.stats.bytes  # type: ignore[union-attr]
    part = {"model": {"w": torch.zeros(64, 8)}}
    reader2 = StorageReader(src, storage_options=opts)
    from torch.distributed.checkpoint import DefaultLoadPlanner

    dcp.load(part, storage_reader=reader2, planner=DefaultLoadPlanner(allow_partial_load=True), no_dist=True)
    assert torch.equal(part["model"]["w"], state["model"]["w"])
    assert before > 0 and reader2._ckpt is not None


def test_bad_uris_give_clear_errors(tmp_path: Any) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from objckpt.dcp import StorageReader, StorageWriter

    with pytest.raises(CheckpointException, match="no checkpoint at"):
        dcp.load({"w": torch.zeros(2)}, storage_reader=StorageReader(str(tmp_path / "missing")), no_dist=True)
    with pytest.raises(CheckpointException, match="has no URI"):
        dcp.save({"w": torch.zeros(2)}, storage_writer=StorageWriter(), no_dist=True)
    assert StorageWriter.validate_checkpoint_id("s3://b/x") and StorageReader.validate_checkpoint_id("/a/b")
    assert not StorageWriter.validate_checkpoint_id("gopher://x") and not StorageReader.validate_checkpoint_id("")
    assert not list(tmp_path.iterdir())  # nothing was written anywhere


def test_failed_saves_commit_nothing_and_clean_up(tmp_path: Any) -> None:
    """A blob upload that fails, or a manifest write that fails, leaves no checkpoint and no blobs."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from objckpt.runtime import loop as _runtime
    from objckpt.dcp import StorageWriter
    from objckpt.integrations.stream_write import SourceTensor, WriteOptions, write_checkpoint
    from objckpt.storage import open_store
    from objckpt.testing.stores import FaultyStore

    state = {f"t{i}": torch.full((64, 4), float(i)) for i in range(5)}
    for n, (op, nth) in enumerate((("write_part", 3), ("put", 1))):
        uri = str(tmp_path / f"ck{n}")
        st, prefix = open_store(uri)
        faulty = FaultyStore(st, op, nth)
        with pytest.raises(CheckpointException, match="injected fault|committing"):
            dcp.save(state, storage_writer=StorageWriter(uri, store=faulty, blob_size=1), no_dist=True)
        assert faulty.seen[op] >= nth  # the fault did fire, after some blobs were complete
        assert _runtime.run(st.list(prefix + "/")) == []
        with pytest.raises(objckpt.NotFoundError):
            objckpt.inspect(uri)
    # the converters' streaming writer alike
    uri = str(tmp_path / "ck-stream")
    st, prefix = open_store(uri)
    srcs = [SourceTensor(k, v.dtype, tuple(v.shape)) for k, v in state.items()]
    tree = {k: {"$tensor": k} for k in state}
    with pytest.raises(ConnectionError, match="injected fault"):
        write_checkpoint(uri, srcs, state.__getitem__, tree, store=FaultyStore(st, "write_part", 3),
                         opts=WriteOptions(blob_size=1))
    assert _runtime.run(st.list(prefix + "/")) == []
    write_checkpoint(uri, srcs, state.__getitem__, tree, store=st, opts=WriteOptions(blob_size=1))
    assert_same(state, objckpt.read(uri))
