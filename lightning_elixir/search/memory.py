"""Memory model: the predicted per-rank device peak of a layout, cache size and placement.

    peak = parameter shards (compute dtype, every chunk)
         + sharded state of device-placed chunks (fp32 master + optimizer states + fp32 gradient)
         + cache blocks (blocks x public chunk numel x compute bytes)
         + private chunks (full numel x compute bytes, gathered all step)
         + gradient reduce buffers (``reduce_buffers`` x largest chunk x reduce bytes)
         + activation peak of the profile
         + margin (``margin_fraction`` of the above, plus ``margin_bytes``)

Off the device, a "cpu" chunk holds its whole sharded state in pinned host memory; an "nvme" chunk
keeps master and optimizer states on NVMe and its gradient shard in host memory (it is written
every micro-batch, so it is staged on the host rather than paged).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lightning_elixir.profile.types import ModelProfile
from lightning_elixir.search.layout import Layout
from lightning_elixir.search.options import SearchOptions, dtype_bytes


@dataclass(frozen=True)
class StateBytes:
    """Bytes per sharded element, by kind, for one model and set of options."""

    param: int
    """Compute-dtype parameter shard (always on the device)."""
    master: int
    """fp32 master copy (0 when the parameter shard is the fp32 master)."""
    optimizer: int
    """Optimizer states."""
    grad: int
    """Gradient shard."""
    reduce: int
    """Per element of a chunk's gradient while it is reduce-scattered."""

    def __post_init__(self) -> None:
        if min(self.param, self.master, self.optimizer, self.grad, self.reduce) < 0:
            raise ValueError("bytes per element must be >= 0")

    @property
    def state(self) -> int:
        """Sharded state that moves with the placement: master + optimizer + gradient."""
        return self.master + self.optimizer + self.grad

    @property
    def offloaded_master(self) -> int:
        """Master bytes off the device: the host updates a copy even when fp32 needs no separate master."""
        return self.master or self.param

    def host(self, placement: str) -> int:
        """Host bytes per element of a chunk placed at ``placement``."""
        paged = self.offloaded_master + self.optimizer
        return {"device": 0, "cpu": paged + self.grad, "nvme": self.grad}[placement]

    def nvme(self, placement: str) -> int:
        """NVMe bytes per element of a chunk placed at ``placement``."""
        return self.offloaded_master + self.optimizer if placement == "nvme" else 0


def state_bytes(model: ModelProfile, options: SearchOptions) -> StateBytes:
    """Bytes per element of each kind of state for this model's compute dtype and the options."""
    compute = dtype_bytes(model.compute_dtype)
    reduce = 4 if options.reduce_in_fp32 else compute
    return StateBytes(compute, options.master_bytes(model.compute_dtype), options.optimizer_bytes_per_numel,
                      options.grad_bytes_per_numel, reduce)


@dataclass(frozen=True)
class MemoryBreakdown:
    """Predicted memory of one rank, by component, in bytes."""

    param_shard_bytes: int
    """Compute-dtype parameter shards of every chunk."""
    device_state_bytes: int
    """Master, optimizer and gradient shards of the device-placed chunks."""
    cache_bytes: int
    """Cache blocks holding gathered public chunks."""
    private_bytes: int
    """Gathered private chunks."""
    reduce_buffer_bytes: int
    """Full-chunk gradient buffers being reduce-scattered."""
    activation_bytes: int
    """The profile's activation peak."""
    margin_bytes: int
    """Fragmentation and workspace margin."""
    host_bytes: int
    """Pinned host memory for offloaded state (not part of the device peak)."""
    nvme_bytes: int
    """NVMe space for offloaded state (not part of the device peak)."""

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if value < 0:
                raise ValueError(f"MemoryBreakdown.{name} must be >= 0, got {value}")

    @property
    def peak_bytes(self) -> int:
        """The predicted device peak: every device component plus the margin."""
        return self.fixed_bytes + self.device_state_bytes + self.margin_bytes

    @property
    def fixed_bytes(self) -> int:
        """Device bytes that do not depend on placement (before the margin)."""
        return (self.param_shard_bytes + self.cache_bytes + self.private_bytes
                + self.reduce_buffer_bytes + self.activation_bytes)


def margin_bytes(subtotal_bytes: int, options: SearchOptions) -> int:
    """The margin added on top of a predicted subtotal."""
    return math.ceil(subtotal_bytes * options.margin_fraction) + options.margin_bytes


def fixed_device_bytes(layout: Layout, model: ModelProfile, blocks: int, options: SearchOptions) -> tuple[int, ...]:
    """Placement-independent device bytes: (param shards, cache, private, reduce buffers, activations)."""
    per = state_bytes(model, options)
    shards = layout.total_numel // layout.world_size * per.param
    cache = blocks * layout.chunk_numel * per.param
    private = sum(layout.chunks[i].numel for i in layout.private) * per.param
    buffers = options.reduce_buffers * layout.largest_chunk_numel * per.reduce
    return shards, cache, private, buffers, model.activation_peak_bytes


def memory_breakdown(
    layout: Layout,
    model: ModelProfile,
    blocks: int,
    placements: tuple[str, ...],
    options: SearchOptions,
) -> MemoryBreakdown:
    """The predicted memory of a layout with ``blocks`` cache blocks and per-chunk ``placements``.

    Args:
        layout: the chunks.
        model: the profile (compute dtype, activation peak).
        blocks: cache blocks for public chunks.
        placements: one of "device", "cpu", "nvme" per chunk of the layout.
        options: byte sizes of the state and the margin.

    Returns:
        The breakdown; ``peak_bytes`` is what must fit the budget.
    """
    if len(placements) != len(layout.chunks):
        raise ValueError(f"need one placement per chunk ({len(layout.chunks)}), got {len(placements)}")
    per = state_bytes(model, options)
    shard = [spec.numel // layout.world_size for spec in layout.chunks]
    device_state = sum(n * per.state for n, p in zip(shard, placements) if p == "device")
    host = sum(n * per.host(p) for n, p in zip(shard, placements))
    nvme = sum(n * per.nvme(p) for n, p in zip(shard, placements))
    fixed = fixed_device_bytes(layout, model, blocks, options)
    margin = margin_bytes(sum(fixed) + device_state, options)
    return MemoryBreakdown(fixed[0], device_state, *fixed[1:], margin, host, nvme)
