"""A moto S3 server over HTTPS with a private CA, recording what each request carried.

werkzeug's ``make_server`` takes an ``ssl_context``, so moto's own WSGI app is
served over TLS directly (no forwarder); a thin WSGI wrapper records the
method, path, scheme and the headers the configuration tests look at (the
signing scope of ``Authorization``, requester-pays, SSE-KMS).
"""
from __future__ import annotations

import datetime
import ipaddress
import ssl
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

_RECORDED = ("authorization", "user-agent", "x-amz-request-payer", "x-amz-server-side-encryption",
             "x-amz-server-side-encryption-aws-kms-key-id")


@dataclass
class Seen:
    """One request as the server saw it."""

    method: str
    path: str
    query: str
    scheme: str
    headers: dict[str, str]

    @property
    def botocore(self) -> bool:
        """Sent by botocore (else by objckpt's own HTTP path)."""
        return "botocore" in self.headers.get("user-agent", "").lower()

    @property
    def signed_region(self) -> Optional[str]:
        auth = self.headers.get("authorization", "")
        if "Credential=" not in auth:
            return None
        return auth.split("Credential=", 1)[1].split("/")[2]


@dataclass
class PrivateCA:
    """A CA and a server certificate it signed for 127.0.0.1 / localhost (PEM files)."""

    ca: Path
    cert: Path
    key: Path


def make_ca(directory: Path) -> PrivateCA:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "objckpt test CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(days=1))
          .not_valid_after(now + datetime.timedelta(days=2))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False, data_encipherment=False,
                                       key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
          .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1)).not_valid_after(now + datetime.timedelta(days=2))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                        x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    directory.mkdir(parents=True, exist_ok=True)
    out = PrivateCA(directory / "ca.pem", directory / "server.pem", directory / "server.key")
    out.ca.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    out.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    out.key.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption()))
    return out


@dataclass
class MotoServer:
    """moto's S3 app on 127.0.0.1 (port 0), over TLS when ``tls`` is given."""

    tls: Optional[PrivateCA] = None
    seen: list[Seen] = field(default_factory=list)
    url: str = ""

    def __enter__(self) -> "MotoServer":
        from moto.moto_server.werkzeug_app import DomainDispatcherApplication, create_backend_app
        from werkzeug.serving import make_server

        app = DomainDispatcherApplication(create_backend_app)
        ctx = None
        if self.tls is not None:
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            ctx.load_cert_chain(str(self.tls.cert), str(self.tls.key))
        self._server = make_server("127.0.0.1", 0, self._record(app), threaded=True, ssl_context=ctx)
        self.url = f"{'https' if ctx else 'http'}://127.0.0.1:{self._server.server_port}"
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                        daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _record(self, app: Callable[..., Iterable[bytes]]) -> Callable[..., Iterable[bytes]]:
        def wrapped(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
            headers = {h: environ["HTTP_" + h.upper().replace("-", "_")] for h in _RECORDED
                       if "HTTP_" + h.upper().replace("-", "_") in environ}
            self.seen.append(Seen(environ["REQUEST_METHOD"], environ.get("PATH_INFO", ""),
                                  environ.get("QUERY_STRING", ""), environ["wsgi.url_scheme"], headers))
            return app(environ, start_response)

        return wrapped
