"""Self-correction (search/calibrate.py): a measurement of the running plan corrects the profiles,
and a plan predicted from a wrong profile is replaced by the one the true profile gives."""

from __future__ import annotations

import dataclasses
import math

import pytest

from lightning_elixir.search import SearchOptions, evaluate_plan, search
from lightning_elixir.search.calibrate import (StepMeasurement, _fit_scale, calibrate, reconsider, scale_collectives,
                                               scale_compute)
from tests.search.profiles import GiB, gpt_profile, hardware

SLOW = ((1 << 20, 2e9), (1 << 26, 1.5e10), (1 << 30, 2e10))
TRUE = hardware(all_gather_bytes_per_s=SLOW, reduce_scatter_bytes_per_s=SLOW)
# The fastest prediction wins (plans follow the profile); the budgets below were chosen under a 5% margin.
OPTIONS = SearchOptions(world_size=8, min_offload_gain=0.0, margin_fraction=0.05)
MODEL = gpt_profile(2048, 8, seq=1024, batch=4)


def measure(plan, model=MODEL, truth=TRUE) -> StepMeasurement:
    """What running ``plan`` on the true machine would measure."""
    c = evaluate_plan(plan, model, truth, OPTIONS).cost
    return StepMeasurement(c.step_s, gather_wait_s=c.forward_backward_s - c.compute_s - c.contention_s,
                           offload_wait_s=c.exposed_host_s + c.exposed_copy_s, optimizer_s=c.device_optimizer_s)


def test_ten_times_wrong_bandwidth_switches_to_the_true_profiles_plan():
    wrong = scale_collectives(TRUE, 10.0)
    budget = 4 * GiB
    running, _ = search(MODEL, wrong, budget, OPTIONS)
    best, best_report = search(MODEL, TRUE, budget, OPTIONS)
    assert running.chunks != best.chunks  # the wrong profile chose another plan
    decision = reconsider(running, MODEL, wrong, budget, OPTIONS, measure(running))
    assert decision.calibration is not None
    assert decision.calibration.bandwidth_scale == pytest.approx(0.1, rel=0.05)
    assert decision.calibration.compute_scale == pytest.approx(1.0, rel=0.02)
    assert decision.plan is not None and decision.outcome == "switch"
    assert decision.plan.chunks == best.chunks and decision.plan.cache_blocks == best.cache_blocks
    # calibrated, the new prediction of the running plan is what was measured
    assert decision.calibration.after.step_s == pytest.approx(measure(running).step_s, rel=0.03)


def test_accurate_prediction_keeps_the_plan_without_searching():
    plan, _ = search(MODEL, TRUE, 4 * GiB, OPTIONS)
    decision = reconsider(plan, MODEL, TRUE, 4 * GiB, OPTIONS, measure(plan))
    assert decision.plan is None and decision.calibration is None and decision.report is None
    assert decision.outcome == "within"
    assert decision.error == pytest.approx(1.0)


def test_a_small_gain_is_not_worth_a_switch():
    wrong = scale_collectives(TRUE, 10.0)
    running, _ = search(MODEL, wrong, 8 * GiB, OPTIONS)
    decision = reconsider(running, MODEL, wrong, 8 * GiB, OPTIONS, measure(running), margin=0.1)
    assert decision.calibration is not None and decision.plan is None
    assert decision.outcome in ("margin", "same")


def test_slower_compute_is_calibrated_as_compute():
    plan, _ = search(MODEL, TRUE, 8 * GiB, OPTIONS)
    slow = scale_compute(MODEL, 2.0)
    cal = calibrate(plan, MODEL, TRUE, OPTIONS, measure(plan, model=slow))
    assert cal.compute_scale == pytest.approx(2.0, rel=0.05)
    assert cal.bandwidth_scale == pytest.approx(1.0, rel=0.05)
    assert cal.after.step_s == pytest.approx(measure(plan, model=slow).step_s, rel=0.03)


def test_measured_peak_scales_activations():
    plan, _ = search(MODEL, TRUE, 8 * GiB, OPTIONS)
    predicted = evaluate_plan(plan, MODEL, TRUE, OPTIONS)
    peak = predicted.memory.peak_bytes + predicted.memory.activation_bytes  # twice the activations
    decision = reconsider(plan, MODEL, TRUE, 8 * GiB, OPTIONS, dataclasses.replace(measure(plan), peak_bytes=peak))
    assert decision.calibration is not None
    assert decision.calibration.activation_scale == pytest.approx(2.0, rel=0.01)


def test_fit_scale_takes_the_factor_nearest_one():
    def wait(scale: float) -> float:  # 1 s of communication, of which 0.5 s hides
        return max(1.0 / scale - 0.5, 0.0)

    assert _fit_scale(wait, 0.5, tolerance=1e-3) == 1.0
    assert _fit_scale(wait, 1.5, tolerance=1e-4) == pytest.approx(0.5, rel=1e-3)
    # all hidden identifies only a lower bound: the smallest factor that hides it all
    assert _fit_scale(wait, 0.0, tolerance=1e-4) == pytest.approx(2.0, rel=1e-3)
    assert _fit_scale(wait, 1e9, tolerance=1e-4) == pytest.approx(0.01)


