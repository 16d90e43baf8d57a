"""Offloaded updates started in backward ([Note: updates started in backward] in runtime/offload.py).

A model of five layers, one chunk each, every other chunk's state in host memory, on 2 gloo ranks
through the Trainer, AdamW with two param groups (different lr and weight decay). Each configuration
trains twice, with updates allowed to start in backward and with ``updates_in_backward=False``: the
losses and weights must be the same, bit for bit. Where nothing can change an update between
backward and the step, the offloaded chunks' updates start in backward (counted); with clipping by
norm, fp16 loss scaling (whose first steps skip) or a hook between backward and step, they wait for
the step; with accumulation, they start in the last micro-batch's backward only.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback

from lightning_elixir import ElixirPlan, ElixirStrategy
from lightning_elixir.precision import ElixirPrecision
from lightning_elixir.runtime.layout import resolve_specs
from tests.test_resume import fit_on_ranks

STEPS = 4
WIDTH = 16


class Layers(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(4)))
        self.head = nn.Linear(WIDTH, 4)
        self.losses: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.body:
            x = torch.tanh(layer(x))
        return self.head(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        decay = [p for n, p in self.named_parameters() if n.endswith("weight")]
        rest = [p for n, p in self.named_parameters() if not n.endswith("weight")]
        return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                                  {"params": rest, "weight_decay": 0.0, "lr": 3e-3}], lr=1e-2)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        data = torch.utils.data.TensorDataset(torch.randn(64, WIDTH, generator=g), torch.randint(0, 4, (64,), generator=g))
        return torch.utils.data.DataLoader(data, batch_size=4)


class HalvesAGradient(Layers):
    def on_before_optimizer_step(self, optimizer) -> None:  # between backward and step: the update must see it
        with torch.no_grad():
            for p in self.body[3].parameters():  # a chunk offloaded by the plan
                if p.grad is not None:
                    p.grad.mul_(0.5)


class PenalizesALayer(Layers):
    """Reads an offloaded chunk's weight outside its module (an L2 penalty in the step): the chunk is exposed
    to writes there, and an update started in backward must not be undone by writing its block back."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y) + 1e-2 * self.body[1].weight.pow(2).sum()
        self.losses.append(loss.item())
        return loss


class OnlyOverridesTheHook(Callback):
    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        pass


class Record(Callback):
    """Each rank's losses and the count of updates started in backward; rank 0 the weights."""

    def __init__(self, run: Path) -> None:
        self.run = run

    def on_train_end(self, trainer, pl_module) -> None:
        strategy = trainer.strategy
        with strategy.gathered_params():
            weights = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}
        if trainer.global_rank == 0:
            torch.save(weights, self.run / "weights.pt")
        out = {"losses": pl_module.losses, "started": strategy.runtime.offload.early_updates,
               "offloaded": len(strategy.runtime.offload.chunks), "skipped": strategy.runtime.skipped_steps}
        (self.run / f"rank{trainer.global_rank}.json").write_text(json.dumps(out))


def offloading_plan(world_size: int) -> ElixirPlan:
    """One chunk per layer and one for the head; those of body.1 and body.3 with their state in host memory."""
    specs = resolve_specs(Layers(), ElixirPlan(chunk_numel=WIDTH * WIDTH + WIDTH + 32), world_size)
    chunks = tuple(dataclasses.replace(s, placement="cpu" if i % 2 else "device") for i, s in enumerate(specs))
    return ElixirPlan(chunks=chunks, world_size=world_size, cache_blocks="all", name="offloading")


CONFIGS = {
    "plain": {},
    "clip_norm": {"gradient_clip_val": 0.05},
    "fp16": {},  # the strategy's own fp16 plugin: on a CPU, Trainer(precision="16-mixed") runs bf16
    "accumulation": {"accumulate_grad_batches": 2},
    "hook": {},
    "callback": {},
    "read_outside": {},
}


def fit(run: Path, world_size: int, config: str, early: bool) -> None:
    run.mkdir(parents=True, exist_ok=True)
    module = {"hook": HalvesAGradient, "read_outside": PenalizesALayer}.get(config, Layers)()
    precision = None
    if config == "fp16":
        precision = ElixirPrecision("16-mixed")
        precision.scaler.scale = 2.0 ** 18  # too large for these gradients in fp16: the first steps are skipped
    strategy = ElixirStrategy(plan=offloading_plan(world_size), updates_in_backward=early, precision_plugin=precision)
    trainer = L.Trainer(accelerator="cpu", devices=world_size, strategy=strategy, max_steps=STEPS, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                        callbacks=[Record(run)] + ([OnlyOverridesTheHook()] if config == "callback" else []),
                        **CONFIGS[config])
    trainer.fit(module)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("early")
    fit_on_ranks(2, [(root / f"{config}_{early}", config, early) for config in CONFIGS for early in (True, False)],
                 fit_fn=fit)
    return root


def _result(run: Path, rank: int) -> dict:
    return json.loads((run / f"rank{rank}.json").read_text())


@pytest.mark.parametrize("config", list(CONFIGS))
def test_updates_started_in_backward_change_nothing(runs, config):
    for rank in (0, 1):
        early, late = _result(runs / f"{config}_True", rank), _result(runs / f"{config}_False", rank)
        assert early["losses"] == late["losses"]
        assert late["started"] == 0
        assert early["offloaded"] == 2  # body.1 and body.3
        expected = STEPS * early["offloaded"] if config in ("plain", "accumulation", "read_outside") else 0  # per step
        assert early["started"] == expected, config
        assert early["skipped"] == late["skipped"]
        if config == "fp16":
            assert 0 < early["skipped"] < STEPS, early["skipped"]  # a skipped step, and steps taken
    weights, reference = torch.load(runs / f"{config}_True" / "weights.pt"), torch.load(runs / f"{config}_False" / "weights.pt")
    for name, value in reference.items():
        assert torch.equal(weights[name], value), name


@pytest.mark.parametrize("wanted, module, trainer_args, starts", [
    (True, Layers, {}, True),
    (None, Layers, {}, False),  # default: on an accelerator only
    (False, Layers, {}, False),
    (True, Layers, {"gradient_clip_val": 1.0}, False),
    (True, Layers, {"callbacks": [OnlyOverridesTheHook()]}, False),
    (True, HalvesAGradient, {}, False),
])
def test_the_search_is_told_whether_updates_will_start_in_backward(wanted, module, trainer_args, starts):
    strategy = ElixirStrategy(plan="zero2", updates_in_backward=wanted)
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, logger=False, **trainer_args)
    model = module()
    model.trainer = trainer
    strategy.connect(model)
    assert strategy.updates_will_start_in_backward() is starts
