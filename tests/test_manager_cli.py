"""``objckpt ls | rm | prune`` against a real moto S3 over HTTP."""
from __future__ import annotations

from typing import Any

import boto3
import pytest
import torch

import objckpt
from objckpt.cli import main


def _step_dirs(bucket: str, opts: dict[str, Any]) -> list[str]:
    r = boto3.client("s3", **opts).list_objects_v2(Bucket=bucket, Prefix="run/")
    return sorted({o["Key"].split("/")[1] for o in r.get("Contents", []) if o["Key"].split("/")[1].startswith("step-")})


def test_ls_rm_prune(moto_s3: tuple[str, dict[str, Any]], moto_endpoint: str,
                     capsys: pytest.CaptureFixture[str]) -> None:
    bucket, opts = moto_s3
    root = f"s3://{bucket}/run"
    ep = ["--endpoint-url", moto_endpoint]
    with objckpt.CheckpointManager(root, storage_options=opts) as m:
        for step in range(1, 6):
            m.save(step * 10, {"w": torch.randn(100), "step": step}, metadata={"loss": round(1 / step, 3)})

    assert main(["ls", root, *ep]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split()[:2] == ["STEP", "SIZE"] and out[-1].startswith("5 step(s)")
    rows = [line.split() for line in out[1:-1]]
    assert [r[0] for r in rows] == ["10", "20", "30", "40", "50"]
    assert rows[0][1:3] == ["400", "B"] and '{"loss":' in out[1] and "0.5}" in out[2]

    assert main(["ls", root, "--objects", *ep]) == 0
    assert capsys.readouterr().out.split() == [f"{root}/step-{s * 10:010d}" for s in range(1, 6)]

    # committed but never indexed (as a save killed before its index update leaves it): prune adopts it
    objckpt.save({"w": torch.randn(100)}, f"{root}/step-0000000060", storage_options=opts)
    assert main(["prune", root, "--keep-last", "2", "--keep-every", "20", "--dry-run", *ep]) == 0
    out = capsys.readouterr().out
    assert "would delete step 10 " in out and "would delete step 30 " in out
    assert "would delete 2 of 6 step(s); kept [20, 40, 50, 60]" in out
    assert len(_step_dirs(bucket, opts)) == 6  # a dry run deletes nothing
    assert objckpt.CheckpointManager(root, storage_options=opts).steps() == [10, 20, 30, 40, 50]  # nor writes

    assert main(["prune", root, "--keep-last", "2", "--keep-every", "20", *ep]) == 0
    assert "deleted 2 of 6 step(s); kept [20, 40, 50, 60]" in capsys.readouterr().out
    assert _step_dirs(bucket, opts) == ["step-0000000020", "step-0000000040", "step-0000000050", "step-0000000060"]

    assert main(["rm", f"{root}/step-0000000040", *ep]) == 0
    out = capsys.readouterr().out
    assert "removed step 40 from the index" in out and "deleted" in out
    assert _step_dirs(bucket, opts) == ["step-0000000020", "step-0000000050", "step-0000000060"]
    assert objckpt.CheckpointManager(root, storage_options=opts).steps() == [20, 50, 60]

    assert main(["rm", f"{root}/step-0000000040", *ep]) == 2
    assert "step-0000000040" in capsys.readouterr().err
    assert main(["prune", root, *ep]) == 2
    assert "--keep-last" in capsys.readouterr().err
    assert main(["prune", root, "--keep-last", "0", *ep]) == 2
    assert "keep_last must be a positive int" in capsys.readouterr().err
    assert main(["prune", root, "--keep-best", "1", *ep]) == 2
    assert "best_key" in capsys.readouterr().err
