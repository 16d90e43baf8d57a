"""Placement of sharded state: which chunks leave the device, and to where.

The search does not try all 3^n placements. It walks a ladder: rung n offloads the first n chunks of
``offload_order`` (earliest-reduced first). Of those, as many as pinned host memory holds go to the
CPU and the rest to NVMe: the fewest NVMe chunks for which host memory holds the CPU chunks' state,
the NVMe chunks' staged gradients and the NVMe page buffers (``memory_breakdown``'s host bytes). The
page buffers cost host memory once, as soon as one chunk is on NVMe, so moving a chunk to NVMe can
take more host memory than keeping it on the CPU: a rung may send chunks that the rung below kept on
the CPU to NVMe, and the ladder ends where even the best split does not fit.

This order is justified by the cost model ([Note: overlap] in cost.py): every chunk's state costs
the same per element wherever it goes, and the CPU is never slower than NVMe (NVMe adds paging on
top of the same CPU update). A chunk reduced early has the most backward compute left to hide its
gradient copy and, being among the last the forward uses, the most of the next forward to hide its
update; so the NVMe chunks, the slowest to update, are the first in offload order. Device memory
falls with every rung; the search costs every rung that fits a budget, since hidden host work can
make a higher rung as fast as a lower one (or faster, by shortening the device optimizer).
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_elixir.profile.types import ModelProfile
from lightning_elixir.search.layout import Layout, offload_order
from lightning_elixir.search.memory import StateBytes, nvme_page_bytes, state_bytes
from lightning_elixir.search.options import SearchOptions


@dataclass(frozen=True)
class Rung:
    """One placement of every chunk's sharded state."""

    placements: tuple[str, ...]
    """"device", "cpu" or "nvme" per chunk of the layout."""
    device_state_bytes: int
    """Sharded state left on the device."""
    host_bytes: int
    """Pinned host memory used by offloaded state and NVMe page buffers."""

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
        options: allowed placements, host memory and NVMe page buffers.
        nvme_ok: NVMe is configured and its bandwidth measured.
    """
    per = state_bytes(model, options)
    shard = [spec.numel // layout.world_size for spec in layout.chunks]
    order = offload_order(layout, model)
    device_state = sum(shard) * per.state
    rungs = [Rung(("device",) * len(shard), device_state, 0)]
    for n in range(1, len(order) + 1):
        split = _nvme_split(order[:n], shard, per, options, nvme_ok)
        if split is None:
            break
        nvme_count, host_bytes = split
        placements = ["device"] * len(shard)
        for i, c in enumerate(order[:n]):
            placements[c] = "nvme" if i < nvme_count else "cpu"
        device_state -= shard[order[n - 1]] * per.state
        rungs.append(Rung(tuple(placements), device_state, host_bytes))
    return tuple(rungs)


def _nvme_split(chunks: tuple[int, ...], shard: list[int], per: StateBytes, options: SearchOptions,
                nvme_ok: bool) -> tuple[int, int] | None:
    """For offloaded ``chunks`` (in offload order): the fewest of them, taken first, that must go to NVMe
    for the rest to fit on the CPU, and the host bytes then; None if no split fits host memory."""
    allowed = [p for p in options.offload_placements if p != "nvme" or nvme_ok]
    fewest = 0 if "cpu" in allowed else len(chunks)
    most = len(chunks) if "nvme" in allowed else 0
    state = sum(shard[c] for c in chunks) * per.host("cpu")
    largest = None
    for count in range(most + 1):
        if count:
            c = chunks[count - 1]
            state += shard[c] * (per.host("nvme") - per.host("cpu"))
            largest = max(largest or 0, shard[c] * per.nvme("nvme"))
        host_bytes = state + nvme_page_bytes(largest, options)
        if count >= fewest and (options.host_memory_bytes is None or host_bytes <= options.host_memory_bytes):
            return count, host_bytes
    return None
