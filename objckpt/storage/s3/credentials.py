"""Where an S3 request's credentials come from, per request.

Which source serves a store is decided once by :mod:`.config` (storage
options, else botocore's provider chain for the profile, or none for
``unsigned``); :class:`CredentialSource` hands them to each request,
re-reading botocore's refreshing credentials every time.  The signer
(:mod:`.sigv4`) only signs with what it is given.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional


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
