"""Where S3 requests go, proved against botocore (storage/s3/config.py).

For each configuration (environment, AWS config file, profiles, storage options
and their combinations) objckpt's resolved :class:`S3Config` must give the
endpoint, region, URL of a GetObject, signing region, addressing, CA bundle and
proxy that a real botocore client built from the same inputs uses; nothing is
sent (a ``before-sign`` hook captures the request).  Then the deliberate
differences, the transport choice and its log line, bad input, and the
credential chain.
"""
from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import certifi
import pytest

from objckpt.storage.s3.config import NoCredentialsError, S3Config, S3ConfigError, Transport
from objckpt.storage.s3.credentials import Credentials

_CLEARED = ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY", "SSL_CERT_FILE", "REQUESTS_CA_BUNDLE",
            "OBJCKPT_S3_DIRECT_HTTP")


@pytest.fixture
def aws(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    """An environment with no AWS settings but empty config and credentials files in
    ``tmp_path`` (and copies of a real CA bundle there: ca.pem, ca2.pem)."""
    for k in list(os.environ):
        if k.startswith("AWS_") or k.upper() in _CLEARED:
            monkeypatch.delenv(k)
    (tmp_path / "config").write_text("")
    (tmp_path / "credentials").write_text("")
    for name in ("ca.pem", "ca2.pem"):
        shutil.copy(certifi.where(), tmp_path / name)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    yield tmp_path


@dataclass
class Case:
    name: str
    env: dict[str, str] = field(default_factory=dict)
    config: str = ""  # the AWS config file; {dir} is the test's directory
    options: dict[str, Any] = field(default_factory=dict)
    bucket: str = "my-bucket"
    path_default: bool = False  # a custom endpoint with no addressing style: objckpt's path-style default


CASES = [
    Case("nothing set"),
    Case("AWS_DEFAULT_REGION", env={"AWS_DEFAULT_REGION": "eu-west-1"}),
    Case("region only in the config file", config="[default]\nregion = eu-west-1\n"),
    Case("AWS_PROFILE picks a profile", env={"AWS_PROFILE": "prod"},
         config="[default]\nregion = eu-west-1\n[profile prod]\nregion = ap-southeast-2\n"),
    Case("profile option", options={"profile": "prod"},
         config="[default]\nregion = eu-west-1\n[profile prod]\nregion = ap-southeast-2\n"),
    Case("region option beats the environment", env={"AWS_DEFAULT_REGION": "eu-west-1"},
         options={"region_name": "us-west-2"}),
    Case("environment beats the config file", env={"AWS_DEFAULT_REGION": "eu-north-1"},
         config="[default]\nregion = eu-west-1\n"),
    Case("dotted bucket on AWS", bucket="my.dotted.bucket", env={"AWS_DEFAULT_REGION": "eu-west-1"}),
    Case("bucket name that is no DNS label", bucket="My_Bucket", env={"AWS_DEFAULT_REGION": "eu-west-1"}),
    Case("path style option on AWS", options={"addressing_style": "path", "region_name": "eu-west-1"}),
    Case("virtual style option, dotted bucket", bucket="a.b", options={"addressing_style": "virtual"}),
    Case("path style in the config file", config="[default]\nregion = us-west-2\ns3 =\n  addressing_style = path\n"),
    Case("endpoint option, IP", options={"endpoint_url": "http://127.0.0.1:9000"}, path_default=True),
    Case("endpoint option, name, virtual style",
         options={"endpoint_url": "https://minio.example.com", "addressing_style": "virtual"}),
    Case("endpoint option with a base path", options={"endpoint_url": "https://gw.example.com/s3/"},
         path_default=True),
    Case("AWS_ENDPOINT_URL", env={"AWS_ENDPOINT_URL": "http://127.0.0.1:9001"}, path_default=True),
    Case("AWS_ENDPOINT_URL_S3 beats AWS_ENDPOINT_URL",
         env={"AWS_ENDPOINT_URL": "http://127.0.0.1:9001", "AWS_ENDPOINT_URL_S3": "http://127.0.0.1:9002"},
         path_default=True),
    Case("endpoint_url in the config file", config="[default]\nendpoint_url = http://127.0.0.1:9003\n",
         path_default=True),
    Case("services section of the config file",
         config="[default]\nservices = local\n[services local]\ns3 =\n  endpoint_url = http://127.0.0.1:9004\n",
         path_default=True),
    Case("endpoint option beats the environment", env={"AWS_ENDPOINT_URL": "http://127.0.0.1:9001"},
         options={"endpoint_url": "http://127.0.0.1:9005"}, path_default=True),
    Case("configured endpoints ignored",
         env={"AWS_ENDPOINT_URL": "http://127.0.0.1:9001", "AWS_IGNORE_CONFIGURED_ENDPOINT_URLS": "true"}),
    Case("FIPS from the environment", env={"AWS_USE_FIPS_ENDPOINT": "true", "AWS_DEFAULT_REGION": "us-east-2"}),
    Case("FIPS in the config file", config="[default]\nregion = us-west-2\nuse_fips_endpoint = true\n"),
    Case("dual-stack from the environment",
         env={"AWS_USE_DUALSTACK_ENDPOINT": "true", "AWS_DEFAULT_REGION": "eu-west-1"}),
    Case("dual-stack in the s3 section", config="[default]\nregion = eu-west-1\ns3 =\n  use_dualstack_endpoint = true\n"),
    Case("acceleration in the s3 section", config="[default]\nregion = eu-west-1\ns3 =\n  use_accelerate_endpoint = true\n"),
    Case("FIPS and dual-stack together",
         config="[default]\nregion = us-east-1\nuse_fips_endpoint = true\nuse_dualstack_endpoint = true\n"),
    Case("China partition", options={"region_name": "cn-north-1"}),
    Case("us-east-1 regional endpoint", config="[default]\nregion = us-east-1\ns3 =\n  us_east_1_regional_endpoint = regional\n"),
    Case("AWS_CA_BUNDLE", env={"AWS_CA_BUNDLE": "{dir}/ca.pem"}),
    Case("ca_bundle in the config profile", config="[default]\nca_bundle = {dir}/ca.pem\n"),
    Case("ca_bundle option beats AWS_CA_BUNDLE", env={"AWS_CA_BUNDLE": "{dir}/ca.pem"},
         options={"ca_bundle": "{dir}/ca2.pem"}),
    Case("AWS_CA_BUNDLE beats REQUESTS_CA_BUNDLE",
         env={"AWS_CA_BUNDLE": "{dir}/ca.pem", "REQUESTS_CA_BUNDLE": "{dir}/ca2.pem"}),
    Case("REQUESTS_CA_BUNDLE", env={"REQUESTS_CA_BUNDLE": "{dir}/ca2.pem"}),
    Case("verify off", options={"verify": False, "endpoint_url": "https://127.0.0.1:9443"}, path_default=True),
    Case("HTTPS_PROXY on AWS", env={"HTTPS_PROXY": "http://proxy.example:3128", "AWS_DEFAULT_REGION": "eu-west-1"}),
    Case("lower-case https_proxy", env={"https_proxy": "http://proxy.example:3129"}),
    Case("NO_PROXY covers AWS", env={"HTTPS_PROXY": "http://proxy.example:3128", "NO_PROXY": ".amazonaws.com"}),
    Case("HTTP_PROXY, custom endpoint", env={"HTTP_PROXY": "http://proxy.example:3128"},
         options={"endpoint_url": "http://10.1.2.3:9000"}, path_default=True),
    Case("NO_PROXY covers the custom endpoint",
         env={"HTTP_PROXY": "http://proxy.example:3128", "NO_PROXY": "localhost,10.1.2.3"},
         options={"endpoint_url": "http://10.1.2.3:9000"}, path_default=True),
    Case("ALL_PROXY is not botocore's", env={"ALL_PROXY": "http://proxy.example:3128"}),
    Case("everything from one profile", env={"AWS_PROFILE": "lab"},
         config="[profile lab]\nregion = eu-central-1\nendpoint_url = https://127.0.0.1:9443\nca_bundle = {dir}/ca.pem\n"
                "s3 =\n  addressing_style = path\n"),
    Case("unsigned requests", options={"unsigned": True, "region_name": "us-west-2"}),
]


def _fill(value: Any, d: Path) -> Any:
    return value.replace("{dir}", str(d)) if isinstance(value, str) else value


def _apply(case: Case, d: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    (d / "config").write_text(_fill(case.config, d))
    for k, v in case.env.items():
        monkeypatch.setenv(k, _fill(v, d))
    return {k: _fill(v, d) for k, v in case.options.items()}


_LOADER: dict[str, Any] = {}


def botocore_sees(bucket: str, options: dict[str, Any], path_default: bool) -> dict[str, Any]:
    """What a botocore client built from the same inputs does with a GetObject of ``bucket``."""
    import botocore.session
    from botocore import UNSIGNED
    from botocore.config import Config
    from botocore.httpsession import get_cert_path

    session = botocore.session.Session(profile=options.get("profile"))
    _LOADER.setdefault("loader", session.get_component("data_loader"))  # the service's JSON, read once
    session.register_component("data_loader", _LOADER["loader"])
    s3: dict[str, Any] = {}
    if options.get("addressing_style"):
        s3["addressing_style"] = options["addressing_style"]
    elif path_default:
        s3["addressing_style"] = "path"
    verify = False if options.get("verify") is False else options.get("ca_bundle")
    client = session.create_client("s3", region_name=options.get("region_name"),
                                   endpoint_url=options.get("endpoint_url"), verify=verify,
                                   config=Config(signature_version=UNSIGNED, s3=s3 or None))
    seen: dict[str, Any] = {}

    class Stop(Exception):
        pass

    def grab(request: Any, region_name: str, **_: Any) -> None:
        seen.update(url=request.url, signing=region_name)
        raise Stop

    client.meta.events.register("before-sign.s3.GetObject", grab)
    with pytest.raises(Stop):
        client.get_object(Bucket=bucket, Key="k")
    http = client._endpoint.http_session
    return {"endpoint": client.meta.endpoint_url, "region": client.meta.region_name, "url": seen["url"],
            "signing_region": seen["signing"], "addressing": (client.meta.config.s3 or {}).get("addressing_style", "auto"),
            "ca": get_cert_path(http._verify) if http._verify else False,
            "proxy": http._proxy_config.proxy_url_for(seen["url"])}


def objckpt_sees(cfg: S3Config) -> dict[str, Any]:
    t = cfg.target
    return {"endpoint": cfg.client_endpoint, "region": cfg.region.value,
            "url": f"{t.scheme}://{t.host_header}{t.prefix}/k", "signing_region": t.region,
            "addressing": cfg.addressing_style.value, "ca": cfg.ca_bundle.value if cfg.verify else False,
            "proxy": cfg.proxy.value}


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_resolution_matches_botocore(case: Case, aws: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    options = _apply(case, aws, monkeypatch)
    cfg = S3Config.resolve(case.bucket, options)
    assert objckpt_sees(cfg) == botocore_sees(case.bucket, options, case.path_default)
    # the aiobotocore client is built from the same values: nothing left for it to resolve differently
    kw, ckw = cfg.client_args()
    assert kw["region_name"] == cfg.region.value and kw.get("endpoint_url") == cfg.endpoint_url.value
    assert kw["verify"] == (cfg.ca_bundle.value if cfg.verify else False)
    assert ckw["s3"]["addressing_style"] == cfg.addressing_style.value


def test_there_are_at_least_thirty_configurations() -> None:
    assert len(CASES) >= 30 and len({c.name for c in CASES}) == len(CASES)


def test_the_issue_cases_resolve_where_boto3_sends(aws: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The rows of the issue, each of which the own path got wrong before."""
    (aws / "config").write_text("[default]\nregion = eu-west-1\n")
    t = S3Config.resolve("bkt", {}).target
    assert (t.host, t.region) == ("bkt.s3.eu-west-1.amazonaws.com", "eu-west-1")  # signed us-east-1 before
    (aws / "config").write_text("[default]\nendpoint_url = http://127.0.0.1:9/\n")
    t = S3Config.resolve("bkt", {}).target
    assert (t.host, t.port, t.prefix) == ("127.0.0.1", 9, "/bkt")  # sent to AWS before
    (aws / "config").write_text(f"[default]\nregion = us-west-2\nuse_fips_endpoint = true\n"
                                f"s3 =\n  use_dualstack_endpoint = true\n")
    assert S3Config.resolve("bkt", {}).target.host == "bkt.s3-fips.dualstack.us-west-2.amazonaws.com"
    (aws / "config").write_text(f"[default]\nca_bundle = {aws}/ca.pem\n")
    assert S3Config.resolve("bkt", {}).target.cafile == f"{aws}/ca.pem"  # the system's CAs before


def test_aws_region_is_read_after_botocores_sources(aws: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """botocore ignores AWS_REGION (the other AWS SDKs read it): objckpt reads it only where
    botocore finds no region, and both transports sign the region it gives."""
    monkeypatch.setenv("AWS_REGION", "eu-west-3")
    cfg = S3Config.resolve("bkt", {})
    assert cfg.region.value == cfg.target.region == cfg.client_args()[0]["region_name"] == "eu-west-3"
    assert "AWS_REGION" in cfg.region.source and cfg.target.host == "bkt.s3.eu-west-3.amazonaws.com"
    monkeypatch.setenv("AWS_DEFAULT_REGION", "eu-south-1")  # botocore's own source wins
    assert S3Config.resolve("bkt", {}).region == type(cfg.region)("eu-south-1", "environment variable AWS_DEFAULT_REGION")


def test_ssl_cert_file_is_trusted_on_both_transports(aws: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Only SSL_CERT_FILE set: botocore alone would verify against certifi (so deletes,
    listings and gc failed while the own path's reads worked); objckpt hands the same
    bundle to both transports, after botocore's own CA settings."""
    monkeypatch.setenv("SSL_CERT_FILE", f"{aws}/ca2.pem")
    cfg = S3Config.resolve("bkt", {"endpoint_url": "https://127.0.0.1:9443"})
    assert cfg.target.cafile == cfg.client_args()[0]["verify"] == f"{aws}/ca2.pem"
    assert "SSL_CERT_FILE" in cfg.ca_bundle.source and "SSL_CERT_FILE" in cfg.endpoint()
    monkeypatch.setenv("AWS_CA_BUNDLE", f"{aws}/ca.pem")
    assert S3Config.resolve("bkt", {}).target.cafile == f"{aws}/ca.pem"


def test_transport_is_chosen_once_and_logged_with_the_reason(aws: Path, monkeypatch: pytest.MonkeyPatch,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="objckpt.storage")
    opts = {"endpoint_url": "http://127.0.0.1:9000"}
    monkeypatch.setenv("HTTP_PROXY", "http://proxy.example:3128")
    cfg = S3Config.resolve("bkt", opts)
    assert cfg.transport is Transport.BOTOCORE and cfg.proxy.value == "http://proxy.example:3128"
    assert "proxy http://proxy.example:3128 (environment variable HTTP_PROXY)" in cfg.transport_reason
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    cfg = S3Config.resolve("bkt", opts)
    assert cfg.transport is Transport.DIRECT and cfg.proxy.value is None
    assert "HTTP_PROXY bypassed by NO_PROXY" in cfg.transport_reason
    assert cfg.target.host == "127.0.0.1"
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert len(lines) == 2
    assert "s3://bkt: botocore transport (requests go through proxy" in lines[0]
    assert "s3://bkt: direct transport (objckpt's own HTTP path (HTTP_PROXY bypassed by NO_PROXY" in lines[1]
    monkeypatch.setenv("OBJCKPT_S3_DIRECT_HTTP", "off")
    assert S3Config.resolve("bkt", opts).transport_reason == "direct_http is off"


def test_extra_headers_per_operation(aws: Path) -> None:
    cfg = S3Config.resolve("bkt", {"request_payer": "requester", "sse_kms_key_id": "arn:aws:kms:k"})
    sse = {"x-amz-server-side-encryption": "aws:kms", "x-amz-server-side-encryption-aws-kms-key-id": "arn:aws:kms:k"}
    assert cfg.extra_headers("PutObject") == {"x-amz-request-payer": "requester", **sse}
    assert cfg.extra_headers("CreateMultipartUpload") == {"x-amz-request-payer": "requester", **sse}
    assert cfg.extra_headers("UploadPart") == cfg.extra_headers("GetObject") == {"x-amz-request-payer": "requester"}
    assert S3Config.resolve("bkt", {}).extra_headers("PutObject") == {}


@pytest.mark.parametrize("setup, options, setting, source", [
    ({}, {"region": "eu-west-1"}, "region", "storage_options"),
    ({"config": "[default]\nca_bundle = {dir}/missing.pem\n"}, {"endpoint_url": "https://h:1"}, "ca_bundle",
     "profile 'default' of {dir}/config"),
    ({"env": {"AWS_CA_BUNDLE": "{dir}/config"}}, {}, "ca_bundle", "environment variable AWS_CA_BUNDLE"),
    ({}, {"ca_bundle": "{dir}/nope"}, "ca_bundle", "storage option ca_bundle"),
    ({"env": {"AWS_DEFAULT_REGION": "eu west 1"}}, {}, "region", "environment variable AWS_DEFAULT_REGION"),
    ({"config": "[default]\nregion = eu_west!\n"}, {}, "region", "profile 'default' of {dir}/config"),
    ({"env": {"AWS_PROFILE": "nosuch"}}, {}, "profile", "environment variable AWS_PROFILE"),
    ({}, {"profile": "nosuch"}, "profile", "storage option profile"),
    ({"config": "[default]\nendpoint_url = ftp://h/\n"}, {}, "endpoint_url", "profile 'default' of {dir}/config"),
    ({}, {"addressing_style": "sideways"}, "addressing_style", "storage option addressing_style"),
    ({}, {"request_payer": "me"}, "request_payer", "storage option"),
    ({}, {"aws_access_key_id": "AKIA"}, "aws_secret_access_key", "storage options"),
])
def test_bad_input_names_the_setting_and_its_source(aws: Path, monkeypatch: pytest.MonkeyPatch, setup: dict[str, Any],
                                                    options: dict[str, Any], setting: str, source: str) -> None:
    case = Case("bad", env=setup.get("env", {}), config=setup.get("config", ""), options=options)
    opts = _apply(case, aws, monkeypatch)
    with pytest.raises(ValueError) as info:
        S3Config.resolve("bkt", opts)
    assert _fill(source, aws) in str(info.value)
    if setting:
        assert isinstance(info.value, S3ConfigError) and info.value.setting == setting
        assert info.value.source == _fill(source, aws)


def test_credentials_follow_botocores_chain(aws: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (aws / "credentials").write_text("[default]\naws_access_key_id = FILEKEY\naws_secret_access_key = filesecret\n"
                                     "[prof]\naws_access_key_id = PROFKEY\naws_secret_access_key = profsecret\n")
    assert S3Config.resolve("b", {}).credentials().get() == Credentials("FILEKEY", "filesecret", None)  # type: ignore[union-attr]
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "ENVKEY")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "envsecret")
    monkeypatch.setenv("AWS_SESSION_TOKEN", "tok")
    assert S3Config.resolve("b", {}).credentials().get() == Credentials("ENVKEY", "envsecret", "tok")  # type: ignore[union-attr]
    # AWS_PROFILE does not hide the environment's keys from botocore (it did from the own path)
    monkeypatch.setenv("AWS_PROFILE", "prof")
    assert S3Config.resolve("b", {}).credentials().get().access_key == "ENVKEY"  # type: ignore[union-attr]
    # a profile given to the session does
    assert S3Config.resolve("b", {"profile": "prof"}).credentials().get().access_key == "PROFKEY"  # type: ignore[union-attr]
    opts = {"aws_access_key_id": "OPT", "aws_secret_access_key": "optsecret", "aws_session_token": "t"}
    cfg = S3Config.resolve("b", opts)
    assert cfg.credentials().get() == Credentials("OPT", "optsecret", "t")  # type: ignore[union-attr]
    assert cfg.client_args()[0]["aws_access_key_id"] == "OPT" and "optsecret" not in repr(cfg)
    assert S3Config.resolve("b", {"unsigned": True}).credentials().get() is None  # type: ignore[union-attr]
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(k)
    (aws / "credentials").write_text("")
    with pytest.raises(NoCredentialsError, match="unsigned=True"):
        S3Config.resolve("b", {}).credentials()


def test_the_endpoint_named_in_failures_carries_the_settings_behind_it(aws: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A well-formed but wrong region, an unreachable proxy, an untrusted certificate all
    surface as failures at the endpoint: its description names each setting and its source."""
    monkeypatch.setenv("AWS_DEFAULT_REGION", "eu-wset-1")
    assert S3Config.resolve("bkt", {}).endpoint() == (
        "https://s3.eu-wset-1.amazonaws.com (region eu-wset-1 from environment variable AWS_DEFAULT_REGION)")
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.example:3128")
    (aws / "config").write_text(f"[default]\nca_bundle = {aws}/ca.pem\n")
    assert S3Config.resolve("bkt", {"endpoint_url": "https://10.0.0.1:9443"}).endpoint() == (
        f"https://10.0.0.1:9443 via proxy http://proxy.example:3128 (environment variable HTTPS_PROXY) "
        f"(CA bundle {aws}/ca.pem from profile 'default' of {aws}/config)")
    assert S3Config.resolve("bkt", {"endpoint_url": "http://10.0.0.1:9000", "verify": f"{aws}/ca2.pem"}
                            ).ca_bundle.value == f"{aws}/ca2.pem"  # botocore's verify also takes a path


def test_extra_headers_are_signed_as_botocore_signs_them() -> None:
    """S3 refuses x-amz-* headers left out of the signature (moto does not check): the own
    path signs requester-pays, SSE-KMS and checksum headers exactly as botocore does."""
    import datetime

    from botocore.auth import S3SigV4Auth
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials as BotoCreds

    from objckpt.storage.s3.sigv4 import Signer, quote_path

    now = datetime.datetime(2026, 11, 25, 12, 0, tzinfo=datetime.timezone.utc)
    extra = {"x-amz-request-payer": "requester", "x-amz-server-side-encryption": "aws:kms",
             "x-amz-server-side-encryption-aws-kms-key-id": "alias/ckpt", "x-amz-checksum-crc32c": "AAAAAA=="}
    creds = Credentials("AKIDEXAMPLE", "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY", "tok")
    host, path = "bkt.s3.eu-west-2.amazonaws.com", quote_path("/ck/blob 1")
    ours = Signer("eu-west-2").headers("PUT", path, "", host, creds, now=now, extra=extra)
    assert not set(extra) & set(ours)  # the caller sends them; only the signature covers them
    req = AWSRequest(method="PUT", url=f"https://{host}{path}",
                     headers={"x-amz-content-sha256": "UNSIGNED-PAYLOAD", **extra})
    auth = S3SigV4Auth(BotoCreds(creds.access_key, creds.secret_key, "tok"), "s3", "eu-west-2")
    req.context["timestamp"] = now.strftime("%Y%m%dT%H%M%SZ")
    req.headers["X-Amz-Date"] = req.context["timestamp"]
    req.headers["X-Amz-Security-Token"] = "tok"
    auth._modify_request_before_signing = lambda r: None  # headers set above, as ours
    sig = auth.signature(auth.string_to_sign(req, auth.canonical_request(req)), req)
    assert ours["authorization"].endswith(f"Signature={sig}")
    assert "x-amz-request-payer;x-amz-security-token;x-amz-server-side-encryption;" in ours["authorization"]
