"""AWS Signature Version 4 for S3 requests, and where their credentials come from.

The direct read path (:mod:`.direct`) signs its own GET/HEAD requests so that
a restore needs neither aiobotocore nor aiohttp (together 0.5-0.7 s of imports
and client set-up in a new process, before the first byte).  The payload is
never hashed (``UNSIGNED-PAYLOAD``, as the botocore client is configured too):
integrity is objckpt's own crc32c per chunk.

Credentials: where they come from is decided once per store by
:mod:`.config` (storage options, else botocore's provider chain for the
profile); :class:`CredentialSource` hands them to each request, re-reading
botocore's refreshing credentials every time, or none for unsigned requests.
"""
from __future__ import annotations

import datetime
import hashlib
import hmac
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
    """Credentials for each request: fixed ones, botocore's (which refresh), or none
    (``anonymous``: unsigned requests, for public buckets)."""

    def __init__(self, fixed: Optional[Credentials] = None, botocore_creds: Any = None, *,
                 anonymous: bool = False) -> None:
        self._fixed = fixed
        self._boto = botocore_creds
        self.anonymous = anonymous

    def get(self) -> Optional[Credentials]:
        if self.anonymous:
            return None
        if self._fixed is not None:
            return self._fixed
        f = self._boto.get_frozen_credentials()  # refreshes temporary credentials when due
        return Credentials(f.access_key, f.secret_key, f.token or None)


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
                now: Optional[datetime.datetime] = None, *, extra: Mapping[str, str] = {}) -> dict[str, str]:
        """The headers that authenticate ``method path?query`` on ``host``.

        ``path`` is already URI-encoded (:func:`quote_path`) and ``query`` is the
        canonical query string (sorted, encoded; empty for plain GET/HEAD).
        ``extra``: other headers the request carries; its ``x-amz-*`` ones are signed
        too (S3 refuses unsigned ones, e.g. requester-pays or SSE-KMS headers).
        """
        t = now or datetime.datetime.now(datetime.timezone.utc)
        amz_date = t.strftime("%Y%m%dT%H%M%SZ")
        day = amz_date[:8]
        hdrs = {k.lower(): str(v) for k, v in extra.items() if k.lower().startswith("x-amz-")}
        hdrs.update({"host": host, "x-amz-content-sha256": UNSIGNED_PAYLOAD, "x-amz-date": amz_date})
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
        given = {k.lower() for k in extra}  # the caller sends those itself
        out = {k: v for k, v in hdrs.items() if k != "host" and k not in given}
        out["authorization"] = (f"AWS4-HMAC-SHA256 Credential={creds.access_key}/{scope}, "
                                f"SignedHeaders={';'.join(names)}, Signature={sig}")
        return out
