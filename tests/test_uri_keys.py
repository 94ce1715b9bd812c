"""A URI names its keys character for character: ``#``, ``?``, ``%``, ``+``, spaces and
unicode are key characters (never a URL's fragment, query or escape), so two URIs never
name one checkpoint; control characters are refused, naming the URI, before anything is
written.  Proven on a real moto server and on testkit's in-memory S3 server over HTTP (both
of objckpt's S3 transports), on local files (paths and ``file://``) and in memory."""
from __future__ import annotations

import os
from typing import Any

import boto3  # type: ignore[import-untyped]
import pytest
import torch

import objckpt
from objckpt.cli import main as cli_main
from objckpt.errors import InvalidURIError, ObjckptError
from objckpt.ops.gc import collect_garbage
from objckpt.runtime import loop as _runtime
from objckpt.storage import open_store, split_uri

from conftest import make_bucket, s3_options

#: key names whose characters a URL parser or a careless encoder would cut, drop or mangle
ODD_NAMES = ["q?mark/ck", "h#/a#b?c=d&e/ck", "sp ace/ck", "plus+sign/ck", "pct%20x%2F/ck", "uni/ünï€😀/ck",
             "tilde~/semi;colon/ck"]


def _state(v: float) -> dict[str, Any]:
    return {"w": torch.full((4, 3), float(v)), "b": torch.arange(5) * int(v), "step": int(v)}


def _value(uri: str, opts: Any = None) -> float:
    got = objckpt.read(uri, storage_options=opts)
    assert torch.equal(got["b"], torch.arange(5) * got["step"]), uri
    return float(got["w"][0, 0])


# -- split_uri ----------------------------------------------------------------------------
@pytest.mark.parametrize("uri, want", [
    ("s3://bkt/runs/lr=0.1#seed1", ("s3", "bkt", "runs/lr=0.1#seed1")),
    ("s3://bkt/q?mark/ck", ("s3", "bkt", "q?mark/ck")),
    ("s3://bkt/a#b?c#d/", ("s3", "bkt", "a#b?c#d/")),
    ("S3://bkt/a%20b+c d#e", ("s3", "bkt", "a%20b+c d#e")),  # the scheme is case-blind; nothing is decoded
    ("s3a://bkt/#", ("s3a", "bkt", "#")),
    ("file:///data/runs/x#1?y", ("file", "/", "data/runs/x#1?y")),
    ("memory://ns/a#b", ("memory", "ns", "a#b")),
    ("fsspec+memory://root/a?b#c", ("fsspec+memory", "root", "a?b#c")),
    ("gcs://bkt/p#q", ("gcs", "bkt", "p#q")),
])
def test_split_uri_keeps_every_key_character(uri: str, want: tuple[str, str, str]) -> None:
    assert split_uri(uri) == want


def test_split_uri_local_paths_keep_hash_and_question_mark(tmp_path: Any) -> None:
    p = str(tmp_path / "lr=0.1#seed1" / "q?mark")
    assert split_uri(p) == ("file", "/", p.lstrip("/"))
    assert split_uri("file://" + p) == split_uri(p)  # a path and its file:// URI: one place


def test_split_uri_never_maps_two_uris_to_one_place() -> None:
    uris = ["s3://b/runs/lr=0.1", "s3://b/runs/lr=0.1#seed1", "s3://b/runs/lr=0.1#seed2", "s3://b/q",
            "s3://b/q?mark/ck", "s3://b/q?other/ck", "file:///d/x", "file:///d/x#1", "file:///d/x?1",
            "memory://n/x", "memory://n/x#1"]
    assert len({split_uri(u) for u in uris}) == len(uris)


@pytest.mark.parametrize("ch", ["\t", "\r", "\n", "\x00", "\x01", "\x1b", "\x1f", "\x7f"])
def test_split_uri_refuses_control_characters(ch: str) -> None:
    for uri in (f"s3://bkt/run{ch}x/ck", f"file:///tmp/a{ch}b", f"/tmp/a{ch}b", f"memory://n/x{ch}",
                f"s3://bk{ch}t/ck"):
        with pytest.raises(InvalidURIError) as ei:
            split_uri(uri)
        assert isinstance(ei.value, ValueError) and isinstance(ei.value, ObjckptError)
        assert repr(uri) in str(ei.value) and "control character" in str(ei.value)


def test_split_uri_refuses_a_malformed_scheme() -> None:
    with pytest.raises(InvalidURIError, match=r"'1bad://x/y': '1bad' is not a URI scheme"):
        split_uri("1bad://x/y")


