"""Recovery from out of memory through the Trainer, on two gloo ranks, under an emulated device budget.

Each recovered fit runs plan="auto" inside ``emulated_device_memory`` ([Note: emulated device
memory]) with a limit the first plan does not fit at some step; it must end with the losses and
weights of an uninterrupted fit of the plan it ended on (the "reference": that plan given from the
start, no budget), with the learning-rate schedule and the logged metric intact and no batch
skipped or repeated ([Note: recovering from out of memory]). The model has dropout, so a redo that
drew other random numbers would differ, and it logs a mean over the epoch, which a redo that logged
twice would change.
"""

from __future__ import annotations

import dataclasses
import json
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Optional

import lightning as L
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import TensorBoardLogger

from lightning_elixir import ElixirMonitor, ElixirPlan, ElixirStrategy
from lightning_elixir.demos.gpt import GPT, GPTConfig
from lightning_elixir.recovery import ElixirOutOfMemoryError
from lightning_elixir.runtime.emulated import active, emulated_device_memory
from tests.test_resume import fit_on_ranks

CONFIG = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32, dropout=0.1, bias=False)
BATCH = 2
TIMEOUT = timedelta(seconds=60)
BUDGET = 4 << 20
"""The search's budget: everything fits it, so the first plan is the fastest (all on the device)."""


class DropoutGPT(L.LightningModule):
    def __init__(self, checkpointing: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = GPT(dataclasses.replace(CONFIG, activation_checkpointing=checkpointing))

    def train_dataloader(self):
        g = torch.Generator().manual_seed(1)
        data = torch.randint(CONFIG.vocab_size, (64, CONFIG.block_size + 1), generator=g)
        return torch.utils.data.DataLoader(data, batch_size=BATCH)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        armed = self.oom_in_backward == self.trainer.global_step + 1 and not getattr(self, "_ran_out", False)
        run_out = self.model.h[-1].mlp  # inside the block: its backward has begun (and pinned) when this raises
        handle = run_out.register_forward_hook(lambda mod, args, out: _RunOut.apply(out)) if armed else None
        self._ran_out = self._ran_out if hasattr(self, "_ran_out") else False
        logits = self.model(batch[:, :-1])
        if handle is not None:
            handle.remove()
            self._ran_out = True
        loss = F.cross_entropy(logits.reshape(-1, CONFIG.vocab_size), batch[:, 1:].reshape(-1))
        self.log("mean_loss", loss, on_step=False, on_epoch=True, sync_dist=False)
        return loss

    oom_in_update = 0
    """The optimizer step whose update raises torch.OutOfMemoryError (0: none)."""
    oom_in_backward = 0
    """The optimizer step whose backward raises torch.OutOfMemoryError once, inside the last block's backward
    (at its MLP's output): the head's backward has run, the last block's chunks are pinned for its own."""

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-2)
        if self.oom_in_update:
            steps = []

            def run_out(*_) -> None:  # inside optimizer.step(): the update has begun
                steps.append(1)
                if len(steps) == self.oom_in_update:
                    raise torch.OutOfMemoryError("out of memory in the update (raised by the test)")

            optimizer.register_step_pre_hook(run_out)
        scheduler = torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=0.9)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class _RunOut(torch.autograd.Function):
    """Identity forward; its backward raises torch.OutOfMemoryError, as the CUDA allocator does."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 16.00 KiB (raised by the test)")


class ManualDropoutGPT(DropoutGPT):
    """The same model under manual optimization: backward and the optimizer step inside training_step."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> dict:
        optimizer, scheduler = self.optimizers(), self.lr_schedulers()
        logits = self.model(batch[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, CONFIG.vocab_size), batch[:, 1:].reshape(-1))
        self.log("mean_loss", loss, on_step=False, on_epoch=True, sync_dist=False)
        optimizer.zero_grad()
        self.manual_backward(loss)
        optimizer.step()
        scheduler.step()
        return {"loss": loss.detach()}


