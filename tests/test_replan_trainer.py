"""Self-correction through the Trainer: a plan chosen from a wrong hardware profile is replaced after the
first steps by the plan the machine's true profile gives, and training goes on as that plan's would.

Two gloo ranks (processes started as in tests/test_resume.py). Four fits from the same weights and data:

1. "measured": plan="auto" on this machine's measured profile, ``replan=False``: the true profile's plan;
2. "wrong": plan="auto" with that profile's collectives 10x too fast ([Note: self-correction]); the
   monitor calibrates after its calibration steps and switches (margin 0: any other plan of the
   calibrated search is taken, so that the test does not hinge on how large the gain is here);
3. "fixed": the plan "wrong" switched to, given from the start: never reconsidered;
4. "kept": the wrong profile with ``replan=False``: never switches.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback

from examples.gpt import GPT, GPTConfig
from lightning_elixir import ElixirPlan, ElixirStrategy
from lightning_elixir.monitor import ElixirMonitor
from lightning_elixir.profile.types import HardwareProfile
from lightning_elixir.search.calibrate import scale_collectives
from tests.test_resume import COLLECTIVE_TIMEOUT, RankLosses, TinyGPT, fit_on_ranks, rank_losses
import tests.test_resume as resume

CONFIG = GPTConfig(vocab_size=4096, block_size=64, n_layer=4, n_head=4, n_embd=384, bias=False)
BUDGET = "375MiB"
"""Tight enough that plans differ in chunk size and offloading; see the module docstring."""
CALIBRATION_STEPS, STEPS = 3, 7


class Planned(Callback):
    """Writes, per rank, the plan the run started with, the one it ended with and the monitor's decision."""

    def __init__(self, run: Path) -> None:
        self.run, self.first = run, None

    def on_train_start(self, trainer, pl_module) -> None:
        self.first = trainer.strategy.runtime.plan.to_dict()

    def on_train_end(self, trainer, pl_module) -> None:
        strategy = trainer.strategy
        decision = strategy.monitor(trainer).decision
        out = {"first": self.first, "last": strategy.runtime.plan.to_dict(),
               "decision": None if decision is None else {
                   "switched": decision.plan is not None, "reason": decision.reason,
                   "bandwidth_scale": decision.calibration and decision.calibration.bandwidth_scale}}
        if strategy.planning is not None:
            strategy.planning.hardware_profile.to_json(self.run / f"hardware{trainer.global_rank}.json")
        (self.run / f"planned{trainer.global_rank}.json").write_text(json.dumps(out))


def fit(run: Path, world_size: int, plan, hardware: Optional[str], replan: bool) -> None:
    run.mkdir(parents=True, exist_ok=True)
    (run / "losses").mkdir(exist_ok=True)
    rank = torch.distributed.get_rank()
    if hardware == "wrong":  # the measured profile of fit 1, with collectives 10x faster than measured
        measured = HardwareProfile.from_json(run.parent / "measured" / f"hardware{rank}.json")
        hardware = scale_collectives(measured, 10.0)
    if isinstance(plan, Path):
        plan = ElixirPlan.from_dict(json.loads(plan.with_name(f"planned{rank}.json").read_text())["last"])
    strategy = ElixirStrategy(plan=plan, hardware_profile=hardware, replan=replan,
                              device_memory_limit=BUDGET if plan == "auto" else None,
                              collective_timeout_s=COLLECTIVE_TIMEOUT.total_seconds())
    monitor = ElixirMonitor(calibration_steps=CALIBRATION_STEPS, replan_margin=0.0, figure=False)
    trainer = L.Trainer(accelerator="cpu", devices=world_size, strategy=strategy, max_steps=STEPS,
                        use_distributed_sampler=False, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, default_root_dir=run,
                        callbacks=[monitor, RankLosses(run / "losses"), Planned(run)])
    trainer.fit(_Model())


class _Model(TinyGPT):
    def __init__(self) -> None:
        L.LightningModule.__init__(self)
        torch.manual_seed(0)
        self.model = GPT(CONFIG)

    def training_step(self, batch, batch_idx):
        g = torch.Generator().manual_seed(1000 * self.global_step + self.global_rank)
        tokens = torch.randint(CONFIG.vocab_size, (4, CONFIG.block_size + 1), generator=g)
        logits = self.model(tokens[:, :-1])
        return torch.nn.functional.cross_entropy(logits.reshape(-1, CONFIG.vocab_size), tokens[:, 1:].reshape(-1))


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("replan")
    runs = {name: root / name for name in ("measured", "wrong", "fixed", "kept")}
    fit_on_ranks(2, [(runs["measured"], "auto", None, False), (runs["wrong"], "auto", "wrong", True),
                     (runs["fixed"], runs["wrong"] / "planned0.json", None, True),
                     (runs["kept"], "auto", "wrong", False)], fit_fn=fit)
    return runs


def planned(run: Path) -> list[dict]:
    return [json.loads((run / f"planned{r}.json").read_text()) for r in range(2)]


def test_wrong_profile_switches_to_the_true_profiles_plan(runs):
    true_plan = planned(runs["measured"])[0]["last"]
    for rank in planned(runs["wrong"]):
        decision = rank["decision"]
        assert decision is not None and decision["switched"], decision
        assert decision["bandwidth_scale"] < 1.0  # the collectives were found slower than the profile said
        assert rank["first"] != rank["last"]
        assert rank["last"]["chunks"] == true_plan["chunks"], decision["reason"]


def test_switched_run_trains_as_the_new_plan_from_the_start(runs):
    switched, fixed = rank_losses(runs["wrong"]), rank_losses(runs["fixed"])
    for got, want in zip(switched, fixed):
        assert sorted(got) == sorted(want) == list(range(1, STEPS + 1))
        for step in want:
            assert got[step] == pytest.approx(want[step], rel=1e-5, abs=1e-6), step


def test_no_switch_with_a_fixed_plan_or_replan_false(runs):
    for rank in planned(runs["fixed"]) + planned(runs["kept"]) + planned(runs["measured"]):
        assert rank["decision"] is None and rank["first"] == rank["last"]
