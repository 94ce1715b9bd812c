"""Measure what an S3-compatible store does with the requests objckpt relies on.

Why: S3 implementations differ on exactly the points objckpt's commit and integrity depend on
(conditional create, checksums, DeleteObjects, the minimum part size), and the docs' table of
stores should state what was measured, not what a vendor page claims.  :func:`probe` asks one
store with boto3 (the reference client), one question per column of that table, and returns
:class:`StoreFacts`.  It needs no pytest, so any fixture (moto, the test server, a real Ceph
RGW) or a person at a prompt can run it::

    python -m testkit.store_probe http://127.0.0.1:7480 my-bucket ACCESS SECRET

Every object and multipart upload it makes lives under one fresh prefix and is removed again
(single DeleteObject / AbortMultipartUpload calls, so the cleanup does not depend on the
DeleteObjects answer being measured).  Botocore is told to add no checksum of its own
(``request_checksum_calculation="when_required"``): each checksum header sent is the one the
probe chose, so a wrong one reaches the store as written.

A fact is ``True``/``False`` when the store answered one way or the other, ``None`` when its
answer was something else (an unexpected error, kept in ``notes``).
"""
from __future__ import annotations

import base64
import dataclasses
import sys
import uuid
from typing import Any, Callable, List, Optional, Tuple

__all__ = ["PART_CHECKSUM_REFUSALS", "StoreFacts", "probe"]

#: the error codes a store answers a part whose bytes do not match its checksum header with
#: (AWS: BadDigest; some stores say XAmzContentChecksumMismatch or InvalidDigest)
PART_CHECKSUM_REFUSALS = frozenset({"BadDigest", "XAmzContentChecksumMismatch", "InvalidDigest", "InvalidChecksum"})
_SMALL_PART = 64 << 10  # a non-last part far below S3's 5 MiB minimum (also below any store's sane minimum)


@dataclasses.dataclass(frozen=True)
class StoreFacts:
    """One store's answers, one field per column of the docs' table of S3 implementations."""

    #: PutObject with ``If-None-Match: *`` on an existing key refused with 412 (False: it overwrote)
    put_if_none_match: Optional[bool]
    #: CompleteMultipartUpload with ``If-None-Match: *`` on an existing key refused with 412
    complete_if_none_match: Optional[bool]
    #: UploadPart with a wrong ``x-amz-checksum-crc32c`` refused (400 BadDigest or alike)
    part_checksum_checked: Optional[bool]
    #: PutObject with a wrong ``x-amz-checksum-crc32c`` refused
    put_checksum_checked: Optional[bool]
    #: UploadPart's answer carries the ``x-amz-checksum-crc32c`` it was sent (what objckpt's
    #: "does not check part checksums" warning keys on: it warns when the answer has none)
    part_checksum_echoed: Optional[bool]
    #: HEAD with ``x-amz-checksum-mode: ENABLED`` returns the crc32c a PutObject carried
    head_checksum_put: Optional[bool]
    #: the same for an object uploaded in parts with crc32c
    head_checksum_multipart: Optional[bool]
    #: CompleteMultipartUpload's answer carries ``ChecksumCRC32C`` for an upload made with crc32c
    complete_returns_checksum: Optional[bool]
    #: DeleteObjects (the batch delete) works and removes the keys it names
    delete_objects: Optional[bool]
    #: a non-last part smaller than 5 MiB refused at Complete with EntityTooSmall (False: accepted)
    min_part_size_enforced: Optional[bool]
    #: what each question saw beyond the yes/no: error codes, checksum values, surprises
    notes: Tuple[str, ...] = ()


def _crc32c_b64(data: bytes) -> str:
    """The base64 big-endian crc32c S3 sends in ``x-amz-checksum-crc32c``."""
    try:
        import crc32c  # the project's dependency; botocore's own needs awscrt
        value = crc32c.crc32c(data)
    except ImportError:  # pragma: no cover - plain Python fallback, slow but the probe sends kilobytes
        value = 0xFFFFFFFF
        for byte in data:
            value ^= byte
            for _ in range(8):
                value = (value >> 1) ^ (0x82F63B78 & -(value & 1))
        value ^= 0xFFFFFFFF
    return base64.b64encode(value.to_bytes(4, "big")).decode()


