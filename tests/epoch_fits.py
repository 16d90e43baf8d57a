"""A fit of a few epochs under DDP or Elixir with a checkpoint at each epoch's end, for tests that
compare final weights across strategies, plans and resumes (run on ranks by ``fit_on_ranks``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Union

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_elixir import ElixirPlan, ElixirStrategy
from tests.test_resume import COLLECTIVE_TIMEOUT


def fit_epochs(model: L.LightningModule, run: Path, world_size: int, plan: Union[str, ElixirPlan], fmt: str,
               epochs: int, ckpt_path: Optional[Path] = None, **trainer_kwargs: Any) -> None:
    """``epochs`` epochs of ``model`` under DDP (``plan="ddp"``) or Elixir with ``plan`` and checkpoints of
    ``fmt`` ("full" or "sharded") in ``run/ckpt/epoch={n}.ckpt``, resumed from ``ckpt_path``; rank 0 saves the
    final weights to ``run/final.pt``. Each rank takes its own samples (no distributed sampler)."""
    if plan == "ddp":
        strategy: Any = "ddp"
    else:
        strategy = ElixirStrategy(plan=plan, state_dict_type=fmt, collective_timeout_s=COLLECTIVE_TIMEOUT.total_seconds())
    trainer = L.Trainer(accelerator="cpu", devices=world_size, strategy=strategy, max_epochs=epochs, logger=False,
                        use_distributed_sampler=False, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=run, **trainer_kwargs,
                        callbacks=[ModelCheckpoint(dirpath=run / "ckpt", filename="{epoch}", save_top_k=-1)])
    trainer.fit(model, ckpt_path=ckpt_path)
    if trainer.is_global_zero:
        torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, run / "final.pt")


def final_weights(run: Path) -> dict[str, torch.Tensor]:
    return torch.load(run / "final.pt")
