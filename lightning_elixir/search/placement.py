"""Placement of sharded state: which chunks leave the device, and to where.

The search does not try all 3^n placements. It walks a ladder: rung n offloads the first n chunks of
``offload_order`` (earliest-reduced first, so their gradient copies hide behind the most backward
compute), each to the CPU while pinned host memory lasts and to NVMe after that. This order is
justified by the cost model: every chunk's state costs the same per element wherever it goes, the
CPU is never slower than NVMe (NVMe adds paging on top of the same CPU update), and a chunk reduced
early has the most compute left to hide its copy. Device memory falls with every rung, so the
cheapest rung that fits a budget is found by walking up from rung 0.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_elixir.profile.types import ModelProfile
from lightning_elixir.search.layout import Layout, offload_order
from lightning_elixir.search.memory import StateBytes, state_bytes
from lightning_elixir.search.options import SearchOptions


@dataclass(frozen=True)
class Rung:
    """One placement of every chunk's sharded state."""

    placements: tuple[str, ...]
    """"device", "cpu" or "nvme" per chunk of the layout."""
    device_state_bytes: int
    """Sharded state left on the device."""
    host_bytes: int
    """Pinned host memory used by offloaded state."""

    def __post_init__(self) -> None:
        if self.device_state_bytes < 0 or self.host_bytes < 0:
            raise ValueError("a rung's byte counts must be >= 0")

    @property
    def cpu_chunks(self) -> int:
        """Chunks whose state is in host memory."""
        return self.placements.count("cpu")

    @property
    def nvme_chunks(self) -> int:
        """Chunks whose state is on NVMe."""
        return self.placements.count("nvme")

    @property
    def offloaded(self) -> int:
        """Chunks whose state is off the device."""
        return len(self.placements) - self.placements.count("device")


def placement_ladder(layout: Layout, model: ModelProfile, options: SearchOptions, nvme_ok: bool) -> tuple[Rung, ...]:
    """Rungs 0.. of the ladder, up to every chunk offloaded or the first that host memory cannot hold.

    Args:
        layout: the chunks.
        model: the profile (compute dtype, access order).
        options: allowed placements and host memory.
        nvme_ok: NVMe is configured and its bandwidth measured.
    """
    per = state_bytes(model, options)
    shard = [spec.numel // layout.world_size for spec in layout.chunks]
    placements = ["device"] * len(layout.chunks)
    device_state = sum(shard) * per.state
    host = 0
    rungs = [Rung(tuple(placements), device_state, host)]
    for c in offload_order(layout, model):
        where = _where(shard[c], host, per, options, nvme_ok)
        if where is None:
            break
        placements[c] = where
        device_state -= shard[c] * per.state
        host += shard[c] * per.host(where)
        rungs.append(Rung(tuple(placements), device_state, host))
    return tuple(rungs)


def _where(shard_numel: int, host_used: int, per: StateBytes, options: SearchOptions, nvme_ok: bool) -> str | None:
    """The cheapest off-device placement with room for one more shard, if any."""
    allowed = [p for p in options.offload_placements if p != "nvme" or nvme_ok]
    cap = options.host_memory_bytes
    for placement in allowed:
        if cap is None or host_used + shard_numel * per.host(placement) <= cap:
            return placement
    return None
