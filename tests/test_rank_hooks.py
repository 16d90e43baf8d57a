"""Weights read and written in the hooks every rank runs ([Note: hooks every rank runs] in
lightning_elixir/rank_hooks.py), on two gloo ranks against DDP.

A momentum teacher (BYOL's, a mean teacher's) updated from the student in the module's
``on_train_batch_end``; a callback of the user's that scales a weight in ``on_train_start`` and records
a weight's norm in ``on_train_epoch_end`` (and, on rank 0 only, a sum of a weight gathered up front with
``gathered_params(params=...)``, nested in the hook's region); the module's ``on_save_checkpoint`` storing a weight's sum.
Under zero3 (chunks released between steps) and plan="auto" the weights, the recorded norms and the
stored sums are DDP's, and after fit the module and the callback have their own hooks back.
"""

from __future__ import annotations

import contextlib
import copy
import json
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_elixir import ElixirStrategy
from tests.test_resume import COLLECTIVE_TIMEOUT, fit_on_ranks

EPOCHS = 2


class MomentumTeacher(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.student = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        self.teacher = copy.deepcopy(self.student)
        self.teacher.requires_grad_(False)
        self.sums: list[float] = []

    def training_step(self, batch, batch_idx):
        (x,) = batch
        with torch.no_grad():
            target = self.teacher(x)
        return (self.student(x) - target).square().mean() + 0.1 * self.student(x).mean()

    @torch.no_grad()
    def on_train_batch_end(self, outputs, batch, batch_idx):
        for teacher, student in zip(self.teacher.parameters(), self.student.parameters()):
            teacher.mul_(0.9).add_(student, alpha=0.1)

    def on_save_checkpoint(self, checkpoint):
        checkpoint["teacher_sum"] = self.teacher[0].weight.sum().item()

    def configure_optimizers(self):
        return torch.optim.SGD(self.student.parameters(), lr=0.1)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(1)
        return DataLoader(TensorDataset(torch.randn(32, 8, generator=g)), batch_size=4)


class WeightWatcher(L.Callback):
    def __init__(self) -> None:
        self.norms: list[float] = []
        self.rank_zero_sums: list[float] = []

    @torch.no_grad()
    def on_train_start(self, trainer, pl_module):
        pl_module.student[2].weight.mul_(0.5)

    def on_train_epoch_end(self, trainer, pl_module):
        self.norms.append(pl_module.student[0].weight.norm().item())
        weight = pl_module.teacher[2].weight  # read on rank 0 only: gathered up front, in the hook's region too
        gathered = getattr(trainer.strategy, "gathered_params", contextlib.nullcontext)
        with gathered(params=[weight]) if gathered is not contextlib.nullcontext else gathered():
            if trainer.global_rank == 0:
                self.rank_zero_sums.append(weight.sum().item())


def fit(run: Path, world_size: int, plan: str) -> None:
    model, watcher = MomentumTeacher(), WeightWatcher()
    strategy = "ddp" if plan == "ddp" else ElixirStrategy(plan=plan,
                                                          collective_timeout_s=COLLECTIVE_TIMEOUT.total_seconds())
    trainer = L.Trainer(accelerator="cpu", devices=world_size, strategy=strategy, max_epochs=EPOCHS, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=run,
                        callbacks=[watcher, ModelCheckpoint(dirpath=run / "ckpt", filename="{epoch}", save_top_k=-1)])
    trainer.fit(model)
    restored = not any(hook in vars(target) for target in (model, watcher)
                       for hook in ("on_train_batch_end", "on_train_start", "on_train_epoch_end", "on_save_checkpoint"))
    if trainer.is_global_zero:
        torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, run / "final.pt")
        (run / "seen.json").write_text(json.dumps({"norms": watcher.norms, "sums": watcher.rank_zero_sums,
                                                   "restored": restored}))


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("rank_hooks")
    runs = {plan: root / plan for plan in ("ddp", "zero3", "auto")}
    fit_on_ranks(2, [(run, plan) for plan, run in runs.items()], fit_fn=fit)
    return runs


@pytest.mark.parametrize("plan", ["zero3", "auto"])
def test_weights_read_and_written_in_hooks_every_rank_runs_are_ddps(runs, plan):
    ddp, ours = torch.load(runs["ddp"] / "final.pt"), torch.load(runs[plan] / "final.pt")
    start = MomentumTeacher().state_dict()
    assert not torch.allclose(ddp["teacher.0.weight"], start["teacher.0.weight"])  # the teacher followed
    for key, value in ddp.items():
        torch.testing.assert_close(ours[key], value, rtol=1e-5, atol=1e-6, msg=key)
    seen, ddp_seen = (json.loads((runs[name] / "seen.json").read_text()) for name in (plan, "ddp"))
    assert len(seen["norms"]) == EPOCHS and seen["restored"]
    torch.testing.assert_close(torch.tensor(seen["norms"]), torch.tensor(ddp_seen["norms"]), rtol=1e-5, atol=1e-6)
    assert len(seen["sums"]) == EPOCHS
    torch.testing.assert_close(torch.tensor(seen["sums"]), torch.tensor(ddp_seen["sums"]), rtol=1e-5, atol=1e-6)
    for epoch in range(EPOCHS):
        stored, ddp_stored = (torch.load(runs[name] / "ckpt" / f"epoch={epoch}.ckpt", weights_only=False)["teacher_sum"]
                              for name in (plan, "ddp"))
        assert stored == pytest.approx(ddp_stored, rel=1e-5, abs=1e-6)