def _code(e: Exception) -> Tuple[str, int]:
    """(S3 error code, HTTP status) of a botocore ClientError; ("", 0) for anything else."""
    resp = getattr(e, "response", None) or {}
    return str(resp.get("Error", {}).get("Code", "")), int(resp.get("ResponseMetadata", {}).get("HTTPStatusCode", 0))


class _Probe:
    """The questions, over one client and one prefix; remembers what to clean up."""

    def __init__(self, client: Any, bucket: str) -> None:
        self.s3, self.bucket = client, bucket
        self.prefix = f"objckpt-store-probe/{uuid.uuid4().hex}/"
        self.keys: List[str] = []
        self.uploads: List[Tuple[str, str]] = []
        self.notes: List[str] = []
        self.part_answers: List[Any] = []  # every UploadPart answer, in order

    def key(self, name: str) -> str:
        k = self.prefix + name
        self.keys.append(k)
        return k

    def note(self, text: str) -> None:
        self.notes.append(text)

    def put(self, key: str, body: bytes, **kw: Any) -> Any:
        return self.s3.put_object(Bucket=self.bucket, Key=key, Body=body, **kw)

    def create_upload(self, key: str, crc: bool) -> str:
        kw = {"ChecksumAlgorithm": "CRC32C"} if crc else {}
        uid = self.s3.create_multipart_upload(Bucket=self.bucket, Key=key, **kw)["UploadId"]
        self.uploads.append((key, uid))
        return uid

    def upload_part(self, key: str, uid: str, n: int, body: bytes, crc: Optional[str], **kw: Any) -> dict:
        if crc is not None:
            kw["ChecksumCRC32C"] = crc
        r = self.s3.upload_part(Bucket=self.bucket, Key=key, UploadId=uid, PartNumber=n, Body=body, **kw)
        self.part_answers.append(r)
        part = {"PartNumber": n, "ETag": r["ETag"]}
        if crc is not None:
            part["ChecksumCRC32C"] = crc
        return part

    def complete(self, key: str, uid: str, parts: List[dict], **kw: Any) -> Any:
        r = self.s3.complete_multipart_upload(Bucket=self.bucket, Key=key, UploadId=uid,
                                              MultipartUpload={"Parts": parts}, **kw)
        self.uploads.remove((key, uid))
        return r

    def head_crc(self, key: str) -> str:
        r = self.s3.head_object(Bucket=self.bucket, Key=key, ChecksumMode="ENABLED")
        return str(r.get("ChecksumCRC32C") or "")

    def ask(self, what: str, question: Callable[[], Optional[bool]]) -> Optional[bool]:
        """One question; an unexpected failure is a None answer with a note, never an exception."""
        try:
            return question()
        except Exception as e:  # any store surprise is a fact to report, not a probe crash
            code, status = _code(e)
            self.note(f"{what}: unexpected {type(e).__name__} {status} {code or e}")
            return None

    # ---- the questions ---------------------------------------------------------------------
    def put_if_none_match(self) -> Optional[bool]:
        key = self.key("conditional-put")
        self.put(key, b"first")
        try:
            self.put(key, b"second", IfNoneMatch="*")
        except Exception as e:
            code, status = _code(e)
            if status == 412:
                return True
            self.note(f"PutObject If-None-Match on an existing key: {status} {code}")
            return None
        body = self.s3.get_object(Bucket=self.bucket, Key=key)["Body"].read()
        self.note(f"PutObject If-None-Match on an existing key: accepted, object now {body!r}")
        return False

    def complete_if_none_match(self) -> Optional[bool]:
        key = self.key("conditional-complete")
        self.put(key, b"first")
        uid = self.create_upload(key, crc=False)
        parts = [self.upload_part(key, uid, 1, b"second", None)]
        try:
            self.complete(key, uid, parts, IfNoneMatch="*")
        except Exception as e:
            code, status = _code(e)
            if status == 412:
                return True
            self.note(f"CompleteMultipartUpload If-None-Match on an existing key: {status} {code}")
            return None
        body = self.s3.get_object(Bucket=self.bucket, Key=key)["Body"].read()
        self.note(f"CompleteMultipartUpload If-None-Match on an existing key: accepted, object now {body!r}")
        return False

    def _wrong_checksum_refused(self, what: str, send: Callable[[str], Any]) -> Optional[bool]:
        wrong = _crc32c_b64(b"not these bytes")
        try:
            send(wrong)
        except Exception as e:
            code, status = _code(e)
            self.note(f"{what} with a wrong crc32c: {status} {code}")
            # another refusal (a store that refuses the header itself, say) answers nothing here
            return True if code in PART_CHECKSUM_REFUSALS else None
        self.note(f"{what} with a wrong crc32c: accepted")
        return False

    def part_checksum_checked(self) -> Optional[bool]:
        key = self.key("wrong-part-checksum")
        uid = self.create_upload(key, crc=True)
        refused = self._wrong_checksum_refused(
            "UploadPart", lambda crc: self.upload_part(key, uid, 1, b"part bytes", crc))
        if refused is False:  # does the SDK's algorithm header change its mind? (a note only)
            self._wrong_checksum_refused("UploadPart with x-amz-sdk-checksum-algorithm", lambda crc: self.upload_part(
                key, uid, 2, b"part bytes", crc, ChecksumAlgorithm="CRC32C"))
        return refused

    def put_checksum_checked(self) -> Optional[bool]:
        key = self.key("wrong-put-checksum")
        return self._wrong_checksum_refused("PutObject", lambda crc: self.put(key, b"object bytes", ChecksumCRC32C=crc))

    def head_checksum_put(self) -> Optional[bool]:
        """objckpt's PutObject carries ``x-amz-checksum-crc32c`` alone (S3 needs no more); a
        store that keeps it only beside ``x-amz-sdk-checksum-algorithm`` is noted."""
        key, body = self.key("put-checksum"), b"checksummed object"
        want = _crc32c_b64(body)
        self.put(key, body, ChecksumCRC32C=want)
        got = self.head_crc(key)
        self.note(f"HEAD checksum of a PutObject: {got or 'none'} (sent {want})")
        if not got:
            self.put(key, body, ChecksumCRC32C=want, ChecksumAlgorithm="CRC32C")
            self.note(f"HEAD checksum of a PutObject sent with x-amz-sdk-checksum-algorithm too: "
                      f"{self.head_crc(key) or 'none'}")
        return got == want if got else False

    def multipart_checksums(self) -> Tuple[Optional[bool], Optional[bool], Optional[bool]]:
        """(HEAD returns it, Complete returns it, each UploadPart answer echoes its own) for a
        two-part upload made with crc32c."""
        key = self.key("multipart-checksum")
        uid = self.create_upload(key, crc=True)
        bodies = [b"a" * (5 << 20), b"last part"]  # the first at S3's minimum, so any store accepts it
        sent = [_crc32c_b64(b) for b in bodies]
        del self.part_answers[:]
        parts = [self.upload_part(key, uid, n, b, c) for n, (b, c) in enumerate(zip(bodies, sent), 1)]
        echoed = [str(a.get("ChecksumCRC32C") or "") for a in self.part_answers]
        r = self.complete(key, uid, parts)
        in_complete = str(r.get("ChecksumCRC32C") or "")
        in_head = self.head_crc(key)
        self.note(f"multipart crc32c: UploadPart answered {echoed} (sent {sent}), Complete answered "
                  f"{in_complete or 'none'}, HEAD {in_head or 'none'}")
        return bool(in_head), bool(in_complete), echoed == sent

    def delete_objects(self) -> Optional[bool]:
        keys = [self.key(f"batch-delete-{i}") for i in range(3)]
        for k in keys:
            self.put(k, b"x")
        try:
            r = self.s3.delete_objects(Bucket=self.bucket, Delete={"Objects": [{"Key": k} for k in keys],
                                                                   "Quiet": False})
        except Exception as e:
            code, status = _code(e)
            self.note(f"DeleteObjects: {status} {code}")
            return False if status in (400, 405, 501) or code == "NotImplemented" else None
        errors = r.get("Errors") or []
        left = [k for k in keys if self._exists(k)]
        if errors or left:
            self.note(f"DeleteObjects: errors {errors}, still present {left}")
            return False
        return True

    def _exists(self, key: str) -> bool:
        try:
            self.s3.head_object(Bucket=self.bucket, Key=key)
            return True
        except Exception as e:
            if _code(e)[1] == 404:
                return False
            raise

    def min_part_size_enforced(self) -> Optional[bool]:
        key = self.key("small-parts")
        uid = self.create_upload(key, crc=False)
        parts = [self.upload_part(key, uid, n, b"s" * _SMALL_PART, None) for n in (1, 2)]
        try:
            self.complete(key, uid, parts)
        except Exception as e:
            code, status = _code(e)
            self.note(f"Complete with a {_SMALL_PART} B non-last part: {status} {code}")
            return True if code == "EntityTooSmall" else None
        self.note(f"Complete with a {_SMALL_PART} B non-last part: accepted")
        return False

    # ---- cleanup ---------------------------------------------------------------------------
    def clean(self) -> None:
        """Abort every upload still open and delete every key, one request each."""
        for key, uid in list(self.uploads):
            try:
                self.s3.abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=uid)
            except Exception as e:
                if _code(e)[1] != 404:
                    self.note(f"cleanup: abort of {key} failed: {e}")
        for key in self.keys:
            try:
                self.s3.delete_object(Bucket=self.bucket, Key=key)
            except Exception as e:
                self.note(f"cleanup: delete of {key} failed: {e}")


