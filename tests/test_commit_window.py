"""A rank that dies during rank 0's commit never costs a committed checkpoint.

The real proof: 2 gloo ranks in their own processes, one SIGKILLed at a point of
rank 0's commit (testkit/campaign_commit.py), local files and S3 (the in-memory
server), fresh saves and overwrites; the URI then holds the old checkpoint whole or
the new one whole, the survivor's RankLostError says which, and gc leaves only what
the manifest names.  ``python -m benchmarks.fault_campaign --commit-kills N`` runs
every combination; this file runs a sample, plus the decision record's rules on an
in-process store.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

import objckpt
from objckpt.format import keys
from objckpt.format.manifest import decode
from objckpt.results import IOStats
from objckpt.runtime import loop as _runtime
from objckpt.save.commit import CommitState, commit
from objckpt.save.decision import Decision, Fate, claim, decision_key, learn_fate, read_decision
from objckpt.storage.memory import MemoryStore
from testkit.campaign import OK, Target, make_bucket, s3_options
from testkit.campaign_commit import commit_kill_trial
from testkit.s3server import S3Server


def _saved(store: MemoryStore, prefix: str, seed: int) -> Any:
    """A committed single-rank checkpoint in ``store``; returns its manifest."""
    objckpt.save({"w": torch.arange(100, dtype=torch.float32) + seed}, f"memory://unused/{prefix}", store=store,
                 overwrite=True)
    mkey = keys.manifest_key(prefix)
    return decode(store.objects[mkey], mkey)


def _next_attempt(m: Any) -> Any:
    return dataclasses.replace(m, attempt=keys.new_attempt_id())


def test_a_survivors_abort_stops_rank_0s_manifest_put() -> None:
    """The survivor decides first: rank 0 must not PUT, so the survivor's deletes are safe."""
    st = MemoryStore()
    old = _saved(st, "ck", 0)
    new = _next_attempt(old)
    learned = _runtime.run(learn_fate(st, "ck", new.attempt, 1, looks=()))
    assert learned.fate == Fate.NOT_COMMITTED, learned
    status = commit(st, "ck", new, True, "memory://ck", [], IOStats(), [], decided_by_record=True)
    assert status.state == CommitState.FAILED_CLEAN and "aborted" in status.message, status
    mkey = keys.manifest_key("ck")
    assert decode(st.objects[mkey], mkey).attempt == old.attempt  # the old checkpoint stands


def test_rank_0s_record_keeps_a_survivor_from_deleting() -> None:
    """Rank 0 decided first: a survivor that does not see the manifest yet must not delete."""
    st = MemoryStore()
    old = _saved(st, "ck", 0)
    new = _next_attempt(old)
    key = decision_key("ck", new.attempt)
    assert _runtime.run(claim(st, key, Decision.COMMIT, 0)) == Decision.COMMIT
    learned = _runtime.run(learn_fate(st, "ck", new.attempt, 1, looks=()))
    assert learned.fate == Fate.UNKNOWN and "rank 0 decided to commit" in learned.how, learned
    assert _runtime.run(read_decision(st, key)) == Decision.COMMIT  # the survivor's abort lost
    # once the manifest is there the survivor learns it was committed
    status = commit(st, "ck", new, True, "memory://ck", [], IOStats(), [], decided_by_record=False)
    assert status.state == CommitState.OK
    assert _runtime.run(learn_fate(st, "ck", new.attempt, 1, looks=())).fate == Fate.COMMITTED


def test_the_record_is_an_attempt_leftover_for_gc_and_delete() -> None:
    """A decision record left by a failure goes with gc (grace 0) and with ``objckpt.delete``."""
    from objckpt.ops.gc import collect_garbage

    st = MemoryStore()
    m = _saved(st, "ck", 0)
    stray = decision_key("ck", keys.new_attempt_id())  # an aborted attempt's
    mine = decision_key("ck", m.attempt)  # the committed attempt's, left when the sharing failed
    for k in (stray, mine):
        _runtime.run(claim(st, k, Decision.ABORT, 1))
    report = _runtime.run(collect_garbage(st, "ck", grace=0))
    assert stray in report.deleted and stray not in st.objects
    st.objects[mine] = b'{"decision": "commit"}'
    objckpt.delete("memory://unused/ck", store=st)
    assert not [k for k in st.objects if k.startswith("ck/")], sorted(st.objects)


# every point of the window once, the two cases first (rank 1 killed while rank 0
# commits an overwrite; rank 0 killed right after its manifest PUT); the campaign runs all
LOCAL_CASES = [("after_put", 1, True), ("after_put", 0, True), ("before_put", 0, False)]
S3_CASES = [("before_record", 1, True), ("cleanup", 1, True), ("during_put", 0, True)]


def test_rank_killed_in_the_commit_window_of_an_async_save(tmp_path: Any) -> None:
    """The commit of an ``async_save`` runs on its background thread and gloo group; rank 1
    killed after rank 0's manifest PUT of an overwrite: the new checkpoint stands, whole."""
    r = commit_kill_trial(Target("local", str(tmp_path)), 23, "after_put", 1, overwrite=True, asynchronous=True)
    assert r.outcome == OK and r.extra.get("said") == [True], r.to_json()


@pytest.mark.parametrize("point,victim,overwrite", LOCAL_CASES)
def test_rank_killed_in_the_commit_window_local(tmp_path: Any, point: str, victim: int, overwrite: bool) -> None:
    r = commit_kill_trial(Target("local", str(tmp_path)), 21, point, victim, overwrite=overwrite)
    assert r.outcome == OK, r.to_json()


@pytest.mark.parametrize("point,victim,overwrite", S3_CASES)
def test_rank_killed_in_the_commit_window_s3(memory_s3: S3Server, point: str, victim: int,
                                             overwrite: bool) -> None:
    bucket = make_bucket(memory_s3.endpoint_url, f"window-{point.replace('_', '-')}-{victim}-{int(overwrite)}")
    r = commit_kill_trial(Target("s3", bucket, s3_options(memory_s3.endpoint_url)), 22, point, victim,
                          overwrite=overwrite)
    assert r.outcome == OK, r.to_json()


def test_on_a_store_ignoring_create_only_writes_a_survivor_never_deletes() -> None:
    """There the record cannot arbitrate (rank 0's create would "win" over an abort), so
    what the manifest does not show stays unknown and nothing is deleted."""
    st = MemoryStore()
    old = _saved(st, "ck", 0)
    new = _next_attempt(old)
    learned = _runtime.run(learn_fate(st, "ck", new.attempt, 1, looks=(), trusted=False))
    assert learned.fate == Fate.UNKNOWN and "ignores create-only" in learned.how, learned
    assert decision_key("ck", new.attempt) not in st.objects  # no record claimed either
