"""benchmarks/device_check.py, the one-call GPU check: its CPU dry run end to end (every step,
every code path the GPU run takes, on ~32 MiB and 2 ranks), its reading of the CUDA tests,
and its time slices (a step past its slice is stopped, what was measured is kept)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from typing import Any

import pytest

from benchmarks import device_check as dc

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _verified(reps: list[dict[str, Any]]) -> bool:
    return bool(reps) and all(r["verify"] == "ok" and r["wall_s"] > 0 for r in reps)


@pytest.mark.slow
def test_dry_run_writes_every_section_with_numbers(tmp_path: Any) -> None:
    out = tmp_path / "out"
    # run as the GPU host runs it: the script by path, here from another folder
    p = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "device_check.py"), "--dry", "--out",
                        str(out), "--budget-s", "400"], cwd=tmp_path, capture_output=True, text=True, timeout=500)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    r = json.loads((out / "device_check.json").read_text())
    assert {k: v["status"] for k, v in r["steps"].items()} == dict.fromkeys(dc.STEPS, "ok"), r["steps"]

    t = r["tests"]
    assert "tests/test_cuda.py" in t["files"] and t["unmarked_gpu_skips"] == []
    assert t["counts"].get("skipped", 0) >= 4 and not t["counts"].get("failed") and len(t["tests"]) >= 4

    s = r["stall"]
    assert s["bytes"] > 16 << 20 and s["dtypes"] == ["torch.bfloat16", "torch.float32"]
    for key in ("host_copy", "objckpt_async", "objckpt_lazy", "dcp_default_stager", "dcp_pinned_cached"):
        assert isinstance(s[key], dict) and s[key]["median_s"] > 0 and s[key]["x_ref"] > 0, (key, s[key])
    assert s["objckpt_async"]["done_s"] >= s["objckpt_async"]["ready_s"] > 0

    save, load = r["restore"]["save"], r["restore"]["load"]
    assert load["raw_get"]["gbps"] > 0 and load["host_copy_gbps"] > 0
    assert load["ceiling_gbps"] == min(load["raw_get"]["gbps"], load["host_copy_gbps"])
    assert save["objckpt_s3"]["save_s"] > 0 and _verified(load["objckpt_s3"]["reps"])
    assert len(load["objckpt_s3"]["reps"]) == 2 and load["objckpt_s3"]["warm_s"] > 0
    for peer in ("tensorstore_ocdbt", "dcp_s3fs"):  # a peer not installed here is recorded, with the reason
        if save[peer]["status"] == "unavailable":
            assert save[peer]["error"] and peer not in load
        else:
            assert save[peer]["status"] == "ok" and _verified(load[peer]["reps"]), (peer, save[peer], load.get(peer))
    assert r["server"]["server_cpus"] and r["server"]["client_cpus"]

    (mr,) = r["multirank"]["summary"]
    assert mr["world"] == 2 and mr["save"]["wall_s"] > 0 and mr["load"]["gbps"] > 0

    tier = r["tier"]
    local, peers = tier["local"]["result"], tier["peers"]["result"]
    assert local["device"] == "cpu" and local["stall"]["tiered_async_stall_s"] > 0
    assert local["stall"]["local_restore_s"] > 0 and local["stall"]["verified_read_floor_s"] > 0
    peer = peers["summary"]["restore"]["peer"]
    assert peers["summary"]["ratio"] > 0 and peer["ratio"] > 0 and peer["ratio_to_gloo_file"] > 0
    assert all(x["verified"] for rank in peers["restore"] for x in rank)
    crc = tier["crc32c"]["result"]["implementations"]
    assert crc["crc32c"]["cached_1t_gbps"] > 0 and all(r["verified_read_512k_over_memcpy"] > 0 for r in crc.values())

    for step in dc.STEPS:
        assert json.loads((out / f"{step}.json").read_text())["status"] == "ok"
    md = (out / "device_check.md").read_text()
    assert all(f"## {i}." in md for i in range(1, 6)) and "| objckpt_s3 |" in md and "peer restore / gloo" in md
    assert re.search(r"^\[\d\d:\d\d:\d\d \+ *\d+s\] == step 4/5 multirank", p.stdout, re.M), p.stdout[-2000:]


def test_scan_lists_cuda_test_files_and_gpu_skips_without_the_mark(tmp_path: Any) -> None:
    d = tmp_path / "tests"
    d.mkdir()
    (d / "test_a.py").write_text(textwrap.dedent("""
        import pytest, torch
        pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="gpu")]
        def test_marked_by_its_module(): pass
    """))
    (d / "test_b.py").write_text(textwrap.dedent("""
        import pytest, torch
        @pytest.mark.skipif(not torch.cuda.is_available(), reason="gpu")
        def test_unmarked(): pass
        @pytest.mark.cuda
        @pytest.mark.skipif(torch.cuda.device_count() < 2, reason="two")
        def test_marked(): pass
        class TestX:
            def test_skips_in_its_body(self):
                if not torch.cuda.is_available():
                    pytest.skip("no gpu")
        def test_cpu(): pass
    """))
    (d / "test_c.py").write_text("def test_cpu(): pass\n")
    scan = dc.scan_cuda_tests(str(d))
    assert scan == {"files": ["tests/test_a.py", "tests/test_b.py"],
                    "unmarked_gpu_skips": ["tests/test_b.py::test_unmarked", "tests/test_b.py::test_skips_in_its_body"]}
    real = dc.scan_cuda_tests(os.path.join(REPO, "tests"))  # `pytest -m cuda` runs every GPU test of this tree
    assert "tests/test_cuda.py" in real["files"] and real["unmarked_gpu_skips"] == []


def test_a_step_past_its_slice_is_stopped_and_what_was_measured_is_kept(tmp_path: Any) -> None:
    run = dc.Run(dc.parse(["--dry", "--out", str(tmp_path), "--budget-s", "6"]))
    pid_file = tmp_path / "pid"

    def quick(run: dc.Run, timeout: float) -> dict[str, Any]:
        return {"figure": 1.5}

    def overruns(run: dc.Run, timeout: float) -> dict[str, Any]:
        run.put("overruns", {"measured": 2}, step_file=False)
        code = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(120)"
        dc.run_child(["-c", code], 120)  # ignores its slice: the run's alarm must stop it
        return {"never": True}

    def last(run: dc.Run, timeout: float) -> dict[str, Any]:
        return {"timeout_s": timeout}

    dc.run_steps(run, [dc.Step("quick", quick, 1), dc.Step("overruns", overruns, 1), dc.Step("last", last, 1)])
    r = json.loads((tmp_path / "device_check.json").read_text())
    assert r["quick"] == {"figure": 1.5, "status": "ok"}
    assert r["overruns"]["status"].startswith("timeout") and r["overruns"]["measured"] == 2 and "never" not in r["overruns"]
    assert r["steps"]["last"]["status"] in ("ok", dc.OUT_OF_TIME)  # recorded either way, never lost
    assert json.loads((tmp_path / "overruns.json").read_text())["measured"] == 2
    with pytest.raises(ProcessLookupError):  # the child of the stopped step was killed and reaped
        os.kill(int(pid_file.read_text()), 0)