def make_client(endpoint_url: str, access_key: str, secret_key: str, region: str = "us-east-1") -> Any:
    """A boto3 S3 client that sends only the checksums it is given (path-style, SigV4)."""
    import boto3
    from botocore.config import Config

    config = Config(signature_version="s3v4", s3={"addressing_style": "path"},
                    request_checksum_calculation="when_required", response_checksum_validation="when_required",
                    retries={"mode": "standard", "max_attempts": 3}, connect_timeout=10, read_timeout=60)
    return boto3.client("s3", endpoint_url=endpoint_url, aws_access_key_id=access_key,
                        aws_secret_access_key=secret_key, region_name=region, config=config)


def probe(endpoint_url: str, bucket: str, access_key: str, secret_key: str, region: str = "us-east-1") -> StoreFacts:
    """Ask the store at ``endpoint_url`` each question of the table, in ``bucket`` (which must
    exist), and clean up after itself.  About 6 MiB is uploaded in all."""
    p = _Probe(make_client(endpoint_url, access_key, secret_key, region), bucket)
    try:
        put_inm = p.ask("PutObject If-None-Match", p.put_if_none_match)
        complete_inm = p.ask("CompleteMultipartUpload If-None-Match", p.complete_if_none_match)
        part_crc = p.ask("UploadPart checksum", p.part_checksum_checked)
        put_crc = p.ask("PutObject checksum", p.put_checksum_checked)
        head_put = p.ask("HEAD checksum of a PutObject", p.head_checksum_put)
        multipart: Tuple[Optional[bool], Optional[bool], Optional[bool]] = (None, None, None)
        try:
            multipart = p.multipart_checksums()
        except Exception as e:
            code, status = _code(e)
            p.note(f"multipart crc32c upload: unexpected {type(e).__name__} {status} {code or e}")
        delete = p.ask("DeleteObjects", p.delete_objects)
        min_part = p.ask("minimum part size", p.min_part_size_enforced)
    finally:
        p.clean()
    return StoreFacts(put_if_none_match=put_inm, complete_if_none_match=complete_inm, part_checksum_checked=part_crc,
                      put_checksum_checked=put_crc, part_checksum_echoed=multipart[2], head_checksum_put=head_put,
                      head_checksum_multipart=multipart[0],
                      complete_returns_checksum=multipart[1], delete_objects=delete, min_part_size_enforced=min_part,
                      notes=tuple(p.notes))


def main(argv: Optional[List[str]] = None) -> None:
    """``python -m testkit.store_probe ENDPOINT BUCKET ACCESS_KEY SECRET_KEY [REGION]``: print the facts."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) not in (4, 5):
        sys.exit(main.__doc__)
    facts = probe(*args)
    for f in dataclasses.fields(facts):
        value = getattr(facts, f.name)
        if f.name == "notes":
            for line in value:
                print(f"  note: {line}")
        else:
            print(f"{f.name}: {value}")


if __name__ == "__main__":
    main()
