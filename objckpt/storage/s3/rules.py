"""Where botocore sends a GetObject of a bucket, found without building a client.

:mod:`.config` needs, for one set of S3 settings, the URL a GetObject of the
bucket goes to, the region that signs it and botocore's ``meta.endpoint_url``.
A botocore client would say, but making the first one in a process costs 60-120
ms here: besides the endpoint data read here too (~20 ms), it reads S3's 185 KB
API model (``service-2.json``) after listing every service's folder, and builds
a class of ~100 methods, none of which bear on endpoints (measured:
a new process's first 4 MiB restore took 0.18-0.22 s with a client, 0.16 s
without, botocore's import included).  This module runs the same botocore code a client
runs for that, in the same order, on the same session and configuration store
(:func:`resolve`):

* ``ClientArgsCreator.compute_client_args`` with a ``ClientEndpointBridge`` over
  the session's legacy endpoint resolver (``endpoints.json``): ``meta.endpoint_url``,
  the client's region, signing region and variant tags, the S3 configuration
  (profile, ``s3`` section, defaults mode);
* ``compute_endpoint_resolver_builtin_defaults`` and an ``EndpointRulesetResolver``
  over S3's endpoint ruleset and the partitions: the request URL and its signing
  context, with botocore's own ``before-endpoint-resolution.s3`` handler
  (``customize_endpoint_resolver_builtins``) and ``validate_bucket_name``;
* ``prepare_request_dict`` to join the key's path onto that URL.

Only the few facts of S3's API model this code reads are given here
(:class:`_S3Model`, :class:`_GetObject`); a test checks them against botocore's
model.  Should a botocore release change any of these functions (they are not
all public), :func:`resolve` falls back to a real client (:func:`client_probe`),
slower and as right, and says so once at DEBUG.
"""
from __future__ import annotations

import copy
import threading
from dataclasses import dataclass
from typing import Any, Optional

from ...logs import get_logger

log = get_logger("objckpt.storage")

#: S3's client context parameters (service-2.json ``clientContextParams``: name, type)
CLIENT_CONTEXT_PARAMS = (("Accelerate", "boolean"), ("DisableMultiRegionAccessPoints", "boolean"),
                         ("DisableS3ExpressSessionAuth", "boolean"), ("ForcePathStyle", "boolean"),
                         ("UseArnRegion", "boolean"))
#: GetObject's input members that are endpoint context parameters (``contextParam``)
GET_OBJECT_CONTEXT_PARAMS = ("Bucket", "Key")
#: the key of the probed GetObject (the URL's path ends with it)
PROBE_KEY = "k"


@dataclass(frozen=True)
class Resolved:
    """What a GetObject of the bucket would do: botocore's ``meta.endpoint_url``, the request
    URL, the signing context (``region``; ``auth_type`` when the ruleset names one)."""

    client_endpoint: str
    url: str
    signing: dict[str, Any]


class _S3Model:
    """The parts of botocore's S3 ``ServiceModel`` the endpoint code reads."""

    service_name = "s3"
    endpoint_prefix = "s3"
    resolved_protocol = "rest-xml"
    signing_name = "s3"
    signature_version = "s3"
    metadata = {"endpointPrefix": "s3", "signatureVersion": "s3", "serviceId": "S3", "protocol": "rest-xml",
                "auth": ["aws.auth#sigv4"]}

    def __init__(self) -> None:
        from botocore.model import ClientContextParameter, ServiceId

        self.service_id = ServiceId("S3")
        self.client_context_parameters = [ClientContextParameter(name=n, type=t, documentation="")
                                          for n, t in CLIENT_CONTEXT_PARAMS]


class _GetObject:
    """The parts of the GetObject ``OperationModel`` the ruleset resolver reads."""

    name = "GetObject"
    static_context_parameters: list[Any] = []
    operation_context_parameters: dict[str, Any] = {}

    def __init__(self) -> None:
        from botocore.model import ContextParameter

        self.context_parameters = [ContextParameter(name=n, member_name=n) for n in GET_OBJECT_CONTEXT_PARAMS]


