"""One format, three writers: objckpt.save, DCP's ``dcp.save`` with objckpt's StorageWriter,
and the streamed writer behind ``convert`` (here from a torch.save file).

The same state is written by each, on moto S3; each checkpoint is then read by
``objckpt.read``, by ``objckpt.load`` into a template, by ``dcp.load`` through objckpt's
StorageReader, and exported back to a DCP directory that DCP's own FileSystemReader loads.
The manifests are compared field by field: blob names differ by attempt (and
``objckpt.save`` packs its tensors in another order, so blob offsets differ from the
other two), but every entry, chunk box, length, dtype, crc32c and block crc, the tree,
the crc block, the format version and the writer's name must be the same.  The DCP
and the streamed writer pack in the same order, so their blobs match byte for byte.
"""
from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

import objckpt
from conftest import assert_same
from objckpt.format.manifest import Manifest

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(24)
    return {
        "model": {
            "w": torch.randn(300, 5, generator=g),  # cut into many part-size chunks
            "b": torch.randn(7, generator=g).to(torch.bfloat16),
            "e": torch.empty(0, 3),
            "s": torch.tensor(2.5),
            "i": torch.arange(12, dtype=torch.int64).reshape(3, 4),
            "h": torch.randn(2, 3, 4, generator=g, dtype=torch.float64),
        },
        "step": 11,
        "sched": {"lr": 0.5, "milestones": [1, 2], "name": "cosine"},
    }


def _template() -> dict[str, Any]:
    s = _state()
    return {"model": {k: torch.zeros_like(v) for k, v in s["model"].items()}, "step": 0,
            "sched": {"lr": 0.0, "milestones": [], "name": ""}}


def _write_each(bucket: str, opts: dict[str, Any], tmp_path: Any, state: dict[str, Any]) -> dict[str, str]:
    """The same state written by each writer; returns writer name -> URI."""
    import torch.distributed.checkpoint as dcp

    from objckpt.dcp import StorageWriter
    from objckpt.integrations.convert import convert
    from objckpt.integrations.stream_write import WriteOptions

    uris = {w: f"s3://{bucket}/one-writer/{w}" for w in ("save", "dcp", "stream")}
    sizes = {"part_size": 1024, "blob_size": 4096}  # several blobs and several chunks per tensor
    objckpt.save(state, uris["save"], storage_options=opts, **sizes)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, storage_writer=StorageWriter(uris["dcp"], storage_options=opts, **sizes), no_dist=True)
    src = tmp_path / "state.pt"
    torch.save(state, src)
    convert(str(src), uris["stream"], dst_storage_options=opts, opts=WriteOptions(**sizes))
    return uris


def _chunks(m: Manifest, with_blobs: bool) -> dict[str, Any]:
    out = {}
    for k, e in m.tensors.items():
        cs = [(c.offsets, c.shape, c.length, c.crc32c, c.block_crc32c)
              + ((m.blobs[c.blob].size, c.offset) if with_blobs else ()) for c in e.chunks]
        out[k] = (e.dtype, e.shape, e.alias_of, e.layout, cs)
    return out


def _common(m: Manifest) -> tuple[Any, ...]:
    return (m.format_version, m.writer, m.world_size, m.crc_block, m.tree, m.rank_trees, m.meshes,
            m.rank_indexes, m.spread_up)


def test_three_writers_write_the_same_checkpoint(moto_s3: tuple[str, dict[str, Any]], tmp_path: Any) -> None:
    bucket, opts = moto_s3
    state = _state()
    uris = _write_each(bucket, opts, tmp_path, state)
    ms = {w: objckpt.inspect(u, storage_options=opts) for w, u in uris.items()}

    # field by field: what each writer records of the same state is the same
    assert len({m.attempt for m in ms.values()}) == 3  # three attempts, so three sets of blob names
    for w, m in ms.items():
        assert all(b.name.startswith(f"blobs/{m.attempt}/") and b.rank == 0 for b in m.blobs), w
        assert len(m.tensors["model.w"].chunks) > 1 and len(m.blobs) > 1, w
    assert _common(ms["dcp"]) == _common(ms["save"]) == _common(ms["stream"])
    assert _chunks(ms["dcp"], False) == _chunks(ms["save"], False) == _chunks(ms["stream"], False)
    assert _chunks(ms["dcp"], True) == _chunks(ms["stream"], True)  # the same packing order
    assert [b.size for b in ms["dcp"].blobs] == [b.size for b in ms["stream"].blobs]
    # metadata: only what each writer says of itself
    assert ms["save"].metadata == {}
    assert ms["dcp"].metadata == {"objckpt.dcp": {"torch_save": []}}
    assert ms["stream"].metadata == {"converted_from": {"format": "torch"}}


@pytest.mark.parametrize("writer", ["save", "dcp", "stream"])
def test_each_writer_reads_with_every_reader(writer: str, moto_s3: tuple[str, dict[str, Any]],
                                             tmp_path: Any) -> None:
    import torch.distributed.checkpoint as dcp

    from objckpt.dcp import StorageReader
    from objckpt.integrations.convert import convert

    bucket, opts = moto_s3
    state = _state()
    uri = _write_each(bucket, opts, tmp_path, state)[writer]

    assert_same(state, objckpt.read(uri, storage_options=opts))
    tmpl = _template()
    objckpt.load(tmpl, uri, storage_options=opts)
    assert_same(state, tmpl)
    narrow = {"model": {"w": torch.zeros(300, 5)}}  # a partial load reads only its ranges
    objckpt.load(narrow, uri, storage_options=opts, strict=False)
    assert torch.equal(narrow["model"]["w"], state["model"]["w"])

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tmpl = _template()
        dcp.load(tmpl, storage_reader=StorageReader(uri, storage_options=opts), no_dist=True)
        assert_same(state, tmpl)
        out = tmp_path / "as-dcp"  # objckpt -> a DCP directory, read by DCP's own reader
        convert(uri, str(out), storage_options=opts)
        tmpl = _template()
        dcp.load(tmpl, storage_reader=dcp.FileSystemReader(str(out)), no_dist=True)
        assert_same(state, tmpl)


