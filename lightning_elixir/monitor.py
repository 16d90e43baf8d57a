"""The monitoring callback: shows the plan, the memory and the step times on the trainer's logger.

[Note: the planning callback]
``ElixirMonitor`` measures and logs; it decides nothing. Planning, the self-correction and
out-of-memory recovery belong to the strategy's ``AutoPlanner`` ([Note: one owner of the plan] in
autoplan.py): the monitor times each optimizer step and hands it to the planner, then logs what
the planner concluded. The strategy adds a monitor when the user has none, so
``Trainer(strategy="elixir")`` needs nothing else; a user's own instance, with its options, is used
as it is.

What it logs (to every logger the trainer has; TensorBoard is Lightning's default; text and
figures only where the logger can take them):

- at the start of the stage: the plan as hyperparameters (``elixir/...``), the plan and the search
  report as text, the predicted memory timeline over one step (``elixir/predicted_memory/<kind>``,
  indexed by position in the step, [Note: timeline positions] in timeline.py), and the plan JSON in
  the first logger's directory (``elixir_plan.json``, with the report in ``elixir_report.txt``;
  ``ElixirStrategy(plan="that.json")`` reuses it; nothing is written without a logger);
- on training step ``timeline_step``: the same positions measured (``elixir/measured_memory/<kind>``)
  and, with matplotlib installed, a figure of both (also saved as ``elixir_memory_timeline.png``);
- every ``log_every_n_steps`` training steps: device memory (the CUDA allocator's peak on GPUs;
  everywhere the bytes the runtime holds between steps), host memory (pinned on GPUs) and NVMe
  bytes of offloaded state, and the step time broken
  down into compute and the host's waits for gathers, reduce-scatters, offloaded updates and the
  optimizer (runtime/phases.py), next to the search's prediction (``elixir/predicted_time/...``);
- after the self-correction's calibration steps (the first step, which learns the access order,
  not counted): the measured against the predicted step (``elixir/calibration/...``), and what the
  self-correction concluded ([Note: self-correction] in search/calibrate.py): the plan kept, or
  switched to another in place. After a switch the plan file, the timelines and the predictions
  logged from then on are the new plan's;
- after a step that ran out of memory and was redone under a smaller plan: a console line and
  ``elixir/recovery/...`` ([Note: recovering from out of memory] in recovery.py).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Optional

import torch
from lightning.pytorch import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_elixir.plan import ElixirPlan
from lightning_elixir.planner import PlanningResult
from lightning_elixir.runtime import emulated
from lightning_elixir.runtime.phases import PHASES
from lightning_elixir.search.calibrate import Decision
from lightning_elixir.search.report import format_bytes
from lightning_elixir.search.timeline import predict_timeline
from lightning_elixir.timeline import KINDS, MemoryTimeline

log = logging.getLogger(__name__)

PLAN_FILE = "elixir_plan.json"
FIGURE_FILE = "elixir_memory_timeline.png"
MiB = 2 ** 20


class ElixirMonitor(Callback):
    """Plans ``ElixirStrategy(plan="auto")`` before the run and logs the plan, memory timelines and step times.

    Args:
        timeline_step: The training step (1-based, counting optimizer steps) whose memory is
            measured at every position of the step. The first step learns the access order the
            cache replays afterwards, so the default is the third.
        log_every_n_steps: How often to log the per-step memory and time breakdown; default: the
            trainer's ``log_every_n_steps``.
        save_plan: Write the plan as ``elixir_plan.json`` and the search report as ``elixir_report.txt``
            into the first logger's directory.
        figure: Log a figure of the predicted and measured timelines (needs matplotlib).

    See [Note: the planning callback] for what it logs.
    """

    def __init__(self, timeline_step: int = 3, log_every_n_steps: Optional[int] = None, save_plan: bool = True,
                 figure: bool = True) -> None:
        if not isinstance(timeline_step, int) or timeline_step < 1:
            raise ValueError(f"timeline_step must be a positive int (an optimizer step), got {timeline_step!r}")
        if log_every_n_steps is not None and (not isinstance(log_every_n_steps, int) or log_every_n_steps < 1):
            raise ValueError(f"log_every_n_steps must be a positive int or None, got {log_every_n_steps!r}")
        self.timeline_step = timeline_step
        self.log_every_n_steps = log_every_n_steps
        self.save_plan = save_plan
        self.figure = figure
        self.predicted: Optional[MemoryTimeline] = None
        self.measured: Optional[MemoryTimeline] = None
        self._recorder: Any = None
        self._dir: Optional[str] = None
        self._step_started: Optional[float] = None
        self._last_global_step = 0

    # ---- the stage starts: the plan and the predicted timeline ----------------------------------

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        self._log_plan(trainer)

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        if trainer.state.fn == "validate":  # not the validation inside fit
            self._log_plan(trainer)

    def on_test_start(self, trainer: Any, pl_module: Any) -> None:
        self._log_plan(trainer)

    def on_predict_start(self, trainer: Any, pl_module: Any) -> None:
        self._log_plan(trainer)

    def _log_plan(self, trainer: Any) -> None:
        self._dir = _log_dir(trainer)  # on every rank: Trainer.log_dir is a collective (a broadcast)
        runtime = getattr(trainer.strategy, "runtime", None)
        if runtime is None:
            return
        plan, planning = runtime.plan, self._current_planning(trainer)
        report = planning.report if planning is not None else None
        self.predicted = None
        if planning is not None and planning.model_profile is not None and planning.options is not None:
            self.predicted = predict_timeline(planning.model_profile, plan, planning.options, planning.budget_bytes,
                                              rank=runtime.group.rank)
        if not trainer.is_global_zero:
            return
        hparams = {"elixir/plan": plan.name or "custom", "elixir/chunk_numel": plan.chunk_numel,
                   "elixir/cache_blocks": str(plan.cache_blocks), "elixir/prefetch_depth": plan.prefetch_depth,
                   "elixir/chunks": len(runtime.chunks),
                   "elixir/cpu_chunks": sum(c.placement == "cpu" for c in plan.chunks),
                   "elixir/nvme_chunks": sum(c.placement == "nvme" for c in plan.chunks)}
        if report is not None:
            hparams.update({"elixir/predicted_step_ms": report.winner.step_s * 1e3,
                            "elixir/predicted_peak_mib": report.winner.peak_bytes / MiB,
                            "elixir/budget_mib": report.budget_bytes / MiB,
                            "elixir/lower_bound_ms": report.lower_bound_s * 1e3})
        text = _plan_text(plan, planning)
        for logger in trainer.loggers:
            logger.log_hyperparams(hparams)
            _log_text(logger, "elixir/plan", text)
            if self.predicted is not None:
                _log_timeline(logger, "elixir/predicted_memory", self.predicted, with_budget=True)
        directory = self._dir
        if self.save_plan and directory is not None:
            os.makedirs(directory, exist_ok=True)
            plan.to_json(os.path.join(directory, PLAN_FILE))
            if report is not None:
                with open(os.path.join(directory, "elixir_report.txt"), "w") as f:
                    f.write(report.summary() + "\n")

    def _current_planning(self, trainer: Any) -> Optional[PlanningResult]:
        return getattr(trainer.strategy, "planning", None)

    # ---- training steps: memory and time ---------------------------------------------------------

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        runtime = getattr(trainer.strategy, "runtime", None)
        if runtime is None:
            return
        if self._step_started is None:  # the first micro-batch of an optimizer step
            self._step_started = time.perf_counter()
            runtime.clock.take()  # waits outside the step (validation, checkpoints) are not the step's
            planner = getattr(trainer.strategy, "planner", None)
            # While the self-correction measures, GPU waits are timed on the device ([Note: phases timed
            # on the device] in runtime/phases.py).
            runtime.clock.device_timing = planner is not None and planner.may_replan
            every = self.log_every_n_steps or trainer.log_every_n_steps
            logged = trainer.is_global_zero and every and (trainer.global_step + 1) % every == 0
            if runtime.device.type == "cuda" and (runtime.clock.device_timing or logged):
                # The step's own peak, for the self-correction or the log; steps nothing reads leave the
                # allocator's statistics to the user (torch.cuda.max_memory_allocated after fit, as under DDP).
                torch.cuda.reset_peak_memory_stats(runtime.device)
            if trainer.global_step + 1 == self.timeline_step and self._recorder is None:
                planning = self._current_planning(trainer)
                self._recorder = runtime.record_timeline(planning.budget_bytes if planning is not None else None)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        runtime = getattr(trainer.strategy, "runtime", None)
        if runtime is None or trainer.global_step == self._last_global_step:
            return  # not the end of an optimizer step (accumulating), or no runtime
        self._last_global_step = trainer.global_step
        measuring = runtime.clock.device_timing  # the self-correction's steps: the step as the device ran it
        phases = runtime.clock.take()  # with device timing, waits for the step's timed spans
        if measuring and runtime.device.type == "cuda":
            # The host is ahead of the device by what it queued last (at least the optimizer's kernels). Not
            # waited for here, that tail would count in neither this step nor the next, which starts after it.
            torch.cuda.synchronize(runtime.device)
        step_s = time.perf_counter() - (self._step_started or time.perf_counter())
        self._step_started = None
        if self._recorder is not None and self._recorder.done:
            self.measured, self._recorder = self._recorder.timeline, None
            self._log_measured(trainer)
        every = self.log_every_n_steps or trainer.log_every_n_steps
        if trainer.is_global_zero and every and trainer.global_step % every == 0:
            metrics = _step_metrics(runtime, step_s, phases, self._current_planning(trainer))
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)
        planner = getattr(trainer.strategy, "planner", None)
        if planner is not None and planner.may_replan and trainer.global_step > 1:
            cuda, memory = runtime.device.type == "cuda", emulated.active()
            peak = torch.cuda.max_memory_allocated(runtime.device) if cuda else memory.peak if memory else -1.0
            reserved = torch.cuda.max_memory_reserved(runtime.device) if cuda else memory.peak if memory else -1.0
            decision = planner.observe(trainer.strategy, [step_s, *(phases[p] for p in PHASES), float(peak),
                                                          float(reserved)])
            if decision is not None:
                self._log_decision(trainer, decision, planner.correction.calibration_steps)

    # ---- self-correction ---------------------------------------------------------------------------

    def _log_decision(self, trainer: Any, decision: Decision, steps: int) -> None:
        """What the self-correction concluded after ``steps`` measured steps; a switched plan is logged anew."""
        console(trainer, f"Elixir: after {steps} steps, {decision.reason}")
        if decision.plan is not None:
            self._recorder = None
            self._log_plan(trainer)
        if trainer.is_global_zero:
            metrics = _calibration_metrics(decision)
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)
                _log_text(logger, "elixir/calibration", decision.reason)

    def log_recovery(self, trainer: Any, attempt: Any, running: str) -> None:
        """A step ran out of memory and was redone under a smaller plan ([Note: recovering from out of memory]):
        one console line, the numbers on the loggers, and the new plan's file and timelines."""
        ranks = ", ".join(map(str, attempt.ranks)) or "?"
        console(trainer, f"Elixir: step {attempt.step} ran out of device memory in {attempt.where} on rank(s) {ranks} "
                         f"under {attempt.plan} (short by {format_bytes(attempt.overshoot_bytes)}); redoing it under "
                         f"{running}, searched for {format_bytes(attempt.budget_bytes)}")
        self._step_started, self._recorder = None, None  # a recovered step measures nothing
        self._log_plan(trainer)
        if trainer.is_global_zero:
            metrics = {"elixir/recovery/count": float(len(trainer.strategy.recovery.attempts)),
                       "elixir/recovery/overshoot_mib": attempt.overshoot_bytes / MiB,
                       "elixir/recovery/budget_mib": attempt.budget_bytes / MiB}
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)
                _log_text(logger, "elixir/recovery", f"step {attempt.step}: {attempt.message}; now {running}")

    def _log_measured(self, trainer: Any) -> None:
        if not trainer.is_global_zero or self.measured is None:
            return
        for logger in trainer.loggers:
            _log_timeline(logger, "elixir/measured_memory", self.measured, with_budget=False)
        if self.figure:
            _log_figure(trainer, self._dir, self.predicted, self.measured)


