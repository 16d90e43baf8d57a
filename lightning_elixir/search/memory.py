"""Memory model: the predicted per-rank device peak of a layout, cache size and placement.

    peak = parameter shards (compute dtype, every chunk)
         + sharded state of device-placed chunks (fp32 master + optimizer states + fp32 gradient)
         + cache blocks (blocks x public chunk numel x compute bytes)
         + private chunks (full numel x compute bytes, gathered all step)
         + gradient reduce buffers (``reduce_buffers`` x largest chunk x reduce bytes)
         + activation peak of the profile
         + margin (``margin_fraction`` of the above, plus ``margin_bytes``)

Off the device, a "cpu" chunk holds its whole sharded state in pinned host memory; an "nvme" chunk
keeps master and optimizer states (its record) in a file on NVMe and its gradient shard in host
memory (it is written every micro-batch, so it is staged on the host rather than paged). The NVMe
store's format is runtime/nvme.py's ([Note: NVMe record format]): every file and every host page
buffer starts with a 4096-byte header block, and payloads are padded to whole 4096-byte blocks
(direct I/O). Records are paged through ``nvme_buffers`` page buffers, each as large as the largest
record. ``memory_breakdown`` counts exactly what a runtime with the placement allocates:

    host = sum over cpu chunks of shard x (offloaded master + optimizer + gradient)
         + sum over nvme chunks of shard x gradient
         + nvme_buffers x (4096 + round_up(largest record, 4096))    (if any chunk is on NVMe)
    nvme = sum over nvme chunks of (4096 + round_up(record, 4096))
    record = shard x (offloaded master + optimizer)

(The runtime lays a record's fields back to back, each aligned to its own element size: fp32 master
and fp32 optimizer state leave no gaps.) On a GPU the runtime cuts the pinned part of that host
memory from a few power-of-two slabs, whose slack, under one shard per slab (about 13% of the pinned
bytes for equal shards, [Note: pinned memory in slabs] in runtime/hostmem.py), and holds each NVMe
page buffer in a power-of-two block (up to twice the page); it counts both and this model does not:
the host limit the search fills is 80% of the available memory by default.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lightning_elixir.plan import round_up, stays_gathered
from lightning_elixir.profile.types import ModelProfile
from lightning_elixir.search.layout import Layout
from lightning_elixir.search.options import SearchOptions, dtype_bytes

NVME_BLOCK_BYTES = 4096
"""NVMe payloads are padded to whole blocks of this size: direct I/O moves whole blocks."""
NVME_HEADER_BYTES = 4096
"""The header block in front of every NVMe file and page buffer."""


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


def nvme_block_bytes(payload_bytes: int) -> int:
    """A header block and the payload padded to whole blocks: one NVMe file or page buffer."""
    return NVME_HEADER_BYTES + round_up(payload_bytes, NVME_BLOCK_BYTES)


def nvme_page_bytes(largest_record_bytes: int | None, options: SearchOptions) -> int:
    """Host bytes of the NVMe page buffers, given the largest NVMe record (None: no chunk on NVMe)."""
    if largest_record_bytes is None:
        return 0
    return options.nvme_buffers * nvme_block_bytes(max(largest_record_bytes, 1))


def offloaded_bytes(shard_numels: list[int], placements: tuple[str, ...], per: StateBytes,
                    options: SearchOptions) -> tuple[int, int]:
    """(host bytes, NVMe bytes) a runtime allocates for the offloaded state of a placement."""
    records = [n * per.nvme(p) for n, p in zip(shard_numels, placements) if p == "nvme"]
    host = sum(n * per.host(p) for n, p in zip(shard_numels, placements))
    host += nvme_page_bytes(max(records, default=None), options)
    return host, sum(nvme_block_bytes(r) for r in records)


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
    """Pinned host memory for offloaded state and NVMe page buffers (not part of the device peak)."""
    nvme_bytes: int
    """NVMe space for offloaded state, file headers included (not part of the device peak)."""
    whole_state_bytes: int = 0
    """Optimizer state every rank holds whole (``SearchOptions.whole_state_bytes_per_numel``)."""
    step_gather_bytes: int = 0
    """What the optimizer step gathers for its largest chunk, after the activations are freed."""

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
        """Device bytes that do not depend on placement (before the margin): the larger of the activations
        (forward and backward) and the step's gathers (after them) on top of what both see."""
        return device_bytes((self.param_shard_bytes, self.cache_bytes, self.private_bytes, self.reduce_buffer_bytes,
                             self.whole_state_bytes, self.activation_bytes, self.step_gather_bytes))


def margin_bytes(subtotal_bytes: int, options: SearchOptions) -> int:
    """The margin added on top of a predicted subtotal."""
    return math.ceil(subtotal_bytes * options.margin_fraction) + options.margin_bytes


def fixed_device_bytes(layout: Layout, model: ModelProfile, blocks: int, options: SearchOptions,
                       aliased: bool = False) -> tuple[int, ...]:
    """Device bytes the placement does not change: (param shards, cache, private, reduce buffers, whole
    optimizer state, activations, the step's gathers); ``device_bytes`` adds them up.

    ``aliased``: one rank under a resident plan, whose shards are its blocks and whose gradients land
    in their shards ([Note: a world of one] in runtime/chunk.py): no blocks, no buffers beyond the shards.
    """
    per = state_bytes(model, options)
    shards = layout.total_numel // layout.world_size * per.param
    whole = sum(p.numel for p in model.params if p.requires_grad) * options.whole_state_bytes_per_numel
    gathered = layout.largest_chunk_numel * options.step_gather_bytes_per_numel
    if aliased:
        return shards, 0, 0, 0, whole, model.activation_peak_bytes, gathered
    cache = blocks * layout.chunk_numel * per.param
    private = sum(layout.chunks[i].numel for i in layout.private) * per.param
    buffers = options.reduce_buffers * layout.largest_chunk_numel * per.reduce
    return shards, cache, private, buffers, whole, model.activation_peak_bytes, gathered


def device_bytes(fixed: tuple[int, ...]) -> int:
    """The total of ``fixed_device_bytes``: the step's gathers come after the activations are freed."""
    *together, activations, gathered = fixed
    return sum(together) + max(activations, gathered)


def is_aliased(layout: Layout, blocks: int, placements: tuple[str, ...]) -> bool:
    """Whether a layout with ``blocks`` cache blocks and ``placements`` runs with its shards as its blocks."""
    return layout.world_size == 1 and stays_gathered(blocks, len(layout.public), any(p != "device" for p in placements),
                                                  layout.world_size)


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
    host, nvme = offloaded_bytes(shard, placements, per, options)
    fixed = fixed_device_bytes(layout, model, blocks, options, is_aliased(layout, blocks, placements))
    shards, cache, private, buffers, whole, activations, gathered = fixed
    return MemoryBreakdown(shards, device_state, cache, private, buffers, activations,
                           margin_bytes(device_bytes(fixed) + device_state, options), host, nvme, whole, gathered)