def _calls_and_imports(path: Any) -> tuple[set[str], set[str]]:
    """Names called (``Manifest(...)``) and modules imported (package-relative) by one module."""
    import ast

    tree = ast.parse(path.read_text())
    calls = {n.func.id if isinstance(n.func, ast.Name) else n.func.attr for n in ast.walk(tree)
             if isinstance(n, ast.Call) and isinstance(n.func, (ast.Name, ast.Attribute))}
    mods = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.ImportFrom) and n.module:
            mods.add(n.module.lstrip(".") if n.level else n.module.removeprefix("objckpt."))
    return calls, mods


def test_only_save_and_layout_build_chunks_and_manifests() -> None:
    """One writer: the manifest is built in layout/ only, chunk records in save/records.py
    only, and the DCP plugin and the streamed writer reach save/ through its source
    interface (save.source), never its commit, upload or the layouts' internals."""
    import pathlib

    root = pathlib.Path(objckpt.__file__).parent
    builders = {"Manifest", "TensorEntry", "Chunk", "ChunkRecord"}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        calls, mods = _calls_and_imports(path)
        if not rel.startswith(("layout/", "format/")) and rel != "save/records.py":
            assert not calls & builders, f"{rel} builds {sorted(calls & builders)}: only layout/ and save/ may"
        if rel.startswith("integrations/"):
            inner = {m for m in mods if m.startswith(("save.", "layout."))}
            assert inner <= {"save.source", "save.background"}, f"{rel} imports save/layout internals {inner}"


def test_streamed_writer_refuses_what_would_not_tile(tmp_path: Any) -> None:
    """A source naming a tensor twice, or handing over another shape than it announced,
    commits nothing and leaves nothing (the first used to commit overlapping chunks)."""
    from objckpt.runtime import loop as _runtime
    from objckpt.integrations.stream_write import SourceTensor, write_checkpoint
    from objckpt.storage import open_store

    uri = str(tmp_path / "ck")
    st, prefix = open_store(uri)
    t = torch.arange(6.0)
    with pytest.raises(objckpt.errors.UnsupportedValueError, match="'w'.* more than once"):
        write_checkpoint(uri, [SourceTensor("w", t.dtype, (6,))] * 2, lambda k: t, {"w": {"$tensor": "w"}})
    with pytest.raises(objckpt.errors.UnsupportedFormatError, match="'w' is torch.float32 \\[6\\].*announced"):
        write_checkpoint(uri, [SourceTensor("w", t.dtype, (2, 3))], lambda k: t, {"w": {"$tensor": "w"}})
    assert _runtime.run(st.list(prefix + "/")) == []


def _save_both_world2(rank: int, world: int, uris: dict[str, str], opts: dict[str, Any]) -> bool:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from objckpt.dcp import StorageWriter

    mesh = init_device_mesh("cpu", (world,))
    full = _world2_full()
    state = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in full.items() if k != "plain"}
    state["plain"] = full["plain"]
    dcp.save(state, storage_writer=StorageWriter(uris["dcp"], storage_options=opts, part_size=1024))
    objckpt.save(state, uris["save"], storage_options=opts, part_size=1024)
    return True


def _world2_full() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    return {"w": torch.randn(300, 5, generator=g), "one": torch.randn(1, 4, generator=g),  # rank 1 holds none of it
            "e": torch.empty(0, 3), "plain": torch.arange(10, dtype=torch.int32)}


def test_two_ranks_dcp_and_save_store_the_same_chunks(moto_s3: tuple[str, dict[str, Any]]) -> None:
    """At two ranks (DTensors sharded on dim 0, one with an empty shard on rank 1, an empty
    tensor, a replicated plain tensor), the DCP plugin's manifest lists every rank's chunks
    inline (v1) and objckpt.save writes rank indexes (v2); resolved, both hold the same
    chunks with the same crc32c, no empty chunk of a non-empty tensor, one of the empty one."""
    from mp import run_multiprocess

    bucket, opts = moto_s3
    uris = {w: f"s3://{bucket}/two/{w}" for w in ("dcp", "save")}
    assert run_multiprocess(2, _save_both_world2, uris, opts) == [True, True]
    ms = {w: objckpt.inspect(u, storage_options=opts) for w, u in uris.items()}
    assert ms["dcp"].world_size == ms["save"].world_size == 2 and ms["save"].rank_indexes
    assert {b.rank for b in ms["dcp"].blobs} == {0, 1}
    dcp_chunks, save_chunks = _chunks(ms["dcp"], False), _chunks(ms["save"], False)
    assert list(dcp_chunks) == list(save_chunks)
    for k in ("w", "one", "plain"):  # (a v2 layout lists no chunk of an empty tensor once resolved)
        assert dcp_chunks[k] == save_chunks[k][:3] + (None, save_chunks[k][4]), k
    assert len(dcp_chunks["w"][4]) == 6  # three part-size chunks of each rank's 150 rows
    assert [c.length for c in ms["dcp"].tensors["one"].chunks] == [16]
    assert [(c.shape, c.length) for c in ms["dcp"].tensors["e"].chunks] == [((0, 3), 0)]
    for uri in uris.values():
        assert_same(_world2_full(), objckpt.read(uri, storage_options=opts))
