"""The reliability suite: a bounded, seeded sample of every fault-campaign kind
(testkit.campaign*) on each test run; ``python -m benchmarks.fault_campaign``
runs the large campaign with the same trial functions.

Cases marked ``xfail(strict=True)`` fail on purpose today: each names the item of
issue 10 being fixed in parallel.  Once the fix merges the case passes, strict makes
it fail loudly, and the mark must go.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any, Iterator

import pytest

import objckpt
from testkit.campaign import (
    FAILED, OK, Target, dead_endpoint_trial, kill_trial, make_bucket, make_state, race_trial, s3_options, same,
)
from testkit.campaign_hostile import CASES, hostile_trial
from testkit.campaign_io import FaultProxy, corrupt_trial, fault_trial, make_v2_checkpoint
from testkit.s3server import S3Server


def _issue(n: str, what: str) -> Any:
    return pytest.mark.xfail(strict=True, reason=f"issue 10 item {n}: {what}")


@pytest.fixture(scope="module")
def s3_server() -> Iterator[S3Server]:
    """A dedicated in-memory S3 server (fault trials reset it between trials)."""
    srv = S3Server()
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def bases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Committed pristine checkpoints on local files: v1 (one process) and v2 (two gloo ranks)."""
    root = tmp_path_factory.mktemp("bases")
    v1 = str(root / "v1")
    state = make_state(3)
    objckpt.save(state, v1, crc_block=4096)
    v2 = str(root / "v2")
    return {"v1": v1, "v2": v2, "v1_state": state, "v2_state": make_v2_checkpoint(v2)}


# --------------------------------------------------------------------------- kill


@pytest.mark.parametrize("seed,fresh", [(1, False), (18, False), (2, True)])  # seeds whose kill lands inside the save
def test_kill_during_local_save(tmp_path: Any, seed: int, fresh: bool) -> None:
    r = kill_trial(Target("local", str(tmp_path)), seed, fresh=fresh)
    assert r.outcome == OK and r.faults == 1, r.to_json()  # killed, and judged sound


@pytest.mark.parametrize("seed,fresh", [(3, False), (4, True)])
def test_kill_during_s3_save(s3_server: S3Server, seed: int, fresh: bool) -> None:
    """``fresh``: the killed save is the prefix's first: nothing may show, gc leaves nothing."""
    bucket = make_bucket(s3_server.endpoint_url, f"kill-{seed}")
    r = kill_trial(Target("s3", bucket, s3_options(s3_server.endpoint_url)), seed, fresh=fresh)
    assert r.outcome == OK and r.faults == 1, r.to_json()


def test_kill_during_moto_save(moto_s3: tuple[str, dict[str, Any]]) -> None:
    bucket, opts = moto_s3
    r = kill_trial(Target("s3", bucket, opts), 14)
    assert r.outcome == OK and r.faults == 1, r.to_json()


# --------------------------------------------------------------------------- faults


@pytest.mark.parametrize("kind,seeds", [("503", range(4)), ("500", range(4, 8)), ("reset", range(8, 22)),
                                        ("stall", range(22, 30))])
