"""Kills in tiered checkpoints, as tests: a sample of testkit.campaign_tier's trials.

Each is a 2-node job (2 ranks, or 4 ranks two per node) saving steps 1..4 with a local
tier, ``replicas=1``, ``persist_every=2`` and ``local_keep=2`` to a moto root over HTTP;
one rank or two ranks are SIGKILLed at once from inside the real code path (a hook in the
function of the point: the local blob writes, the metadata spread, replication, the
drain's uploads, its manifest commit, retention); the survivors must end with an objckpt
error within the collective timeout; then the whole job restarts (fresh processes, the
same world size or another) and restores.  A trial checks (a) one step's values,
bit-exact, never a mix; (b) not older than the newest step every rank was promised;
(c) every step committed in object storage reads bit-exact; (d) no step restorable
before the restart (whole across the node folders, or in object storage) is gone after
the restore; (e) the restarted job saves two more steps and the second drains whole.
The campaign (``python -m benchmarks.fault_campaign --tier-kills N``) runs them all.
"""
from __future__ import annotations

from typing import Any

import pytest

from testkit.campaign import OK
from testkit.campaign_tier import TierCase, tier_kill_trial

CASES = [
    # one rank of two, each part of the window
    TierCase("local_write", False, 2, (0,), 2),
    TierCase("before_spread", True, 2, (1,), 2),  # an async step committed on n0 only
    TierCase("during_spread", False, 2, (1,), 2),  # n1's first rank dies before writing the metadata
    TierCase("drain_commit", True, 2, (0,), 2),  # rank 0 dies right after the drained manifest's PUT
    TierCase("retention", False, 2, (1,), 2),
    # two ranks at once of four on two nodes
    TierCase("during_spread", False, 4, (2, 3), 2),  # a whole node, then a restart on two ranks
    TierCase("drain_upload", False, 4, (1, 2), 4),  # one rank on each node mid-drain
]


@pytest.mark.parametrize("case", CASES, ids=[f"{c.point}-{'async' if c.asynchronous else 'sync'}-w{c.world}-"
                                              f"k{''.join(map(str, c.victims))}-r{c.restart_world}" for c in CASES])
def test_a_tiered_job_killed_and_restarted_restores_one_whole_step_and_goes_on(
        case: TierCase, moto_s3: tuple[str, dict[str, Any]]) -> None:
    bucket, opts = moto_s3
    trial = tier_kill_trial(f"s3://{bucket}/run", opts, case, timeout=120.0)
    assert trial.outcome == OK, trial.detail
