"""How the test suite and the campaigns start rank processes."""
from __future__ import annotations

import multiprocessing
from typing import Any


def rank_context() -> Any:
    """A forkserver whose server imported torch once: each rank is a fork of it instead of
    a fresh interpreter importing torch again (about 2 CPU-seconds a rank on these
    machines; the suite starts some hundred ranks).  Nothing CUDA is initialised in the
    server, so NCCL ranks fork safely too.  Falls back to spawn where there is no forkserver."""
    try:
        ctx = multiprocessing.get_context("forkserver")
    except ValueError:
        return multiprocessing.get_context("spawn")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "objckpt"])
    return ctx
