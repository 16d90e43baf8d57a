"""Predict the step time and memory of a given plan (a fixed preset, a user's plan, or the winner)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from lightning_elixir.plan import ElixirPlan, PlanError, stays_gathered
from lightning_elixir.profile.types import HardwareProfile, ModelProfile
from lightning_elixir.search.cost import (CostBreakdown, access_compute_s, chunk_times, hides_host_work, placement_cost,
                                          reduce_schedule, step_cost, timeline)
from lightning_elixir.search.layout import Layout, access_chunks, layout_from_plan
from lightning_elixir.search.memory import MemoryBreakdown, memory_breakdown
from lightning_elixir.search.options import SearchOptions, dtype_bytes
from lightning_elixir.search.simulate import SimResult, resolve_cache_blocks, simulate


@dataclass(frozen=True)
class PlanPrediction:
    """What the models predict for one plan."""

    cost: CostBreakdown
    """Predicted seconds of one optimizer step."""
    memory: MemoryBreakdown
    """Predicted memory of one rank."""
    sim: SimResult
    """The gathers of one step."""


def evaluate_plan(
    plan: ElixirPlan,
    model: ModelProfile,
    hardware: HardwareProfile,
    options: SearchOptions = SearchOptions(),
) -> PlanPrediction:
    """Predict a plan's step time and device peak with the search's own models.

    Args:
        plan: the plan; without explicit chunks it is packed in first-use order from ``chunk_numel``
            at ``options.world_size``. Gradients reduce in fp32 where both its ``reduce_in_fp32`` and the
            options' say so.
        model: the profile.
        hardware: the measured hardware.
        options: world size, micro-batches, state sizes and margins.

    Returns:
        The predicted cost, memory and gathers.
    """
    layout, options = plan_layout(plan, model, options)
    needs = access_chunks(layout, model)
    blocks = resolve_cache_blocks(plan.cache_blocks, needs, len(layout.public))
    m = options.micro_batches
    placements = tuple(spec.placement for spec in layout.chunks)
    resident = stays_gathered(blocks, len(layout.public), any(p != "device" for p in placements), layout.world_size)
    sim = simulate(layout, needs, blocks, plan.prefetch_depth, m, dtype_bytes(model.compute_dtype), resident)
    times = chunk_times(layout, model, hardware, options)
    tl = timeline(layout, needs * m, sim, access_compute_s(model) * m, reduce_schedule(layout, model, m), times,
                  hardware.comm_overlap)
    cost = step_cost(tl, times, placement_cost(times, placements, m), hides_host_work(hardware),
                     options.updates_in_backward)
    return PlanPrediction(cost, memory_breakdown(layout, model, blocks, placements, options), sim)


def plan_layout(plan: ElixirPlan, model: ModelProfile, options: SearchOptions) -> tuple[Layout, SearchOptions]:
    """The layout ``plan`` runs with at ``options.world_size``, and the options with its reduce dtype.

    Raises:
        PlanError: when the plan was built for another world size or does not match the model.
    """
    if plan.world_size is not None and plan.world_size != options.world_size:
        raise PlanError(f"the plan was built for world size {plan.world_size}, not {options.world_size}")
    # As the runtime's policy: fp32 reduction only where both the plan and the precision ask for it.
    options = dataclasses.replace(options, reduce_in_fp32=options.reduce_in_fp32 and plan.reduce_in_fp32)
    return layout_from_plan(dataclasses.replace(plan, world_size=options.world_size), model), options
