"""plan="auto" through a real Trainer: every stage plans from its own data, RNG is untouched, failures fall back."""

from __future__ import annotations

import os
import warnings

import lightning as L
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils.data import DataLoader, TensorDataset

from lightning_elixir import ElixirStrategy
from lightning_elixir.planner import FALLBACK_PLAN
from tests.distributed import free_port
from tests.profile.test_robust_trace import GAN, UpdatesMetrics, _batch
from tests.search.profiles import hardware

CALLS: list[tuple[str, int, int | None]] = []
"""(step, batch size, dataloader_idx) of every step called on fake tensors (outside the module, so
that planning's state restore does not erase it)."""


def _loader(n: int, batch_size: int, seed: int) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    return DataLoader(TensorDataset(torch.randn(n, 8, generator=g), torch.randn(n, 1, generator=g)),
                      batch_size=batch_size)


def _record(step: str, x: torch.Tensor, dataloader_idx: int | None = None) -> None:
    if isinstance(x, FakeTensor):
        CALLS.append((step, x.shape[0], dataloader_idx))


class EvalOnly(L.LightningModule):
    """Validation, test (two loaders) and prediction, and no training data at all."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        _record("validation_step", x)
        self.log("val_loss", F.mse_loss(self(x), y))

    def test_step(self, batch, batch_idx, dataloader_idx=0):
        x, y = batch
        _record("test_step", x, dataloader_idx)
        self.log("test_loss", F.mse_loss(self(x), y))

    def predict_step(self, batch, batch_idx):
        x, _ = batch
        _record("predict_step", x)
        return self(x)

    def val_dataloader(self):
        return _loader(10, 5, 1)

    def test_dataloader(self):
        return [_loader(6, 3, 2), _loader(8, 4, 3)]

    def predict_dataloader(self):
        return _loader(14, 7, 4)


class WithDropout(L.LightningModule):
    """A regression MLP with dropout: its losses depend on the random stream."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        _record("training_step", x)
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


@torch.library.custom_op("elixir_test::signs", mutates_args=())
def _signs(x: torch.Tensor) -> torch.Tensor:
    return torch.unique(torch.sign(x))


@_signs.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty(torch.library.get_ctx().new_dynamic_size())  # a library's value-dependent shape


class UnboundedShape(WithDropout):
    """A step whose operator (a library's, with a value-dependent shape) fake tensors cannot bound."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.net(x), y) * (_signs(x).numel() > 0)


class Losses(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(outputs["loss"].item())


@pytest.fixture(autouse=True)
def _fresh_calls():
    CALLS.clear()
    os.environ["MASTER_PORT"] = str(free_port())


def _trainer(strategy=None, **kwargs) -> L.Trainer:
    strategy = strategy or ElixirStrategy(plan="auto", hardware_profile=hardware(world_size=1, device_count=1))
    return L.Trainer(accelerator="cpu", devices=1, strategy=strategy, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False, **kwargs)


def test_validate_plans_forward_only_from_the_validation_data():
    trainer = _trainer()
    metrics = trainer.validate(EvalOnly())
    assert CALLS == [("validation_step", 5, None)]
    profile = trainer.strategy.planning.model_profile
    assert {a.phase for a in profile.accesses} == {"forward"} and trainer.strategy.planning.fallback_reason is None
    assert metrics and "val_loss" in metrics[0]


def test_test_plans_from_the_first_of_several_test_loaders():
    trainer = _trainer()
    metrics = trainer.test(EvalOnly())
    assert CALLS == [("test_step", 3, 0)]
    assert len(metrics) == 2


def test_predict_plans_from_the_prediction_data():
    trainer = _trainer()
    predictions = trainer.predict(EvalOnly())
    assert CALLS == [("predict_step", 7, None)]
    assert [p.shape for p in predictions] == [(7, 1), (7, 1)]


def _fit_losses(module_class, strategy=None) -> tuple[list[float], L.Trainer]:
    torch.manual_seed(1)
    module = module_class()
    losses = Losses()
    trainer = _trainer(strategy, max_steps=6, limit_val_batches=0, callbacks=[losses], use_distributed_sampler=False)
    L.seed_everything(0)  # the Elixir strategy re-seeds with it in setup_environment; the same stream for both
    trainer.fit(module, _loader(48, 8, 5))
    return losses.losses, trainer


def test_fit_with_dropout_sees_the_same_random_stream_as_without_planning():
    elixir, trainer = _fit_losses(WithDropout)
    reference, _ = _fit_losses(WithDropout, strategy="auto")
    assert CALLS == [("training_step", 8, None)]  # planning traced the step once
    assert trainer.strategy.planning.report is not None
    assert elixir == pytest.approx(reference, rel=1e-6)


class DtypeChecked(WithDropout):
    """Refuses a batch that is not in its parameters' dtype, as a model in true precision may."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        assert x.dtype == self.net[0].weight.dtype, f"a {x.dtype} batch for {self.net[0].weight.dtype} weights"
        return F.mse_loss(self.net(x), y)


