"""The first S3 store of a process resolves its configuration without building a botocore
client (storage/s3/rules.py): botocore's endpoint code run on S3's endpoint ruleset, not
its 185 KB API model.  Proved here to send every request where a real, signing botocore
client sends it, over the parity cases and a wide matrix of settings; the stand-in model
facts are checked against botocore's model; and a new process opening a store reads no
API model, makes no client and imports neither aiobotocore nor aiohttp.
"""
from __future__ import annotations

import itertools
import json
import random
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from objckpt.storage.s3 import rules as s3_rules
from objckpt.storage.s3.config import S3Config, S3ConfigError, Transport
from test_s3_config_parity import CASES, Case, _apply, aws, botocore_sees, objckpt_sees  # noqa: F401 (fixture)


class FellBack(BaseException):
    """Raised where the resolution asked a real client (not an Exception: nothing swallows it)."""


@pytest.fixture
def no_client(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*_: Any, **__: Any) -> Any:
        raise FellBack("resolved through a botocore client")

    monkeypatch.setattr(s3_rules, "client_probe", refuse)


_LOADER: dict[str, Any] = {}


def botocore_signs(bucket: str, options: dict[str, Any], path_default: bool) -> dict[str, Any]:
    """Where a botocore client with credentials sends a GetObject and the region it signs for."""
    import botocore.session
    from botocore.config import Config

    session = botocore.session.Session(profile=options.get("profile"))
    _LOADER.setdefault("loader", session.get_component("data_loader"))  # the service's JSON, read once
    session.register_component("data_loader", _LOADER["loader"])
    s3: dict[str, Any] = {}
    if options.get("addressing_style"):
        s3["addressing_style"] = options["addressing_style"]
    elif path_default:
        s3["addressing_style"] = "path"
    client = session.create_client("s3", region_name=options.get("region_name"),
                                   endpoint_url=options.get("endpoint_url"), aws_access_key_id="AKIDEXAMPLE",
                                   aws_secret_access_key="secret", config=Config(s3=s3 or None))
    seen: dict[str, Any] = {}

    class Stop(Exception):
        pass

    def grab(request: Any, region_name: str, **_: Any) -> None:
        seen.update(url=request.url, region=region_name)
        raise Stop

    client.meta.events.register("before-sign.s3.GetObject", grab)
    with pytest.raises(Stop):
        client.get_object(Bucket=bucket, Key="k")
    return {"endpoint": client.meta.endpoint_url, "url": seen["url"], "signing_region": seen["region"]}


def _sees(cfg: S3Config) -> dict[str, Any]:
    t = cfg.target
    return {"endpoint": cfg.client_endpoint, "url": f"{t.scheme}://{t.host_header}{t.prefix}/k",
            "signing_region": t.region}


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_parity_cases_resolve_without_a_client(case: Case, aws: Path, monkeypatch: pytest.MonkeyPatch,
                                               no_client: None) -> None:
    options = _apply(case, aws, monkeypatch)
    cfg = S3Config.resolve(case.bucket, options)
    assert objckpt_sees(cfg) == botocore_sees(case.bucket, options, case.path_default)
    if not cfg.unsigned:
        assert _sees(cfg) == botocore_signs(case.bucket, options, case.path_default)


_REGIONS = ["us-east-1", "eu-west-1", "cn-north-1", "us-gov-west-1", "ap-southeast-2", "eu-wset-1"]
_ENDPOINTS = [None, "http://127.0.0.1:9000", "https://minio.example.com/base/"]
_BUCKETS = ["my-bucket", "a.b.c", "My_Bucket", "x" * 63]
_MATRIX = list(itertools.product(_REGIONS, [None, "path", "virtual"], [False, True], [False, True], [False, True],
                                 [None, "regional"], _ENDPOINTS, _BUCKETS))
_SAMPLE = random.Random(26).sample(_MATRIX, 96)