def test_measurement_is_checked():
    with pytest.raises(ValueError):
        StepMeasurement(0.0)
    with pytest.raises(ValueError):
        StepMeasurement(1.0, gather_wait_s=math.nan)
    assert StepMeasurement(1.0, gather_wait_s=0.2, reduce_wait_s=0.1, optimizer_s=0.3).compute_s == pytest.approx(0.4)


def test_a_slow_host_moves_offloaded_state_back_to_the_device():
    """On a GPU the host's update speed is fitted to the measured waits for offloaded updates, apart from
    the device optimizer's: a plan that offloaded for speed, slow because the host updates 100x slower
    than its profile said, is replaced by one that keeps more of its state on the device."""
    believed = dataclasses.replace(TRUE, optimizer_device_numel_per_s=1e9, optimizer_cpu_numel_per_s=1e10)
    truth = dataclasses.replace(believed, optimizer_cpu_numel_per_s=1e8)
    budget = 8 * GiB
    running, _ = search(MODEL, believed, budget, OPTIONS)
    offloaded = sum(c.placement != "device" for c in running.chunks)
    assert offloaded  # a fast host and a slow device optimizer: offloading was predicted faster
    measured = measure(running, truth=truth)
    assert measured.offload_wait_s > 0.1 * measured.step_s
    decision = reconsider(running, MODEL, believed, budget, OPTIONS, measured)
    assert decision.calibration is not None
    assert decision.calibration.host_update_scale == pytest.approx(100.0, rel=0.2)
    assert decision.calibration.optimizer_scale == pytest.approx(1.0, rel=0.05)
    assert decision.outcome == "switch" and decision.plan is not None
    assert sum(c.placement != "device" for c in decision.plan.chunks) < offloaded
    assert "host updates x" in decision.reason


def test_the_switch_searches_within_what_the_allocator_leaves():
    """[Note: memory in the self-correction]: the allocator reserved 1 GiB beyond its measured peak, so
    the plan switched to is the true profile's best for the budget less that, not for the whole budget."""
    wrong = scale_collectives(TRUE, 10.0)
    budget, overhead = 5 * GiB, 1 * GiB
    running, _ = search(MODEL, wrong, budget, OPTIONS)
    peak = evaluate_plan(running, MODEL, TRUE, OPTIONS).memory.peak_bytes  # the activations as predicted
    measured = dataclasses.replace(measure(running), peak_bytes=peak, reserved_bytes=peak + overhead)
    assert measured.allocator_overhead_bytes == overhead
    decision = reconsider(running, MODEL, wrong, budget, OPTIONS, measured, margin=0.0)
    assert decision.report is not None and decision.report.budget_bytes == budget - overhead
    assert decision.report.winner.peak_bytes <= peak + budget - measured.reserved_bytes
    within, within_report = search(MODEL, TRUE, budget - overhead, OPTIONS)
    whole, whole_report = search(MODEL, TRUE, budget, OPTIONS)
    def shape(c):
        return c.chunks, c.cache_blocks, c.prefetch_depth, c.cpu_chunks, c.nvme_chunks

    assert shape(within_report.winner) != shape(whole_report.winner)  # the overhead matters here
    assert shape(decision.report.winner) == shape(within_report.winner)
    if decision.outcome == "switch":
        assert (decision.plan.chunks, decision.plan.cache_blocks) == (within.chunks, within.cache_blocks)
    else:  # here the running plan, measured to fit, is faster than anything predicted to fit what is left
        assert decision.outcome in ("same", "margin") and decision.plan is None


def test_no_switch_when_nothing_fits_what_the_allocator_leaves():
    wrong = scale_collectives(TRUE, 10.0)
    budget = 4 * GiB
    running, _ = search(MODEL, wrong, budget, OPTIONS)
    peak = evaluate_plan(running, MODEL, TRUE, OPTIONS).memory.peak_bytes
    measured = dataclasses.replace(measure(running), peak_bytes=peak, reserved_bytes=peak + 3 * GiB)
    decision = reconsider(running, MODEL, wrong, budget, OPTIONS, measured)
    assert decision.plan is None and decision.outcome == "no-fit"
    assert "the allocator leaves" in decision.reason and "keeping the plan" in decision.reason


def test_steps_too_noisy_or_too_short_are_not_calibrated_from():
    plan, _ = search(MODEL, TRUE, 8 * GiB, OPTIONS)
    noisy = dataclasses.replace(measure(plan), step_s=measure(plan).step_s * 3, spread=1.5)
    decision = reconsider(plan, MODEL, TRUE, 8 * GiB, OPTIONS, noisy)
    assert decision.outcome == "noisy" and decision.plan is None and decision.calibration is None
    assert "too noisy to calibrate from" in decision.reason
    # a step 50x the prediction, all of it "optimizer": no factor within the limit explains it
    real = measure(plan)
    short = dataclasses.replace(real, step_s=real.step_s * 500, optimizer_s=real.step_s * 499)
    decision = reconsider(plan, MODEL, TRUE, 8 * GiB, OPTIONS, short)
    assert decision.outcome == "noisy" and decision.plan is None
    assert "too short or too noisy to calibrate from" in decision.reason and "x100" not in decision.reason
