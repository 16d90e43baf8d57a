"""Self-correction: fit the cost model to a few measured steps, and decide whether another plan is faster.

[Note: self-correction]
The search predicts from a profile measured in seconds before the run. After a short warm-up the
run knows the truth for the plan it runs: the step time, and in it the waits for gathers and
reduce-scatters (on a GPU, the stream's: [Note: phases timed on the device] in runtime/phases.py),
for offloaded updates and the optimizer. ``reconsider``
compares that with the prediction. Within ``threshold`` it changes nothing. Beyond it, ``calibrate``
fits three factors so that the running plan's prediction matches what was measured:

- compute: measured compute (the step less every wait and the optimizer) over the predicted
  compute plus contention; every access's compute time is scaled by it (the roofline misses
  kernel efficiency, dispatch and hook overhead; one factor is what one plan's step identifies);
- collectives: the bandwidth factor whose predicted exposed wait (forward/backward less compute
  and contention) matches the measured waits, found by bisection on the log of the factor, the
  one nearest 1 within tolerance (a wait that is all hidden identifies only a lower bound, so it
  moves no further than it must); bandwidths and latency move together;
- updates: on a GPU, two factors. The device optimizer's speed is scaled by the measured over the
  predicted optimizer step. The host's update speed is the factor nearest 1 whose predicted exposed
  host work matches the measured waits for offloaded updates (bisection, as for the collectives):
  the host and the device are different machines, and a host slower than measured before the run
  (the update's worker thread contending with the main thread, say) is what makes an offloading
  plan slow, so it must make offloading look slower, not the whole optimizer. On a CPU-only machine
  the host is the device and its updates run inside the step: one factor, measured optimizer step
  and offload waits over predicted device optimizer and exposed host work, scales both speeds; so
  it does where the running plan offloads nothing (no wait tells the host's speed, and a slower
  device optimizer must not make offloading look faster than it was planned).

With a measured device peak (CUDA), the activations are scaled so that the predicted peak
matches it. The search then runs again on the calibrated profiles and the budget of the first
search. It switches only when the new winner is a different plan predicted faster than the running
plan, under the same calibrated model, by ``margin``: both predictions carry the same errors, so
the comparison is fairer than either number, and a small gain is not worth the risk of a wrong one.
The factors are clamped to [1/100, 100]. A measurement that needs a factor at its limit, or whose
steps varied by more than their median, is not calibrated from ("noisy"): a step of a few
milliseconds on a shared CPU is mostly noise, and factors printed at their clamp explain nothing.

[Note: memory in the self-correction]
On a GPU the budget is not all the plan's: the caching allocator reserves more than the peak it
hands out (blocks cached for reuse, fragmentation), and that share is lost to any plan. A switch
once chose a plan predicted at the budget's edge that then ran out of memory in the loss. So with a
measured peak, the search runs on the budget less what the allocator reserved beyond its peak, on
profiles whose activations match the measured peak: no plan it may switch to is predicted above the
running plan's measured peak plus the budget's real headroom (budget less reserved). When nothing
fits that, it keeps the running plan and says that memory is why ("no-fit"). Without a
measurement (the CPU) the budget is the first search's.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Callable, Optional

from lightning_elixir.plan import ElixirPlan
from lightning_elixir.profile.types import HardwareProfile, ModelProfile
from lightning_elixir.search.cost import CostBreakdown, hides_host_work
from lightning_elixir.search.errors import NoPlanFitsError
from lightning_elixir.search.evaluate import evaluate_plan
from lightning_elixir.search.options import SearchOptions
from lightning_elixir.search.report import SearchReport, format_bytes, format_ms
from lightning_elixir.search.variants import Variant, search_variants

FACTOR_LIMIT = 100.0
NOISY = 1.0
"""Steps that vary by more than this fraction of their median are not calibrated from."""


@dataclass(frozen=True)
class SelfCorrection:
    """When and how plan="auto" reconsiders its plan after the first steps ([Note: self-correction]).

    Args:
        calibration_steps: Training steps, after the first, whose median is compared with the
            prediction; the self-correction decides after them. More steps: a steadier measurement,
            a later switch.
        threshold: How far (a fraction) the measured step may be from the prediction before the cost
            model is calibrated and the search runs again.
        margin: How much faster (a fraction) the calibrated search's plan must be predicted than the
            running one for a switch.
    """

    calibration_steps: int = 4
    threshold: float = 0.15
    margin: float = 0.1

    def __post_init__(self) -> None:
        if isinstance(self.calibration_steps, bool) or not isinstance(self.calibration_steps, int) \
                or self.calibration_steps < 1:
            raise ValueError(f"calibration_steps must be a positive int, got {self.calibration_steps!r}")
        for name in ("threshold", "margin"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
                raise ValueError(f"{name} must be a fraction in [0, 1), got {value!r}")


@dataclass(frozen=True)
class StepMeasurement:
    """What a few real steps of one plan took (median step of the slowest rank), in seconds."""

    step_s: float
    """Wall time of one optimizer step."""
    gather_wait_s: float = 0.0
    """Host waits for all-gathers."""
    reduce_wait_s: float = 0.0
    """Host waits for reduce-scatters."""
    offload_wait_s: float = 0.0
    """Host waits for offloaded updates."""
    optimizer_s: float = 0.0
    """The optimizer step."""
    peak_bytes: Optional[int] = None
    """Device memory peak of a step (the CUDA allocator's allocated bytes), when measured."""
    spread: float = 0.0
    """How much the measured steps varied: (slowest - fastest) / median step, 0 when unknown."""
    reserved_bytes: Optional[int] = None
    """The allocator's reserved peak (allocated plus what it caches and loses to fragmentation), when measured."""

    def __post_init__(self) -> None:
        times = (self.step_s, self.gather_wait_s, self.reduce_wait_s, self.offload_wait_s, self.optimizer_s)
        if not all(math.isfinite(t) and t >= 0 for t in times) or self.step_s <= 0:
            raise ValueError(f"a step measurement needs finite times >= 0 and a positive step, got {times}")

    @property
    def allocator_overhead_bytes(self) -> int:
        """What the allocator reserved beyond the peak it handed out: memory no plan's tensors can use."""
        if self.peak_bytes is None or self.reserved_bytes is None:
            return 0
        return max(self.reserved_bytes - self.peak_bytes, 0)

    @property
    def wait_s(self) -> float:
        """Exposed communication: the waits for gathers and reduce-scatters."""
        return self.gather_wait_s + self.reduce_wait_s

    @property
    def compute_s(self) -> float:
        """The step less every wait and the optimizer (what the step spent computing, hooks included)."""
        return max(self.step_s - self.wait_s - self.offload_wait_s - self.optimizer_s, 0.0)


@dataclass(frozen=True)
class Calibration:
    """Profiles corrected so that the running plan's prediction matches a measurement."""

    model: ModelProfile
    hardware: HardwareProfile
    compute_scale: float
    """Measured over predicted compute (every access's compute time is multiplied by it)."""
    bandwidth_scale: float
    """Collective bandwidths are multiplied by it (latency divided)."""
    optimizer_scale: float
    """Measured over predicted device optimizer time (its speed is divided by it; on a CPU-only machine
    the offloaded updates' too, as ``host_update_scale``)."""
    host_update_scale: float
    """How many times longer offloaded updates take than the profile said (the host optimizer's speed is
    divided by it); ``optimizer_scale`` where the host is the device or the running plan offloads nothing."""
    activation_scale: float
    """Activation bytes are multiplied by it (1 without a measured peak)."""
    before: CostBreakdown
    """The running plan, predicted with the profiles planning used."""
    after: CostBreakdown
    """The running plan, predicted with the calibrated profiles."""

    def applied(self, model: ModelProfile) -> ModelProfile:
        """Another trace of the step (a recomputation variant) corrected as the running plan's was."""
        return scale_compute(scale_activations(model, self.activation_scale), self.compute_scale)

    def variants(self, variants: Sequence[Variant]) -> tuple[Variant, ...]:
        """``variants`` corrected as the running plan's profile was ([Note: recomputation variants])."""
        return tuple(Variant(v.recompute, self.applied(v.profile)) for v in variants)


@dataclass(frozen=True)
class Decision:
    """What ``reconsider`` concluded."""

    measured: StepMeasurement
    predicted_s: float
    """The running plan's predicted step (planning's profiles)."""
    predicted_peak_bytes: int
    """The running plan's predicted device peak."""
    calibration: Optional[Calibration]
    """None when the prediction was within the threshold."""
    outcome: str = "within"
    """"within" (the prediction was close enough), "same" (the calibrated search picks the running plan
    again), "margin" (another plan, not faster by the margin), "no-fit" (nothing fits the calibrated
    model; with a measured peak, within the memory the allocator leaves), "noisy" (the steps were too
    short or too noisy to calibrate from) or "switch"."""
    plan: Optional[ElixirPlan] = None
    """The plan to switch to; None to keep the running one."""
    report: Optional[SearchReport] = None
    """The search on the calibrated profiles (None when it did not run)."""
    reason: str = ""
    """One line: why it switches or keeps the plan."""

    @property
    def error(self) -> float:
        """Measured over predicted step time."""
        return self.measured.step_s / self.predicted_s if self.predicted_s > 0 else float("inf")


def calibrate(plan: ElixirPlan, model: ModelProfile, hardware: HardwareProfile, options: SearchOptions,
              measured: StepMeasurement, rounds: int = 3) -> Calibration:
    """Fit compute, collective and update factors so that ``plan`` is predicted as measured ([Note: self-correction]).

    The factors interact (faster collectives move when offloaded updates must be done), so they are
    fitted in turn for a few ``rounds``, each from the original profiles.
    """
    before = evaluate_plan(plan, model, hardware, options)
    activation_scale = 1.0
    if measured.peak_bytes is not None and before.memory.activation_bytes > before.memory.step_gather_bytes:
        rest = before.memory.peak_bytes - before.memory.activation_bytes
        activation_scale = _clamp(_ratio(measured.peak_bytes - rest, before.memory.activation_bytes))
        model = scale_activations(model, activation_scale)
    compute, bandwidth, optimizer, host = 1.0, 1.0, 1.0, 1.0
    separate_host = hides_host_work(hardware) and plan.offloads
    tolerance = 0.02 * measured.step_s + 1e-4

    def profiles(compute: float, bandwidth: float, optimizer: float,
                 host: float) -> tuple[ModelProfile, HardwareProfile]:
        return scale_compute(model, compute), scale_updates(scale_collectives(hardware, bandwidth), optimizer, host)

    def wait_at(scale: float) -> float:
        c = evaluate_plan(plan, *profiles(compute, scale, optimizer, host), options).cost
        return max(c.forward_backward_s - c.compute_s - c.contention_s, 0.0)

    def offload_wait_at(speed: float) -> float:  # non-increasing in the host's speed
        c = evaluate_plan(plan, *profiles(compute, bandwidth, optimizer, 1.0 / speed), options).cost
        return c.exposed_host_s + c.exposed_copy_s

    for _ in range(rounds):
        cost = evaluate_plan(plan, *profiles(compute, bandwidth, optimizer, host), options).cost
        compute = _clamp(compute * _ratio(measured.compute_s, cost.compute_s + cost.contention_s))
        if separate_host:
            optimizer = _clamp(optimizer * _ratio(measured.optimizer_s, cost.device_optimizer_s))
            host = 1.0 / _fit_scale(offload_wait_at, measured.offload_wait_s, tolerance)
        else:  # the host is the device, or nothing offloaded tells the host's speed: one factor for both
            updates_s = cost.device_optimizer_s + cost.exposed_host_s + cost.exposed_copy_s
            optimizer = host = _clamp(optimizer * _ratio(measured.optimizer_s + measured.offload_wait_s, updates_s))
        bandwidth = _fit_scale(wait_at, measured.wait_s, tolerance)
    model, hardware = profiles(compute, bandwidth, optimizer, host)
    after = evaluate_plan(plan, model, hardware, options).cost
    return Calibration(model, hardware, compute, bandwidth, optimizer, host, activation_scale, before.cost, after)


def reconsider(plan: ElixirPlan, model: ModelProfile, hardware: HardwareProfile, budget_bytes: int,
               options: SearchOptions, measured: StepMeasurement, threshold: float = 0.15,
               margin: float = 0.1, variants: Sequence[Variant] = ()) -> Decision:
    """Compare ``measured`` with ``plan``'s prediction; beyond ``threshold``, calibrate, search again,
    and name a plan to switch to when one is predicted faster by ``margin`` ([Note: self-correction]).

    ``model`` is the step traced with ``plan``'s blocks recomputing; ``variants``, with others, which the
    search weighs again, corrected alike ([Note: recomputation variants]); none: ``model`` alone."""
    predicted = evaluate_plan(plan, model, hardware, options)
    step_s, peak = predicted.cost.step_s, predicted.memory.peak_bytes
    error = measured.step_s / step_s - 1.0 if step_s > 0 else float("inf")
    memory_error = 0.0 if measured.peak_bytes is None else measured.peak_bytes / max(peak, 1) - 1.0
    if abs(error) <= threshold and memory_error <= threshold:
        return Decision(measured, step_s, peak, None,
                        reason=f"measured {format_ms(measured.step_s)} per step, predicted {format_ms(step_s)} "
                               f"({error:+.0%}, within {threshold:.0%}): keeping the plan")
    if measured.spread > NOISY:
        reason = (f"measured {format_ms(measured.step_s)} per step, predicted {format_ms(step_s)} ({error:+.0%}), "
                  f"but the steps varied by {measured.spread:.0%} of their median: too noisy to calibrate from, "
                  "keeping the plan")
        return Decision(measured, step_s, peak, None, "noisy", reason=reason)
    calibration = calibrate(plan, model, hardware, options, measured)
    clamped = [name for name, f in (("compute", calibration.compute_scale), ("bandwidth", calibration.bandwidth_scale),
                                    ("optimizer", calibration.optimizer_scale),
                                    ("host updates", calibration.host_update_scale))
               if f >= FACTOR_LIMIT or f <= 1.0 / FACTOR_LIMIT]
    if clamped:
        reason = (f"measured {format_ms(measured.step_s)} per step, predicted {format_ms(step_s)} ({error:+.0%}); "
                  f"no correction of the {' and '.join(clamped)} within {FACTOR_LIMIT:.0f}x explains it: the step is "
                  "too short or too noisy to calibrate from, keeping the plan")
        return Decision(measured, step_s, peak, None, "noisy", reason=reason)
    factors = (f"calibrated compute x{calibration.compute_scale:.2f}, collectives' bandwidth "
               f"x{calibration.bandwidth_scale:.2f}, optimizer x{calibration.optimizer_scale:.2f}"
               + (f", host updates x{calibration.host_update_scale:.2f}"
                  if calibration.host_update_scale != calibration.optimizer_scale else ""))
    start = (f"measured {format_ms(measured.step_s)} per step, predicted {format_ms(step_s)} ({error:+.0%}); "
             f"{factors}")
    overhead = measured.allocator_overhead_bytes
    usable = budget_bytes - overhead  # [Note: memory in the self-correction]
    within = (f" within the {format_bytes(usable)} the allocator leaves of the {format_bytes(budget_bytes)} budget "
              f"(it reserved {format_bytes(overhead)} beyond its peak)" if overhead else "")
    try:
        found = search_variants(calibration.variants(variants) or (Variant(plan.recompute, calibration.model),),
                                calibration.hardware, usable, options)
        best, report = found.plan, found.report
    except NoPlanFitsError as err:
        reason = (f"{start}; no plan fits the calibrated model{within} ({str(err).splitlines()[0]}): "
                  "keeping the plan")
        return Decision(measured, step_s, peak, calibration, "no-fit", reason=reason)
    running = calibration.after.step_s
    if _same_plan(best, report.winner.cache_blocks, plan, predicted.sim.cache_blocks):
        reason = f"{start}; the search picks the running plan again: keeping it"
        return Decision(measured, step_s, peak, calibration, "same", report=report, reason=reason)
    gain = 1.0 - report.winner.step_s / running if running > 0 else 0.0
    if gain < margin:
        reason = (f"{start}; best other plan {format_ms(report.winner.step_s)} vs {format_ms(running)} for the "
                  f"running one (calibrated), {gain:.0%} faster, under the {margin:.0%} margin: keeping the plan")
        return Decision(measured, step_s, peak, calibration, "margin", report=report, reason=reason)
    recomputing = (f", recomputing {len(best.recompute)} blocks (instead of {len(plan.recompute)})"
                   if tuple(best.recompute) != tuple(plan.recompute) else "")
    reason = (f"{start}; switching to {report.winner.describe()}{recomputing}: predicted "
              f"{format_ms(report.winner.step_s)} vs {format_ms(running)} for the running plan (calibrated), "
              f"{gain:.0%} faster")
    return Decision(measured, step_s, peak, calibration, "switch", plan=best, report=report, reason=reason)


def scale_compute(model: ModelProfile, scale: float) -> ModelProfile:
    """``model`` with every compute time multiplied by ``scale``."""
    if scale == 1.0:
        return model
    accesses = tuple(dataclasses.replace(a, compute_s=a.compute_s * scale) for a in model.accesses)
    return dataclasses.replace(model, accesses=accesses, forward_compute_s=model.forward_compute_s * scale,
                               backward_compute_s=model.backward_compute_s * scale)


def scale_activations(model: ModelProfile, scale: float) -> ModelProfile:
    """``model`` with every activation byte count multiplied by ``scale``."""
    if scale == 1.0:
        return model
    accesses = tuple(dataclasses.replace(a, live_bytes=int(a.live_bytes * scale), peak_bytes=int(a.peak_bytes * scale))
                     for a in model.accesses)
    return dataclasses.replace(model, accesses=accesses, forward_peak_bytes=int(model.forward_peak_bytes * scale),
                               backward_peak_bytes=int(model.backward_peak_bytes * scale))


def scale_collectives(hardware: HardwareProfile, scale: float) -> HardwareProfile:
    """``hardware`` with collective bandwidths multiplied by ``scale`` and their latency divided by it."""
    if scale == 1.0:
        return hardware
    return dataclasses.replace(
        hardware, collective_latency_s=hardware.collective_latency_s / scale,
        all_gather_bytes_per_s=tuple((b, bw * scale) for b, bw in hardware.all_gather_bytes_per_s),
        reduce_scatter_bytes_per_s=tuple((b, bw * scale) for b, bw in hardware.reduce_scatter_bytes_per_s))


def scale_updates(hardware: HardwareProfile, scale: float, host_scale: Optional[float] = None) -> HardwareProfile:
    """``hardware`` with the device optimizer's speed divided by ``scale`` and the host's by ``host_scale``
    (default ``scale``): updates take that many times as long."""
    host_scale = scale if host_scale is None else host_scale
    if scale == 1.0 and host_scale == 1.0:
        return hardware
    return dataclasses.replace(hardware, optimizer_device_numel_per_s=hardware.optimizer_device_numel_per_s / scale,
                               optimizer_cpu_numel_per_s=hardware.optimizer_cpu_numel_per_s / host_scale)


def _fit_scale(predict: Callable[[float], float], target: float, tolerance: float, steps: int = 30) -> float:
    """The factor nearest 1 whose ``predict`` (non-increasing in it) is within ``tolerance`` of ``target``."""
    if abs(predict(1.0) - target) <= tolerance:
        return 1.0
    faster = predict(1.0) > target  # less wait measured: the factor is above 1
    limit = FACTOR_LIMIT if faster else 1.0 / FACTOR_LIMIT
    if (predict(limit) > target + tolerance) if faster else (predict(limit) < target - tolerance):
        return limit
    near, far = 0.0, math.log(limit)  # in log space: |near| grows toward far until within tolerance
    for _ in range(steps):
        mid = (near + far) / 2
        value = predict(math.exp(mid))
        reached = value <= target + tolerance if faster else value >= target - tolerance
        near, far = (near, mid) if reached else (mid, far)
    return math.exp(far)


def _same_plan(a: ElixirPlan, a_blocks: int, b: ElixirPlan, b_blocks: int) -> bool:
    """Whether two plans run the same way: same chunks (or packing), prefetch, cache blocks (with
    "min"/"all" resolved to counts, ``*_blocks``) and recomputation."""
    same_layout = a.chunks == b.chunks if a.chunks and b.chunks else a.chunk_numel == b.chunk_numel
    return same_layout and a.prefetch_depth == b.prefetch_depth and a_blocks == b_blocks \
        and tuple(a.recompute) == tuple(b.recompute)


def _ratio(measured: float, predicted: float) -> float:
    return measured / predicted if predicted > 0 and measured > 0 else 1.0


def _clamp(factor: float) -> float:
    return min(max(factor, 1.0 / FACTOR_LIMIT), FACTOR_LIMIT)
