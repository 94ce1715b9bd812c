"""The credentials botocore's chain gives, signed on objckpt's own HTTP path, proved against boto3.

``tests/test_s3_config_parity.py`` proves which chain objckpt asks (environment,
files, profiles) without sending anything.  Here the providers that do real work
run end to end, each in an AWS environment built from scratch in ``tmp_path``:
a role chain and ``credential_source = Environment`` (STS AssumeRole), web
identity (AssumeRoleWithWebIdentity), a ``credential_process`` whose answers are
already due for refresh, and a session token in the credentials file.  Each test
saves and loads a checkpoint against a moto server over HTTP (S3 and STS) and
records every request the server receives: the key id and session token on each
S3 request must be the ones the chain gave (STS's ``ASIA...`` keys, never the
source profile's), and a ``boto3.Session`` given the same inputs must resolve the
same: the same STS calls (action, role, session name, signer) or, where the
source answers the same to both (a file, a process counting its runs), the same
keys.  Where moto knows the keys (IAM users, the roles its STS assumed), its
signature checking is on for the objckpt requests, so the secret and token are
proved too, not only the key id.
"""
from __future__ import annotations

import io
import json
import os
import re
import sys
import threading
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional
from urllib.parse import parse_qsl

import boto3
import pytest
import torch
from botocore.exceptions import ClientError

import objckpt
from objckpt.storage.s3.config import S3Config, Transport
from objckpt.storage.s3.credentials import Credentials

ACCOUNT = "123456789012"  # moto's
_CREDENTIAL = re.compile(r"Credential=([^/]+)/\d{8}/([^/]+)/([^/]+)/aws4_request")
_SIGNED = re.compile(r"SignedHeaders=([^,]+)")
_CLEARED = ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY", "SSL_CERT_FILE", "REQUESTS_CA_BUNDLE",
            "OBJCKPT_S3_DIRECT_HTTP")


# -- a moto server that records what it was sent ---------------------------------------------

@dataclass(frozen=True)
class Seen:
    """One request as the server received it."""

    service: str  # the signature's credential scope ("s3", "sts"); "sts" for an unsigned STS call
    method: str
    path: str
    agent: str
    key_id: Optional[str]  # the access key id in the Authorization header (None: unsigned)
    token: Optional[str]  # x-amz-security-token
    signed: tuple[str, ...]  # the headers the signature covers
    form: dict[str, str] = field(default_factory=dict)  # an STS call's parameters
    issued: Optional[Credentials] = None  # the keys an STS answer gave


class Recorder:
    """WSGI middleware in front of moto's app: every request, and the keys STS handed out."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.seen: list[Seen] = []
        self.lock = threading.Lock()

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
        body = environ["wsgi.input"].read(int(environ.get("CONTENT_LENGTH") or 0))
        environ["wsgi.input"] = io.BytesIO(body)
        auth = environ.get("HTTP_AUTHORIZATION", "")
        cred, signed = _CREDENTIAL.search(auth), _SIGNED.search(auth)
        form = dict(parse_qsl(body.decode("latin-1"))) if "form-urlencoded" in environ.get("CONTENT_TYPE", "") else {}
        answer = b"".join(self.app(environ, start_response))
        if environ.get("PATH_INFO", "").startswith("/moto-api/"):  # the test's own resets
            return [answer]
        issued = None
        if form.get("Action", "").startswith("AssumeRole"):
            got = {k: re.search(rf"<{k}>([^<]+)</{k}>", answer.decode()) for k in
                   ("AccessKeyId", "SecretAccessKey", "SessionToken")}
            if all(got.values()):
                issued = Credentials(*(m.group(1) for m in got.values() if m))
        service = cred.group(3) if cred else ("sts" if "Action" in form else "")
        seen = Seen(service, environ["REQUEST_METHOD"], environ.get("PATH_INFO", ""),
                    environ.get("HTTP_USER_AGENT", ""), cred.group(1) if cred else None,
                    environ.get("HTTP_X_AMZ_SECURITY_TOKEN"), tuple(signed.group(1).split(";")) if signed else (),
                    form, issued)
        with self.lock:
            self.seen.append(seen)
        return [answer]

    def take(self) -> list[Seen]:
        """What was seen since the last take."""
        with self.lock:
            out, self.seen = self.seen, []
        return out


@dataclass
class Moto:
    url: str
    recorder: Recorder

    def post(self, path: str, data: bytes = b"") -> None:
        req = urllib.request.Request(f"{self.url}{path}", data=data, method="POST",
                                     headers={"Content-Type": "text/plain"})
        urllib.request.urlopen(req).read()

    def checks_signatures(self, on: bool) -> None:
        """moto verifies every request's signature, key id, token and IAM policy (or stops)."""
        self.post("/moto-api/reset-auth", b"0" if on else b"inf")


