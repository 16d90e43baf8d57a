"""Self-correction through the Trainer, on two gloo ranks (processes started as in tests/test_resume.py).

Five fits from the same weights and data:

1. "measured": plan="auto" on this machine's measured profile, ``replan=False``: the true profile's plan;
2. "wrong": plan="auto" with that profile's collectives 50x too slow ([Note: self-correction]): after its
   calibration steps the monitor finds the step far faster than predicted, fits the collectives'
   bandwidth above 1, searches again on the calibrated profiles and ends on their plan,
   switching when the wrong profile chose another (margin 0: whether a switch happens at all depends on
   this machine's speeds, which the test cannot fix; tests/search/test_calibrate.py shows it on fixed ones);
3. "by hand": a fixed plan switched to another by ``ElixirStrategy.switch_plan`` after step 3, as the
   monitor does: training goes on exactly as a fit of the second plan from the start (4);
4. "second": the second plan from the start;
5. "kept": the wrong profile with ``replan=False``: never reconsidered, never switched.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback

from lightning_elixir.demos.gpt import GPT, GPTConfig
from lightning_elixir import ElixirPlan, ElixirStrategy
from lightning_elixir.search.calibrate import SelfCorrection
from lightning_elixir.monitor import ElixirMonitor
from lightning_elixir.profile.types import HardwareProfile
from lightning_elixir.search import evaluate_plan
from lightning_elixir.search.calibrate import scale_collectives
from tests.test_resume import COLLECTIVE_TIMEOUT, RankLosses, TinyGPT, fit_on_ranks, rank_losses

CONFIG = GPTConfig(vocab_size=4096, block_size=64, n_layer=4, n_head=4, n_embd=384, bias=False)
BUDGET = "375MiB"
"""Tight enough that plans differ in chunk size and offloading; see the module docstring."""
CALIBRATION_STEPS, STEPS = 3, 7
SWITCH_AFTER = 3
FIRST = ElixirPlan(chunk_numel=1 << 20, cache_blocks="min", prefetch_depth=1, name="first")
SECOND = ElixirPlan(chunk_numel=3 << 20, cache_blocks="all", name="second")


class SwitchByHand(Callback):
    """Switches the running plan to SECOND after optimizer step SWITCH_AFTER, as the monitor would."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == SWITCH_AFTER:
            trainer.strategy.switch_plan(SECOND)


class Planned(Callback):
    """Writes, per rank, the plan the run started with, the one it ended with and the monitor's decision."""

    def __init__(self, run: Path) -> None:
        self.run, self.first = run, None

    def on_train_start(self, trainer, pl_module) -> None:
        self.first = trainer.strategy.runtime.plan.to_dict()

    def on_train_end(self, trainer, pl_module) -> None:
        strategy = trainer.strategy
        decision = strategy.planner.decision if strategy.planner is not None else None
        out = {"first": self.first, "last": strategy.runtime.plan.to_dict(),
               "decision": None if decision is None else {
                   "switched": decision.plan is not None, "reason": decision.reason, "outcome": decision.outcome,
                   "bandwidth_scale": decision.calibration and decision.calibration.bandwidth_scale}}
        planning, rank = strategy.planning, trainer.global_rank
        if planning is not None:
            planning.hardware_profile.to_json(self.run / f"hardware{rank}.json")
        measured = self.run.parent / "measured"
        if planning is not None and self.run.name == "wrong" and decision is not None and decision.calibration:
            calibration = decision.calibration
            out["calibrated_over_measured"] = calibration.after.step_s / decision.measured.step_s
            # the plan it ends on against the calibrated search's winner, both on the calibrated profiles (the
            # planning describes the plan it ends on by the variant traced with its recomputation, calibrated)
            last = evaluate_plan(strategy.runtime.plan, planning.model_profile, calibration.hardware, planning.options)
            out["last_over_best"] = last.cost.step_s / decision.report.cost.step_s
            # and against the measured profile's plan, on the measured profile (reported, not asserted)
            hardware = HardwareProfile.from_json(measured / f"hardware{rank}.json")
            true_plan = ElixirPlan.from_dict(json.loads((measured / f"planned{rank}.json").read_text())["last"])
            predict = [evaluate_plan(p, planning.model_profile, hardware, planning.options).cost.step_s
                       for p in (strategy.runtime.plan, true_plan)]
            out["last_over_true"] = predict[0] / predict[1]
        (self.run / f"planned{trainer.global_rank}.json").write_text(json.dumps(out))


