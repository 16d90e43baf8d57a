"""``Trainer(sync_batchnorm=True)`` and other ``LayerSync`` plugins: applied to the model before it is chunked, as DDP
applies them, and reverted after fit.

torch's SyncBatchNorm trains on GPUs only, so the 2-rank comparison with DDP runs a ``LayerSync`` plugin of the
test's own (``GlobalBatchNorm``), which Lightning applies through the same hook: BatchNorm layers replaced by ones
that normalise with the statistics of the global batch, gathered with differentiable all-reduces."""

from __future__ import annotations

import os
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
from lightning.pytorch.plugins.layer_sync import LayerSync
from torch import nn
from torch.utils.data import DataLoader, Subset, TensorDataset

from lightning_elixir import ElixirPlan, ElixirStrategy
from tests.distributed import free_port
from tests.test_resume import COLLECTIVE_TIMEOUT, fit_on_ranks

SAMPLES, GLOBAL_BATCH, STEPS = 32, 8, 4


class _GlobalBatchNorm1d(nn.BatchNorm1d):
    """BatchNorm1d normalising a training batch with the mean and variance of the batch of every rank."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return super().forward(x)
        count = dist_fn.all_reduce(torch.tensor([float(x.shape[0])]))
        mean = dist_fn.all_reduce(x.sum(0)) / count
        var = dist_fn.all_reduce(((x - mean) ** 2).sum(0)) / count
        with torch.no_grad():
            self.running_mean.lerp_(mean, self.momentum)
            self.running_var.lerp_(var * count / (count - 1), self.momentum)
            self.num_batches_tracked += 1
        return (x - mean) / torch.sqrt(var + self.eps) * self.weight + self.bias


def _swap(module: nn.Module, to: type) -> nn.Module:
    for name, child in module.named_children():
        if isinstance(child, nn.BatchNorm1d) and type(child) is not to:
            swapped = to(child.num_features, child.eps, child.momentum)
            swapped.weight, swapped.bias = child.weight, child.bias
            swapped.running_mean, swapped.running_var = child.running_mean, child.running_var
            swapped.num_batches_tracked = child.num_batches_tracked
            module.add_module(name, swapped)
        else:
            _swap(child, to)
    return module


class GlobalBatchNorm(LayerSync):
    def apply(self, model: nn.Module) -> nn.Module:
        return _swap(model, _GlobalBatchNorm1d)

    def revert(self, model: nn.Module) -> nn.Module:
        return _swap(model, nn.BatchNorm1d)


class BatchNormNet(L.LightningModule):
    """A linear layer, a BatchNorm1d and a classifier; each rank takes its own samples of every global batch."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))
        self.kinds: list[str] = []

    def training_step(self, batch, batch_idx):
        self.kinds.append(type(self.net[1]).__name__)
        return nn.functional.cross_entropy(self.net(batch[0]), batch[1])

    def train_dataloader(self):
        g = torch.Generator().manual_seed(1)
        data = TensorDataset(torch.randn(SAMPLES, 6, generator=g) * 3 + 1, torch.randint(0, 3, (SAMPLES,), generator=g))
        ranks = self.trainer.world_size
        return DataLoader(Subset(data, range(self.trainer.global_rank, SAMPLES, ranks)), batch_size=GLOBAL_BATCH // ranks)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def fit(run: Path, world_size: int, plan: str) -> None:
    """STEPS steps under DDP (plan="ddp") or Elixir with the GlobalBatchNorm plugin; rank 0 saves the final state
    dict and the layer types the steps ran with and the module has after fit."""
    run.mkdir(parents=True, exist_ok=True)
    strategy = "ddp" if plan == "ddp" else ElixirStrategy(plan=ElixirPlan(chunk_numel=256, cache_blocks="min")
                                                          if plan == "zero3" else plan, replan=False,
                                                          collective_timeout_s=COLLECTIVE_TIMEOUT.total_seconds())
    trainer = L.Trainer(accelerator="cpu", devices=world_size, strategy=strategy, max_steps=STEPS, logger=False,
                        plugins=[GlobalBatchNorm()], use_distributed_sampler=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, default_root_dir=run)
    model = BatchNormNet()
    trainer.fit(model)
    if trainer.is_global_zero:
        torch.save({"state": {k: v.detach().clone() for k, v in model.state_dict().items()}, "kinds": model.kinds,
                    "after": type(model.net[1]).__name__}, run / "final.pt")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict]:
    root = tmp_path_factory.mktemp("layer_sync")
    plans = ("ddp", "zero3", "zero2")
    fit_on_ranks(2, [(root / plan, plan) for plan in plans], fit_fn=fit)
    return {plan: torch.load(root / plan / "final.pt") for plan in plans}


@pytest.mark.parametrize("plan", ["zero3", "zero2"])
def test_a_layer_sync_plugin_trains_as_under_ddp(runs, plan):
    """The plugin's layers run every step (so the statistics are the global batch's), and the weights and running
    statistics end as DDP's; after fit the module has plain BatchNorm layers again."""
    ddp, elixir = runs["ddp"], runs[plan]
    assert ddp["kinds"] == ["_GlobalBatchNorm1d"] * STEPS
    assert elixir["kinds"] == ddp["kinds"]
    assert elixir["after"] == ddp["after"] == "BatchNorm1d"
    for key, value in ddp["state"].items():
        torch.testing.assert_close(elixir["state"][key], value, rtol=1e-5, atol=1e-6, msg=key)


def test_sync_batchnorm_on_the_cpu_is_refused_before_training_with_the_module_given_back(tmp_path):
    os.environ["MASTER_PORT"] = str(free_port())
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=ElixirStrategy(plan="zero3"), sync_batchnorm=True,
                        max_steps=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False, use_distributed_sampler=False, default_root_dir=tmp_path)
    model = BatchNormNet()
    with pytest.raises(ValueError, match="sync_batchnorm=True.* remove sync_batchnorm=True for a CPU run"):
        trainer.fit(model)
    assert model.kinds == []
    assert not isinstance(model.net[1], nn.SyncBatchNorm)


class EvaluatedBatchNormNet(BatchNormNet):
    def validation_step(self, batch, batch_idx):
        return nn.functional.cross_entropy(self.net(batch[0]), batch[1])

    def val_dataloader(self):
        return self.train_dataloader()


def test_a_fit_after_a_stage_that_kept_the_module_chunked_converts_its_layers(tmp_path):
    """With unshard_on_teardown=False a fit takes over the module the Trainer's last stage left chunked; a
    validation does not convert the layers (as under DDP), so the fit converts them before it trains."""
    def fit_once(kept: bool) -> BatchNormNet:
        os.environ["MASTER_PORT"] = str(free_port())
        trainer = L.Trainer(accelerator="cpu", devices=1, strategy=ElixirStrategy(plan="zero3", unshard_on_teardown=not kept),
                            plugins=[GlobalBatchNorm()], max_steps=STEPS, logger=False, enable_progress_bar=False,
                            enable_model_summary=False, enable_checkpointing=False, use_distributed_sampler=False,
                            default_root_dir=tmp_path)
        model = EvaluatedBatchNormNet()
        if kept:
            trainer.validate(model, verbose=False)
        trainer.fit(model)
        with trainer.strategy.gathered_params():
            model.final = {k: v.detach().clone() for k, v in model.state_dict().items()}
        return model

    kept, reference = fit_once(kept=True), fit_once(kept=False)
    assert kept.kinds == reference.kinds == ["_GlobalBatchNorm1d"] * STEPS
    for key, value in reference.final.items():
        torch.testing.assert_close(kept.final[key], value, rtol=1e-6, atol=1e-7, msg=key)
