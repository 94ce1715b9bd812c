"""Custom step folder names (``step_format``): an existing layout managed where it is, the
latest step found without LIST in a fresh process, reindex(), and the command line (moto S3 over HTTP)."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from typing import Any

import boto3
import pytest
import torch

import objckpt
from objckpt.cli import main
from objckpt.manager.naming import StepFormatError, StepNaming
from testkit.http_count import CountingProxy
from conftest import assert_same


def _state(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(16, generator=g), "step": step}


def _folders(bucket: str, opts: dict[str, Any], prefix: str = "run/") -> set[str]:
    r = boto3.client("s3", **opts).list_objects_v2(Bucket=bucket, Prefix=prefix)
    return {o["Key"][len(prefix):].split("/")[0] for o in r.get("Contents", [])} - {"_objckpt_index"}


def test_step_naming_round_trips_and_rejects_what_cannot_name_steps() -> None:
    n = StepNaming("step_{step}")
    assert n.name(7) == "step_7" and n.parse("step_7") == 7 and n.parse("step_07") is None
    assert n.parse("step_") is None and n.parse("step_7x") is None
    z = StepNaming("ckpt-{step:08d}")
    assert z.name(42) == "ckpt-00000042" and z.parse("ckpt-00000042") == 42 and z.parse("ckpt-42") is None
    assert z.name(123456789) == "ckpt-123456789" and z.parse("ckpt-123456789") == 123456789
    assert StepNaming("{n}").parse("100") == 100 and StepNaming("checkpoint_{}").name(3) == "checkpoint_3"
    for bad in ("step", "a/{step}", "{step}-{step}", "{step:x}", "{epoch}", "_objckpt{step}", "{step!r}"):
        with pytest.raises(StepFormatError):
            StepNaming(bad)


def test_existing_layout_managed_in_place_and_found_without_list_in_a_fresh_process(
        moto_s3: tuple[str, dict[str, Any]], moto_endpoint: str, capsys: pytest.CaptureFixture[str]) -> None:
    bucket, opts = moto_s3
    root = f"s3://{bucket}/run"
    for step in (5, 10, 100):  # a run saved before the manager: plain checkpoints, its own names, no index
        objckpt.save(_state(step), f"{root}/step_{step}", storage_options=opts, metadata={"s": step})
    objckpt.save(_state(99), f"{root}/step_0099", storage_options=opts)  # not a step of this format
    with objckpt.CheckpointManager(root, step_format="step_{step}", keep_last=3, storage_options=opts) as m:
        assert m.latest_step() == 100  # no index yet: one LIST, the manifests adopted
        assert m.steps() == [5, 10, 100] and m.entries().get(10).metadata == {"s": 10}  # type: ignore[union-attr]
        m.save(101, _state(101))
        m.save(102, _state(102))
        m.wait()
        assert m.steps() == [100, 101, 102]
    assert _folders(bucket, opts) == {"step_100", "step_101", "step_102", "step_0099"}
    objckpt.save(_state(103), f"{root}/step_103", storage_options=opts)  # committed beside the manager
    # a fresh process (a resumed job): the latest step with GETs and a HEAD, no LIST; reindex adopts step 103;
    # a step older than the newest that keep_last=1 would drop at once is refused there too
    script = textwrap.dedent(f"""
        import json, torch, objckpt
        from objckpt.manager.retention import StepOrderError
        from testkit.http_count import CountingProxy
        out = {{}}
        with CountingProxy({moto_endpoint!r}) as proxy:
            m = objckpt.CheckpointManager({root!r}, step_format="step_{{step}}", keep_last=1,
                                          storage_options={{**{opts!r}, "endpoint_url": proxy.url}})
            out["latest"] = m.latest_step()
            out["kinds"] = [r.kind for r in proxy.requests]
            try:
                m.save(50, {{"w": torch.zeros(16), "step": 0}})
            except StepOrderError as e:
                out["refused"] = str(e)
            out["reindex"] = m.reindex()
            st = {{"w": torch.zeros(16), "step": 0}}
            m.load(st)
            out["loaded"] = st["step"]
            m.close()
        print(json.dumps(out))
    """)
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["latest"] == 102 and "LIST" not in out["kinds"] and len(out["kinds"]) <= 4, out
    assert "step 50 is older than the latest step 102" in out["refused"], out
    assert out["reindex"] == [100, 101, 102, 103] and out["loaded"] == 103, out
    # zero padding, and a manager with another format is told which one the index has
    with objckpt.CheckpointManager(f"s3://{bucket}/padded", step_format="ckpt-{step:08d}",
                                   storage_options=opts) as z:
        z.save(42, _state(42))
        assert z.step_uri(42) == f"s3://{bucket}/padded/ckpt-00000042"
    assert _folders(bucket, opts, "padded/") == {"ckpt-00000042"}
    with pytest.raises(StepFormatError, match=r"named 'ckpt-\{step:08d\}'.*pass step_format="):
        objckpt.CheckpointManager(f"s3://{bucket}/padded", storage_options=opts).latest_step()
    st = _state(0)
    objckpt.CheckpointManager(f"s3://{bucket}/padded", step_format="ckpt-{step:08d}",
                              storage_options=opts).load(st)
    assert_same(st, _state(42))
    # the command line reads the format from the index
    ep = ["--endpoint-url", moto_endpoint]
    assert main(["ls", root, *ep, "--json"]) == 0
    assert [e["step"] for e in json.loads(capsys.readouterr().out)] == [100, 101, 102, 103]
    assert main(["rm", f"{root}/step_101", *ep]) == 0
    assert "removed step 101 from the index" in capsys.readouterr().out
    assert main(["prune", root, "--keep-last", "1", *ep]) == 0
    assert f"deleted step 100 ({root}/step_100)" in capsys.readouterr().out
    assert _folders(bucket, opts) == {"step_103", "step_0099"}
