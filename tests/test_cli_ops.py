"""The flags every command takes, and the progress bar (stderr, terminals only)."""
from __future__ import annotations

import argparse
import io
import json
import sys
from typing import Any

import pytest
import torch

import objckpt
from objckpt.cli import main
from objckpt.cli.options import storage_options
from objckpt.logs import Progress, wanted


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_storage_flags_reach_s3(moto_s3: tuple[str, dict[str, Any]], capsys: pytest.CaptureFixture[str]) -> None:
    bucket, opts = moto_s3
    uri = f"s3://{bucket}/run/ck"
    objckpt.save({"w": torch.arange(12.0).reshape(3, 4)}, uri, storage_options=opts)
    creds = json.dumps({"aws_access_key_id": "testing", "aws_secret_access_key": "testing",
                        "endpoint_url": "http://127.0.0.1:1"})  # the flag below wins over this endpoint
    flags = ["--storage-options", creds, "--endpoint-url", opts["endpoint_url"], "--region", "us-east-1"]
    assert main(["info", uri, *flags]) == 0
    assert "[3, 4]" in capsys.readouterr().out
    assert main(["verify", uri, *flags]) == 0
    assert "ok: 1 tensors" in capsys.readouterr().out
    # the JSON alone carries the endpoint too
    only_json = json.dumps({**json.loads(creds), "endpoint_url": opts["endpoint_url"], "concurrency": 4})
    assert main(["ls", f"s3://{bucket}/run", "--storage-options", only_json]) == 0
    assert capsys.readouterr().out.split() == [uri]
    # an option S3 does not know, a profile that does not exist: clear errors, exit 2
    bad = json.dumps({**json.loads(only_json), "no_such_option": 1})
    assert main(["info", uri, "--storage-options", bad]) == 2
    assert "unknown S3 storage_options: ['no_such_option']" in capsys.readouterr().err
    assert main(["info", uri, "--storage-options", only_json, "--profile", "objckpt-no-such-profile"]) == 2
    assert "objckpt-no-such-profile" in capsys.readouterr().err


@pytest.mark.parametrize("text, why", [('{"a":', "not valid JSON"), ("[1, 2]", "must be a JSON object")])
def test_bad_storage_options_json_is_a_usage_error(text: str, why: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["info", "s3://b/ck", "--storage-options", text])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--storage-options" in err and why in err


def test_flags_merge_over_json() -> None:
    ns = argparse.Namespace(storage_options={"region_name": "eu-west-1", "concurrency": 8}, endpoint_url="http://e",
                            region="us-east-2", profile="p")
    assert storage_options(ns) == {"region_name": "us-east-2", "concurrency": 8, "endpoint_url": "http://e",
                                   "profile": "p"}
    assert storage_options(argparse.Namespace()) is None


def test_progress_only_on_terminals(tmp_path: Any, capsys: pytest.CaptureFixture[str],
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    uri = str(tmp_path / "ck")
    objckpt.save({"w": torch.randn(1000, 100), "b": torch.randn(100)}, uri)
    assert main(["verify", uri]) == 0  # under pytest stdout is not a terminal: no bar
    out = capsys.readouterr()
    assert "ok:" in out.out and "\r" not in out.err and "verify [" not in out.err
    assert not wanted(stdout=io.StringIO(), stderr=_Tty()) and not wanted(True, _Tty(), _Tty())
    assert wanted(stdout=_Tty(), stderr=_Tty())
    out_tty, err_tty = _Tty(), _Tty()
    monkeypatch.setattr(sys, "stdout", out_tty)
    monkeypatch.setattr(sys, "stderr", err_tty)
    assert main(["verify", uri]) == 0
    assert "verify [" in err_tty.getvalue() and "100.0%" in err_tty.getvalue() and "\r" in err_tty.getvalue()
    assert "\r" not in out_tty.getvalue()  # the bar never touches stdout
    err_tty.truncate(0)
    err_tty.seek(0)
    assert main(["cp", uri, str(tmp_path / "copy")]) == 0
    assert "cp [" in err_tty.getvalue() and "100.0%" in err_tty.getvalue()
    err_tty.truncate(0)
    err_tty.seek(0)
    assert main(["verify", uri, "--no-progress"]) == 0
    assert err_tty.getvalue() == ""


def test_progress_bar_draws_and_counts() -> None:
    s = _Tty()
    with Progress(0, "cp", stream=s, interval=0.0) as p:
        p.update(512, total=1024)
        p.update(512)
    text = s.getvalue()
    assert "50.0%" in text and "100.0%" in text and text.endswith("\n")
    s2 = _Tty()
    with Progress(10, "x", stream=s2, enabled=False) as p:
        p.update(10)
    assert s2.getvalue() == ""