@pytest.fixture(scope="module")
def moto() -> Iterator[Moto]:
    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, create_backend_app
    from werkzeug.serving import make_server

    recorder = Recorder(DomainDispatcherApplication(create_backend_app))
    server = make_server("127.0.0.1", 0, recorder, threaded=True)
    thread = threading.Thread(target=server.serve_forever, name="recording-moto", daemon=True)
    thread.start()
    try:
        yield Moto(f"http://127.0.0.1:{server.server_port}", recorder)
    finally:
        server.shutdown()
        thread.join()


# -- one AWS environment per test, from scratch -----------------------------------------------

@dataclass
class Env:
    dir: Path
    moto: Moto
    bucket: str = "chain"

    def write(self, config: str, credentials: str = "") -> None:
        """The AWS config and credentials files; ``{moto}`` is the server's URL, ``{dir}`` the test's."""
        fill = {"moto": self.moto.url, "dir": str(self.dir)}
        (self.dir / "config").write_text(config.format(**fill))
        (self.dir / "credentials").write_text(credentials.format(**fill))

    def iam_user(self, name: str = "saver") -> Credentials:
        """An IAM user's keys, allowed S3 and AssumeRole (moto checks them once its checking is on)."""
        iam = _admin("iam", self.moto.url)
        iam.create_user(UserName=name)
        iam.put_user_policy(UserName=name, PolicyName="p", PolicyDocument=_ALLOW)
        k = iam.create_access_key(UserName=name)["AccessKey"]
        return Credentials(k["AccessKeyId"], k["SecretAccessKey"])

    def role(self, name: str) -> str:
        """A role anyone may assume, allowed S3 and AssumeRole (a chain goes on from it); its ARN."""
        iam = _admin("iam", self.moto.url)
        trust = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Principal": {"AWS": "*"},
                                                          "Action": ["sts:AssumeRole", "sts:AssumeRoleWithWebIdentity"]}]}
        arn = iam.create_role(RoleName=name, AssumeRolePolicyDocument=json.dumps(trust))["Role"]["Arn"]
        iam.put_role_policy(RoleName=name, PolicyName="p", PolicyDocument=_ALLOW)
        return str(arn)


_ALLOW = json.dumps({"Version": "2012-10-17",
                     "Statement": [{"Effect": "Allow", "Action": ["s3:*", "sts:AssumeRole"], "Resource": "*"}]})
_ENDPOINTS = "services = moto\n[services moto]\ns3 =\n  endpoint_url = {moto}\nsts =\n  endpoint_url = {moto}\n"


def _admin(service: str, url: str) -> Any:
    """A client with fixed keys, for setting the scene (never the keys under test)."""
    return boto3.Session().client(service, endpoint_url=url, region_name="us-east-1", aws_access_key_id="admin",
                                  aws_secret_access_key="admin")


@pytest.fixture
def env(moto: Moto, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Env]:
    """No AWS settings but the config and credentials files in ``tmp_path``; moto reset, one bucket."""
    for k in list(os.environ):
        if k.startswith("AWS_") or k.upper() in _CLEARED:
            monkeypatch.delenv(k)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    e = Env(tmp_path, moto)
    e.write("")
    moto.checks_signatures(False)
    moto.post("/moto-api/reset")
    _admin("s3", moto.url).create_bucket(Bucket=e.bucket)
    moto.recorder.take()
    try:
        yield e
    finally:
        moto.checks_signatures(False)


# -- what each side does with the same inputs -------------------------------------------------