# ---- what is logged ---------------------------------------------------------------------------------


def console(trainer: Any, text: str) -> None:
    """One line for the user on rank 0: through the progress bar while one is drawn (its own print
    keeps the bar's line intact), else through logging, as Lightning's messages."""
    if not trainer.is_global_zero:
        return
    bar = getattr(trainer, "progress_bar_callback", None)
    if bar is not None and getattr(bar, "is_enabled", False) and not getattr(bar, "is_disabled", False):
        bar.print(text)
    else:
        rank_zero_info(text)


def _plan_text(plan: ElixirPlan, planning: Optional[PlanningResult]) -> str:
    """The plan and, when it was searched, the report, as a markdown code block."""
    body = [plan.to_json()]
    if planning is not None and planning.report is not None:
        body = [planning.report.summary(), "", *body]
    elif planning is not None and planning.fallback_reason:
        body = [f"fallback plan: {planning.fallback_reason}", "", *body]
    return "```\n" + "\n".join(body) + "\n```"


def _step_metrics(runtime: Any, step_s: float, phases: dict[str, float],
                  planning: Optional[PlanningResult]) -> dict[str, float]:
    """Per-step memory and the step time by phase, with the prediction next to it."""
    metrics = {"elixir/memory/runtime_held_mib": runtime.device_bytes_between_steps() / MiB,
               "elixir/memory/host_mib": runtime.offload.host_bytes() / MiB,
               "elixir/memory/nvme_mib": runtime.offload.nvme_bytes() / MiB}
    if runtime.device.type == "cuda":
        metrics["elixir/memory/device_peak_mib"] = torch.cuda.max_memory_allocated(runtime.device) / MiB
    waits = sum(phases[p] for p in PHASES)
    metrics["elixir/time/step_ms"] = step_s * 1e3
    metrics["elixir/time/compute_ms"] = max(step_s - waits, 0.0) * 1e3
    metrics.update({f"elixir/time/{p}_ms": phases[p] * 1e3 for p in PHASES})
    report = planning.report if planning is not None else None
    if report is not None:
        c = report.cost
        metrics.update({"elixir/predicted_time/step_ms": c.step_s * 1e3,
                        "elixir/predicted_time/compute_ms": c.compute_s * 1e3,
                        "elixir/predicted_time/exposed_comm_ms": max(c.forward_backward_s - c.compute_s, 0.0) * 1e3,
                        "elixir/predicted_time/optimizer_ms": c.device_optimizer_s * 1e3,
                        "elixir/predicted_time/exposed_offload_ms": c.exposed_host_s * 1e3})
    return metrics


