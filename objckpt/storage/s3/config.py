"""One frozen S3 configuration per store, resolved once, the way botocore resolves it.

Both ways an :class:`~objckpt.storage.s3.S3Store` moves bytes (objckpt's own
HTTP path, :mod:`.direct`, and the aiobotocore client) take every setting
from the one :class:`S3Config` built here when the store opens, so they cannot
disagree on where requests go, which region signs them, which CA is trusted or
which proxy is used.  This is the only module that reads ``storage_options``
and the environment for S3.

Nothing botocore already parses is parsed again: one ``botocore.session.Session``
(with the store's profile) answers for the environment and the AWS config and
credentials files (``get_config_variable``, ``get_scoped_config``,
``ConfiguredEndpointProvider``, ``get_credentials``), and botocore's endpoint
code, run as a client would run it but without building one (:mod:`.rules`),
says which URL a GetObject of the bucket goes to and which region signs it (S3's
endpoint ruleset decides FIPS, dual-stack, acceleration, addressing and
partitions).  The first store of a process pays for importing botocore and
reading its endpoint data (~0.1 s; a client, which also reads S3's 185 KB API
model, cost ~0.1 s more), later ones ~2 ms (sessions and answers are kept per
state of the AWS environment and files); requests never touch botocore on the
own path.

Where objckpt deliberately differs from botocore (each logged with its source,
see README "Where requests go"): ``AWS_REGION`` is read after botocore's own
region sources (the other AWS SDKs read it; botocore does not), ``SSL_CERT_FILE``
is trusted after botocore's CA sources (botocore would use certifi), and a
custom endpoint defaults to path-style addressing.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import enum
import os
import ssl
import threading
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional
from urllib.parse import urlsplit

from ...errors import ObjckptError, StorageError
from ...logs import get_logger, register_secret
from ...options import switch_word
from .retry import RetryPolicy
from .retry_settings import RetrySettings, resolve_retry
from .setting import S3ConfigError, Setting, env_source as _env_source
from .request_settings import RequestSettings, resolve_request_settings
from .env_state import environment_state as environment_state, files_state  # re-exported for tests
from . import rules, tls
from .rules import Resolved
from ..shape import parse_kind
from .credentials import CredentialSource, Credentials

log = get_logger("objckpt.storage")

#: the S3 storage options besides the retry budgets (:class:`RetryPolicy` and ``max_attempts``)
OPTIONS = ("endpoint_url", "region_name", "aws_access_key_id", "aws_secret_access_key", "aws_session_token",
           "profile", "addressing_style", "ca_bundle", "verify", "unsigned", "request_payer", "sse_kms_key_id",
           "direct_http", "checksums", "adaptive", "concurrency", "endpoint_kind")
_SECRET_ENV = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN")
_STYLES = ("auto", "path", "virtual")
#: operations whose request carries the SSE-KMS headers (the object is created by them)
_SSE_OPS = ("PutObject", "CreateMultipartUpload")


class NoCredentialsError(ObjckptError, PermissionError):
    """No AWS credentials were found anywhere botocore looks for them."""


class CertificateError(StorageError):
    """The endpoint's TLS certificate is not trusted by the configured CA bundle."""


class Transport(str, enum.Enum):
    """How a store's requests travel; chosen once per store (:attr:`S3Config.transport`)."""

    DIRECT = "direct"  #: objckpt's own HTTP path (:mod:`.direct`)
    BOTOCORE = "botocore"  #: every request through the aiobotocore client


@dataclass(frozen=True)
class Target:
    """Where a bucket's requests go and how they are addressed (what botocore's
    endpoint ruleset gives for a GetObject of the bucket)."""

    scheme: str
    host: str  # to connect to
    port: int
    host_header: str
    prefix: str  # path before the key: "/bucket" (path style) or "" (virtual host)
    region: str  # the region that signs
    cafile: Optional[str] = None  # CA bundle (file or directory); None: the system's default
    verify: bool = True
    trust: str = ""  # where the CA bundle came from, for a failed verification's message