def objckpt_round_trip(env: Env, options: Optional[dict[str, Any]] = None) -> list[Seen]:
    """A save, a load and a read through objckpt's own HTTP path; what the server got
    since the last :meth:`Recorder.take`."""
    options = options or {}
    uri = f"s3://{env.bucket}/run/step-1"
    assert S3Config.resolve(env.bucket, options).transport is Transport.DIRECT
    state: dict[str, Any] = {"w": torch.arange(4096, dtype=torch.float32), "b": torch.ones(7, dtype=torch.int64), "step": 3}
    objckpt.save(state, uri, storage_options=options)
    out: dict[str, Any] = {"w": torch.zeros(4096), "b": torch.zeros(7, dtype=torch.int64), "step": 0}
    objckpt.load(out, uri, storage_options=options)
    assert torch.equal(out["w"], state["w"]) and torch.equal(out["b"], state["b"]) and out["step"] == 3
    assert torch.equal(objckpt.read(uri, "w", storage_options=options)["w"], state["w"])
    return env.moto.recorder.take()


def s3_requests(seen: list[Seen]) -> list[Seen]:
    """The S3 requests of ``seen``: all from objckpt's own path, all signed."""
    s3 = [s for s in seen if s.service != "sts"]
    assert len(s3) >= 4 and all(s.agent == "objckpt" for s in s3), {s.agent for s in s3}
    assert all(s.service == "s3" for s in s3), [(s.method, s.path) for s in s3 if s.service != "s3"]
    return s3


def objckpt_resolves(env: Env, options: Optional[dict[str, Any]] = None) -> Credentials:
    got = S3Config.resolve(env.bucket, options or {}).credentials().get()  # type: ignore[union-attr]
    assert got is not None
    return got


def frozen(botocore_creds: Any) -> Credentials:
    """What botocore would sign the next request with (refreshed first when due)."""
    f = botocore_creds.get_frozen_credentials()
    return Credentials(f.access_key, f.secret_key, f.token or None)


def boto3_resolves(profile: Optional[str] = None) -> Credentials:
    return frozen(boto3.Session(profile_name=profile).get_credentials())


def sts_transcript(seen: list[Seen], known: dict[str, str]) -> list[tuple[Any, ...]]:
    """The STS calls made, keys named: ``known`` (static key id -> name), an STS answer's
    keys and token by the number of the call that issued them (random in moto)."""
    names = dict(known)
    out: list[tuple[Any, ...]] = []
    for s in seen:
        if s.service != "sts":
            continue
        out.append((s.form.get("Action"), s.form.get("RoleArn"), s.form.get("RoleSessionName"),
                    names.get(s.key_id or "", s.key_id), names.get(s.token or "", s.token),
                    s.form.get("WebIdentityToken")))
        assert s.issued is not None, f"STS refused {s.form}"
        names[s.issued.access_key] = names[s.issued.token or ""] = f"answer {len(out)}"
    return out


def issued_by(seen: list[Seen]) -> dict[str, Seen]:
    """Access key id -> the STS call whose answer gave it."""
    return {s.issued.access_key: s for s in seen if s.issued is not None}


def assert_signed_with(s3: list[Seen], creds: Credentials) -> None:
    """Every S3 request carries ``creds``' key id and token, the token inside the signature."""
    assert {(s.key_id, s.token) for s in s3} == {(creds.access_key, creds.token)}, \
        sorted({(s.key_id, s.token) for s in s3}, key=str)
    if creds.token:
        assert all("x-amz-security-token" in s.signed for s in s3)


# -- 1. a role chain ---------------------------------------------------------------------------