class Record(Callback):
    """Per rank: the loss of every micro-batch, the learning rate, the batches seen, the peak emulated
    memory, the calls of the first block; at the end the weights, the plan it ended on, the logged mean
    and the recoveries."""

    def __init__(self, run: Path) -> None:
        self.run, self.rows, self.calls = run, [], 0

    def on_train_start(self, trainer, pl_module) -> None:
        def called(*_) -> None:
            self.calls += 1

        pl_module.model.h[0].register_forward_pre_hook(called)  # twice a micro-batch where it is recomputed

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        lr = trainer.optimizers[0].param_groups[0]["lr"]
        memory = active()
        self.rows.append([trainer.global_step, batch_idx, outputs["loss"].item(), lr, int(batch.sum()),
                          memory.peak if memory else None, self.calls])
        self.calls = 0

    def on_train_end(self, trainer, pl_module) -> None:
        strategy, rank = trainer.strategy, trainer.global_rank
        with strategy.gathered_params():
            weights = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}
        recovery, planning = strategy.recovery, strategy.planning
        winner = planning.report.winner if planning is not None and planning.report is not None else None
        out = {"rows": self.rows, "plan": strategy.runtime.plan.to_dict(),
               "planned": None if winner is None else [winner.chunk_numel, winner.peak_bytes,
                                                       planning.report.budget_bytes, planning.budget_bytes],
               "mean_loss": float(trainer.callback_metrics["mean_loss"]),
               "attempts": [] if recovery is None else [[a.step, a.where, list(a.ranks)] for a in recovery.attempts],
               "adam_steps": sorted({int(s["step"]) for view, s in trainer.optimizers[0].state.items()  # views this
                                     if "step" in s and view.numel() > 0})}  # rank updates: the rest are agreed on reads
        (self.run / f"rank{rank}.json").write_text(json.dumps(out))
        if rank == 0:
            torch.save(weights, self.run / "weights.pt")


SWITCHED = ElixirPlan(chunk_numel=12 << 10, cache_blocks="all", name="switched")


class SwitchAfter(Callback):
    """Switches the running plan to ``plan`` after an optimizer step, as the self-correction does."""

    def __init__(self, step: int, plan: ElixirPlan = SWITCHED) -> None:
        self.step, self.plan = step, plan

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            trainer.strategy.switch_plan(self.plan)


def fit(run: Path, world_size: int, plan, limit, ranks, steps: int, accumulate: int = 1,
        recovery: bool = True, switch_after: int = 0, manual: bool = False, checkpointing: bool = False,
        oom_in_update: int = 0, oom_in_backward: int = 0, budget: int = BUDGET, switch_to: ElixirPlan = SWITCHED
        ) -> None:
    run.mkdir(parents=True, exist_ok=True)
    strategy = ElixirStrategy(plan=plan, device_memory_limit=budget if plan == "auto" else None, replan=False,
                              oom_recovery=recovery, collective_timeout_s=TIMEOUT.total_seconds())
    logger = TensorBoardLogger(run, name="tb", version=0) if limit is not None else False
    trainer = L.Trainer(accelerator="cpu", devices=world_size, strategy=strategy, max_steps=steps, logger=logger,
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                        accumulate_grad_batches=accumulate, default_root_dir=run,
                        callbacks=[Record(run), ElixirMonitor(figure=False)]
                        + ([SwitchAfter(switch_after, switch_to)] if switch_after else []))
    model = ManualDropoutGPT() if manual else DropoutGPT(checkpointing)
    model.oom_in_update = oom_in_update
    model.oom_in_backward = oom_in_backward
    try:
        if limit is None:
            trainer.fit(model)
        else:
            with emulated_device_memory(limit, ranks=ranks):
                trainer.fit(model)
    except Exception as err:  # the test reads what was raised
        (run / f"error{trainer.global_rank}.txt").write_text(f"{type(err).__name__}: {err}")
        (run / f"traceback{trainer.global_rank}.txt").write_text(traceback.format_exc())


def result(run: Path, rank: int = 0) -> dict:
    return json.loads((run / f"rank{rank}.json").read_text())


def assert_same_training(run: Path, reference: Path) -> None:
    for rank in (0, 1):
        got, want = result(run, rank), result(reference, rank)
        assert [r[1] for r in got["rows"]] == [r[1] for r in want["rows"]]  # no batch skipped or repeated
        assert [r[4] for r in got["rows"]] == [r[4] for r in want["rows"]]
        assert [r[3] for r in got["rows"]] == pytest.approx([r[3] for r in want["rows"]], rel=1e-12)  # the schedule
        assert [r[2] for r in got["rows"]] == pytest.approx([r[2] for r in want["rows"]], rel=1e-5, abs=1e-6)
        assert got["mean_loss"] == pytest.approx(want["mean_loss"], rel=1e-5)
        assert got["adam_steps"] == want["adam_steps"]
    weights, expected = torch.load(run / "weights.pt"), torch.load(reference / "weights.pt")
    for name, value in expected.items():
        torch.testing.assert_close(weights[name], value, rtol=1e-5, atol=1e-6, msg=name)


