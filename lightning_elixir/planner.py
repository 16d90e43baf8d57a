"""plan="auto": profile the model and the machine, then search, before the model is chunked.

The strategy calls ``plan_automatically`` from its ``setup``; the planning callback will take this
over (and log the report and memory timelines). Every rank profiles (the hardware benchmarks are
collective) and searches; rank 0's plan is broadcast so that all ranks run the same one even if
their measurements differ in the last digit.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch
import torch.distributed as dist

from lightning_elixir.plan import ElixirPlan
from lightning_elixir.profile import profile_hardware, profile_model
from lightning_elixir.profile.types import HardwareProfile, ModelProfile
from lightning_elixir.runtime import collectives
from lightning_elixir.runtime.collectives import Group
from lightning_elixir.search import SearchOptions, SearchReport, parse_memory_limit, search

log = logging.getLogger(__name__)

MemoryLimit = Union[int, float, str, None]


@dataclass(frozen=True)
class PlanningResult:
    """What planning produced, kept on the strategy for logging and inspection."""

    plan: ElixirPlan
    """The plan every rank runs (rank 0's)."""
    report: SearchReport
    """Rank 0's search report: top candidates, cost breakdown, lower bound."""
    model_profile: ModelProfile
    """The profile the search planned from."""
    hardware_profile: HardwareProfile
    """The measured (or cached, or user-given) machine."""
    budget_bytes: int
    """Device memory per rank the search planned for."""


def first_batch(trainer: Any) -> Any:
    """One batch of the training data (the profile needs its shapes)."""
    loader = trainer.fit_loop._data_source.dataloader()
    try:
        return next(iter(loader))
    except StopIteration as err:
        raise ValueError("the training dataloader is empty; plan='auto' profiles one batch of it") from err


def device_total_bytes(device: torch.device, local_world_size: int) -> int:
    """Memory of one device, or this process's share of host memory on the CPU."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return host // max(local_world_size, 1)


def budget_bytes(device: torch.device, limit: MemoryLimit, local_world_size: int) -> int:
    """The device memory budget: the device's memory, or ``device_memory_limit`` of it."""
    total = device_total_bytes(device, local_world_size)
    return total if limit is None else parse_memory_limit(limit, total)


def measure_hardware(device: torch.device, group: Group, compute_dtype: torch.dtype,
                     hardware: Optional[Union[HardwareProfile, str]]) -> HardwareProfile:
    """The user's HardwareProfile (object or JSON path), or one measured on this process group."""
    if isinstance(hardware, HardwareProfile):
        return hardware
    if hardware is not None:
        return HardwareProfile.from_json(hardware)
    return profile_hardware(
        device, world_size=group.world_size, compute_dtype=compute_dtype,
        all_gather=lambda out, inp: collectives.all_gather(out, inp, group),
        reduce_scatter=lambda out, inp: collectives.reduce_scatter(out, inp, group))


def plan_automatically(module: torch.nn.Module, batch: Any, *, device: torch.device, group: Group,
                       compute_dtype: torch.dtype, autocast_dtype: Optional[torch.dtype], micro_batches: int,
                       memory_limit: MemoryLimit = None, local_world_size: int = 1,
                       hardware: Optional[Union[HardwareProfile, str]] = None) -> PlanningResult:
    """Profile, search and agree on a plan. Call on every rank."""
    hw = measure_hardware(device, group, compute_dtype, hardware)
    profile = profile_model(module, batch, compute_dtype=autocast_dtype or compute_dtype, hardware=hw,
                            device=device, param_dtype=compute_dtype)
    budget = budget_bytes(device, memory_limit, local_world_size)
    options = _options(group.world_size, micro_batches, compute_dtype, autocast_dtype)
    plan, report = search(profile, hw, budget, options)
    plan = _agree(plan, group)
    return PlanningResult(plan, report, profile, hw, budget)


def _options(world_size: int, micro_batches: int, compute_dtype: torch.dtype,
             autocast_dtype: Optional[torch.dtype]) -> SearchOptions:
    """Search options that describe what the runtime will do with this precision."""
    true_low_precision = autocast_dtype is None and compute_dtype != torch.float32
    return SearchOptions(
        world_size=world_size, micro_batches=micro_batches,
        master_bytes_per_numel=0 if true_low_precision else None,  # bf16-true: the master is the shard
        grad_bytes_per_numel=2 if true_low_precision else 4,
        optimizer_bytes_per_numel=4 if true_low_precision else 8,
        reduce_in_fp32=not true_low_precision,
        allow_cpu=False, nvme_available=False)  # offload is not in the runtime yet: state stays on the device


def _agree(plan: ElixirPlan, group: Group) -> ElixirPlan:
    """Rank 0's plan, on every rank."""
    if group.world_size == 1:
        return plan
    box = [plan.to_json()]
    dist.broadcast_object_list(box, src=0, group=group.pg)
    return ElixirPlan.from_json(box[0])