@pytest.mark.parametrize("roles", [1, 2], ids=["one role", "two roles"])
def test_a_role_chain_signs_with_the_keys_sts_gave_the_last_role(env: Env, roles: int,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """``a``: role_arn + source_profile ``b``; ``b`` holds static keys, or (two roles) is
    itself a role over ``c``'s keys.  STS (moto, checking every signature and policy) is
    asked for each role in turn, the second signed with the first's temporary keys; S3
    requests carry the last role's ASIA keys, never the source profile's."""
    user = env.iam_user()
    r1, r0 = env.role("r1"), env.role("r0")
    inner = f"[profile b]\nrole_arn = {r0}\nsource_profile = c\nrole_session_name = inner\n" if roles == 2 else ""
    env.write(f"[profile a]\nregion = us-east-1\nrole_arn = {r1}\nsource_profile = b\nrole_session_name = ckpt\n"
              f"{_ENDPOINTS}{inner}",
              f"[{'c' if roles == 2 else 'b'}]\naws_access_key_id = {user.access_key}\n"
              f"aws_secret_access_key = {user.secret_key}\n")
    monkeypatch.setenv("AWS_PROFILE", "a")
    env.moto.checks_signatures(True)
    env.moto.recorder.take()

    got = objckpt_resolves(env)
    objckpt_seen = objckpt_round_trip(env)
    s3 = s3_requests(objckpt_seen)
    mine = boto3_resolves()
    boto_sts = env.moto.recorder.take()

    expected: list[tuple[Any, ...]] = [("AssumeRole", r1, "ckpt", "user", None, None)]
    if roles == 2:
        expected = [("AssumeRole", r0, "inner", "user", None, None),
                    ("AssumeRole", r1, "ckpt", "answer 1", "answer 1", None)]
    assert sts_transcript(objckpt_seen, {user.access_key: "user"}) == expected
    assert sts_transcript(boto_sts, {user.access_key: "user"}) == expected
    # the keys objckpt resolved and signed with are the ones STS gave for the last role
    assert got.access_key.startswith("ASIA") and got.access_key != user.access_key and got.token
    assert got == issued_by(objckpt_seen)[got.access_key].issued
    assert issued_by(objckpt_seen)[got.access_key].form["RoleArn"] == r1
    assert_signed_with(s3, got)
    assert mine == issued_by(boto_sts)[mine.access_key].issued and mine.access_key.startswith("ASIA")
    with pytest.raises(ClientError, match="InvalidAccessKeyId"):  # moto was checking all along
        _admin("s3", env.moto.url).list_objects_v2(Bucket=env.bucket)


# -- 2. credential_process, its answers due for refresh ----------------------------------------

#: prints credentials numbered by its runs (counted in the file it is given), each expiring in
#: 5 minutes: inside botocore's mandatory refresh window (10 minutes), so every use of them
#: runs the process again, with no waiting
PROCESS = """\
import datetime, json, pathlib, sys
runs = pathlib.Path(sys.argv[1])
n = int(runs.read_text() or 0) + 1 if runs.exists() else 1
runs.write_text(str(n))
due = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(minutes=5)
print(json.dumps({"Version": 1, "AccessKeyId": f"ASIAPROCESS{n:09d}", "SecretAccessKey": f"secret-{n}",
                  "SessionToken": f"token-{n}", "Expiration": due.strftime("%Y-%m-%dT%H:%M:%SZ")}))
"""


def _answer(n: int) -> Credentials:
    return Credentials(f"ASIAPROCESS{n:09d}", f"secret-{n}", f"token-{n}")


def test_credential_process_runs_again_when_its_answer_is_due(env: Env) -> None:
    """The process's first answer (the chain's walk) is already due: the first request's
    signing runs it again, and so does every later one; requests carry the newer keys."""
    (env.dir / "process.py").write_text(PROCESS)
    runs = env.dir / "runs"
    env.write(f'[default]\nregion = us-east-1\ncredential_process = "{sys.executable}" "{{dir}}/process.py" '
              f'"{{dir}}/runs"\n{_ENDPOINTS}')

    # the same inputs, the same answers: the walk runs it once, each use of the keys once more
    theirs = boto3.Session().get_credentials()
    assert [frozen(theirs), frozen(theirs)] == [_answer(2), _answer(3)] and runs.read_text() == "3"
    runs.unlink()
    src = S3Config.resolve(env.bucket, {}).credentials()
    assert src is not None and [src.get(), src.get()] == [_answer(2), _answer(3)] and runs.read_text() == "3"

    s3 = s3_requests(objckpt_round_trip(env))
    n = int(runs.read_text())
    sent = {s.key_id for s in s3}
    # each request signed with keys from a run after the ones above, fresh keys for each request
    assert sent <= {_answer(i).access_key for i in range(4, n + 1)} and len(sent) == len(s3), (sent, n)
    assert all(s.token == f"token-{int(s.key_id[-9:])}" for s in s3 if s.key_id)  # type: ignore[index]
    assert n >= 3 + len(s3)


# -- 3. a session token in the credentials file ------------------------------------------------

def test_a_session_token_in_the_credentials_file_goes_out_signed(env: Env) -> None:
    env.write(f"[default]\nregion = us-east-1\n{_ENDPOINTS}",
              "[default]\naws_access_key_id = ASIAFILEKEY000000001\naws_secret_access_key = file-secret\n"
              "aws_session_token = file-token/with+odd=chars\n")
    want = Credentials("ASIAFILEKEY000000001", "file-secret", "file-token/with+odd=chars")
    assert boto3_resolves() == objckpt_resolves(env) == want
    assert_signed_with(s3_requests(objckpt_round_trip(env)), want)


# -- 4. web identity; a role over the environment's keys ---------------------------------------

@pytest.mark.parametrize("where", ["profile", "environment"])
def test_web_identity_signs_with_the_keys_sts_gave(env: Env, where: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``web_identity_token_file`` + ``role_arn`` in the profile, or AWS_WEB_IDENTITY_TOKEN_FILE +
    AWS_ROLE_ARN (and STS reached through AWS_ENDPOINT_URL_STS): AssumeRoleWithWebIdentity,
    unsigned, carrying the file's token; moto then checks the S3 requests' signatures."""
    role = env.role("web")
    (env.dir / "token").write_text("eyJ.web-identity.token")
    if where == "profile":
        env.write(f"[default]\nregion = us-east-1\nrole_arn = {role}\nweb_identity_token_file = {{dir}}/token\n"
                  f"role_session_name = ckpt\n{_ENDPOINTS}")
    else:
        env.write("[default]\nregion = us-east-1\n")
        for k, v in {"AWS_WEB_IDENTITY_TOKEN_FILE": str(env.dir / "token"), "AWS_ROLE_ARN": role,
                     "AWS_ROLE_SESSION_NAME": "ckpt", "AWS_ENDPOINT_URL_STS": env.moto.url,
                     "AWS_ENDPOINT_URL_S3": env.moto.url}.items():
            monkeypatch.setenv(k, v)
    env.moto.recorder.take()

    got = objckpt_resolves(env)
    objckpt_sts = env.moto.recorder.take()
    env.moto.checks_signatures(True)  # (moto cannot check an unsigned call: on for S3 only)
    s3 = s3_requests(objckpt_round_trip(env))
    env.moto.checks_signatures(False)
    mine = boto3_resolves()
    boto_sts = env.moto.recorder.take()

    expected = [("AssumeRoleWithWebIdentity", role, "ckpt", None, None, "eyJ.web-identity.token")]
    assert sts_transcript(objckpt_sts, {}) == sts_transcript(boto_sts, {}) == expected
    assert got.access_key.startswith("ASIA") and got == issued_by(objckpt_sts)[got.access_key].issued
    assert_signed_with(s3, got)
    assert mine == issued_by(boto_sts)[mine.access_key].issued


@pytest.mark.parametrize("profile_from", ["storage option", "AWS_PROFILE"])
def test_credential_source_environment(env: Env, profile_from: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``role_arn`` + ``credential_source = Environment``, keys in AWS_ACCESS_KEY_ID/...:
    with the profile given to the session (storage option ``profile``, boto3's
    ``profile_name``) the role is assumed with the environment's keys; named by
    AWS_PROFILE only, botocore's environment provider comes first and the keys are
    used as they are, by boto3 and objckpt alike."""
    user = env.iam_user()
    role = env.role("from-env")
    env.write(f"[default]\nregion = us-east-1\n[profile job]\nregion = us-east-1\nrole_arn = {role}\n"
              f"credential_source = Environment\nrole_session_name = ckpt\n{_ENDPOINTS}")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", user.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", user.secret_key)
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", env.moto.url)  # (the profile's services section, when it is chosen)
    options: dict[str, Any] = {}
    if profile_from == "storage option":
        options["profile"] = "job"
    else:
        monkeypatch.setenv("AWS_PROFILE", "job")
    env.moto.checks_signatures(True)
    env.moto.recorder.take()

    got = objckpt_resolves(env, options)
    objckpt_seen = objckpt_round_trip(env, options)
    s3 = s3_requests(objckpt_seen)
    mine = boto3_resolves(options.get("profile"))
    boto_sts = env.moto.recorder.take()

    expected: list[tuple[Any, ...]] = []
    if profile_from == "storage option":
        expected = [("AssumeRole", role, "ckpt", "user", None, None)]
        assert got.access_key.startswith("ASIA") and got == issued_by(objckpt_seen)[got.access_key].issued
        assert mine == issued_by(boto_sts)[mine.access_key].issued
    else:
        assert got == mine == user
    assert sts_transcript(objckpt_seen, {user.access_key: "user"}) == expected
    assert sts_transcript(boto_sts, {user.access_key: "user"}) == expected
    assert_signed_with(s3, got)
