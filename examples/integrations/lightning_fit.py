"""PyTorch Lightning: Trainer checkpoints on S3 through objckpt, keep the best 2, resume from "last".

Run::

    python examples/integrations/lightning_fit.py s3://bucket/run-1 --steps 6
    python examples/integrations/lightning_fit.py s3://bucket/run-1 --steps 10 --resume   # continues at 6
    OBJCKPT_LIGHTNING_URI=/tmp/run-1 python examples/integrations/lightning_fit.py --steps 6

The S3 endpoint and credentials come from the environment (``AWS_ENDPOINT_URL``,
``AWS_ACCESS_KEY_ID``, ...): Lightning's own directory checks use fsspec, which
reads them there too.  The data and model are fixed, so a run that stops and
resumes logs exactly the losses of a run that never stopped;
``tests/test_lightning_recipe.py`` checks that against moto S3.
"""
from __future__ import annotations

import argparse
import json
import os
from typing import Any

import lightning as L
import torch

from objckpt.lightning import ModelCheckpoint, ObjckptCheckpointIO


class Regressor(L.LightningModule):
    def __init__(self, lr: float = 0.05) -> None:
        super().__init__()
        self.save_hyperparameters()  # stored as plain JSON values, no pickle
        self.lr = lr
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
        self.losses: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.losses.append(loss.item())
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def loader() -> "torch.utils.data.DataLoader[Any]":
    g = torch.Generator().manual_seed(1)
    x = torch.randn(8, 4, generator=g)  # 2 batches per epoch: every 2nd step ends an epoch
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4)


def fit(uri: str, steps: int, resume: bool, async_save: bool) -> dict[str, Any]:
    model = Regressor()
    trainer = L.Trainer(
        max_steps=steps,
        default_root_dir=uri,  # checkpoints go to <uri>/checkpoints/
        plugins=[ObjckptCheckpointIO(async_save=async_save)],  # storage_options={...} for objckpt if needed
        callbacks=[ModelCheckpoint(every_n_train_steps=2, save_top_k=2, monitor="step", mode="max",
                                   save_last=True)],
        accelerator="cpu", deterministic=True, logger=False,
        enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(model, loader(), ckpt_path="last" if resume else None)
    return {"global_step": trainer.global_step, "losses": model.losses}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("uri", nargs="?", default=os.environ.get("OBJCKPT_LIGHTNING_URI"),
                   help="run directory (s3://bucket/run, a local path...); default $OBJCKPT_LIGHTNING_URI")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--resume", action="store_true", help='fit(ckpt_path="last")')
    p.add_argument("--sync", action="store_true", help="save synchronously (default: async_save=True)")
    args = p.parse_args()
    if not args.uri:
        p.error("give the run URI as an argument or in $OBJCKPT_LIGHTNING_URI")
    print(json.dumps(fit(args.uri, args.steps, args.resume, not args.sync)))


if __name__ == "__main__":
    main()