def _calibration_metrics(decision: Decision) -> dict[str, float]:
    """The self-correction in numbers: measured against predicted, the fitted factors, whether it switched."""
    metrics = {"elixir/calibration/measured_step_ms": decision.measured.step_s * 1e3,
               "elixir/calibration/predicted_step_ms": decision.predicted_s * 1e3,
               "elixir/calibration/measured_over_predicted": decision.error,
               "elixir/calibration/switched": float(decision.plan is not None)}
    if decision.measured.peak_bytes is not None:
        metrics["elixir/calibration/measured_peak_mib"] = decision.measured.peak_bytes / MiB
        metrics["elixir/calibration/predicted_peak_mib"] = decision.predicted_peak_bytes / MiB
    if decision.measured.reserved_bytes is not None:
        metrics["elixir/calibration/measured_reserved_mib"] = decision.measured.reserved_bytes / MiB
    calibration = decision.calibration
    if calibration is not None:
        metrics.update({"elixir/calibration/compute_scale": calibration.compute_scale,
                        "elixir/calibration/bandwidth_scale": calibration.bandwidth_scale,
                        "elixir/calibration/optimizer_scale": calibration.optimizer_scale,
                        "elixir/calibration/host_update_scale": calibration.host_update_scale,
                        "elixir/calibration/calibrated_step_ms": calibration.after.step_s * 1e3})
    return metrics


