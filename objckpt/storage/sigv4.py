"""AWS Signature Version 4 for S3 requests, and where their credentials come from.

The direct read path (:mod:`.s3_direct`) signs its own GET/HEAD requests so that
a restore needs neither aiobotocore nor aiohttp (together 0.5-0.7 s of imports
and client set-up in a new process, before the first byte).  The payload is
never hashed (``UNSIGNED-PAYLOAD``, as the botocore client is configured too):
integrity is objckpt's own crc32c per chunk.

Credentials: explicit storage options, else the standard environment variables;
anything else (a profile, SSO, web identity, container or instance roles) is
resolved by botocore's own provider chain, imported only then, and its
refreshing credentials are re-read for every request.
"""
from __future__ import annotations

import datetime
import hashlib
import hmac
import os
import threading
from dataclasses import dataclass
from typing import Any, Mapping, Optional
from urllib.parse import quote

UNSIGNED_PAYLOAD = "UNSIGNED-PAYLOAD"


@dataclass(frozen=True)
class Credentials:
    """One set of AWS credentials (a session token for temporary ones)."""

    access_key: str
    secret_key: str
    token: Optional[str] = None


class CredentialSource:
    """Credentials for each request: fixed ones, or botocore's (which refresh)."""

    def __init__(self, fixed: Optional[Credentials] = None, botocore_creds: Any = None) -> None:
        self._fixed = fixed
        self._boto = botocore_creds

    def get(self) -> Credentials:
        if self._fixed is not None:
            return self._fixed
        f = self._boto.get_frozen_credentials()  # refreshes temporary credentials when due
        return Credentials(f.access_key, f.secret_key, f.token or None)


def resolve_credentials(options: Mapping[str, Any], env: Mapping[str, str] = os.environ) -> Optional[CredentialSource]:
    """Where this store's credentials come from, the way botocore would choose;
    ``None`` when there are none (the caller then keeps botocore's path, whose
    error says so)."""
    ak, sk = options.get("aws_access_key_id"), options.get("aws_secret_access_key")
    profile = options.get("profile")
    if ak and sk and profile is None:
        return CredentialSource(Credentials(str(ak), str(sk), options.get("aws_session_token") or None))
    if profile is None and not env.get("AWS_PROFILE") and not env.get("AWS_DEFAULT_PROFILE"):
        eak, esk = env.get("AWS_ACCESS_KEY_ID"), env.get("AWS_SECRET_ACCESS_KEY")
        if eak and esk:
            token = env.get("AWS_SESSION_TOKEN") or env.get("AWS_SECURITY_TOKEN") or None
            return CredentialSource(Credentials(eak, esk, token))
    import botocore.session  # the full provider chain (files, SSO, roles, IMDS)

    session = botocore.session.get_session()
    if profile is not None:
        session.set_config_variable("profile", profile)
        session.get_scoped_config()  # a profile that does not exist raises here, as botocore's client would
    if ak and sk:
        return CredentialSource(Credentials(str(ak), str(sk), options.get("aws_session_token") or None))
    creds = session.get_credentials()
    return None if creds is None else CredentialSource(botocore_creds=creds)


def quote_path(path: str) -> str:
    """S3's URI encoding of a path: every byte but unreserved characters and ``/``."""
    return quote(path, safe="/~")


def canonical_query(params: Mapping[str, str]) -> str:
    """The query string as SigV4 signs it (and as it is sent): sorted, encoded."""
    return "&".join(f"{quote(k, safe='-_.~')}={quote(v, safe='-_.~')}" for k, v in sorted(params.items()))


def _hmac(key: bytes, msg: str) -> bytes:
    return hmac.new(key, msg.encode(), hashlib.sha256).digest()


class Signer:
    """Signs S3 requests for one region; the derived key is cached per day and secret."""

    def __init__(self, region: str, service: str = "s3") -> None:
        self.region = region
        self.service = service
        self._lock = threading.Lock()
        self._key: tuple[str, str, bytes] = ("", "", b"")

    def _signing_key(self, secret: str, day: str) -> bytes:
        with self._lock:
            if self._key[0] == day and self._key[1] == secret:
                return self._key[2]
        k = _hmac(("AWS4" + secret).encode(), day)
        for part in (self.region, self.service, "aws4_request"):
            k = _hmac(k, part)
        with self._lock:
            self._key = (day, secret, k)
        return k

    def headers(self, method: str, path: str, query: str, host: str, creds: Credentials,
                now: Optional[datetime.datetime] = None) -> dict[str, str]:
        """The headers that authenticate ``method path?query`` on ``host``.

        ``path`` is already URI-encoded (:func:`quote_path`) and ``query`` is the
        canonical query string (sorted, encoded; empty for plain GET/HEAD).
        """
        t = now or datetime.datetime.now(datetime.timezone.utc)
        amz_date = t.strftime("%Y%m%dT%H%M%SZ")
        day = amz_date[:8]
        hdrs = {"host": host, "x-amz-content-sha256": UNSIGNED_PAYLOAD, "x-amz-date": amz_date}
        if creds.token:
            hdrs["x-amz-security-token"] = creds.token
        names = sorted(hdrs)
        canonical = "\n".join([
            method, path, query, "".join(f"{n}:{hdrs[n].strip()}\n" for n in names), ";".join(names),
            UNSIGNED_PAYLOAD,
        ])
        scope = f"{day}/{self.region}/{self.service}/aws4_request"
        to_sign = "\n".join(["AWS4-HMAC-SHA256", amz_date, scope, hashlib.sha256(canonical.encode()).hexdigest()])
        sig = hmac.new(self._signing_key(creds.secret_key, day), to_sign.encode(), hashlib.sha256).hexdigest()
        out = {k: v for k, v in hdrs.items() if k != "host"}
        out["authorization"] = (f"AWS4-HMAC-SHA256 Credential={creds.access_key}/{scope}, "
                                f"SignedHeaders={';'.join(names)}, Signature={sig}")
        return out
