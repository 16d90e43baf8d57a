"""When nothing fits: the most frugal plan, what it needs, and which lever would help."""

from __future__ import annotations

import dataclasses

from lightning_elixir.profile.types import HardwareProfile, ModelProfile
from lightning_elixir.search.layout import access_chunks, build_layout, candidate_chunk_numels
from lightning_elixir.search.memory import MemoryBreakdown, memory_breakdown
from lightning_elixir.search.options import SearchOptions
from lightning_elixir.search.placement import Rung, placement_ladder
from lightning_elixir.search.report import format_bytes
from lightning_elixir.search.simulate import min_cache_blocks


class NoPlanFitsError(ValueError):
    """No plan of the search space fits the device memory budget.

    Attributes:
        min_device_bytes: device memory per rank the most frugal plan needs.
        budget_bytes: the budget that was searched.
        levers: what would help, most relevant first.
    """

    def __init__(self, message: str, min_device_bytes: int, budget_bytes: int, levers: tuple[str, ...]) -> None:
        super().__init__(message)
        self.min_device_bytes = min_device_bytes
        self.budget_bytes = budget_bytes
        self.levers = levers


@dataclasses.dataclass(frozen=True)
class Frugal:
    """The plan that needs the least device memory, and what it needs."""

    chunk_numel: int
    """Its public chunk capacity."""
    blocks: int
    """Its cache blocks (the fewest that serve every access)."""
    rung: Rung
    """Its placement (as much state offloaded as allowed)."""
    memory: MemoryBreakdown
    """Its predicted memory."""

    def __post_init__(self) -> None:
        if self.blocks < 0 or self.chunk_numel < 0:
            raise ValueError("a frugal plan needs blocks >= 0 and chunk_numel >= 0")


def nvme_usable(hardware: HardwareProfile, options: SearchOptions) -> bool:
    """NVMe placement is allowed: a path is configured and its bandwidth was measured."""
    return options.nvme_available and hardware.nvme_read_bytes_per_s > 0 and hardware.nvme_write_bytes_per_s > 0


def frugal_plan(model: ModelProfile, hardware: HardwareProfile, options: SearchOptions) -> Frugal:
    """The least device memory over chunk sizes, with the fewest blocks and the most offload allowed."""
    best = None
    for size in candidate_chunk_numels(model, options):
        layout = build_layout(model, size, options.world_size)
        blocks = min_cache_blocks(access_chunks(layout, model)) if layout.public else 0
        rung = placement_ladder(layout, model, options, nvme_usable(hardware, options))[-1]
        memory = memory_breakdown(layout, model, blocks, rung.placements, options)
        if best is None or memory.peak_bytes < best.memory.peak_bytes:
            best = Frugal(layout.chunk_numel, blocks, rung, memory)
    return best


def no_plan_fits(model: ModelProfile, hardware: HardwareProfile, budget_bytes: int,
                 options: SearchOptions) -> NoPlanFitsError:
    """The error to raise when no candidate fits ``budget_bytes``."""
    frugal = frugal_plan(model, hardware, options)
    levers = _levers(frugal, model, hardware, budget_bytes, options)
    rung = frugal.rung
    message = (
        f"No Elixir plan fits the device memory budget of {format_bytes(budget_bytes)} per rank. The most frugal "
        f"plan (chunks of {frugal.chunk_numel:,} elements, {frugal.blocks} cache block(s), sharded state of "
        f"{rung.offloaded} of {len(rung.placements)} chunks offloaded) needs at least "
        f"{format_bytes(frugal.memory.peak_bytes)}: {_components(frugal.memory)}. What would help: "
        + "; ".join(f"({i}) {lever}" for i, lever in enumerate(levers, 1)) + "."
    )
    return NoPlanFitsError(message, frugal.memory.peak_bytes, budget_bytes, levers)


def _components(m: MemoryBreakdown) -> str:
    """The device components of a memory breakdown, for a message."""
    parts = (("activations", m.activation_bytes), ("parameter shards", m.param_shard_bytes),
             ("cache blocks", m.cache_bytes), ("private chunks", m.private_bytes),
             ("gradient reduce buffers", m.reduce_buffer_bytes),
             ("sharded state left on the device", m.device_state_bytes))
    optimizer = (("optimizer state held whole", m.whole_state_bytes), ("gathered at the step", m.step_gather_bytes))
    parts += tuple((name, nbytes) for name, nbytes in optimizer if nbytes) + (("margin", m.margin_bytes),)
    return ", ".join(f"{name} {format_bytes(nbytes)}" for name, nbytes in parts)


def _levers(frugal: Frugal, model: ModelProfile, hardware: HardwareProfile, budget_bytes: int,
            options: SearchOptions) -> tuple[str, ...]:
    """What would shrink the frugal plan below the budget, most relevant first."""
    m = frugal.memory
    levers = []
    if m.activation_bytes >= m.peak_bytes - budget_bytes or m.activation_bytes >= m.fixed_bytes / 2:
        levers.append(f"activations dominate ({format_bytes(m.activation_bytes)}): use a smaller micro-batch "
                      "(keep the global batch with gradient accumulation) or enable activation checkpointing")
    if frugal.rung.offloaded < len(frugal.rung.placements):
        levers.append(_offload_lever(hardware, options))
    more = dataclasses.replace(options, world_size=options.world_size * 2)
    need = frugal_plan(model, hardware, more).memory.peak_bytes
    if need < 0.95 * m.peak_bytes:
        levers.append(f"more devices: with {more.world_size} ranks the most frugal plan needs about "
                      f"{format_bytes(need)} per rank")
    else:  # what is left is per rank (activations, the allocator's margin): sharding further frees nothing
        levers.append(f"more devices would not help: with {more.world_size} ranks the most frugal plan still needs "
                      f"about {format_bytes(need)} per rank, as every rank holds its own activations and margin")
    return tuple(levers)


def _offload_lever(hardware: HardwareProfile, options: SearchOptions) -> str:
    """Why sharded state is still on the device in the most frugal plan, and what to change."""
    if not options.offload_placements:
        return ("offloading sharded state to CPU or NVMe would help, but these search options keep it on the "
                "device (allow_cpu=False, nvme_available=False)")
    if not options.nvme_available:
        return (f"CPU memory is the limit (host_memory_bytes={options.host_memory_bytes:,}): set an nvme_path so "
                "the rest of the optimizer state can go to NVMe, or allow more pinned host memory")
    if not nvme_usable(hardware, options):
        return "NVMe is configured but its bandwidth was not measured: re-run the hardware profile with the nvme_path"
    return (f"host memory for NVMe-staged gradients and the {options.nvme_buffers} NVMe page buffers is the limit "
            f"(host_memory_bytes={options.host_memory_bytes:,}): allow more pinned host memory, or fewer "
            "page buffers (nvme_buffers)")