def _log_timeline(logger: Any, prefix: str, timeline: MemoryTimeline, with_budget: bool) -> None:
    """One scalar per kind and position (the position is the step axis), in MiB."""
    for position in range(len(timeline.labels)):
        metrics = {f"{prefix}/{kind}_mib": timeline[kind][position] / MiB for kind in KINDS
                   if timeline[kind] is not None}
        if with_budget and timeline.budget_bytes:
            metrics[f"{prefix}/budget_mib"] = timeline.budget_bytes / MiB
        logger.log_metrics(metrics, step=position)


def _log_text(logger: Any, tag: str, text: str) -> None:
    """Text for loggers whose writer takes it (TensorBoard's SummaryWriter); others get the hyperparameters only."""
    experiment = getattr(logger, "experiment", None)
    if hasattr(experiment, "add_text"):
        experiment.add_text(tag, text, global_step=0)


def _log_dir(trainer: Any) -> Optional[str]:
    """The first logger's directory; None without a logger (nothing is written into the working
    directory). Call it on every rank: ``Trainer.log_dir`` broadcasts."""
    directory = trainer.log_dir
    return directory if trainer.loggers else None


def _log_figure(trainer: Any, directory: Optional[str], predicted: Optional[MemoryTimeline],
                measured: MemoryTimeline) -> None:
    """Predicted and measured memory over the step, as a PNG in the log directory and on TensorBoard."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        where = os.path.join(directory, FIGURE_FILE) if directory else FIGURE_FILE
        console(trainer, f"Elixir: the memory timeline figure ({where}, and elixir/memory_timeline on "
                         "TensorBoard) needs matplotlib: pip install matplotlib (or lightning-elixir[plot]). "
                         "Its numbers are logged as scalars meanwhile.")
        return
    if not measured.labels:  # no access acquired a public chunk (every chunk private): nothing to draw
        return
    fig, ax = plt.subplots(figsize=(10, 4.5))
    positions = list(range(len(measured.labels)))
    top = max(measured["runtime"]) / MiB
    title = "Elixir: device memory per rank over one training step"
    if predicted is not None and predicted.labels:
        # Its own positions: a step with several backward passes (manual optimization) has more than predicted.
        kinds = [k for k in ("params", "grads", "optimizer", "activations") if predicted[k] is not None]
        ax.stackplot(range(len(predicted.labels)), *[[b / MiB for b in predicted[k]] for k in kinds], alpha=0.45,
                     labels=[f"predicted {k}" for k in kinds])
        top = max(top, max(predicted["total"] or predicted["runtime"]) / MiB)
        if predicted.budget_bytes and predicted.budget_bytes / MiB <= 2 * top:
            ax.axhline(predicted.budget_bytes / MiB, color="tab:red", label="budget")
        elif predicted.budget_bytes:
            title += f" (budget {predicted.budget_bytes / MiB:,.0f} MiB, off the chart)"
    ax.plot(positions, [b / MiB for b in measured["runtime"]], color="black", marker=".", linewidth=1,
            label="measured runtime-held")
    if measured["total"] is not None:
        ax.plot(positions, [b / MiB for b in measured["total"]], color="tab:orange", label="measured total")
    ax.set_xlabel("position in the step (chunk acquisitions: forward, then backward)")
    ax.set_ylabel("MiB")
    ax.set_title(title)
    ax.legend(loc="upper left", fontsize="small")
    fig.tight_layout()
    if directory is not None:
        os.makedirs(directory, exist_ok=True)
        fig.savefig(os.path.join(directory, FIGURE_FILE), dpi=110)
    for logger in trainer.loggers:
        experiment = getattr(logger, "experiment", None)
        if hasattr(experiment, "add_figure"):
            experiment.add_figure("elixir/memory_timeline", fig, global_step=trainer.global_step, close=False)
    plt.close(fig)
