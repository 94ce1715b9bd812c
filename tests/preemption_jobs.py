"""What the Trainer and Lightning preemption tests share: the bit-for-bit digest of a training
state their jobs report, the jobs' environment (moto over HTTP, one thread), and running a job
(under torchrun for several ranks) for each rank's result."""
from __future__ import annotations

import hashlib
import json
import os
import pathlib
import subprocess
import sys
from typing import Any

import torch


def state_digest(state: Any) -> str:
    """sha256 of every tensor's bytes and every other value's repr, dict keys in sorted order."""
    h = hashlib.sha256()

    def walk(v: Any) -> None:
        if isinstance(v, torch.Tensor):
            h.update(v.detach().cpu().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
        elif isinstance(v, dict):
            for k in sorted(v, key=str):
                h.update(str(k).encode())
                walk(v[k])
        elif isinstance(v, (list, tuple)):
            for x in v:
                walk(x)
        else:
            h.update(repr(v).encode())

    walk(state)
    return h.hexdigest()


def job_env(endpoint: str, opts: dict[str, Any]) -> dict[str, str]:
    return {**os.environ, "AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": opts["aws_access_key_id"],
            "AWS_SECRET_ACCESS_KEY": opts["aws_secret_access_key"], "AWS_DEFAULT_REGION": opts["region_name"],
            "OMP_NUM_THREADS": "1"}  # compared bit for bit: one thread count everywhere


def run_job(job: pathlib.Path, args: dict[str, Any], env: dict[str, str], ranks: int = 1) -> list[dict[str, Any]]:
    """``job`` (under torchrun for ``ranks`` > 1); each rank's result.  Exit status 0 required."""
    cmd = [sys.executable, str(job), json.dumps(args)]
    if ranks > 1:
        cmd[1:1] = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
                    "--monitor-interval", "0.1"]
    done = subprocess.run(cmd, env=env, cwd=job.parent, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (done.returncode, done.stdout[-2000:], done.stderr[-4000:])
    return [json.loads(pathlib.Path(args["out"], f"{args['mode']}-{r}.json").read_text()) for r in range(ranks)]
