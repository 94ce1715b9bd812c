"""A bucket in another region than the one the client signs for (issue 22).

Round trips in new processes (nothing learned beforehand) against moto behind
:class:`region_proxy.RegionProxy`, which refuses requests signed for the wrong
region exactly as S3 does: bare 400 to HeadObject, bare 301 with
``x-amz-bucket-region`` to HeadBucket, ``301 PermanentRedirect`` or ``400
AuthorizationHeaderMalformed`` to everything else.  Save, read, load and delete
must succeed on both transports, the direct path must stay the direct path
(the redirect is followed, not fled), and a PUT body refused once must go out
again whole.  botocore's transport runs once with ``awscrt`` importable (botocore
then signs through the CRT) and once with it made unimportable.
"""
from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import textwrap
from typing import Any

import boto3
import pytest

from conftest import make_bucket, s3_options
from region_proxy import RegionProxy

from objckpt.storage.s3.direct import Target
from objckpt.storage.s3.transport import retargeted

CHILD = textwrap.dedent("""
    import sys
    if sys.argv[1] == "nocrt":
        sys.modules["awscrt"] = None  # as if boto3[crt] were not installed
    import json, os, torch, objckpt
    for k in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "NO_PROXY", "no_proxy", "ALL_PROXY"):
        os.environ.pop(k, None)
    from objckpt.runtime import loop as _runtime
    from objckpt.storage import open_store

    out = []
    for spec in json.loads(sys.argv[2]):
        opts = {"endpoint_url": spec["endpoint"], "aws_access_key_id": "testing", "aws_secret_access_key": "testing",
                "region_name": "us-east-1"}
        if spec["via"] == "proxy":  # botocore's transport because a proxy applies (direct_http left on)
            opts["endpoint_url"] = spec["upstream"]
            os.environ["HTTP_PROXY"] = spec["endpoint"]
        else:
            opts["direct_http"] = spec["direct"]
            os.environ.pop("HTTP_PROXY", None)
        # a body refused as sent to the wrong region goes out again (the first request of its bucket)
        store = open_store("s3://" + spec["put_bucket"], opts)[0]
        _runtime.run(store.put("first.bin", bytes(range(256)) * 400))
        # a whole round trip whose first request is a HEAD (answered by a bare 400)
        uri = "s3://" + spec["bucket"] + "/run/ck"
        state = {"w": torch.arange(3 << 19, dtype=torch.float32), "b": torch.ones(7)}
        objckpt.save(state, uri, storage_options=opts, part_size=5 << 20)  # 6 MiB: two parts
        back = objckpt.read(uri, storage_options=opts)
        into = {"w": torch.empty(3 << 19), "b": torch.empty(7)}
        objckpt.load(into, uri, storage_options=opts)
        same = all(torch.equal(back[k], state[k]) and torch.equal(into[k], state[k]) for k in state)
        objckpt.delete(uri, storage_options=opts)
        s = open_store("s3://" + spec["bucket"], opts)[0]
        out.append({"same": same, "direct_kept": type(_runtime.run(s.transport())).__name__ == "DirectTransport"})
    print("RESULT " + json.dumps({"runs": out, "crt": sys.modules.get("awscrt") is not None}))
""")


def _check(result: dict[str, Any], proxies: list[RegionProxy], specs: list[dict[str, Any]], client: Any) -> None:
    for p, spec, run in zip(proxies, specs, result["runs"]):
        what = (p.mode, "direct" if spec["direct"] else "botocore", spec["via"],
                "awscrt" if result["crt"] else "no awscrt")
        assert run["same"], what
        # the redirects happened: a HEAD refused bare, a body refused (301 or 400) and sent again
        assert p.refused["HEAD"] >= 1 and p.refused["PUT"] >= 1, (what, p.log)
        if spec["direct"]:  # followed on the direct path, never handed to botocore mid-flight
            assert run["direct_kept"], what
        if spec["via"] == "proxy":  # the proxy saw the requests only as HTTP_PROXY: botocore's transport
            assert not run["direct_kept"], what
        body = client.get_object(Bucket=spec["put_bucket"], Key="first.bin")["Body"].read()
        assert body == bytes(range(256)) * 400, what
        # delete went through as well: nothing of the checkpoint is left
        assert not client.list_objects_v2(Bucket=spec["bucket"]).get("Contents"), what