def fit(run: Path, world_size: int, plan, hardware: Optional[str], replan: bool) -> None:
    run.mkdir(parents=True, exist_ok=True)
    (run / "losses").mkdir(exist_ok=True)
    rank = torch.distributed.get_rank()
    # The measured profile of fit 1, with collectives 50x slower than measured. Not faster: the step of this
    # model is not all collectives, so a profile far too fast predicts it within 15% whenever the machine
    # ran faster during the fit than during fit 1's measurement (it is shared). 10x too slow was not enough
    # either: under a full second test job the step ran 4x slower than fit 1 measured, and 10x slower
    # collectives then predicted it within 15%.
    if hardware == "wrong":
        measured = HardwareProfile.from_json(run.parent / "measured" / f"hardware{rank}.json")
        hardware = scale_collectives(measured, 0.02)
    callbacks = []
    if plan == "by hand":
        plan, callbacks = FIRST, [SwitchByHand()]
    correction = SelfCorrection(calibration_steps=CALIBRATION_STEPS, margin=0.0) if replan else False
    strategy = ElixirStrategy(plan=plan, hardware_profile=hardware, replan=correction,
                              device_memory_limit=BUDGET if plan == "auto" else None,
                              collective_timeout_s=COLLECTIVE_TIMEOUT.total_seconds())
    monitor = ElixirMonitor(figure=False)
    trainer = L.Trainer(accelerator="cpu", devices=world_size, strategy=strategy, max_steps=STEPS,
                        use_distributed_sampler=False, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, default_root_dir=run,
                        callbacks=[monitor, RankLosses(run / "losses"), Planned(run), *callbacks])
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
    runs = {name: root / name for name in ("measured", "wrong", "by hand", "second", "kept")}
    fit_on_ranks(2, [(runs["measured"], "auto", None, False), (runs["wrong"], "auto", "wrong", True),
                     (runs["by hand"], "by hand", None, True), (runs["second"], SECOND, None, True),
                     (runs["kept"], "auto", "wrong", False)], fit_fn=fit)
    return runs


def planned(run: Path) -> list[dict]:
    return [json.loads((run / f"planned{r}.json").read_text()) for r in range(2)]


def test_wrong_profile_is_calibrated_and_ends_on_the_calibrated_searchs_plan(runs):
    """The wrong profile is corrected and the run ends on the plan the corrected profiles choose.

    Whether that is the plan fit 1 chose on its own measured profile is not asserted: the two fits
    measure this shared machine at different moments, and on 2 loaded cores the collectives' speed
    moves by 2x between them (one run calibrated a 10x error to 0.20, not 0.10), which is enough to
    flip a choice between plans predicted within 10% of each other. tests/search/test_calibrate.py
    shows the convergence on fixed profiles.
    """
    for rank in planned(runs["wrong"]):
        decision = rank["decision"]
        assert decision is not None and decision["outcome"] != "within", decision  # 50x off: far beyond 15%
        assert decision["bandwidth_scale"] > 1.0  # the collectives were found faster than the profile said
        # the calibrated profiles predict the running plan as it was measured...
        assert rank["calibrated_over_measured"] == pytest.approx(1.0, abs=0.15), decision["reason"]
        # ...and the run ends on their search's winner, or on the running plan when the winner is no faster
        assert rank["last_over_best"] <= 1.0 + 1e-6, decision["reason"]
        assert decision["switched"] == (rank["first"] != rank["last"])


def test_a_switched_run_trains_as_the_new_plan_from_the_start(runs):
    for rank in planned(runs["by hand"]):
        assert rank["first"]["name"] == "first" and rank["last"]["name"] == "second"
    switched, second = rank_losses(runs["by hand"]), rank_losses(runs["second"])
    for got, want in zip(switched, second):
        assert sorted(got) == sorted(want) == list(range(1, STEPS + 1))
        for step in want:
            assert got[step] == pytest.approx(want[step], rel=1e-5, abs=1e-6), step


def test_no_switch_with_a_fixed_plan_or_replan_false(runs):
    for name in ("by hand", "second", "kept", "measured"):
        for rank in planned(runs[name]):
            assert rank["decision"] is None, name
            if name != "by hand":
                assert rank["first"] == rank["last"], name
