"""A momentum encoder updated through ``.data`` in ``training_step`` (MoCo's
``param_k.data.mul_(m).add_(param_q.data, alpha=1 - m)``), on two gloo ranks against DDP.

The frozen key encoder is read outside its own forward, so ``plan="auto"`` gives it a private chunk
(``private_params`` does the same under zero3). A write through ``.data`` moves no version counter of
the parameter, so the chunk must be compared with its shard when it is released
([Note: writes to parameters] in runtime/chunk.py), or the key encoder never moves.
"""

from __future__ import annotations

import copy
from pathlib import Path

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_elixir import ElixirStrategy
from tests.test_resume import COLLECTIVE_TIMEOUT, fit_on_ranks


class MomentumByData(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.query = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        self.key = copy.deepcopy(self.query)
        self.key.requires_grad_(False)

    def training_step(self, batch, batch_idx):
        (x,) = batch
        with torch.no_grad():
            for k, q in zip(self.key.parameters(), self.query.parameters()):
                k.data.mul_(0.9).add_(q.data, alpha=0.1)
            target = self.key(x)
        return (self.query(x) - target).square().mean() + 0.1 * self.query(x).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.query.parameters(), lr=0.1)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(1)
        return DataLoader(TensorDataset(torch.randn(32, 8, generator=g)), batch_size=4)


PRIVATE = tuple(f"key.{name}" for name, _ in MomentumByData().key.named_parameters())


def fit(run: Path, world_size: int, plan: str) -> None:
    model = MomentumByData()
    if plan == "ddp":
        strategy = "ddp"
    else:
        strategy = ElixirStrategy(plan="zero3" if plan == "private" else plan,
                                  private_params=PRIVATE if plan == "private" else (),
                                  collective_timeout_s=COLLECTIVE_TIMEOUT.total_seconds())
    trainer = L.Trainer(accelerator="cpu", devices=world_size, strategy=strategy, max_epochs=1, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                        default_root_dir=run)
    trainer.fit(model)
    if trainer.is_global_zero:
        run.mkdir(parents=True, exist_ok=True)
        torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, run / "final.pt")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("private_data_writes")
    runs = {plan: root / plan for plan in ("ddp", "private", "auto")}
    fit_on_ranks(2, [(run, plan) for plan, run in runs.items()], fit_fn=fit)
    return runs


@pytest.mark.parametrize("plan", ["private", "auto"])
def test_momentum_encoder_written_through_data_in_the_step_is_ddps(runs, plan):
    ddp, ours = torch.load(runs["ddp"] / "final.pt"), torch.load(runs[plan] / "final.pt")
    assert not torch.allclose(ddp["key.0.weight"], MomentumByData().state_dict()["key.0.weight"])
    for key, value in ddp.items():
        torch.testing.assert_close(ours[key], value, rtol=1e-5, atol=1e-6, msg=key)