def _switch(options: dict[str, Any], name: str, env: Optional[str] = None) -> bool:
    """Pop the on/off option ``name`` (on when absent, or from ``env`` when that variable
    is set); True/False or an on/off word, anything else a ValueError naming it."""
    where = f"storage option {name!r}"
    value: Any = True
    if name in options:
        value = options.pop(name)
    elif env is not None and env in os.environ:
        value, where = os.environ[env], f"environment variable {env}"
    said = switch_word(value)
    if said is None:
        raise ValueError(f"{where}={value!r}: expected True/False or on/off (1/true/yes, 0/false/no)")
    return said


# -- botocore sessions, one per profile and state of the AWS environment and files ------
_lock = threading.Lock()
_sessions: dict[tuple[Any, ...], Any] = {}
_loaders: dict[Any, Any] = {}  # the service models' JSON, read once per data path
_KEPT = 32
_creds_lock = threading.Lock()


def _after_fork_in_child() -> None:
    """A thread of the parent (a chain walk started early) may have held these at the fork."""
    global _lock, _creds_lock
    _lock, _creds_lock = threading.Lock(), threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _aws_state(profile: Optional[str]) -> tuple[Any, ...]:
    """The profile, the AWS_* environment and the config files' identity: a session (or a
    probe client) made under the same state resolves the same; any change makes a new one."""
    return profile, tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith("AWS_"))), files_state()


def _session(profile: Optional[str]) -> Any:
    """The botocore session for ``profile`` in the current AWS environment: made once per
    state (:func:`_aws_state`; a session costs ~30 ms of handler registration), sharing
    the process's service-model loader with the others."""
    import botocore.session

    key = _aws_state(profile)
    with _lock:
        s = _sessions.get(key)
    if s is not None:
        return s
    s = botocore.session.Session(profile=profile)
    s.get_scoped_config()  # a missing profile raises here, before the session is kept
    path = s.get_config_variable("data_path")
    with _lock:
        s.register_component("data_loader", _loaders.setdefault(path, s.get_component("data_loader")))
        if len(_sessions) >= _KEPT:  # a process that keeps changing its environment (tests)
            _sessions.clear()
            _probes.clear()
        _sessions[key] = s
    return s