ROOMY = 10 << 20
TIGHT = 450_000
"""Between the most frugal plans' peak and the first plan's (measured under the emulated budget: about 380
and 480-530 KB), so the first plan runs out and a smaller one fits."""
STEPS = 6
RECOVERED = {  # name: (limit, ranks, accumulate, switch after, manual optimization)
    "step1": ({1: TIGHT}, None, 1, 0, False),
    "step5": ({1: ROOMY, 5: TIGHT}, None, 1, 0, False),
    "one_rank": ({1: TIGHT}, (1,), 1, 0, False),
    "after_switch": ({1: ROOMY, 4: TIGHT}, None, 1, 3, False),
    "accumulating": ({1: ROOMY, 3: 500_000}, None, 2, 0, False),
    "manual": ({1: ROOMY, 2: TIGHT}, None, 1, 0, True),
}
"""The accumulating fit runs out in both micro-batches of step 3: the second redo carries the first's gradients."""


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """The recovered fits, the failing ones, then uninterrupted fits of the plans the recovered ones ended on."""
    root = tmp_path_factory.mktemp("oom")
    fits = [(root / name, "auto", limit, ranks, STEPS, accumulate, True, switch, manual)
            for name, (limit, ranks, accumulate, switch, manual) in RECOVERED.items()]
    fits += [(root / "repeated", "auto", {1: 150_000}, None, 2),
             (root / "off", "auto", {1: TIGHT}, None, 2, 1, False),
             (root / "in_update", "auto", {1: ROOMY}, None, 3, 1, True, 0, False, False, 2),
             (root / "evicting", "auto", {1: ROOMY}, None, STEPS, 1, True, 0, False, False, 0, 3, EVICTING)]
    fit_on_ranks(2, fits, fit_fn=fit)
    references = []
    for name, (_, _, accumulate, _, manual) in RECOVERED.items():
        plan = result(root / name)["plan"]
        references.append((root / f"{name}_reference", plan, None, None, STEPS, accumulate, True, 0, manual))
    references.append((root / "evicting_reference", result(root / "evicting")["plan"], None, None, STEPS))
    fit_on_ranks(2, references, fit_fn=fit)
    return root


EVICTING = 680_000
"""A search budget under which plan="auto" offloads a chunk: a plan whose units pin their chunks for their
backward, unlike the resident plans the emulated budgets above start from."""


def test_a_backward_given_up_while_units_hold_their_chunks_is_redone(runs):
    """Out of memory in backward under a plan that gathers per unit (it offloads), after some units ran
    their backward and with the last block's chunks pinned for its own: every pin goes with the step."""
    for rank in (0, 1):
        assert not (runs / "evicting" / f"error{rank}.txt").exists(), (runs / "evicting" / f"error{rank}.txt").read_text()
    attempts = result(runs / "evicting")["attempts"]
    assert [(a[0], a[1]) for a in attempts] == [(3, "backward")]
    assert_same_training(runs / "evicting", runs / "evicting_reference")


@pytest.mark.parametrize("name", list(RECOVERED))
def test_a_step_that_runs_out_of_memory_is_redone_under_a_smaller_plan(runs, name):
    """At step 1 (in backward), at step 5, on one rank only (the other learns of it in its next wait),
    right after a plan switch, in both micro-batches of an accumulating step and under manual
    optimization: each recovers, on both ranks, and trains exactly as the plan it ends on does from
    the start."""
    for rank in (0, 1):
        assert not (runs / name / f"error{rank}.txt").exists(), (runs / name / f"error{rank}.txt").read_text()
    attempts = result(runs / name)["attempts"]
    assert attempts and attempts == result(runs / name, 1)["attempts"]
    first_step = {"step1": 1, "step5": 5, "one_rank": 1, "after_switch": 4, "accumulating": 3, "manual": 2}[name]
    assert attempts[0][0] == first_step
    if name == "one_rank":
        assert all(ranks == [1] for _, _, ranks in attempts)
    if name == "accumulating":
        assert len(attempts) == 2 and {a[0] for a in attempts} == {3}
    assert_same_training(runs / name, runs / f"{name}_reference")


