"""A deterministic tiny LightningModule and Trainer set-up shared by the Lightning tests."""
from __future__ import annotations

from typing import Any, Optional

import lightning as L
import torch

BATCHES_PER_EPOCH = 2


class Tiny(L.LightningModule):
    """Linear regression on fixed data; records every training loss (as exact Python floats)."""

    def __init__(self, lr: float = 0.05, extra: Any = None) -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
        self.losses: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams["lr"])
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)}


def data() -> "torch.utils.data.DataLoader[Any]":
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4 * BATCHES_PER_EPOCH, 4, generator=g)
    y = x.sum(dim=1, keepdim=True)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4, shuffle=False)


def trainer(max_steps: int, plugins: Optional[list[Any]] = None, callbacks: Optional[list[Any]] = None,
            **kw: Any) -> L.Trainer:
    return L.Trainer(max_steps=max_steps, plugins=plugins, callbacks=callbacks, accelerator="cpu", devices=1,
                     deterministic=True, logger=False, enable_progress_bar=False, enable_model_summary=False,
                     enable_checkpointing=callbacks is not None, num_sanity_val_steps=0, **kw)


def reference_losses(steps: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """An uninterrupted run without checkpoints: its losses and final weights."""
    model = Tiny()
    trainer(steps).fit(model, data())
    return model.losses, {k: v.clone() for k, v in model.state_dict().items()}