@dataclass(frozen=True)
class S3Config:
    """Everything a store's requests depend on, resolved once (:meth:`resolve`)."""

    bucket: str
    profile: Optional[str]
    region: Setting
    endpoint_url: Setting  # the custom endpoint (value None: AWS's, from the ruleset)
    client_endpoint: str  # botocore's ``meta.endpoint_url`` for these settings
    addressing_style: Setting
    use_fips: bool
    use_dualstack: bool
    use_accelerate: bool
    verify: bool
    ca_bundle: Setting  # a path (file or directory); the source says whose default it is
    proxy: Setting  # the proxy botocore would use for this endpoint (NO_PROXY applied); value None: none
    target: Target  # where a GetObject of the bucket goes
    transport: Transport
    transport_reason: str
    unsigned: bool = False
    request_payer: Optional[str] = None
    sse_kms_key_id: Optional[str] = None
    concurrency: int = 32
    policy: RetryPolicy = field(default_factory=RetryPolicy)
    adaptive: bool = True
    checksums: bool = True
    endpoint_kind: str = "auto"
    #: flexible checksums, the User-Agent app id, TCP keepalive, spliced bodies (:mod:`.request_settings`)
    request_settings: RequestSettings = field(default_factory=RequestSettings)
    static_keys: Optional[Credentials] = field(default=None, repr=False, compare=False)
    _creds: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)
    retries: Optional[RetrySettings] = None  # the policy's sources (None: built without resolving)

    # -- what requests carry ---------------------------------------------------
    def extra_headers(self, op: str) -> dict[str, str]:
        """Headers operation ``op`` (botocore's name: ``GetObject``, ``PutObject``...)
        carries on either transport: requester-pays on every request, SSE-KMS on the
        requests that create an object."""
        out: dict[str, str] = {}
        if self.request_payer:
            out["x-amz-request-payer"] = self.request_payer
        if self.sse_kms_key_id and op in _SSE_OPS:
            out["x-amz-server-side-encryption"] = "aws:kms"
            out["x-amz-server-side-encryption-aws-kms-key-id"] = self.sse_kms_key_id
        return out

    def client_args(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """(``create_client`` keyword arguments, ``Config`` keyword arguments) that make a
        botocore or aiobotocore client resolve exactly this configuration."""
        kw: dict[str, Any] = {"region_name": self.region.value, "verify": self.ca_bundle.value if self.verify else False}
        if self.endpoint_url.value:
            kw["endpoint_url"] = self.endpoint_url.value
        if self.static_keys is not None:
            kw.update(aws_access_key_id=self.static_keys.access_key, aws_secret_access_key=self.static_keys.secret_key,
                      aws_session_token=self.static_keys.token)
        s3: dict[str, Any] = {"addressing_style": self.addressing_style.value, "payload_signing_enabled": False}
        if self.use_accelerate:
            s3["use_accelerate_endpoint"] = True
        cfg: dict[str, Any] = {"s3": s3, "use_fips_endpoint": self.use_fips, "use_dualstack_endpoint": self.use_dualstack}
        if self.unsigned:
            from botocore import UNSIGNED

            cfg["signature_version"] = UNSIGNED
        return kw, cfg

    def credentials(self) -> Optional[CredentialSource]:
        """The credentials of the own path: the options' keys, else botocore's provider
        chain for the profile (environment, files, SSO, roles, container, IMDS: may do
        network calls, so call it off the event loop), resolved once per store.
        ``CredentialSource(anonymous)`` when ``unsigned``; NoCredentialsError when none."""
        if "src" in self._creds:
            return self._creds["src"]  # type: ignore[no-any-return]
        lock = self._creds.setdefault("lock", threading.Lock())
        with lock:
            if "src" not in self._creds:
                self._creds["src"] = self._resolve_credentials()
        return self._creds["src"]  # type: ignore[no-any-return]

    def _resolve_credentials(self) -> CredentialSource:
        if self.unsigned:
            return CredentialSource(anonymous=True)
        if self.static_keys is not None:
            return CredentialSource(self.static_keys)
        early = self._creds.pop("early", None)
        if early is not None:  # the walk started as the store opened (_session_and_walk): its answer, or its error, once
            creds = early.result()
        else:
            with _creds_lock:  # one chain walk at a time (sessions are shared by stores)
                creds = _session(self.profile).get_credentials()
        if creds is None:
            name, src = (self.profile, "storage option profile") if self.profile else _profile_env()
            raise NoCredentialsError(
                f"no AWS credentials for s3://{self.bucket}: none in storage options (aws_access_key_id, "
                f"aws_secret_access_key), the environment (AWS_ACCESS_KEY_ID...), the profile "
                f"{name or 'default'!r} ({src}) of the AWS config and credentials "
                "files, SSO, web identity, container or instance roles; for a public bucket pass "
                "storage option unsigned=True")
        log.debug("s3://%s: credentials from botocore's chain (%s)", self.bucket, getattr(creds, "method", "?"))
        return CredentialSource(botocore_creds=creds)

    # -- descriptions ------------------------------------------------------------
    def endpoint(self) -> str:
        """The endpoint requests go to, with the settings a failure there may come from."""
        notes = []
        if not self.endpoint_url.value:
            notes.append(f"region {self.region.value} from {self.region.source}")
        if self.target.scheme == "https":
            if not self.verify:
                notes.append("TLS verification off")
            elif "botocore's default" not in self.ca_bundle.source:
                notes.append(f"CA bundle {self.ca_bundle.value} from {self.ca_bundle.source}")
        via = f" via proxy {self.proxy.value} ({self.proxy.source})" if self.proxy.value else ""
        return f"{self.client_endpoint}{via}" + (f" ({'; '.join(notes)})" if notes else "")

    def summary(self) -> str:
        """One line for the store's INFO log: transport, why, and where each setting came from
        (the CA bundle only for an https:// endpoint: an http:// one uses none)."""
        tls = "" if self.target.scheme != "https" else (
            f", TLS CA {self.ca_bundle.value} ({self.ca_bundle.source})" if self.verify else ", TLS unverified")
        return (f"s3://{self.bucket}: {self.transport.value} transport ({self.transport_reason}); "
                f"endpoint {self.client_endpoint} ({self.endpoint_url.source}), region {self.region.value} "
                f"({self.region.source}), {self.addressing_style.value} addressing ({self.addressing_style.source})"
                f"{tls}"
                + (f", proxy {self.proxy.value} ({self.proxy.source})" if self.proxy.value else "")
                + (f", {self.retries.describe()}" if self.retries is not None else "")
                + (f"; {self.request_settings.describe()}" if self.request_settings.describe() else ""))

    # -- resolution ----------------------------------------------------------------
    @classmethod
    def resolve(cls, bucket: str, options: Mapping[str, Any]) -> "S3Config":
        """The configuration of a store of ``bucket`` with ``options``; bad input is an
        :class:`S3ConfigError` (a ValueError) naming the setting and its source, at once."""
        return _resolve(bucket, dict(options))


def _opt(options: dict[str, Any], name: str) -> Any:
    v = options.pop(name, None)
    return None if v is None or v == "" else v


def _resolve(bucket: str, options: dict[str, Any]) -> S3Config:
    concurrency = int(options.pop("concurrency", 32))
    adaptive = _switch(options, "adaptive")
    checksums_given = "checksums" in options  # an explicit option wins over request_checksum_calculation
    checksums = _switch(options, "checksums")
    kind = parse_kind(options.pop("endpoint_kind", None))
    direct_wanted = _switch(options, "direct_http", env="OBJCKPT_S3_DIRECT_HTTP")
    retry_names = {f.name for f in dataclasses.fields(RetryPolicy)} | {"max_attempts"}
    unknown = sorted(set(options) - set(OPTIONS) - retry_names)
    if unknown:  # said at once: a restore may never build the botocore client
        raise S3ConfigError(", ".join(unknown), "storage_options",
                            f"unknown S3 storage_options: {unknown} (known: {', '.join(sorted(OPTIONS))}; and the "
                            f"retry budgets {', '.join(sorted(retry_names))})")
    for k in ("aws_secret_access_key", "aws_session_token"):  # never logged, whatever error text carries them
        register_secret(options.get(k))
    for k in _SECRET_ENV:
        register_secret(os.environ.get(k))
    unsigned = _switch(options, "unsigned") if "unsigned" in options else False
    said = options.get("verify")
    if isinstance(said, str) and switch_word(said) is None:  # botocore's verify also takes a CA bundle path
        options.setdefault("ca_bundle", options.pop("verify"))
    verify_opt = _switch(options, "verify") if "verify" in options else None
    payer = _opt(options, "request_payer")
    if payer is not None and payer != "requester":
        raise S3ConfigError("request_payer", "storage option", f"{payer!r}: the only value S3 takes is 'requester'")
    kms = _opt(options, "sse_kms_key_id")
    keys = _static_keys(options)

    profile = _opt(options, "profile")
    profile_src = "storage option profile" if profile else _profile_env()[1]
    walk = direct_wanted and not unsigned and keys is None  # the own path will sign with botocore's chain
    try:
        session, early = _session_and_walk(profile) if walk else (_session(profile), None)
        scoped = session.get_scoped_config()
    except Exception as e:  # ProfileNotFound
        where = os.path.expanduser(os.environ.get("AWS_CONFIG_FILE", "~/.aws/config"))
        raise S3ConfigError("profile", profile_src, f"{e} (profiles are read from {where})") from None
    in_file = f"profile {session.profile or 'default'!r} of {_config_file(session)}"

    retries = resolve_retry(options, session, in_file)
    sends = resolve_request_settings(session, in_file, checksums if checksums_given else None)
    region = _region(options, session, scoped, in_file)
    endpoint = _endpoint(options, session, scoped, in_file)
    s3_section = session.get_config_variable("s3") or {}
    style = _opt(options, "addressing_style")
    if style is not None:
        addressing = Setting(str(style), "storage option addressing_style")
    elif s3_section.get("addressing_style"):
        addressing = Setting(str(s3_section["addressing_style"]), f"s3 section of {in_file}")
    elif endpoint.value:  # S3-compatible servers (MinIO, moto, on-prem) rarely do virtual-host buckets
        addressing = Setting("path", "objckpt's default for a custom endpoint")
    else:
        addressing = Setting("auto", "botocore's default")
    if addressing.value not in _STYLES:
        raise S3ConfigError("addressing_style", addressing.source, f"{addressing.value!r} is not one of {_STYLES}")
    fips = bool(session.get_config_variable("use_fips_endpoint"))
    dual = bool(session.get_config_variable("use_dualstack_endpoint")) or switch_word(
        s3_section.get("use_dualstack_endpoint", "")) is True
    accel = switch_word(s3_section.get("use_accelerate_endpoint", "")) is True

    probe = S3Config(bucket, profile, region, endpoint, "", addressing, fips, dual, accel, True,
                     Setting(None, ""), Setting(None, ""), Target("", "", 0, "", "", ""), Transport.BOTOCORE, "",
                     unsigned)
    client_endpoint, url, signing = _probe(session, bucket, probe)
    verify, ca = _trust(options, verify_opt, session, scoped, in_file, urlsplit(url).scheme == "https")
    proxy = _proxy(client_endpoint)
    target = _target(url, signing.get("region") or region.value, ca.value, verify, ca.source)
    transport, why = _transport(direct_wanted, proxy, signing, url, client_endpoint)
    cfg = S3Config(bucket, profile, region, endpoint, client_endpoint, addressing, fips, dual, accel, verify, ca, proxy,
                   target, transport, why, unsigned, payer, kms, concurrency, retries.policy, adaptive,
                   sends.part_checksums.value, kind, static_keys=keys, retries=retries, request_settings=sends)
    if early is not None:
        cfg._creds["early"] = early
    if target.scheme == "https" and transport is Transport.DIRECT:  # the first connection's context, loaded meanwhile
        tls.prepare(target.cafile, target.verify)
    log.info("%s", cfg.summary())
    return cfg


def _session_and_walk(profile: Optional[str]) -> tuple[Any, "concurrent.futures.Future[Any]"]:
    """The botocore session for ``profile`` (:func:`_session`), and botocore's credential chain
    walked for it on the same pool thread right after: its round trips (IMDS, a container
    endpoint, STS for web identity) then overlap the rest of the store's opening (the
    endpoint rules, ~25 ms of CPU the first time) and the operation's first steps instead of
    waiting in front of the first request.  The thread that made the session walks on at once,
    so the walk's own Python runs before the caller takes the GIL back for the rules.  The
    same walk of the same session as :meth:`S3Config.credentials` would make, only earlier
    (a proxy or an odd endpoint may still choose the botocore transport, which then walks on
    its own); the first credentials() call takes its answer, or raises its error, once.  The
    caller waits for the session meanwhile, so botocore's first import runs while it waits."""
    from ...runtime import loop as _runtime

    made: "concurrent.futures.Future[Any]" = concurrent.futures.Future()

    def job() -> Any:
        try:
            session = _session(profile)
        except BaseException as e:  # noqa: BLE001 - the caller raises it
            made.set_exception(e)
            return None
        made.set_result(session)
        with _creds_lock:
            return session.get_credentials()

    early = _runtime.aside_pool().submit(job)
    return made.result(), early


def _profile_env() -> tuple[Optional[str], str]:
    """(profile, source) botocore takes from the environment: the first of its ``profile``
    variables that is set, ``AWS_DEFAULT_PROFILE`` before ``AWS_PROFILE``."""
    from botocore.configprovider import BOTOCORE_DEFAUT_SESSION_VARIABLES as variables

    for name in variables["profile"][1]:
        if name in os.environ:
            return os.environ[name], f"environment variable {name}"
    return None, "the default profile"


def _config_file(session: Any) -> str:
    return os.path.expanduser(str(session.get_config_variable("config_file")))


def _static_keys(options: dict[str, Any]) -> Optional[Credentials]:
    ak, sk = _opt(options, "aws_access_key_id"), _opt(options, "aws_secret_access_key")
    token = _opt(options, "aws_session_token")
    if (ak is None) != (sk is None):
        missing = "aws_secret_access_key" if sk is None else "aws_access_key_id"
        raise S3ConfigError(missing, "storage options", "one of the key pair is given without the other")
    return None if ak is None else Credentials(str(ak), str(sk), token and str(token))


def _region(options: dict[str, Any], session: Any, scoped: Mapping[str, Any], in_file: str) -> Setting:
    """Option, botocore's (AWS_DEFAULT_REGION, the profile's ``region``), then AWS_REGION, then us-east-1."""
    from botocore.exceptions import InvalidRegionError
    from botocore.utils import validate_region_name

    v = _opt(options, "region_name")
    if v is not None:
        r = Setting(str(v), "storage option region_name")
    elif session.get_config_variable("region"):
        v = session.get_config_variable("region")
        r = Setting(v, _env_source(v, "AWS_DEFAULT_REGION") or in_file)
    elif os.environ.get("AWS_REGION"):
        r = Setting(os.environ["AWS_REGION"], "environment variable AWS_REGION (botocore reads only AWS_DEFAULT_REGION)")
    else:
        r = Setting("us-east-1", "botocore's default")
    try:
        validate_region_name(r.value)
    except InvalidRegionError:
        raise S3ConfigError("region", r.source, f"{r.value!r} is not a region name") from None
    return r


def _endpoint(options: dict[str, Any], session: Any, scoped: Mapping[str, Any], in_file: str) -> Setting:
    """Option, else botocore's configured endpoint (AWS_ENDPOINT_URL_S3, AWS_ENDPOINT_URL,
    the profile's ``services`` section, its ``endpoint_url``) unless configured endpoints are ignored."""
    from botocore.configprovider import ConfiguredEndpointProvider

    v = _opt(options, "endpoint_url")
    if v is not None:
        e = Setting(str(v), "storage option endpoint_url")
    elif session.get_config_variable("ignore_configured_endpoint_urls"):
        e = Setting(None, "AWS's endpoint (configured endpoint URLs are ignored)")
    else:
        v = ConfiguredEndpointProvider(full_config=session.full_config, scoped_config=scoped,
                                       client_name="s3").provide()
        src = _env_source(v, "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")
        if src is None and v:
            src = in_file if scoped.get("endpoint_url") == v else f"services section of {in_file}"
        e = Setting(v or None, src or "AWS's endpoint for the region")
    if e.value:
        u = urlsplit(e.value)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise S3ConfigError("endpoint_url", e.source, f"{e.value!r} is not an http(s) URL")
    return e


def _trust(options: dict[str, Any], verify_opt: Optional[bool], session: Any, scoped: Mapping[str, Any],
           in_file: str, https: bool) -> tuple[bool, Setting]:
    """(verify, CA bundle): option ``verify``/``ca_bundle``, AWS_CA_BUNDLE, the profile's
    ``ca_bundle``, REQUESTS_CA_BUNDLE (botocore's order), then SSL_CERT_FILE (objckpt),
    then botocore's default (certifi)."""
    ca = _opt(options, "ca_bundle")
    if verify_opt is False:
        return False, Setting(None, "storage option verify=False")
    if ca is not None:
        s = Setting(os.path.expanduser(str(ca)), "storage option ca_bundle")
    elif session.get_config_variable("ca_bundle"):
        v = session.get_config_variable("ca_bundle")
        s = Setting(os.path.expanduser(v), _env_source(v, "AWS_CA_BUNDLE") or in_file)
    elif os.environ.get("REQUESTS_CA_BUNDLE"):
        s = Setting(os.environ["REQUESTS_CA_BUNDLE"], "environment variable REQUESTS_CA_BUNDLE")
    elif os.environ.get("SSL_CERT_FILE"):
        s = Setting(os.environ["SSL_CERT_FILE"], "environment variable SSL_CERT_FILE (botocore alone would use certifi)")
    else:
        from botocore.httpsession import get_cert_path

        return True, Setting(get_cert_path(True), "botocore's default (certifi)")
    if https:
        try:  # loading a bundle costs 13-30 ms: once per file version, the context kept for the connections
            tls.context(s.value, True)
        except (OSError, ssl.SSLError) as e:
            raise S3ConfigError("ca_bundle", s.source, f"{s.value!r} cannot be used as a CA bundle: {e}") from None
    return True, s


def _proxy(client_endpoint: str) -> Setting:
    """The proxy botocore uses for this endpoint: ``get_environ_proxies`` (NO_PROXY
    applied) looked up by the endpoint's scheme, as its HTTP session does."""
    from botocore.utils import get_environ_proxies

    scheme = urlsplit(client_endpoint).scheme
    url = get_environ_proxies(client_endpoint).get(scheme)
    if not url:
        covered = [n for n in ("NO_PROXY", "no_proxy") if os.environ.get(n)]
        set_ = [n for n in (f"{scheme.upper()}_PROXY", f"{scheme}_proxy") if os.environ.get(n)]
        return Setting(None, f"{set_[0]} bypassed by {covered[0]}" if set_ and covered else "no proxy set")
    return Setting(url, _env_source(url, f"{scheme}_proxy", f"{scheme.upper()}_PROXY") or "the system's proxy settings")


#: what botocore's endpoint rules said, by the settings and the AWS state (:func:`_aws_state`)
_probes: dict[tuple[Any, ...], Resolved] = {}


def _probe(session: Any, bucket: str, cfg: S3Config) -> tuple[str, str, dict[str, Any]]:
    """(``meta.endpoint_url``, the URL a GetObject of ``bucket`` key ``k`` goes to, the
    signing context) of a botocore client with these settings (:mod:`.rules`: botocore's
    endpoint code without a client, ~10 ms once per process and <1 ms after; nothing is sent),
    kept for later stores with the same settings."""
    kw, ckw = cfg.client_args()
    kw = {k: v for k, v in kw.items() if k not in ("verify",) and not k.startswith("aws_")}
    ckw.update(retries={"total_max_attempts": 1})
    try:
        key = (_aws_state(cfg.profile), bucket, repr(sorted(kw.items())), repr(sorted(ckw.items())))
        with _lock:
            got = _probes.get(key)
        if got is None:
            got = rules.where(session, bucket, kw, ckw)
            with _lock:
                if len(_probes) >= 8 * _KEPT:  # many buckets or changing settings: start again
                    _probes.clear()
                _probes[key] = got
    except Exception as e:
        src = "; ".join(f"{n} from {s.source}" for n, s in (("endpoint", cfg.endpoint_url), ("region", cfg.region)))
        raise S3ConfigError("endpoint", src, f"botocore cannot build a request for s3://{bucket}: "
                                             f"{type(e).__name__}: {e}") from None
    return got.client_endpoint, got.url, got.signing


def _target(url: str, region: str, ca: Optional[str], verify: bool, trust: str) -> Target:
    u = urlsplit(url)
    host = str(u.hostname)
    port = u.port or (443 if u.scheme == "https" else 80)
    shown = f"[{host}]" if ":" in host else host
    host_header = shown if port == (443 if u.scheme == "https" else 80) else f"{shown}:{port}"
    return Target(u.scheme, host, port, host_header, u.path[:-2], region, ca, verify, trust)


def _transport(wanted: bool, proxy: Setting, signing: Mapping[str, Any], url: str, endpoint: str) -> tuple[Transport, str]:
    """Which transport serves the store, and why (logged at INFO once per store)."""
    if not wanted:
        return Transport.BOTOCORE, "direct_http is off"
    if proxy.value:
        return Transport.BOTOCORE, (f"requests go through proxy {proxy.value} ({proxy.source}); objckpt's own "
                                    "HTTP path does not speak to proxies, botocore does")
    if signing.get("auth_type") not in (None, "v4"):
        return Transport.BOTOCORE, f"the endpoint needs {signing['auth_type']} signing (the own path signs SigV4)"
    u = urlsplit(url)
    if u.query or not u.path.endswith("/k"):
        return Transport.BOTOCORE, f"the request URL {url} has a shape the own path does not build"
    why = "objckpt's own HTTP path"
    if "bypassed" in proxy.source:
        why += f" ({proxy.source} for {urlsplit(endpoint).hostname})"
    return Transport.DIRECT, why
