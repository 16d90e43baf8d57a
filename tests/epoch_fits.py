"""A fit of a few epochs under DDP or Elixir with a checkpoint at each epoch's end, for tests that
compare final weights across strategies, plans and resumes (run on ranks by ``fit_on_ranks``), and a
small module for them whose tests choose its optimizer."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Union

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, Subset, TensorDataset

from lightning_elixir import ElixirPlan, ElixirStrategy
from tests.test_resume import COLLECTIVE_TIMEOUT

SAMPLES = 48
GLOBAL_BATCH = 8


class ConvClassifier(L.LightningModule):
    """A convolution (a 3-D weight), linear layers and a LayerNorm; ``configure_optimizers`` is the test's.
    Each step takes GLOBAL_BATCH samples, dealt out to the ranks in turn (one process sees them all)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv1d(4, 6, kernel_size=3)
        self.net = nn.Sequential(nn.Linear(36, 32), nn.ReLU(), nn.Linear(32, 24), nn.LayerNorm(24), nn.Linear(24, 3))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(torch.relu(self.conv(x)).flatten(1)), y)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(1)
        data = TensorDataset(torch.randn(SAMPLES, 4, 8, generator=g), torch.randint(0, 3, (SAMPLES,), generator=g))
        ranks = self.trainer.world_size
        return DataLoader(Subset(data, range(self.trainer.global_rank, SAMPLES, ranks)), batch_size=GLOBAL_BATCH // ranks)


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