# -- botocore's data files, read once per loader (one per data path) -------------------
_data_lock = threading.Lock()
_data: dict[int, tuple[Any, Any, Any]] = {}  # id(loader) -> (loader, ruleset, partitions)


def _rules_data(session: Any, api_version: Optional[str]) -> tuple[Any, Any]:
    """S3's endpoint ruleset and the partitions, from the session's loader (its search
    paths: ``~/.aws/models``, ``AWS_DATA_PATH``, botocore's data), read once.  The path is
    the one ``load_service_model`` reads, without listing every service first (~10-25 ms)."""
    loader = session.get_component("data_loader")
    with _data_lock:
        got = _data.get(id(loader))
    if got is not None and got[0] is loader and api_version is None:
        return got[1], got[2]
    version = api_version or loader.determine_latest_version("s3", "endpoint-rule-set-1")
    ruleset = loader.load_data(f"s3/{version}/endpoint-rule-set-1")
    loader._extras_processor.process(ruleset, loader._find_extras("s3", "endpoint-rule-set-1", version))
    partitions = loader.load_data("partitions")
    if api_version is None:
        with _data_lock:
            _data[id(loader)] = (loader, ruleset, partitions)
    return ruleset, partitions


def resolve(session: Any, bucket: str, kw: dict[str, Any], ckw: dict[str, Any]) -> Resolved:
    """Where a botocore client made by ``session.create_client("s3", config=Config(**ckw), **kw)``
    sends a GetObject of ``bucket`` key ``k`` (see the module docstring); botocore's own
    errors go up as they are."""
    from botocore import UNSIGNED
    from botocore.args import ClientArgsCreator
    from botocore.auth import resolve_auth_type
    from botocore.awsrequest import prepare_request_dict
    from botocore.client import ClientCreator, ClientEndpointBridge
    from botocore.config import Config
    from botocore.handlers import customize_endpoint_resolver_builtins, validate_bucket_name
    from botocore.hooks import HierarchicalEmitter
    from botocore.regions import EndpointRulesetResolver
    from botocore.utils import is_valid_endpoint_url, is_valid_ipv6_endpoint_url, validate_region_name

    # Session.create_client: the client's configuration, region, configuration store
    config = Config(**ckw)
    default = session.get_default_client_config()
    if default is not None:
        config = default.merge(config)
    region = kw.get("region_name") or config.region_name or session.get_config_variable("region")
    validate_region_name(region)
    api_version = (session.get_config_variable("api_versions") or {}).get("s3")
    store = copy.copy(session.get_component("config_store"))
    mode = session._resolve_defaults_mode(config, store)
    if mode != "legacy":
        session._get_internal_component("smart_defaults_factory").merge_smart_defaults(store, mode, region)
    session._add_configured_endpoint_provider(client_name="s3", config_store=store)
    scoped = session.get_scoped_config()
    model = _S3Model()
    # ClientCreator.create_client / ClientArgsCreator.get_client_args: a FIPS pseudo-region
    # ("fips-us-gov-west-1") becomes its region with FIPS on, then the legacy endpoint
    region, config = ClientCreator._normalize_fips_region(None, region, config)
    auth = model.metadata.get("auth")
    bridge = ClientEndpointBridge(session._get_internal_component("endpoint_resolver"), scoped, config,
                                  service_signing_name=model.metadata.get("signingName"), config_store=store,
                                  service_signature_version=resolve_auth_type(auth) if auth
                                  else model.metadata.get("signatureVersion"))
    emitter = HierarchicalEmitter()
    emitter.register("before-endpoint-resolution.s3", customize_endpoint_resolver_builtins)
    creator = ClientArgsCreator(emitter, None, None, None, None, config_store=store)
    args = creator.compute_client_args(model, config, bridge, region, kw.get("endpoint_url"), True, scoped)
    endpoint = args["endpoint_config"]
    legacy_url = endpoint["endpoint_url"]
    if not is_valid_endpoint_url(legacy_url) and not is_valid_ipv6_endpoint_url(legacy_url):
        raise ValueError(f"Invalid endpoint: {legacy_url}")  # EndpointCreator.create_endpoint's check
    extra = args["config_kwargs"]
    s3_raw = creator.compute_s3_config(config) or {}
    builtins = creator.compute_endpoint_resolver_builtin_defaults(
        region_name=endpoint["region_name"], service_name="s3", s3_config=s3_raw, endpoint_bridge=bridge,
        client_endpoint_url=args["configured_endpoint_url"], legacy_endpoint_url=legacy_url, credentials=None,
        account_id_endpoint_mode=extra.get("account_id_endpoint_mode"),
        s3_disable_express_session_auth=extra.get("s3_disable_express_session_auth"))
    context = dict(config.client_context_params or {})
    context.update(s3_raw)
    if extra.get("s3_disable_express_session_auth") is not None:
        context["disable_s3_express_session_auth"] = extra["s3_disable_express_session_auth"]
    ruleset, partitions = _rules_data(session, api_version)
    resolver = EndpointRulesetResolver(
        endpoint_ruleset_data=ruleset, partition_data=partitions, service_model=model, builtins=builtins,
        client_context=context, event_emitter=emitter, use_ssl=True, requested_auth_scheme=config.signature_version,
        auth_scheme_preference=extra.get("auth_scheme_preference"))
    # BaseClient._make_api_call for GetObject(Bucket=bucket, Key="k")
    params = {"Bucket": bucket, "Key": PROBE_KEY}
    validate_bucket_name(params)
    found = resolver.construct_endpoint(operation_model=_GetObject(), call_args=params, request_context={})
    # what signs: the ruleset's auth scheme (as a signing client reads it), else the legacy signing region
    signing: dict[str, Any] = {"region": endpoint["signing_region"]}
    schemes = found.properties.get("authSchemes")
    if schemes is not None and config.signature_version is not UNSIGNED:
        auth_type, ctx = resolver.auth_schemes_to_signing_ctx(schemes)
        signing.update(ctx, auth_type=auth_type)
    request = {"url_path": f"/{PROBE_KEY}", "query_string": {}, "headers": {}, "method": "GET", "body": b""}
    prepare_request_dict(request, endpoint_url=found.url)
    return Resolved(str(legacy_url), str(request["url"]), signing)


