"""The request-rate model of docs/s3-scale.md: its per-rank counts match a real save, its headline holds."""
from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch

import objckpt
from benchmarks import s3_scale_model as model
from objckpt.storage.memory import MemoryStore
from objckpt.testing.stores import CountingStore


def test_per_rank_counts_match_a_real_save() -> None:
    """The model's blobs and parts are what objckpt's save writes for the same shards."""
    a = replace(model.Assumptions(), ranks=1, params=40 * model.MiB / 14, tensors_per_rank=10,
                blob_size=16 * model.MiB, part_size=4 * model.MiB)
    r = model.rank_requests(a)
    assert r.blobs == 3 and r.parts > r.blobs
    rows = a.rank_bytes // a.tensors_per_rank // 4096
    state = {f"t{i}": torch.zeros(rows, 1024) for i in range(a.tensors_per_rank)}
    counting = CountingStore(MemoryStore())
    objckpt.save(state, "memory://model/ck", store=counting, blob_size=a.blob_size, part_size=a.part_size)
    assert counting.ops["write_part"] == r.parts and counting.ops["complete"] == r.blobs


def test_headline_numbers() -> None:
    a = model.Assumptions()
    r = model.rank_requests(a)
    assert (r.blobs, r.parts, r.writes, r.reads) == (1, 4, 7, 4)  # 57 MiB per rank
    rows = {(row.op, row.layout.split(",")[0]): row for row in model.table(a)}
    assert rows[("save", "default")].requests == 16384 * 7 + 3
    assert rows[("save", "default")].over > 100 and rows[("save", "default")].floor_s == pytest.approx(32.8, abs=0.1)
    assert rows[("save", "spread")].over < 1 and rows[("restore", "spread")].over < 1
    assert rows[("restore", "default")].over > 50
    assert rows[("restore", "spread")].hot_key_floor_s == pytest.approx(16384 / 5500)
    more = model.table(replace(a, digits=3))
    assert more[2].busiest_prefix_rps < rows[("save", "spread")].busiest_prefix_rps / 8


def test_markdown_table_prints(capsys: pytest.CaptureFixture[str]) -> None:
    model.main(["--ranks", "4096", "--digits", "1"])
    out = capsys.readouterr().out
    assert "| save | default |" in out and "spread, 16 prefixes" in out and out.count("\n| ") == 5


def test_manifest_requests_match_a_real_save() -> None:
    """The model's requests at the checkpoint folder are rank 0's requests for the manifest of a
    real save: HEAD (committed already?), the create-only PUT and the GET that reads it back."""
    seen: list[tuple[str, str]] = []

    class Recording(CountingStore):
        async def head(self, key: str) -> Any:
            seen.append(("head", key))
            return await super().head(key)

        async def get(self, key: str) -> bytes:
            seen.append(("get", key))
            return await super().get(key)

        async def put(self, key: str, data: Any, *, if_absent: bool = False) -> None:
            seen.append(("put" + ("-if-absent" if if_absent else ""), key))
            await super().put(key, data, if_absent=if_absent)

    objckpt.save({"w": torch.zeros(64)}, "memory://model/ck", store=Recording(MemoryStore()))
    at_manifest = [op for op, key in seen if key.endswith("/manifest.json")]
    assert at_manifest == ["head", "put-if-absent", "get"]
    assert len(at_manifest) == model.MANIFEST_REQUESTS
