"""The command line, end to end on real files and the embedded S3 server."""
from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import pytest
import torch

import objckpt
from objckpt.cli import main


def test_demo_on_local_files(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    uri = str(tmp_path / "demo")
    assert main(["demo", "--uri", uri, "--d-model", "64", "--layers", "1"]) == 0
    out = capsys.readouterr().out
    assert "verified" in out and "FAILED" not in out
    for op in ("save", "load model in place", "read everything", "read one tensor"):
        assert op in out
    m = objckpt.inspect(uri)
    assert m.tensors["model.head.weight"].alias_of == "model.embed.weight"


def test_demo_on_embedded_s3(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--d-model", "64", "--layers", "1"]) == 0
    out = capsys.readouterr().out
    assert "embedded moto S3 at http://127.0.0.1:" in out and "verified" in out


def test_info_ls_verify(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    for step in (1, 2):
        objckpt.save({"w": torch.randn(10, 3), "step": step}, str(tmp_path / "run" / f"step-{step}"))
    assert main(["ls", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out.split()
    assert out == [str(tmp_path / "run" / "step-1"), str(tmp_path / "run" / "step-2")]
    assert main(["info", str(tmp_path / "run" / "step-1")]) == 0
    out = capsys.readouterr().out
    assert "w" in out and "float32" in out and "[10, 3]" in out
    assert main(["verify", str(tmp_path / "run" / "step-2")]) == 0
    assert "ok: 1 tensors" in capsys.readouterr().out


def test_verify_reports_corruption(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    uri = str(tmp_path / "ck")
    objckpt.save({"w": torch.randn(100)}, uri)
    blob = os.path.join(uri, objckpt.inspect(uri).blobs[0].name)
    with open(blob, "r+b") as f:
        f.write(b"\xff\xff\xff\xff")
    assert main(["verify", uri]) == 2
    assert "crc32c mismatch" in capsys.readouterr().err
    assert main(["info", str(tmp_path / "none")]) == 2
    assert "no checkpoint" in capsys.readouterr().err


def test_bench_measures_and_cleans_up(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", str(tmp_path / "scratch"), "--size-mb", "8", "--repeat", "1"]) == 0
    out = capsys.readouterr().out
    for op in ("save", "load", "read one tensor", "CPU-s/GB", "peak RSS"):
        assert op in out
    rows = [line.split() for line in out.splitlines() if line.strip().startswith(("save", "load"))]
    assert len(rows) == 2 and all(float(r[1]) > 0 for r in rows)
    assert not any(p.is_file() for p in tmp_path.rglob("*"))  # the scratch checkpoint is deleted


def test_python_dash_m_runs_the_command_line(tmp_path: Any) -> None:
    """``python -m objckpt`` and ``python -m objckpt.cli`` run the ``objckpt`` command line,
    every command listed in one order, for machines where the console script is not on PATH."""
    uri = str(tmp_path / "ck")
    objckpt.save({"w": torch.ones(3)}, uri)
    r = subprocess.run([sys.executable, "-m", "objckpt", "--help"], capture_output=True, text=True, timeout=120,
                       cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert "{demo,bench,convert,export,info,ls,gc,cp,diff,verify,rm,prune}" in r.stdout.replace("\n", "").replace(" ", "")
    r = subprocess.run([sys.executable, "-m", "objckpt.cli", "info", uri], capture_output=True, text=True, timeout=120,
                       cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[0] == uri and "1 tensors" in r.stdout