@pytest.mark.parametrize("precision", ["bf16-true", "64-true"])
def test_planning_traces_the_batch_in_the_dtype_the_loop_converts_it_to(precision):
    trainer = _trainer(max_steps=2, precision=precision)
    trainer.fit(DtypeChecked(), _loader(16, 8, 5))
    assert trainer.strategy.planning.fallback_reason is None and trainer.global_step == 2


def test_an_untraceable_step_falls_back_with_one_warning_and_trains():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        losses, trainer = _fit_losses(UnboundedShape)
    planning_warnings = [w for w in caught if "plan='auto'" in str(w.message)]
    assert len(planning_warnings) == 1, [str(w.message) for w in planning_warnings]
    message = str(planning_warnings[0].message)
    assert "training_step" in message and "elixir_test.signs" in message and "zero3" in message
    planning = trainer.strategy.planning
    assert planning.plan == FALLBACK_PLAN and planning.report is None and planning.model_profile is None
    assert "elixir_test.signs" in planning.fallback_reason
    assert trainer.global_step == 6 and len(losses) == 6


def test_the_fallback_does_not_hide_errors_of_the_real_run():
    class Broken(UnboundedShape):
        def training_step(self, batch, batch_idx):
            if not isinstance(batch[0], FakeTensor):
                raise RuntimeError("a real bug")
            return super().training_step(batch, batch_idx)

    with pytest.warns(UserWarning, match="plan='auto' could not profile"):
        with pytest.raises(RuntimeError, match="a real bug"):
            _fit_losses(Broken)


@pytest.mark.parametrize("module_class", [GAN, UpdatesMetrics])
def test_manual_optimization_and_metrics_plan_and_train_an_epoch(module_class):
    module = module_class()
    trainer = _trainer(max_epochs=1, limit_val_batches=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, DataLoader(TensorDataset(*_batch(32)), batch_size=8))
    assert not [w for w in caught if "plan='auto'" in str(w.message)]
    assert trainer.strategy.planning.report is not None and trainer.fit_loop.epoch_progress.current.completed == 1
    if module_class is UpdatesMetrics:
        assert module.accuracy._update_count == 2 * 4  # update and forward per batch; none from planning
        assert 0 <= module.accuracy.compute() <= 1


def test_when_one_rank_cannot_trace_every_rank_falls_back(monkeypatch):
    from lightning_elixir.planner import plan_automatically
    from lightning_elixir.runtime.collectives import Group

    def all_gather_object(out, obj, group=None):  # this is rank 0 of two; rank 1 could not trace
        out[:] = [obj, "RuntimeError: only rank 1 cannot trace"]

    monkeypatch.setattr(torch.distributed, "all_gather_object", all_gather_object)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = plan_automatically(
            nn.Linear(8, 4), torch.randn(2, 8), device=torch.device("cpu"), group=Group(None, 0, 2),
            compute_dtype=torch.float32, autocast_dtype=None, micro_batches=1,
            hardware=hardware(world_size=2, device_count=2))
    assert result.plan == FALLBACK_PLAN and result.fallback_reason == "rank 1: RuntimeError: only rank 1 cannot trace"
    assert len([w for w in caught if "plan='auto'" in str(w.message)]) == 1


def test_private_params_reach_the_searched_plan():
    strategy = ElixirStrategy(plan="auto", hardware_profile=hardware(world_size=1, device_count=1),
                              private_params=["net.3.weight"])
    _, trainer = _fit_losses(WithDropout, strategy)
    private = [spec.params for spec in trainer.strategy.planning.plan.chunks if spec.private]
    assert ("net.3.weight",) in private