@pytest.mark.parametrize("case", [_SAMPLE[i::8] for i in range(8)], ids=[f"part{i}" for i in range(8)])
def test_a_wide_matrix_of_settings_goes_where_signing_botocore_goes(case: list[tuple[Any, ...]], aws: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Region x addressing x FIPS x dual-stack x acceleration x us-east-1 endpoint x custom
    endpoint x bucket shape (96 of 10,368, a fixed sample): the same URL, signing region and
    ``meta.endpoint_url`` as a signing botocore client, or an S3ConfigError where botocore refuses."""
    for region, style, fips, dual, accel, us_east_1, endpoint, bucket in case:
        s3 = "".join(f"  {k} = {v}\n" for k, v in (("use_accelerate_endpoint", "true" if accel else None),
                                                     ("us_east_1_regional_endpoint", us_east_1)) if v)
        (aws / "config").write_text(f"[default]\nregion = {region}\nuse_fips_endpoint = {str(fips).lower()}\n"
                                    f"use_dualstack_endpoint = {str(dual).lower()}\n" + (f"s3 =\n{s3}" if s3 else ""))
        options: dict[str, Any] = {k: v for k, v in (("addressing_style", style), ("endpoint_url", endpoint)) if v}
        path_default = endpoint is not None and style is None
        try:
            want = botocore_signs(bucket, options, path_default)
        except Exception as e:  # botocore refuses these settings: so must objckpt, naming them
            with pytest.raises(S3ConfigError):
                S3Config.resolve(bucket, options)
            continue
        with monkeypatch.context() as m:
            m.setattr(s3_rules, "client_probe", lambda *a, **k: (_ for _ in ()).throw(FellBack(str(a[1:]))))
            got = _sees(S3Config.resolve(bucket, options))
        assert got == want, (region, style, fips, dual, accel, us_east_1, endpoint, bucket)


def test_the_stand_in_model_facts_are_botocores(aws: Path) -> None:
    """What s3_rules states about S3's API model, read from botocore's model."""
    import botocore.session

    model = botocore.session.Session().get_service_model("s3")
    assert [(p.name, p.type) for p in model.client_context_parameters] == list(s3_rules.CLIENT_CONTEXT_PARAMS)
    op = model.operation_model("GetObject")
    assert [(p.name, p.member_name) for p in op.context_parameters] == [(n, n) for n in s3_rules.GET_OBJECT_CONTEXT_PARAMS]
    assert op.static_context_parameters == [] and not op.operation_context_parameters
    stand_in = s3_rules._S3Model()
    for attr in ("service_name", "endpoint_prefix", "resolved_protocol", "signing_name", "signature_version"):
        assert getattr(stand_in, attr) == getattr(model, attr), attr
    assert stand_in.service_id.hyphenize() == model.service_id.hyphenize()
    for k in ("signingName", "signatureVersion", "endpointPrefix", "auth"):
        assert stand_in.metadata.get(k) == model.metadata.get(k), k
    assert op.http["requestUri"].startswith("/{Bucket}/{Key+}")


@pytest.mark.parametrize("region", ["fips-us-gov-west-1", "us-east-2-fips"])
def test_a_fips_pseudo_region_is_botocores_fips_endpoint(region: str, aws: Path, no_client: None) -> None:
    """botocore turns a FIPS pseudo-region into its region with FIPS on; so must the resolution."""
    cfg = S3Config.resolve("bkt", {"region_name": region})
    assert _sees(cfg) == botocore_signs("bkt", {"region_name": region}, False)
    assert "fips" in cfg.target.host and "fips" not in cfg.target.region


def test_a_botocore_that_changed_beneath_falls_back_to_a_client(aws: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Should botocore's endpoint code read a model fact the stand-in lacks, a real client answers."""

    class Bare:
        name = "GetObject"

    monkeypatch.setattr(s3_rules, "_GetObject", Bare)  # no context parameters: AttributeError inside botocore
    (aws / "config").write_text("[default]\nregion = eu-west-1\n")
    cfg = S3Config.resolve("fallback-bucket", {})
    assert cfg.target.host == "fallback-bucket.s3.eu-west-1.amazonaws.com" and cfg.target.region == "eu-west-1"
    assert cfg.client_endpoint == "https://s3.eu-west-1.amazonaws.com"


def test_express_buckets_go_through_botocore(aws: Path, no_client: None) -> None:
    """A directory bucket signs with S3 Express session auth (the ruleset says so): the own
    path, which signs plain SigV4, is not chosen for it (the probe's unsigned client hid that)."""
    cfg = S3Config.resolve("data--use1-az4--x-s3", {"region_name": "us-east-1"})
    assert cfg.transport is Transport.BOTOCORE and "s3express" in cfg.transport_reason
    assert S3Config.resolve("data", {"region_name": "us-east-1"}).transport is Transport.DIRECT


_CHILD = textwrap.dedent("""
    import json, sys
    import botocore.loaders, botocore.session
    loaded, made = [], []
    real_load, real_make = botocore.loaders.Loader.load_service_model, botocore.session.Session.create_client
    def load(self, service, kind, api_version=None):
        loaded.append(f"{service}/{kind}")
        return real_load(self, service, kind, api_version)
    def make(self, *a, **k):
        made.append(a[0] if a else k.get("service_name"))
        return real_make(self, *a, **k)
    botocore.loaders.Loader.load_service_model = load
    botocore.session.Session.create_client = make
    from objckpt.storage import open_store
    store, _ = open_store("s3://first-call/ckpt", {"endpoint_url": "http://127.0.0.1:9", "region_name": "eu-west-1",
                                                  "aws_access_key_id": "AK", "aws_secret_access_key": "SK"})
    print(json.dumps({"loaded": loaded, "made": made, "transport": store.config.transport.value,
                      "modules": sorted(m for m in ("aiobotocore", "aiohttp") if m in sys.modules)}))
""")


def test_a_new_process_opens_a_store_without_a_client_or_the_api_model(aws: Path) -> None:
    out = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen == {"loaded": [], "made": [], "transport": "direct", "modules": []}
