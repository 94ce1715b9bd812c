"""torchtitan: its CheckpointManager writing objckpt checkpoints through the DCP plugin.

Copy ``ObjckptCheckpointManager`` into your torchtitan job and select it in the config::

    config.checkpoint = ObjckptCheckpointManager.Config(
        enable=True, folder="s3://bucket/run-1", interval=500, async_mode="async")

torchtitan builds the manager from its config (``config.checkpoint.build(...)``), and
``Configurable`` builds the class that *declares* the nested ``Config``: a subclass that
only inherits ``CheckpointManager.Config`` is never built, torchtitan's own manager is.

Written from torchtitan 0.3.0's ``torchtitan/components/checkpointer/dcp.py`` and run
against it by ``tests/test_torchtitan_recipe.py`` (FSDP2, 2 ranks, async, moto S3): a run
stopped at step 4 and resumed in fresh processes continues with exactly the losses of a
run that never stopped.  The S3 endpoint and credentials come from the environment
(``AWS_ENDPOINT_URL``, ...), for objckpt and for torchtitan's own fsspec checks
(``s3fs``, in the ``torchtitan`` extra).

:func:`train` below is the test's training loop: torchtitan's debug model (fused q/k/v),
its optimizer and LR-scheduler containers, FSDP2 over a gloo group, and this manager.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torchtitan.components.checkpoint import MODEL, AsyncMode, CheckpointManager

from objckpt.dcp import StorageReader, StorageWriter


class ObjckptCheckpointManager(CheckpointManager):
    """torchtitan's ``CheckpointManager`` with objckpt as DCP's storage; ``folder`` is an objckpt
    prefix (``s3://bucket/run``, a local path...), each step an objckpt checkpoint under it."""

    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        """``CheckpointManager.Config``; declaring it makes ``build()`` construct this class."""

    def dcp_save(self, state_dict: dict[str, Any], checkpoint_id: str, async_mode: AsyncMode,
                 enable_garbage_collection: bool = False, to_hf: bool = False) -> Any:
        if to_hf:  # a Hugging Face export of the last step: torchtitan's own local writer
            return super().dcp_save(state_dict, checkpoint_id, async_mode, enable_garbage_collection, to_hf)
        self.last_saved_id = checkpoint_id  # counted by _purge_stale_checkpoints while it uploads
        writer = StorageWriter(checkpoint_id)
        if async_mode == AsyncMode.ASYNC:
            return dcp.async_save(state_dict, storage_writer=writer, process_group=self.pg)
        if async_mode == AsyncMode.ASYNC_WITH_PINNED_MEM:
            return dcp.async_save(state_dict, storage_writer=writer, process_group=self.pg,
                                  async_checkpointer_type=AsyncCheckpointerType.PROCESS,
                                  async_stager=self.stager)
        dcp.save(state_dict, storage_writer=writer)
        return None

    def dcp_load(self, state_dict: dict[str, Any], checkpoint_id: str, from_hf: bool = False,
                 from_quantized: bool = False) -> None:
        if from_hf:
            return super().dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)
        dcp.load(state_dict, storage_reader=StorageReader(checkpoint_id))
        # The model's entries in state_dict are the tensors its state-dict hooks handed out:
        # the debug model's fused wqkv appears as fresh wq/wk/wv copies. Only the model's
        # load_state_dict (its load pre-hook fuses them back) gets the loaded values into the
        # parameters; without this call they keep their fresh initialisation.
        if MODEL in self.states:
            self.states[MODEL].load_state_dict(state_dict)

    def _committed_steps(self, folder: str = "") -> list[int]:
        """Steps whose objckpt manifest is committed, ascending (an uncommitted save has none)."""
        from fsspec.core import url_to_fs

        fs, root = url_to_fs(folder or self.folder)
        fs.invalidate_cache(root)  # objckpt wrote behind fsspec's back
        found = fs.glob(f"{root.rstrip('/')}/step-*/manifest.json")
        steps = (re.search(r"step-(\d+)/manifest\.json$", p) for p in found)
        return sorted(int(m.group(1)) for m in steps if m)

    def _find_load_step(self, folder: str = "") -> int:
        steps = self._committed_steps(folder)
        return steps[-1] if steps else -1

    def _purge_stale_checkpoints(self) -> None:
        """Keep the newest ``keep_latest_k`` steps, counting the save still uploading (async)."""
        if self.keep_latest_k <= 0 or dist.get_rank() != 0:
            return
        steps = set(self._committed_steps())
        current = re.search(r"step-(\d+)$", getattr(self, "last_saved_id", "") or "")
        if current:
            steps.add(int(current.group(1)))
        for step in sorted(steps)[: -self.keep_latest_k]:
            self.purge_queue.put(self._create_checkpoint_id(step))  # torchtitan's purge thread deletes it


# ---------------------------------------------------------------------------------------------
# The test's training loop (CPU, gloo).  torchtitan's language models attend through FlexAttention,
# which has no backward on CPU: the debug model is built with torchtitan's SDPA inner attention
# instead (everything that checkpoints is unchanged: the fused q/k/v and its state-dict hooks).


def debug_model() -> torch.nn.Module:
    import torchtitan.models.llama3 as llama3
    from torchtitan.models.common.attention import ScaledDotProductAttention

    cpu_attention = lambda backend: ScaledDotProductAttention.Config()  # noqa: E731
    original, llama3.get_attention_config = llama3.get_attention_config, cpu_attention
    try:
        spec = llama3.model_registry("debugmodel")
    finally:
        llama3.get_attention_config = original
    torch.manual_seed(0)
    model = spec.model.build()
    model.init_states()
    return model


def train(root: str, steps: int, total_steps: int, resume: bool) -> dict[str, Any]:
    """Train torchtitan's debug model on every rank; save every 2 steps; return the losses."""
    from torch.distributed.fsdp import fully_shard
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw

    model = debug_model()
    n_params = len(list(model.parameters()))
    for layer in model.layers.values():
        fully_shard(layer)
    fully_shard(model)
    cfg = default_adamw(lr=8e-4)
    cfg.implementation = "for-loop"  # fused AdamW is CUDA only
    optimizers = cfg.build(model_parts=[model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=2, decay_ratio=0.8).build(
        optimizers=optimizers, training_steps=total_steps)
    progress = _Progress()
    manager = ObjckptCheckpointManager.Config(
        enable=True, folder=root, interval=2, async_mode="async", keep_latest_k=2,
        last_save_model_only=False).build(
        dataloader=None, model_parts=[model], optimizers=optimizers, lr_schedulers=schedulers,
        states={"train_state": progress}, sd_adapter=None, base_folder="")
    assert type(manager) is ObjckptCheckpointManager, type(manager)
    if resume:
        assert manager.load(), f"no checkpoint under {root}"
    losses: dict[int, float] = {}
    rank = dist.get_rank()
    while progress.step < steps:
        progress.step += 1
        g = torch.Generator().manual_seed(1000 * progress.step + rank)
        tokens = torch.randint(0, 2048, (2, 17), generator=g)
        positions = torch.arange(16).repeat(2, 1)
        logits = model(tokens[:, :-1], positions)
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        optimizers.step()
        schedulers.step()
        optimizers.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses[progress.step] = total.item()
        manager.save(progress.step, last_step=False)
    manager.maybe_wait_for_saving()
    manager.close()
    return {"losses": losses, "n_params": n_params}


class _Progress:
    """The loop's own Stateful state (torchtitan's trainer keeps ``step`` the same way)."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": torch.tensor(self.step)}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.step = int(sd["step"])