# -- S3: moto and the in-memory server ------------------------------------------------------
@pytest.fixture(params=["moto", "testkit"])
def s3_bucket(request: pytest.FixtureRequest) -> tuple[str, dict[str, Any]]:
    """(bucket, storage options) on moto, then on testkit's in-memory server."""
    if request.param == "moto":
        bucket, opts = request.getfixturevalue("moto_s3")
        return bucket, opts
    endpoint = request.getfixturevalue("memory_s3").endpoint_url
    return make_bucket(endpoint), s3_options(endpoint)


def _s3_keys(bucket: str, opts: dict[str, Any]) -> list[str]:
    client = boto3.client("s3", **s3_options(opts["endpoint_url"]))
    return sorted(o["Key"] for p in client.get_paginator("list_objects_v2").paginate(Bucket=bucket)
                  for o in p.get("Contents", []))


def test_s3_hash_suffixes_name_distinct_checkpoints(s3_bucket: tuple[str, dict[str, Any]],
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """The issue's case: seed1 and seed2 were both stored at ``runs/lr=0.1``, so saving seed2
    with overwrite=True replaced seed1 and reading seed1 returned seed2's tensors."""
    bucket, opts = s3_bucket
    one, two = f"s3://{bucket}/runs/lr=0.1#seed1", f"s3://{bucket}/runs/lr=0.1#seed2"
    objckpt.save(_state(1), one, storage_options=opts)
    objckpt.save(_state(2), two, storage_options=opts)  # no overwrite needed: another checkpoint
    assert (_value(one, opts), _value(two, opts)) == (1.0, 2.0)
    objckpt.save(_state(3), two, storage_options=opts, overwrite=True)
    assert (_value(one, opts), _value(two, opts)) == (1.0, 3.0)
    template = _state(0)
    objckpt.load(template, one, storage_options=opts)
    assert template["step"] == 1 and float(template["w"][0, 0]) == 1.0
    keys = _s3_keys(bucket, opts)
    assert "runs/lr=0.1#seed1/manifest.json" in keys and "runs/lr=0.1#seed2/manifest.json" in keys
    assert all(k.startswith(("runs/lr=0.1#seed1/", "runs/lr=0.1#seed2/")) for k in keys), keys

    # the command line lists both under their own URIs
    capsys.readouterr()
    assert cli_main(["ls", f"s3://{bucket}/runs", "--objects", "--endpoint-url", opts["endpoint_url"],
                     "--no-progress"]) == 0
    assert capsys.readouterr().out.split("\n")[:2] == [one, two]

    # gc under runs/ (a killed save's blobs in seed2's prefix) leaves seed1 whole
    store, _ = open_store(one, opts)
    orphan = "runs/lr=0.1#seed2/blobs/20000101T000000-000000000000/r00000-0000.bin"
    _runtime.run(store.put(orphan, b"left by a killed save"))
    report = _runtime.run(collect_garbage(store, "runs", grace=0))
    assert report.deleted == [orphan] and report.checkpoints == 2

    # deleting one leaves the other, by API and on the command line
    objckpt.delete(two, storage_options=opts)
    with pytest.raises(objckpt.NotFoundError):
        objckpt.read(two, storage_options=opts)
    assert _value(one, opts) == 1.0
    assert all(k.startswith("runs/lr=0.1#seed1/") for k in _s3_keys(bucket, opts))
    assert cli_main(["rm", one, "--endpoint-url", opts["endpoint_url"], "--no-progress"]) == 0
    assert _s3_keys(bucket, opts) == []


@pytest.mark.parametrize("transport", ["direct", "botocore"])
def test_s3_odd_key_characters_round_trip(s3_bucket: tuple[str, dict[str, Any]], transport: str,
                                          request: pytest.FixtureRequest) -> None:
    """Every object request (PUT, multipart, GET ranges, HEAD, LIST, DeleteObjects) of keys
    with ``#``, ``?``, ``%``, ``+``, spaces and unicode, signed by objckpt's own SigV4 or
    by botocore: the keys S3 stores are the URI's, character for character."""
    bucket, opts = s3_bucket
    opts = {**opts, "direct_http": transport == "direct"}
    for i, name in enumerate(ODD_NAMES):
        objckpt.save(_state(i), f"s3://{bucket}/{name}", storage_options=opts)
    big = f"s3://{bucket}/{ODD_NAMES[1]}/multi#part"  # one multipart upload: 3 parts
    tensor = torch.arange(11 << 18, dtype=torch.float32)
    on_testkit = request.node.callspec.params["s3_bucket"] == "testkit"
    server: Any = request.getfixturevalue("memory_s3") if on_testkit else None
    if server is not None:
        server.reset_stats()
    objckpt.save({"t": tensor}, big, storage_options=opts, part_size=5 << 20, blob_size=64 << 20)
    if server is not None:
        assert server.stats()["ops"].get("UploadPart") == 3
    keys = _s3_keys(bucket, opts)
    assert sorted({k.rsplit("/", 1)[0] for k in keys if k.endswith("/manifest.json")}) == sorted(
        [*ODD_NAMES, f"{ODD_NAMES[1]}/multi#part"])
    for i, name in enumerate(ODD_NAMES):
        assert _value(f"s3://{bucket}/{name}", opts) == float(i)
    assert torch.equal(objckpt.read(big, storage_options=opts)["t"], tensor)
    store, _ = open_store(big, opts)
    assert _runtime.run(store.list_uploads("")) == []
    for name in ODD_NAMES:
        objckpt.delete(f"s3://{bucket}/{name}", storage_options=opts)
    objckpt.delete(big, storage_options=opts)
    assert _s3_keys(bucket, opts) == []


def test_s3_control_characters_write_nothing(s3_bucket: tuple[str, dict[str, Any]]) -> None:
    bucket, opts = s3_bucket
    for ch in ("\t", "\r", "\n", "\x00", "\x7f"):
        uri = f"s3://{bucket}/run{ch}/ck"  # urlsplit dropped TAB, CR and LF: stored at run/ck
        with pytest.raises(InvalidURIError) as ei:
            objckpt.save(_state(1), uri, storage_options=opts)
        assert repr(uri) in str(ei.value)
        with pytest.raises(InvalidURIError):
            objckpt.read(uri, storage_options=opts)
    assert _s3_keys(bucket, opts) == []


# -- local files and memory -----------------------------------------------------------------
def test_local_paths_and_file_uris_keep_hash_and_question_mark(tmp_path: Any) -> None:
    """A path and its ``file://`` URI name the same checkpoint, ``#`` and ``?`` included;
    ``#seed1`` and ``#seed2`` are two."""
    base = str(tmp_path / "runs" / "lr=0.1")
    objckpt.save(_state(1), base + "#seed1")
    objckpt.save(_state(2), "file://" + base + "#seed2")
    assert (_value("file://" + base + "#seed1"), _value(base + "#seed2")) == (1.0, 2.0)
    objckpt.save(_state(3), "file://" + base + "#seed2", overwrite=True)
    assert (_value(base + "#seed1"), _value("file://" + base + "#seed2")) == (1.0, 3.0)
    assert sorted(os.listdir(tmp_path / "runs")) == ["lr=0.1#seed1", "lr=0.1#seed2"]
    q = str(tmp_path / "q?mark" / "ck")
    objckpt.save(_state(4), "file://" + q)
    assert os.path.isfile(os.path.join(q, "manifest.json")) and _value(q) == 4.0
    assert sorted(os.listdir(tmp_path)) == ["q?mark", "runs"]  # nothing at tmp/q
    objckpt.delete("file://" + base + "#seed2")
    assert _value(base + "#seed1") == 1.0 and not os.path.exists(base + "#seed2")


def test_local_control_characters_write_nothing(tmp_path: Any) -> None:
    for ch in ("\t", "\n", "\r", "\x00", "\x01", "\x7f"):
        for uri in (str(tmp_path / f"run{ch}x" / "ck"), f"file://{tmp_path}/run{ch}x/ck"):
            with pytest.raises(InvalidURIError) as ei:
                objckpt.save(_state(1), uri)
            assert repr(uri) in str(ei.value) and "control character" in str(ei.value)
    assert os.listdir(tmp_path) == []


def test_memory_uris_keep_hash_and_question_mark() -> None:
    ns = f"urikeys{os.getpid()}"
    for i, suffix in enumerate(["#1", "#2", "?3"]):
        objckpt.save(_state(i), f"memory://{ns}/run{suffix}")
    assert [_value(f"memory://{ns}/run{s}") for s in ("#1", "#2", "?3")] == [0.0, 1.0, 2.0]
    with pytest.raises(objckpt.NotFoundError):
        objckpt.read(f"memory://{ns}/run")
