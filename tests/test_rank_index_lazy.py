"""A load rank checks only the rank-index records of the tensors it reads: the index's bytes,
crc and header at once, each tensor's records at its first lookup (format/rank_index.py,
``lazy=True``), with the same checks and errors as the whole decode.  Work is bounded by
counting checked tensors, never by timing."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import objckpt
from objckpt.errors import CorruptCheckpointError
from objckpt.format import rank_index
from objckpt.format.manifest import Chunk, ChunkRecord

KW: dict[str, Any] = dict(attempt="a", rank=3, blobs=[5, 6], blob_sizes=[0, 0, 0, 0, 0, 4096, 64], crc_block=32)


def _records(n: int) -> list[ChunkRecord]:
    return [ChunkRecord(f"t{i}", Chunk((0,), (4,), 0, 16 * i, 16, i, ())) for i in range(n)]


def test_a_lazy_index_checks_a_tensor_at_its_first_lookup_and_equals_the_whole_decode() -> None:
    data = rank_index.encode("a", 3, _records(200))
    lazy = rank_index.decode(data, "idx", lazy=True, **KW)
    assert isinstance(lazy, rank_index.RankChunks) and lazy.checked == 0 and len(lazy) == 200
    assert lazy["t7"][(0,)].offset == 16 * 7 and lazy.get("absent") is None
    assert lazy.checked == 1
    whole = rank_index.decode(data, "idx", **KW)
    assert dict(lazy) == dict(whole) and lazy.checked == 200  # (every one looked up by the comparison)


def test_a_malformed_record_is_refused_when_its_tensor_is_read() -> None:
    recs = _records(3) + [ChunkRecord("bad", Chunk((0,), (4,), 2, 0, 16, 1, ()))]  # the rank has two blobs
    data = rank_index.encode("a", 3, recs)
    with pytest.raises(CorruptCheckpointError, match="idx: tensor 'bad': chunk record #0"):
        rank_index.decode(data, "idx", **KW)  # the whole decode: at once
    lazy = rank_index.decode(data, "idx", lazy=True, **KW)  # lazily: the header is fine
    assert lazy["t1"][(0,)].crc32c == 1
    with pytest.raises(CorruptCheckpointError, match="idx: tensor 'bad': chunk record #0"):
        lazy["bad"]
    with pytest.raises(CorruptCheckpointError, match="rank 3"):  # the header is checked at once either way
        rank_index.decode(data, "idx", lazy=True, **{**KW, "rank": 2})


def _save_two(rank: int, world: int, uri: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    state = {f"w{i}": distribute_tensor(torch.arange(32.0).reshape(8, 4) + i, mesh, [Shard(0)]) for i in range(40)}
    objckpt.save(state, uri)


def test_a_resharded_load_checks_only_the_tensors_it_reads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Real processes: 2 gloo ranks save 40 sharded tensors (rank indexes); one process loads
    3 of them whole through both indexes, and checks no other tensor's records."""
    from mp import run_multiprocess

    uri = str(tmp_path / "ck")
    run_multiprocess(2, _save_two, uri)
    made: list[Any] = []
    real = rank_index.decode

    def keeping(*a: Any, **k: Any) -> Any:
        out = real(*a, **k)
        made.append(out)
        return out

    monkeypatch.setattr(rank_index, "decode", keeping)
    want = {f"w{i}": torch.empty(8, 4) for i in (0, 7, 39)}
    objckpt.load(want, uri, strict=False)
    for i in (0, 7, 39):
        assert torch.equal(want[f"w{i}"], torch.arange(32.0).reshape(8, 4) + i)
    assert len(made) == 2 and all(isinstance(r, rank_index.RankChunks) and len(r) == 40 for r in made)
    assert [r.checked for r in made] == [3, 3]