class _Stop(Exception):
    """Raised by the probe's before-sign hook: nothing is ever sent."""


def client_probe(session: Any, bucket: str, kw: dict[str, Any], ckw: dict[str, Any]) -> Resolved:
    """The same answer from a real botocore client (the fallback of :func:`resolve`):
    ``meta.endpoint_url``, and the URL and signing context a ``before-sign`` hook sees."""
    from botocore import UNSIGNED
    from botocore.config import Config

    ckw = {**ckw, "signature_version": UNSIGNED}  # a probe needs no credentials
    seen: dict[str, Any] = {}

    def grab(request: Any, region_name: Optional[str] = None, **_: Any) -> None:
        seen.update(url=request.url, signing={"region": region_name, **(request.context.get("signing") or {})})
        raise _Stop

    client = session.create_client("s3", config=Config(**ckw), **kw)
    client.meta.events.register_first("before-sign.s3.GetObject", grab, unique_id="objckpt-probe")
    try:
        client.get_object(Bucket=bucket, Key=PROBE_KEY)
    except _Stop:
        pass
    return Resolved(str(client.meta.endpoint_url), str(seen["url"]), seen["signing"])


_fell_back = False


def where(session: Any, bucket: str, kw: dict[str, Any], ckw: dict[str, Any]) -> Resolved:
    """:func:`resolve`, or :func:`client_probe` where it fails (an error of the settings
    is then botocore's own, raised by the client)."""
    global _fell_back
    try:
        return resolve(session, bucket, kw, ckw)
    except Exception as e:  # botocore changed beneath, or the settings are wrong: the client decides
        if not _fell_back:
            _fell_back = True
            log.debug("S3 endpoint rules without a client failed (%s: %s); asking a botocore client",
                      type(e).__name__, e)
        return client_probe(session, bucket, kw, ckw)