def test_wrong_region_round_trips_in_new_processes(moto_endpoint: str) -> None:
    """Two new processes at once.  One with awscrt importable: the direct path behind a
    proxy answering 301 and one answering 400, and botocore's behind one answering 400;
    botocore then signs through the CRT, which must take the zero-copy body as a stream
    (every save failed: "a bytes-like object is required, not 'ViewsPayload'"), and
    its redirector must rewind the body ("Need to rewind the stream"); and botocore's
    again because ``HTTP_PROXY`` is set (the proxy redirecting, direct_http left on).
    The other with awscrt unimportable: botocore's path behind a 301 proxy, signing
    in Python."""
    client = boto3.client("s3", **s3_options(moto_endpoint))
    # (transport, the proxy's answer): True direct, False botocore (direct_http=False), "proxy" botocore (HTTP_PROXY)
    runs: dict[str, list[tuple[Any, str]]] = {
        "crt": [(True, "301"), (True, "400"), (False, "400"), ("proxy", "301")], "nocrt": [(False, "301")]}
    proxies = {name: [RegionProxy(moto_endpoint, mode=mode) for _, mode in which] for name, which in runs.items()}
    with contextlib.ExitStack() as stack:
        specs: dict[str, list[dict[str, Any]]] = {}
        children = {}
        for name, which in runs.items():
            for p in proxies[name]:
                stack.enter_context(p)
            specs[name] = [{"endpoint": p.endpoint_url, "upstream": moto_endpoint, "direct": direct is True,
                            "via": "proxy" if direct == "proxy" else "option", "bucket": make_bucket(moto_endpoint),
                            "put_bucket": make_bucket(moto_endpoint)} for p, (direct, _) in zip(proxies[name], which)]
            children[name] = subprocess.Popen([sys.executable, "-c", CHILD, name, json.dumps(specs[name])],
                                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for child in children.values():
            stack.callback(child.kill)  # (a no-op once it has exited)
        for name, child in children.items():
            out, err = child.communicate(timeout=180)
            assert child.returncode == 0, (name, err[-3000:])
            result = json.loads(out.split("RESULT ", 1)[1])
            assert result["crt"] is (name == "crt"), "awscrt (in the [test] extra) must be importable for this test"
            _check(result, proxies[name], specs[name], client)


def test_a_redirect_moves_an_aws_target_to_the_regional_host() -> None:
    """On AWS the region decides the host as well as the signature; a custom
    endpoint (MinIO, moto, a proxy) keeps its host and only signs for the region."""
    def t(host: str, port: int = 443) -> Target:
        return Target("https", host, port, host, "", "us-east-1")

    moved = retargeted(t("bkt.s3.us-east-1.amazonaws.com"), "eu-west-1")
    assert (moved.host, moved.host_header, moved.region) == (
        "bkt.s3.eu-west-1.amazonaws.com", "bkt.s3.eu-west-1.amazonaws.com", "eu-west-1")
    assert retargeted(t("s3.amazonaws.com"), "ap-south-1").host == "s3.ap-south-1.amazonaws.com"
    custom = retargeted(t("minio.internal", 9000), "eu-west-1")
    assert (custom.host, custom.port, custom.region) == ("minio.internal", 9000, "eu-west-1")


def test_a_bare_400_to_head_in_the_right_region_is_an_error_not_a_loop(moto_endpoint: str) -> None:
    """A bare 400 that is not about the region (HeadBucket names the region signed for)
    is sent again once, then reported, naming the request."""
    import objckpt
    from objckpt.errors import StorageError

    bucket = make_bucket(moto_endpoint)
    with RegionProxy(moto_endpoint, mode="400", bucket_region="us-east-1") as p:
        p.always_refuse_head_object = True
        opts: dict[str, Any] = {**s3_options(p.endpoint_url), "error_attempts": 1}
        with pytest.raises(StorageError, match=r"HEAD s3://.*manifest\.json.*bare HTTP 400.*not a region problem"):
            objckpt.save({"x": __import__("torch").ones(3)}, f"s3://{bucket}/ck", storage_options=opts)
        assert p.refused["HEAD"] == 2  # the first, and the one resend after HeadBucket said us-east-1
        assert not p.refused["PUT"]
