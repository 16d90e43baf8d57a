"""plan="auto" for one strategy: planning, the self-correction and out-of-memory recovery, with one owner.

[Note: one owner of the plan]
The strategy holds an ``AutoPlanner`` when its plan is "auto". It plans in ``Strategy.setup`` (the
first point at which the process group is up, the model is complete and not yet chunked: planner.py,
[Note: planning per stage]), keeps the one ``PlanningResult`` that describes the running plan (its
``plan``, ``budget_bytes`` and profiles change with each switch), decides after the first steps
whether to switch ([Note: self-correction] in search/calibrate.py) and shrinks the plan when a step
runs out of memory ([Note: recovering from out of memory] in recovery.py). Every switch goes through
``ElixirStrategy.switch_plan``, so the running plan is ``strategy.runtime.plan`` and the search's
view of it is ``strategy.planning``; nothing else keeps a copy.

The ElixirMonitor callback measures the steps (it wraps each optimizer step, micro-batches and
callbacks included, as the user's step time) and hands each one to ``observe``; it logs what the
planner decided and never decides itself.

[Note: planning for the optimizer]
The search prices the optimizer state each trained element keeps (``SearchOptions.
optimizer_bytes_per_numel``): Adam's two moments are 8 bytes, SGD with momentum 4, plain SGD none,
Adafactor a few values per row and column, a per-parameter optimizer perhaps more than Adam. Lightning
configures optimizers after the strategy's setup, where the plan is made, so the search priced every
optimizer as Adam: too much for SGD or Adafactor (state offloaded that would have fit, a slower plan),
too little for a heavier one (a plan that does not fit). So when fitting under plan="auto" the strategy
calls ``configure_optimizers`` before planning, as Lightning's DeepSpeed strategy does before it wraps
the model, and ``setup_optimizers`` then takes those objects: the user's hook still runs once per fit,
and the optimizers hold the module's parameters, which keep their identity when chunked (their class
changes, not the object). The planning trace of a manually optimizing step hands those objects to its
``self.optimizers()`` (``StepStandIns``), where it used to call ``configure_optimizers`` again.

``optim.state_footprint`` measures each param group's state by building its class anew over a parameter
of each shape the group trains and stepping it once on fake tensors (a step that needs values, on a
real 64 x 64 matrix and a vector on the CPU). State of the
parameter's shape is sharded with its chunk and placed with it; state of any other shape (Shampoo's
preconditioners, Adafactor's rows and columns) is held whole by every rank on the device, so it is
priced per trained element of the whole model, not of a shard (at 4 ranks, a quarter of it would be
counted). Where the step gathers a chunk at a time (a per-parameter optimizer's masters, gradients and
per-element state, [Note: per-parameter optimizers]; Muon's update), the largest chunk's gathers are
priced after the activations are freed: the peak is the larger of the two. Not priced: a model built
on the meta device (``configure_model``; its parameters are replaced when chunked, so its optimizers
are configured after), and a class that cannot be built from its param groups alone or step on the
CPU (8-bit optimizers that need a GPU): those keep Adam's price, as does a stage that does not fit.
Where the real probe stands in, its square matrix stands for every matrix (a factored moment's rows and
columns, per element, are then those of a 64 x 64 matrix: a few percent of one value, either way).
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import Any, Optional

import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_elixir.planner import OffloadSettings, PlanningResult, plan_for_trainer
from lightning_elixir.recovery import OutOfMemoryRecovery
from lightning_elixir.runtime import collectives
from lightning_elixir.runtime.phases import PHASES
from lightning_elixir.search.calibrate import Decision, SelfCorrection, StepMeasurement, reconsider
from lightning_elixir.search.report import format_bytes, format_ms


BETWEEN_BACKWARD_AND_STEP = ("backward", "on_after_backward", "on_before_optimizer_step",
                             "configure_gradient_clipping", "optimizer_step")
"""LightningModule hooks that run between a backward and its optimizer step, around both, or run the
backward itself (``retain_graph``: a second backward would read parameters already updated)."""


def _optimizer_price(options: Any) -> str:
    """What the search priced the optimizer at, for the console line."""
    text = f"; optimizer state priced at {options.optimizer_bytes_per_numel} B per element"
    if options.whole_state_bytes_per_numel:
        text += f" sharded and {options.whole_state_bytes_per_numel} B held whole"
    if options.step_gather_bytes_per_numel:
        text += f", {options.step_gather_bytes_per_numel} B per element of a chunk gathered at the step"
    return text


def updates_start_in_backward(module: Any, wanted: Optional[bool], accelerator: bool, fp16_scaler: bool,
                              gradient_clip_val: Any, callbacks: Any = ()) -> bool:
    """Whether offloaded updates start in the backward that ends an accumulation, as far as the
    configuration tells before fit ([Note: updates started in backward] in runtime/offload.py): asked
    for (``wanted``; None: on an accelerator), and nothing between backward and step can change them
    (automatic optimization, no fp16 loss scaling, no clipping, none of those hooks overridden by the
    module or a callback). The strategy applies it at every backward, and the search prices for it."""
    if not (accelerator if wanted is None else wanted):
        return False
    if not module.automatic_optimization or fp16_scaler or gradient_clip_val:
        return False
    if any(is_overridden(name, module) for name in BETWEEN_BACKWARD_AND_STEP):
        return False
    return not any(is_overridden(name, callback, Callback) for callback in callbacks
                   for name in ("on_after_backward", "on_before_optimizer_step"))


class AutoPlanner:
    """Plans, reconsiders and shrinks plan="auto" for one strategy ([Note: one owner of the plan])."""

    def __init__(self, correction: Optional[SelfCorrection], recovery: Optional[OutOfMemoryRecovery]) -> None:
        self.correction = correction
        """None: the first plan runs throughout."""
        self.recovery = recovery
        """None: an out-of-memory error propagates."""
        self.planning: Optional[PlanningResult] = None
        """The search's view of the running plan (None before planning)."""
        self.decision: Optional[Decision] = None
        """What the self-correction concluded (None until it ran)."""
        self._samples: list[list[float]] = []

    @property
    def searched(self) -> bool:
        """Whether the running plan came from the search (not the untraced fallback)."""
        return self.planning is not None and self.planning.report is not None and self.planning.model_profile is not None

    def plan(self, trainer: Any, strategy: Any) -> PlanningResult:
        """Profile, search and agree on the plan for the stage ``trainer`` runs (every rank calls this)."""
        precision = strategy.precision_plugin
        given = strategy.hardware_profile is not None
        rank_zero_info("Elixir: planning — " + ("reading the given hardware profile" if given else
                       "measuring this machine (collectives, optimizer speed; cached after the first run)")
                       + ", then tracing one step on fake tensors and searching")
        self.planning = plan_for_trainer(
            strategy.model, trainer, device=strategy.root_device, group=strategy._group(),
            compute_dtype=precision.compute_dtype, autocast_dtype=precision.autocast_dtype,
            memory_limit=strategy.device_memory_limit, local_world_size=strategy.num_processes,
            hardware=strategy.hardware_profile, private_params=strategy.private_params,
            offload=OffloadSettings(nvme_path=strategy.nvme_path, host_memory_limit=strategy.host_memory_limit,
                                    updates_in_backward=strategy.updates_will_start_in_backward()),
            configured=strategy.configured_for_planning())
        rank_zero_info(progress_lines(self.planning))
        return self.planning

    def switched(self, plan: Any, budget_bytes: Optional[int] = None, **profiles: Any) -> None:
        """The strategy now runs ``plan`` (searched for ``budget_bytes``, on ``profiles`` when given; else on
        the variant traced with its recomputation, [Note: recomputation variants])."""
        if self.planning is None:
            return
        if budget_bytes is not None:
            profiles["budget_bytes"] = budget_bytes
        self.planning = self.planning.switched_to(plan, **profiles)
        self._samples = []  # steps of the old plan say nothing about the new one

    # ---- self-correction -----------------------------------------------------------------------

    @property
    def may_replan(self) -> bool:
        return self.correction is not None and self.searched and self.decision is None

    def observe(self, strategy: Any, sample: list[float]) -> Optional[Decision]:
        """One measured training step ([step_s, *phase waits, peak, reserved]); after enough of them, the
        self-correction's decision (every rank), applied: a switch goes through ``strategy.switch_plan``."""
        if not self.may_replan:
            return None
        assert self.correction is not None and self.planning is not None
        self._samples.append(sample)
        if len(self._samples) < self.correction.calibration_steps:
            return None
        planning = self.planning
        measured = _slowest_rank(self._samples, strategy.runtime)
        self._samples = []
        decision = reconsider(strategy.runtime.plan, planning.model_profile, planning.hardware_profile,
                              planning.budget_bytes, planning.options, measured, self.correction.threshold,
                              self.correction.margin, variants=planning.searchable)
        plan = strategy.broadcast(decision.plan)  # rank 0's conclusion, on every rank
        self.decision = decision = dataclasses.replace(decision, plan=plan)
        if plan is not None:
            calibration, report = decision.calibration, decision.report
            assert calibration is not None and report is not None
            strategy.switch_plan(plan)
            # the plan was searched on calibrated profiles: so are the searches after it
            self.switched(plan, report=report, hardware_profile=calibration.hardware,
                          variants=calibration.variants(planning.searchable))
        return decision