@pytest.mark.parametrize("name", list(RECOVERED))
def test_after_a_recovery_the_planning_shows_the_search_that_found_the_running_plan(runs, name):
    """The report the monitor logs and prints (predicted step, peak) is the recovery's search, on every rank."""
    for rank in (0, 1):
        got = result(runs / name, rank)
        chunk_numel, peak, searched_for, budget = got["planned"]
        assert chunk_numel == got["plan"]["chunk_numel"]
        assert searched_for == budget and peak <= budget
        assert budget < BUDGET  # lowered by the recovery


def test_a_recovery_is_logged(runs):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(runs / "step1" / "tb" / "version_0"))
    events.Reload()
    scalars = set(events.Tags()["scalars"])
    assert {"elixir/recovery/count", "elixir/recovery/overshoot_mib", "elixir/recovery/budget_mib"} <= scalars
    assert events.Scalars("elixir/recovery/count")[-1].value == len(result(runs / "step1")["attempts"])
    assert any(t.startswith("elixir/recovery") for t in events.Tags()["tensors"])


def test_a_step_that_keeps_running_out_of_memory_ends_with_a_clear_error(runs):
    for rank in (0, 1):
        text = (runs / "repeated" / f"error{rank}.txt").read_text()
        assert text.startswith("ElixirOutOfMemoryError") or text.startswith("NoPlanFitsError"), text
        assert "ran out of device memory" in text or "no plan fits" in text.lower(), text
        assert "To fit:" in text or "What would help" in text, text


def test_an_update_that_ran_out_of_memory_is_not_redone(runs):
    """The update may be partly applied: redoing it would apply part of it twice."""
    for rank in (0, 1):
        text = (runs / "in_update" / f"error{rank}.txt").read_text()
        assert text.startswith("ElixirOutOfMemoryError"), text
        assert "the optimizer's update had begun and may be partly applied" in text, text


def test_without_recovery_the_out_of_memory_error_propagates_unchanged(runs):
    text = (runs / "off" / "error0.txt").read_text()
    assert text.startswith("EmulatedOutOfMemoryError: out of memory (emulated device budget)"), text


def test_recovery_is_off_with_nccl_across_processes_and_says_so(monkeypatch):
    """[Note: no recovery across GPUs yet]: on NCCL with several ranks the strategy runs as with
    oom_recovery=False (one warning), rather than wait in a collective another rank never joins."""
    from lightning_elixir.runtime.collectives import Group

    two_ranks = Group(pg=None, rank=0, world_size=2)
    monkeypatch.setattr(Group, "default", classmethod(lambda cls, timeout_s=None: two_ranks))
    monkeypatch.setattr(torch.distributed, "get_backend", lambda group=None: "nccl")
    strategy = ElixirStrategy(plan="auto")
    assert strategy.recovery is not None
    with pytest.warns(UserWarning, match="out-of-memory recovery is off with NCCL"):
        group = strategy._group()
    assert group is two_ranks and strategy.recovery is None


class ToggledGAN(L.LightningModule):
    """A GAN under manual optimization with toggle_optimizer; with ``oom_at``, the generator's backward runs out
    of memory once at that step, while the discriminator is toggled off."""

    def __init__(self, oom_at: int = -1) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.gen = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 16))
        self.disc = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
        self.automatic_optimization, self.oom_at = False, oom_at

    def train_dataloader(self):
        data = torch.randn(64, 16, generator=torch.Generator().manual_seed(1))
        return torch.utils.data.DataLoader(data, batch_size=4)

    def training_step(self, batch, batch_idx):
        opt_g, opt_d = self.optimizers()
        self.toggle_optimizer(opt_g)
        fake = self.gen(torch.randn(4, 8, generator=torch.Generator().manual_seed(batch_idx)))
        if self.global_step // 2 == self.oom_at:  # two optimizer steps per batch
            self.oom_at, fake = -1, _RunOut.apply(fake)
        g_loss = F.softplus(-self.disc(fake)).mean()
        opt_g.zero_grad()
        self.manual_backward(g_loss)
        opt_g.step()
        self.untoggle_optimizer(opt_g)
        self.toggle_optimizer(opt_d)
        d_loss = F.softplus(-self.disc(batch)).mean() + F.softplus(self.disc(fake.detach())).mean()
        opt_d.zero_grad()
        self.manual_backward(d_loss)
        opt_d.step()
        self.untoggle_optimizer(opt_d)
        self.losses += [g_loss.item(), d_loss.item()]

    def configure_optimizers(self):
        return torch.optim.Adam(self.gen.parameters(), 1e-2), torch.optim.Adam(self.disc.parameters(), 5e-3)


