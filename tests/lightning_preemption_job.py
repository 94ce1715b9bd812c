"""A Lightning training job with objckpt's preemption callback, as a user runs it (one process,
or one torchrun worker): ``python lightning_preemption_job.py '<json arguments>'``.

``mode``: ``"preempt"``: rank ``signal_rank`` sends itself SIGTERM inside the training step
that ends at ``signal_at`` (``user_handler``: the script installs a SIGTERM handler of its own
first); ``"resume"``: a run from scratch without checkpoints (the
reference), then a run resuming from ``ckpt_path="last"`` of ``root``.  Each rank writes what
it saw to ``<out>/<mode>-<rank>.json`` (also when ``fit`` raises: the ``SystemExit`` Lightning
stops with after the preemption save) and the process exits with Lightning's status.

The data loader is resumable (``state_dict`` / ``load_state_dict``): Lightning resumes a
checkpoint taken mid-epoch exactly only then, and a preemption step is usually mid-epoch.
"""
from __future__ import annotations

import json
import os
import signal
import sys
from typing import Any, Iterator

import lightning as L
import torch

from lightning_helpers import Tiny
from preemption_jobs import state_digest
from objckpt.lightning import ModelCheckpoint, ObjckptCheckpointIO, ObjckptPreemption

BATCHES_PER_EPOCH = 4


class Resumable(torch.utils.data.DataLoader):  # type: ignore[type-arg]
    """A sequential loader that resumes mid-epoch at the batch it stopped at."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._seen = 0
        self._skip = 0

    def __iter__(self) -> Iterator[Any]:
        skip, self._skip = self._skip, 0
        self._seen = skip
        for i, batch in enumerate(super().__iter__()):
            if i >= skip:
                self._seen += 1
                yield batch

    def state_dict(self) -> dict[str, int]:
        return {"seen": self._seen}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self._skip = sd["seen"]


def data(rank: int) -> Resumable:
    g = torch.Generator().manual_seed(1 + rank)
    x = torch.randn(4 * BATCHES_PER_EPOCH, 4, generator=g)
    return Resumable(torch.utils.data.TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=4, shuffle=False)


def digest(trainer: L.Trainer, module: L.LightningModule) -> str:
    """The model, optimizer and scheduler state, hashed bit for bit."""
    return state_digest({"model": module.state_dict(), "optimizer": trainer.optimizers[0].state_dict(),
                         "scheduler": trainer.lr_scheduler_configs[0].scheduler.state_dict()})


class Job(Tiny):
    def __init__(self, signal_at: int = 0, signal_rank: int = 0) -> None:
        super().__init__()
        self.signal_at, self.signal_rank = signal_at, signal_rank

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.global_step + 1 == self.signal_at and self.global_rank == self.signal_rank:
            os.kill(os.getpid(), signal.SIGTERM)  # arrives in the middle of the step
        return super().training_step(batch, batch_idx)


class Record(L.Callback):
    """The state's digest after every optimizer step, and at the start of training (after a restore)."""

    def __init__(self) -> None:
        self.after: dict[int, str] = {}
        self.start: str = ""

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.start = digest(trainer, pl_module)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        self.after[trainer.global_step] = digest(trainer, pl_module)


def fit(a: dict[str, Any], module: Job, root: str, ckpt_path: Any, preemption: bool) -> dict[str, Any]:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    record = Record()
    callbacks: list[Any] = [record, ModelCheckpoint(every_n_train_steps=2, save_top_k=-1)]
    pre = ObjckptPreemption(check_every=a["check_every"]) if preemption else None
    if pre is not None:
        callbacks.append(pre)
    trainer = L.Trainer(max_steps=a["max_steps"], accelerator="cpu", devices=world, strategy="ddp" if world > 1
                        else "auto", plugins=[ObjckptCheckpointIO(a["opts"])], callbacks=callbacks,
                        default_root_dir=root, deterministic=True, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, use_distributed_sampler=False)
    out: dict[str, Any] = {"losses": module.losses, "after": record.after}
    user_calls: list[int] = []

    def user(signum: int, frame: Any) -> None:
        user_calls.append(signum)

    if a.get("user_handler"):  # the script's own handler, there before fit: it must still run, and stay
        signal.signal(signal.SIGTERM, user)
        out["user_calls"] = user_calls
    try:
        trainer.fit(module, data(trainer.global_rank), ckpt_path=ckpt_path)
        out["fit"] = "returned"
    except SystemExit as e:
        out["fit"] = f"SystemExit({e.code!r}) {type(e).__name__}"
        raise
    finally:
        out.update(start=record.start, global_step=trainer.global_step,
                   received_sigterm=trainer.received_sigterm)
        if pre is not None:
            out.update(saved_step=pre.saved_step, checkpoint_path=pre.checkpoint_path,
                       signalled=pre.signalled_ranks)
        after = signal.getsignal(signal.SIGTERM)
        out["handler_after"] = "user" if after is user else repr(after)
        a["results"][a["name"]] = out
    return out


def main() -> None:
    a = json.loads(sys.argv[1])
    rank = int(os.environ.get("RANK", "0"))
    a["results"] = {}
    try:
        if a["mode"] == "preempt":
            a["name"] = "preempted"
            fit(a, Job(a["signal_at"], a.get("signal_rank", 0)), a["root"], None, True)
        else:
            if a.get("reference", True):
                a["name"] = "straight"
                fit(a, Job(), a["root"] + "-straight", None, False)
            a["name"] = "resumed"
            fit(a, Job(), a["root"], "last", True)
    finally:
        with open(os.path.join(a["out"], f"{a['mode']}-{rank}.json"), "w") as f:
            json.dump(a["results"], f)


if __name__ == "__main__":
    main()