def progress_lines(planning: PlanningResult) -> str:
    """A few readable lines: what was measured and how long it took, the plan, its prediction."""
    took = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in planning.seconds.items())
    hw = planning.hardware_profile
    lines = [f"Elixir: planned in {sum(planning.seconds.values()):.1f} s ({took}); machine: {hw.device_name}, "
             f"{hw.world_size} rank(s)"]
    report = planning.report
    if report is None:
        lines.append(f"Elixir: the step could not be traced ({planning.fallback_reason}); running the fallback plan")
        return "\n".join(lines)
    w = report.winner
    lines.append(f"Elixir: chose {w.describe()}")
    lines.append(f"Elixir: predicted step {format_ms(w.step_s)} (lower bound {format_ms(report.lower_bound_s)}, "
                 f"{report.lower_bound_reason}); peak {format_bytes(w.peak_bytes)} of "
                 f"{format_bytes(report.budget_bytes)} budget per rank; {report.placement_summary()}"
                 + (_optimizer_price(planning.options) if planning.options is not None else ""))
    lines += [f"Elixir: {note}" for note in planning.notes if note.startswith("recomputing")]
    return "\n".join(lines)


def _slowest_rank(samples: list[list[float]], runtime: Any) -> StepMeasurement:
    """The median of each measured column over the steps, the largest over ranks."""
    steps = [sample[0] for sample in samples]
    spread = (max(steps) - min(steps)) / statistics.median(steps) if statistics.median(steps) > 0 else 0.0
    medians = torch.tensor([statistics.median(column) for column in zip(*samples)] + [spread], dtype=torch.float64,
                           device=runtime.device)
    step_s, *waits, peak, reserved, spread = collectives.all_reduce_max(medians, runtime.group).tolist()
    phases = dict(zip(PHASES, waits))
    return StepMeasurement(step_s, gather_wait_s=phases["gather_wait"], reduce_wait_s=phases["reduce_wait"],
                           offload_wait_s=phases["offload_wait"], optimizer_s=phases["optimizer"],
                           spread=spread, peak_bytes=int(peak) if peak >= 0 else None,
                           reserved_bytes=int(reserved) if reserved >= 0 else None)