def _fit_gan(run: Path, world_size: int, oom_at: int) -> None:
    run.mkdir(parents=True, exist_ok=True)
    strategy = ElixirStrategy(plan="auto", replan=False, device_memory_limit=4 << 20,
                              collective_timeout_s=TIMEOUT.total_seconds())
    trainer = L.Trainer(accelerator="cpu", devices=world_size, strategy=strategy, max_steps=12, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
    model = ToggledGAN(oom_at)
    model.losses = []
    with emulated_device_memory(ROOMY):
        trainer.fit(model)
    recoveries = len(strategy.recovery.attempts) if strategy.recovery is not None else 0
    torch.save({"losses": model.losses, "weights": model.state_dict(), "recoveries": recoveries},
               run / f"rank{trainer.global_rank}.pt")


def test_a_step_redone_after_toggle_optimizer_finds_the_flags_as_before(tmp_path):
    """The failed attempt's toggle_optimizer froze the discriminator; the redo must find it trainable again."""
    fit_on_ranks(2, [(tmp_path / "oom", 3), (tmp_path / "reference", -1)], fit_fn=_fit_gan)
    for rank in (0, 1):
        got, want = (torch.load(tmp_path / name / f"rank{rank}.pt") for name in ("oom", "reference"))
        assert got["recoveries"] == 1 and want["recoveries"] == 0
        assert got["losses"] == pytest.approx(want["losses"], rel=1e-5, abs=1e-6)
        for key, value in want["weights"].items():
            torch.testing.assert_close(got["weights"][key], value, rtol=1e-5, atol=1e-6, msg=key)


def _groups() -> int:
    return len(torch.distributed.distributed_c10d._world.pg_map)


def fit_and_count_groups(run: Path, world_size: int) -> None:
    """Two fits, each followed by a validation and a checkpoint of the finished fit's optimizer state; the number
    of live process groups before, after each stage, and the checkpoint's optimizer state."""
    run.mkdir(parents=True, exist_ok=True)
    counts = [_groups()]
    for i in range(2):
        trainer = L.Trainer(accelerator="cpu", devices=world_size, strategy=ElixirStrategy(plan="auto", replan=False),
                            max_steps=2, logger=False, enable_progress_bar=False, enable_model_summary=False,
                            enable_checkpointing=False, default_root_dir=run, limit_val_batches=1)
        model = DropoutGPT()
        model.validation_step = lambda batch, batch_idx: None
        trainer.fit(model)
        counts.append(_groups())
        trainer.save_checkpoint(run / f"fit{i}.ckpt")  # gathers the state of the finished fit's shards
        trainer.validate(model, dataloaders=model.train_dataloader(), verbose=False)
        counts.append(_groups())
    if trainer.global_rank == 0:
        state = torch.load(run / "fit1.ckpt", weights_only=False)["optimizer_states"][0]["state"]
        (run / "groups.json").write_text(json.dumps({"counts": counts, "steps": [int(s["step"]) for s in state.values()]}))


def test_the_process_groups_a_stage_makes_for_recovery_go_with_it(tmp_path):
    """Recovery gives the runtime a process group of its own and a spare on several ranks; each gloo group keeps
    threads that wake up on their own, so a process that fits again and again (a sweep) must not accumulate them."""
    fit_on_ranks(2, [(tmp_path, )], fit_fn=fit_and_count_groups)
    got = json.loads((tmp_path / "groups.json").read_text())
    assert got["counts"] == [got["counts"][0]] * 5
    assert got["steps"] and set(got["steps"]) == {2}  # the finished fit's shards still gathered for the checkpoint
