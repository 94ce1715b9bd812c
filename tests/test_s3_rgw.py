"""objckpt against a real Ceph RADOS Gateway (testkit/rgw.py): saves, loads, the manager, two
ranks, racing writers, the command line, refusals and odd key characters, through RGW's own
SigV4 check, multipart rules and conditional writes; and the store facts docs/ report for RGW.

The whole module is skipped, with the reason, where the Ceph packages are not installed
(Debian/Ubuntu: ``apt-get install radosgw ceph-mon ceph-osd``; ``.ci/run`` installs them).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import boto3  # type: ignore[import-untyped]
import pytest
import torch

import objckpt
from objckpt.cli import main
from objckpt.errors import BucketNotFoundError, CheckpointExistsError, CredentialsRefusedError, StorageError
from objckpt.format import keys as layout
from testkit.rgw import Rgw

from conftest import assert_same
from mp import run_multiprocess
from rgw_fixture import new_bucket

MiB = 1 << 20
OLD = "20200101T000000-0123456789ab"  # an attempt id from long ago (gc's prey)
#: every character a URL encoder or a SigV4 canonicaliser may treat specially, spaces and non-ASCII
ODD = "+ = & % ~ ; , ( ) * ' ! $ @ : é 日本 😀"


def _state(seed: int, big: int = 0) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    st: dict[str, Any] = {
        "f32": torch.randn(64, 33, generator=g), "bf16": torch.randn(17, generator=g).to(torch.bfloat16),
        "i64": torch.randint(-(2 ** 40), 2 ** 40, (9, 2), generator=g), "flag": torch.tensor([True, False]),
        "empty": torch.zeros(0, 4), "step": seed, "name": f"run-{seed}", "lr": 1e-3,
    }
    if big:
        st["big"] = torch.randn(big // 4, generator=g)
    return st


def _blank(st: dict[str, Any]) -> dict[str, Any]:
    return {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else None for k, v in st.items()}


def _keys(gw: Rgw, bucket: str, prefix: str = "") -> list[str]:
    s3 = boto3.client("s3", **gw.client_options())
    out: list[str] = []
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        out += [o["Key"] for o in page.get("Contents", [])]
    return out


def _blob_parts(gw: Rgw, bucket: str, key: str) -> int:
    """How many parts RGW assembled the object from (its ETag's ``-N``; 1 for a single PUT)."""
    etag = boto3.client("s3", **gw.client_options()).head_object(Bucket=bucket, Key=key)["ETag"].strip('"')
    return int(etag.split("-")[1]) if "-" in etag else 1


def _cli_flags(gw: Rgw) -> list[str]:
    return ["--endpoint-url", gw.endpoint_url, "--region", gw.region, "--storage-options",
            json.dumps({"aws_access_key_id": gw.access_key, "aws_secret_access_key": gw.secret_key})]


# -- saves and loads ------------------------------------------------------------------------
@pytest.mark.parametrize("direct_http", [True, False])
def test_small_and_multipart_saves_load_and_read_bit_exact(rgw: Rgw, direct_http: bool) -> None:
    """A small checkpoint, then one whose blob is a multipart upload: a ``part_size`` below
    RGW's 5 MiB minimum is raised to it (else RGW refuses the upload with EntityTooSmall), so
    13 MiB of tensor bytes become 3 parts; both load and read back bit for bit."""
    bucket, opts = new_bucket(rgw), rgw.storage_options(direct_http=direct_http)
    small = _state(1)
    uri = f"s3://{bucket}/run/small"
    objckpt.save(small, uri, storage_options=opts, metadata={"kind": "small"})
    back = _blank(small)
    objckpt.load(back, uri, storage_options=opts)
    assert_same(back, small)
    assert_same(objckpt.read(uri, storage_options=opts), small)
    assert objckpt.inspect(uri, storage_options=opts).metadata == {"kind": "small"}

    big = _state(2, big=13 * MiB)
    uri = f"s3://{bucket}/run/big"
    res = objckpt.save(big, uri, storage_options=dict(opts, endpoint_kind="s3"), part_size=1 * MiB)
    (blob,) = res.files
    assert _blob_parts(rgw, bucket, f"run/big/{blob}") == 3  # 5 + 5 + the rest
    back = _blank(big)
    objckpt.load(back, uri, storage_options=opts)
    assert_same(back, big)
    got = objckpt.read(uri, ["big", "i64"], storage_options=opts)
    assert torch.equal(got["big"], big["big"]) and torch.equal(got["i64"], big["i64"])
    window = objckpt.read(uri, ["big"], storage_options=opts)["big"][5 * MiB // 4 - 3: 5 * MiB // 4 + 3]
    assert torch.equal(window, big["big"][5 * MiB // 4 - 3: 5 * MiB // 4 + 3])  # across a part boundary


def test_async_save_commits_in_order_and_loads(rgw_s3: tuple[str, dict[str, Any]]) -> None:
    bucket, opts = rgw_s3
    states = [_state(10 + i, big=6 * MiB) for i in range(3)]
    handles = [objckpt.async_save(st, f"s3://{bucket}/async/ck-{i}", storage_options=opts, max_in_flight=2)
               for i, st in enumerate(states)]
    for h in handles:
        h.result(timeout=120)
    for i, st in enumerate(states):
        back = _blank(st)
        objckpt.load(back, f"s3://{bucket}/async/ck-{i}", storage_options=opts)
        assert_same(back, st)


def test_manager_keeps_the_last_two_and_deletes_the_rest(rgw: Rgw) -> None:
    bucket = new_bucket(rgw)
    root, opts = f"s3://{bucket}/run", rgw.storage_options()
    with objckpt.CheckpointManager(root, keep_last=2, storage_options=opts) as m:
        for step in range(1, 6):
            m.save(step, _state(step, big=MiB * (step % 2)), metadata={"loss": 1.0 / step})
        m.wait()
        assert m.steps() == [4, 5] and m.latest_step() == 5
    keys = _keys(rgw, bucket, "run/")
    assert {k.split("/")[1] for k in keys} == {"step-0000000004", "step-0000000005", "_objckpt_index"}, keys
    with objckpt.CheckpointManager(root, storage_options=opts) as fresh:
        for step in (4, 5):
            want = _state(step, big=MiB * (step % 2))
            back = _blank(want)
            fresh.load(back, step=step)
            assert_same(back, want)


# -- two ranks ------------------------------------------------------------------------------
def _save_two_ranks_then_load_resharded(rank: int, world: int, uri: str, opts: dict[str, Any]) -> dict[str, bool]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    full = _full_tensors()
    state = {"rows": distribute_tensor(full["rows"], mesh, [Shard(0)]),  # 6 MiB a rank: multipart each
             "cols": distribute_tensor(full["cols"], mesh, [Shard(1)]),
             "rep": full["rep"], "step": 7}
    objckpt.save(state, uri, storage_options=opts, part_size=5 * MiB)
    tmpl: dict[str, Any] = {"rows": distribute_tensor(torch.zeros_like(full["rows"]), mesh, [Shard(1)]),
                            "cols": distribute_tensor(torch.zeros_like(full["cols"]), mesh, [Replicate()]),
                            "rep": distribute_tensor(torch.zeros_like(full["rep"]), mesh, [Shard(0)]), "step": 0}
    objckpt.load(tmpl, uri, storage_options=opts)
    ok = {k: torch.equal(tmpl[k].full_tensor(), full[k]) for k in ("rows", "cols", "rep")}
    ok["step"] = tmpl["step"] == 7
    return ok


def _full_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(77)
    return {"rows": torch.randn(3 * MiB // 1024, 1024, generator=g), "cols": torch.randn(12, 50, generator=g),
            "rep": torch.randn(10, 3, generator=g).to(torch.float64)}


def test_two_ranks_save_and_resharded_loads(rgw_s3: tuple[str, dict[str, Any]]) -> None:
    """Two gloo ranks save (each its half, multipart) and load every tensor sharded another
    way; one process then reads it whole."""
    bucket, opts = rgw_s3
    uri = f"s3://{bucket}/dist/ck"
    results = run_multiprocess(2, _save_two_ranks_then_load_resharded, uri, opts, timeout=240)
    assert results == [{"rows": True, "cols": True, "rep": True, "step": True}] * 2
    m = objckpt.inspect(uri, storage_options=opts)
    assert m.world_size == 2 and {b.rank for b in m.blobs} == {0, 1}
    back = objckpt.read(uri, storage_options=opts)
    for k, t in _full_tensors().items():
        assert torch.equal(back[k], t), k
    assert back["step"] == 7


# -- racing writers -------------------------------------------------------------------------
def _racer(rank: int, world: int, uris: list[str], opts: dict[str, Any]) -> list[str]:
    """Both processes save their own state to each URI at once (the gloo group is only the barrier)."""
    import torch.distributed as dist

    out = []
    for uri in uris:
        dist.barrier()
        try:
            objckpt.save(_state(100 + rank, big=MiB), uri, storage_options=opts, no_dist=True)
            out.append("ok")
        except CheckpointExistsError as e:
            out.append("exists: " + str(e))
    return out


def test_two_processes_saving_one_uri_one_wins(rgw: Rgw) -> None:
    """RGW honours ``If-None-Match: *`` on PutObject: per URI exactly one save returns, the
    other raises CheckpointExistsError naming the URI, the checkpoint is the winner's bit for
    bit and holds only the winner's blobs."""
    bucket, opts = new_bucket(rgw), rgw.storage_options()
    uris = [f"s3://{bucket}/race/ck-{i}" for i in range(6)]
    outcomes = run_multiprocess(2, _racer, uris, opts, timeout=240)
    for i, uri in enumerate(uris):
        got = [outcomes[w][i] for w in range(2)]
        winners = [w for w in range(2) if got[w] == "ok"]
        assert len(winners) == 1, (uri, got)
        assert got[1 - winners[0]].startswith("exists: ") and repr(uri) in got[1 - winners[0]], got
        back = _blank(_state(0, big=MiB))
        objckpt.load(back, uri, storage_options=opts)
        assert_same(back, _state(100 + winners[0], big=MiB))
        attempt = objckpt.inspect(uri, storage_options=opts).attempt
        blob_dirs = {k.split("/")[3] for k in _keys(rgw, bucket, f"race/ck-{i}/{layout.BLOB_DIR}/")}
        assert blob_dirs == {attempt}, (uri, blob_dirs)  # the loser deleted what it wrote


# -- the command line -----------------------------------------------------------------------
def test_cli_ls_info_verify_rm_gc(rgw: Rgw, capsys: pytest.CaptureFixture[str]) -> None:
    bucket, opts = new_bucket(rgw), rgw.storage_options()
    root, flags = f"s3://{bucket}/run", _cli_flags(rgw)
    with objckpt.CheckpointManager(root, storage_options=opts) as m:
        for step in (10, 20, 30):
            m.save(step, _state(step), metadata={"loss": step / 100})
    assert main(["ls", root, *flags]) == 0
    rows = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in rows[1:-1]] == ["10", "20", "30"] and rows[-1].startswith("3 step(s)")
    step20 = f"{root}/step-0000000020"
    assert main(["info", step20, *flags]) == 0
    out = capsys.readouterr().out
    assert "f32" in out and "float32" in out and "[64, 33]" in out and '"loss": 0.2' in out
    assert main(["verify", step20, *flags]) == 0
    assert "ok: 5 tensors" in capsys.readouterr().out

    # a flipped byte in a blob (same length): verify names the damage
    s3 = boto3.client("s3", **rgw.client_options())
    blob_key = f"run/step-0000000030/{objckpt.inspect(f'{root}/step-0000000030', storage_options=opts).blobs[0].name}"
    data = bytearray(s3.get_object(Bucket=bucket, Key=blob_key)["Body"].read())
    data[10] ^= 0xFF
    s3.put_object(Bucket=bucket, Key=blob_key, Body=bytes(data))
    assert main(["verify", f"{root}/step-0000000030", *flags]) == 2
    assert "crc32c mismatch" in capsys.readouterr().err

    assert main(["rm", step20, *flags]) == 0
    assert "removed step 20 from the index" in capsys.readouterr().out
    assert not _keys(rgw, bucket, "run/step-0000000020/")
    assert objckpt.CheckpointManager(root, storage_options=opts).steps() == [10, 30]
    assert main(["rm", step20, *flags]) == 2
    assert "step-0000000020" in capsys.readouterr().err

    # what a killed save leaves: an old attempt's blob and an old multipart upload
    stale_blob = f"run/step-0000000010/{layout.BLOB_DIR}/{OLD}/r00000-0000.bin"
    s3.put_object(Bucket=bucket, Key=stale_blob, Body=b"junk")
    stale_upload = f"run/step-0000000010/{layout.BLOB_DIR}/{OLD}/r00001-0000.bin"
    s3.create_multipart_upload(Bucket=bucket, Key=stale_upload)
    assert main(["gc", root, "--dry-run", *flags]) == 0
    assert f"would delete {stale_blob}" in capsys.readouterr().out
    assert stale_blob in _keys(rgw, bucket, "run/")
    assert main(["gc", root, *flags]) == 0
    out = capsys.readouterr().out
    assert f"deleted {stale_blob}" in out and f"aborted upload {stale_upload}" in out, out
    assert stale_blob not in _keys(rgw, bucket, "run/")
    assert not s3.list_multipart_uploads(Bucket=bucket).get("Uploads")
    assert_same(objckpt.read(f"{root}/step-0000000010", storage_options=opts), _state(10))


def test_cli_as_a_program(rgw_s3: tuple[str, dict[str, Any]], rgw: Rgw) -> None:
    """``python -m objckpt`` in its own process: the flags carry endpoint and keys."""
    bucket, opts = rgw_s3
    uri = f"s3://{bucket}/prog/ck"
    objckpt.save(_state(3), uri, storage_options=opts)
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    r = subprocess.run([sys.executable, "-m", "objckpt", "ls", f"s3://{bucket}/prog", "--objects", *_cli_flags(rgw)],
                       capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0 and r.stdout.split() == [uri], r.stderr


# -- refusals -------------------------------------------------------------------------------
@pytest.mark.parametrize("direct_http", [True, False])
def test_wrong_keys_and_missing_bucket_are_named(rgw: Rgw, direct_http: bool) -> None:
    bucket = new_bucket(rgw)
    opts = rgw.storage_options(direct_http=direct_http)
    with pytest.raises(CredentialsRefusedError) as ei:
        objckpt.save(_state(1), f"s3://{bucket}/k/ck", storage_options=dict(opts, aws_secret_access_key="wrong"))
    msg = str(ei.value)
    assert isinstance(ei.value, StorageError) and "SignatureDoesNotMatch" in msg and rgw.endpoint_url in msg
    assert "aws_secret_access_key" in msg, msg
    with pytest.raises(CredentialsRefusedError) as ei:
        objckpt.read(f"s3://{bucket}/k/ck", storage_options=dict(opts, aws_access_key_id="NOSUCHKEY"))
    msg = str(ei.value)
    assert "InvalidAccessKeyId" in msg and rgw.endpoint_url in msg and "aws_access_key_id" in msg, msg
    for call in (lambda u: objckpt.save(_state(1), u, storage_options=opts),
                 lambda u: objckpt.read(u, storage_options=opts)):
        with pytest.raises(BucketNotFoundError) as be:
            call("s3://no-such-bucket-here/k/ck")
        assert be.value.bucket == "no-such-bucket-here" and "no-such-bucket-here" in str(be.value)
    assert not _keys(rgw, bucket)  # nothing was written with the wrong keys


# -- odd key characters ---------------------------------------------------------------------
@pytest.mark.parametrize("direct_http", [True, False])
def test_special_characters_in_keys_through_rgw_sigv4(rgw: Rgw, direct_http: bool) -> None:
    """A prefix with every character SigV4 canonicalisation treats specially, spaces and
    non-ASCII: saved (a multipart blob too), listed, read, loaded and deleted under exactly
    those characters, every request passing RGW's own signature check."""
    bucket, opts = new_bucket(rgw), rgw.storage_options(direct_http=direct_http, endpoint_kind="s3")
    prefix = f"odd {ODD}/ck {ODD}"
    uri = f"s3://{bucket}/{prefix}"
    st = _state(5, big=6 * MiB)
    res = objckpt.save(st, uri, storage_options=opts, part_size=5 * MiB, metadata={"odd": ODD})
    keys = _keys(rgw, bucket)
    assert f"{prefix}/manifest.json" in keys and all(k.startswith(prefix + "/") for k in keys), keys
    assert _blob_parts(rgw, bucket, f"{prefix}/{res.files[0]}") == 2
    back = _blank(st)
    objckpt.load(back, uri, storage_options=opts)
    assert_same(back, st)
    assert_same(objckpt.read(uri, storage_options=opts), st)
    assert objckpt.inspect(uri, storage_options=opts).metadata == {"odd": ODD}
    with pytest.raises(CheckpointExistsError):
        objckpt.save(st, uri, storage_options=opts)
    root = f"s3://{bucket}/mgr {ODD}"
    with objckpt.CheckpointManager(root, keep_last=1, storage_options=opts) as m:
        m.save(1, _state(1))
        m.save(2, _state(2))
        m.wait()
        assert m.steps() == [2]
    assert {k.split("/")[1] for k in _keys(rgw, bucket, f"mgr {ODD}/")} == {"step-0000000002", "_objckpt_index"}
    objckpt.delete(uri, storage_options=opts)
    assert not _keys(rgw, bucket, prefix)


# -- what RGW does with the requests objckpt relies on --------------------------------------
def test_store_facts_of_rgw(rgw_s3: tuple[str, dict[str, Any]], rgw: Rgw) -> None:
    """The row of docs' store table for Ceph RGW 16.2, measured: create-only PutObject is
    honoured, create-only CompleteMultipartUpload is not (objckpt commits with a PutObject),
    checksums are neither checked nor stored nor returned, DeleteObjects works, and a non-last
    part must be at least 5 MiB (exactly: 5 MiB passes, one byte less is EntityTooSmall)."""
    from testkit.store_probe import probe

    bucket, _ = rgw_s3
    facts = probe(rgw.endpoint_url, bucket, rgw.access_key, rgw.secret_key)
    want = {"put_if_none_match": True, "complete_if_none_match": False, "part_checksum_checked": False,
            "put_checksum_checked": False, "part_checksum_echoed": False, "head_checksum_put": False,
            "head_checksum_multipart": False, "complete_returns_checksum": False, "delete_objects": True,
            "min_part_size_enforced": True}
    assert {k: getattr(facts, k) for k in want} == want, facts.notes
    s3 = boto3.client("s3", **rgw.client_options())

    def complete(first_part: int) -> str:
        key = f"min-part/{first_part}"
        uid = s3.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
        parts = [{"PartNumber": n, "ETag": s3.upload_part(Bucket=bucket, Key=key, UploadId=uid, PartNumber=n,
                                                          Body=body)["ETag"]}
                 for n, body in ((1, b"a" * first_part), (2, b"tail"))]
        try:
            s3.complete_multipart_upload(Bucket=bucket, Key=key, UploadId=uid, MultipartUpload={"Parts": parts})
        except s3.exceptions.ClientError as e:
            s3.abort_multipart_upload(Bucket=bucket, Key=key, UploadId=uid)
            return str(e.response["Error"]["Code"])
        s3.delete_object(Bucket=bucket, Key=key)
        return "ok"

    assert complete(5 * MiB) == "ok" and complete(5 * MiB - 1) == "EntityTooSmall"


# -- the kit itself -------------------------------------------------------------------------
def test_available_names_what_is_missing(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    from testkit import rgw as kit

    monkeypatch.setenv("PATH", str(tmp_path))  # no Ceph binary on it
    why = kit.available()
    assert why is not None and "radosgw" in why and "ceph-mon" in why and "apt-get install" in why, why


def test_a_failed_start_leaves_no_daemon_and_no_directory(tmp_path: Any) -> None:
    """radosgw given one try to answer (it needs some seconds): the start fails with an error
    that carries the daemons' logs, after stopping the monitor and OSD it had started."""
    from testkit import rgw as kit

    if (why := kit.available()) is not None:
        pytest.skip(f"Ceph RGW cannot run here: {why}")
    d = str(tmp_path / "gw")
    with pytest.raises(kit.RgwStartError) as ei:
        kit.start(d, ready_tries=1)
    msg = str(ei.value)
    assert "no answer to an anonymous ListBuckets after 1 tries" in msg and "--- mon.a.log:" in msg, msg
    assert not os.path.exists(d)
    conf = os.path.join(d, "ceph.conf").encode()
    left = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if conf in f.read():
                    left.append(pid)
        except OSError:
            pass
    assert not left, f"daemons left running: {left}"