def test_round_trips_under_faults(s3_server: S3Server, kind: str, seeds: range) -> None:
    results = [fault_trial(s3_server.endpoint_url, s, kind) for s in seeds]
    failed = [r.to_json() for r in results if r.outcome == FAILED]
    assert not failed, failed
    # the faults really fired (proxy faults are drawn per connection, and an adaptive
    # client opens few connections: a third of the trials, not every one)
    assert sum(r.faults for r in results) >= max(1, len(results) // 3), [r.to_json() for r in results]


@pytest.mark.parametrize("kind", ["cut", "stall"])
def test_broken_response_bodies_are_retried_or_named(s3_server: S3Server, kind: str) -> None:
    """Every response longer than 600 bytes breaks (cut, or a stall beyond the read timeout)
    once per connection: the read must retry to a bit-exact result or raise an ObjckptError."""
    make_bucket(s3_server.endpoint_url, f"body-{kind}")
    uri = f"s3://body-{kind}/ck"
    objckpt.save(make_state(1), uri, storage_options=s3_options(s3_server.endpoint_url))
    with FaultProxy(s3_server.endpoint_url, kind=kind, probability=1.0, direction="down", min_offset=600,
                    max_offset=700, stall_s=1.5) as proxy:
        try:
            back = objckpt.read(uri, storage_options=s3_options(proxy.url, read_timeout=1, max_attempts=3))
            assert same(make_state(1), back)
        except objckpt.ObjckptError:
            pass  # named after the retries: fine
        assert proxy.injected > 0


# --------------------------------------------------------------------------- corruption


@pytest.mark.parametrize("fmt,where,seeds", [("v1", "blob", range(10)), ("v2", "blob", range(10, 16)),
                                             ("v2", "index", range(16, 22))])
def test_flipped_bytes_are_detected(bases: dict[str, Any], fmt: str, where: str, seeds: range) -> None:
    results = [corrupt_trial(bases[fmt], bases[f"{fmt}_state"], s, where) for s in seeds]
    assert all(r.outcome in ("detected", "ok") for r in results), [r.to_json() for r in results if r.outcome == FAILED]
    assert sum(r.outcome == "detected" for r in results) >= len(results) // 2


@pytest.mark.parametrize("fmt,seeds", [("v1", range(22, 27)), ("v2", range(27, 32))])
def test_flipped_manifest_bytes_never_leak_builtin_errors(bases: dict[str, Any], fmt: str, seeds: range) -> None:
    """Random manifest flips: never a built-in exception.  A flip in a value of the tree
    or a length still reads as silently different data until the manifest checksum
    (issue 10, item 7) lands: :func:`test_manifest_value_flip_is_detected` pins that."""
    results = [corrupt_trial(bases[fmt], bases[f"{fmt}_state"], s, "manifest") for s in seeds]
    leaked = [r.to_json() for r in results if r.outcome == FAILED and "silently wrong" not in r.detail]
    assert not leaked, leaked


def test_manifest_value_flip_is_detected(bases: dict[str, Any], tmp_path: Any) -> None:
    import shutil

    ck = str(tmp_path / "ck")
    shutil.copytree(bases["v1"], ck)
    path = os.path.join(ck, "manifest.json")
    data = open(path, "rb").read()
    assert data.count(b'"step": 3') + data.count(b'"step":3') == 1
    open(path, "wb").write(data.replace(b'"step": 3', b'"step": 7').replace(b'"step":3', b'"step":7'))
    with pytest.raises(objckpt.errors.CorruptCheckpointError):
        objckpt.read(ck)


# --------------------------------------------------------------------------- hostile manifests

@pytest.mark.parametrize("case", list(CASES))
def test_hostile_manifest(bases: dict[str, Any], case: str) -> None:
    """Bounded by work, not by the clock: the child may use ``HOSTILE_CPU_S`` CPU seconds in all
    (RLIMIT_CPU kills a loop over a hostile count, e.g. split=10**12), each op well under a
    second's CPU (measured: at most ~0.3 s, the zstd bomb), and less than a GiB; its wall
    limit is only a guard against a hang that uses no CPU."""
    r = hostile_trial(case, bases)
    assert r.outcome == "detected", r.to_json()
    assert (r.extra.get("peak_rss") or 0) < 1 << 30, r.to_json()  # a manifest never costs a GiB
    assert r.extra["max_op_cpu_s"] < 5, r.to_json()  # refused after reading it once, not walked


# --------------------------------------------------------------------------- races


def test_racing_writers_without_overwrite_have_one_winner(tmp_path: Any) -> None:
    r = race_trial(Target("local", str(tmp_path)), 1, overwrite=False)
    assert r.outcome == OK, r.to_json()


def test_racing_overwrites_stay_whole(s3_server: S3Server) -> None:
    bucket = make_bucket(s3_server.endpoint_url, "race-ow")
    r = race_trial(Target("s3", bucket, s3_options(s3_server.endpoint_url)), 2, overwrite=True, reads=0)
    assert r.outcome == OK, r.to_json()


def test_read_racing_an_overwrite_returns_one_version(tmp_path: Any) -> None:
    """Deterministic interleaving: the overwrite (another process) commits and deletes the
    old blobs right after this read fetched the old manifest."""
    from objckpt.storage import open_store
    from testkit.campaign import child_env
    from objckpt.testing.stores import CountingStore

    uri = str(tmp_path / "ck")
    objckpt.save(make_state(1), uri)
    arg = json.dumps({"uri": uri, "seed": 2, "overwrite": True})

    class OverwriteAfterManifest(CountingStore):
        fired = False

        async def get(self, key: str) -> bytes:
            data = await super().get(key)
            if key.endswith("manifest.json") and not self.fired:
                self.fired = True
                subprocess.run([sys.executable, "-m", "testkit.campaign_child", "save", arg], env=child_env(),
                               check=True, capture_output=True, timeout=120)
            return data

    back = objckpt.read(uri, store=OverwriteAfterManifest(open_store(uri)[0]))
    assert same(make_state(1), back) or same(make_state(2), back)


# --------------------------------------------------------------------------- dead endpoints


# "Fast" is bounded by what the read does, not by the clock: the attempts it makes (the
# retry budget for the failure) and how long each may wait (the option it names); the
# subprocess's wall limit is only a hang guard, generous enough for a loaded machine.

def test_refused_endpoint_fails_fast() -> None:
    from objckpt.storage.s3.retry import RetryPolicy

    r = dead_endpoint_trial("refused", limit=120)
    assert r.outcome == "detected", r.to_json()
    assert f"(connect, {RetryPolicy().connect_attempts} attempts)" in r.detail, r.to_json()


def test_silent_endpoint_fails_fast() -> None:
    from objckpt.storage.s3.retry import RetryPolicy

    policy = RetryPolicy()
    r = dead_endpoint_trial("silent", limit=120)
    assert r.outcome == "detected", r.to_json()
    assert f"(timeout, {policy.timeout_attempts} attempts)" in r.detail, r.to_json()
    # each attempt waits the short first-answer timeout, not read_timeout
    assert f"within {policy.first_answer_timeout:g} s (storage option first_answer_timeout)" in r.detail, r.to_json()
    assert r.extra["connections"] == policy.timeout_attempts, r.to_json()


# --------------------------------------------------------------------------- kills beyond one saving process


@pytest.mark.parametrize("op,seed", [("cp", 1), ("rm", 5), ("prune", 2)])  # kills inside the operation
def test_kill_during_cp_rm_prune(tmp_path: Any, op: str, seed: int) -> None:
    from testkit.campaign_ops import op_kill_trial

    r = op_kill_trial(Target("local", str(tmp_path)), seed, op)
    assert r.outcome == OK and r.detail.startswith("killed"), r.to_json()


def test_kill_one_rank_of_a_two_rank_save(tmp_path: Any) -> None:
    """Rank 0 of a 2-rank gloo overwrite dies at its 3rd request: the survivor raises an
    objckpt error (not gloo's bare RuntimeError), the old checkpoint reads bit-exact, gc cleans up."""
    from testkit.campaign_ops import rank_kill_trial

    r = rank_kill_trial(Target("local", str(tmp_path)), 4)
    assert r.params["kill_rank"] == 0 and r.outcome == OK and r.detail.startswith("killed"), r.to_json()


# --------------------------------------------------------------------------- local disk faults


@pytest.mark.parametrize("fault", ["enospc-manifest", "enospc-blob", "erofs", "enotdir", "eisdir-manifest"])
def test_local_disk_faults_are_named_and_harmless(fault: str) -> None:
    from testkit.campaign_disk import OPS_FOR, disk_trial

    for op in OPS_FOR[fault]:
        r = disk_trial(11, fault, op, real=False)  # simulated: the same on every machine
        assert r.outcome == "detected", r.to_json()
