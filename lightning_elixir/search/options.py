"""Search options: the knobs of the search that are not measured (world size, optimizer, margins).

Everything the search needs that is neither the model profile, the hardware profile nor the budget
lives here, so that the search stays a pure function of its four arguments.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_elixir.plan import REDUCE_BUFFERS

MiB = 1 << 20

# Element sizes by dtype name, so the search needs no torch import.
DTYPE_BYTES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of a dtype named as in ``str(torch.float32)`` without the prefix."""
    name = dtype.removeprefix("torch.")
    if name not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; the search knows {sorted(DTYPE_BYTES)}")
    return DTYPE_BYTES[name]


@dataclass(frozen=True)
class SearchOptions:
    """What the search is told rather than what it measures."""

    world_size: int = 1
    """Ranks each chunk is sharded over. Passed in, never queried (the search is pure)."""
    micro_batches: int = 1
    """Micro-batches per optimizer step (gradient accumulation); the profile describes one."""
    master_bytes_per_numel: int | None = None
    """Bytes of the fp32 master copy per element. None: 4 for 16-bit compute, 0 for fp32 compute
    (32-true keeps one fp32 copy: the master IS the parameter shard)."""
    optimizer_bytes_per_numel: int = 8
    """Optimizer state bytes per element (AdamW: exp_avg and exp_avg_sq in fp32)."""
    whole_state_bytes_per_numel: int = 0
    """Optimizer state bytes per trained element that every rank holds whole, on the device, wherever the
    chunk is placed: state not of its parameter's shape (Shampoo's preconditioners, Adafactor's rows and
    columns)."""
    step_gather_bytes_per_numel: int = 0
    """Bytes per element of the largest chunk that the optimizer step gathers, one chunk at a time (a
    per-parameter optimizer's masters, gradients and per-element state; Muon's update). Activations are
    freed by then: the step's peak is the larger of the two."""
    grad_bytes_per_numel: int = 4
    """Bytes per element of the gradient shard (fp32, accumulated across micro-batches)."""
    reduce_in_fp32: bool = True
    """Reduce-scatter gradients in fp32 (the plan's ``reduce_in_fp32``)."""
    allow_cpu: bool = True
    """Whether sharded state may be placed in pinned CPU memory."""
    nvme_available: bool = False
    """Whether an NVMe path is configured (and its bandwidth measured) for sharded state."""
    host_memory_bytes: int | None = None
    """Pinned host memory this rank may use for offloaded state (NVMe page buffers included).
    None: unlimited."""
    nvme_buffers: int = 3
    """Host page buffers NVMe-placed state is paged through, each as large as the largest NVMe
    chunk's record (plus a header block): one being read ahead, one being updated, one being written
    behind. The runtime's ``nvme_buffers``."""
    updates_in_backward: bool = False
    """Whether the runtime starts the updates of chunks in host memory as their gradients land in
    the last micro-batch's backward ([Note: updates started in backward] in runtime/offload.py;
    rule 5 of [Note: overlap] in cost.py), rather than at the optimizer step."""
    min_offload_gain: float = 0.1
    """How much faster (a fraction of its predicted step) a plan must be predicted to beat one that
    offloads fewer chunks ([Note: offloading for speed] in search.py); 0 takes the fastest prediction."""
    margin_fraction: float = 0.15
    """Margin as a fraction of the predicted peak: the caching allocator's slack (a per-process memory
    limit caps the bytes it reserves, not those it hands out) and what the profile misses. On one H200
    (GPT-2 medium, bf16-mixed, batch 8 x 1024, every chunk's state on the host) the allocator's peak was
    10% above the prediction before the margin, and a plan with 5% ran out of memory (BENCHMARKS.md)."""
    margin_bytes: int = 256 * MiB
    """Fixed workspace margin (kernels' workspaces, communicator buffers)."""
    reduce_buffers: int = REDUCE_BUFFERS
    """Full-chunk gradient buffers budgeted for the reduce-scatters in flight (the runtime keeps at most
    ``plan.REDUCE_BUFFERS`` in flight)."""
    min_chunk_numel: int = 1 << 20
    """Smallest chunk capacity considered (capped at the model's size): tiny chunks pay a
    collective launch each."""
    max_chunk_factor: float = 3.0
    """Largest chunk considered, as a multiple of the smallest (Elixir searched [S, 3S])."""
    chunk_size_steps: int = 6
    """Chunk sizes tried, geometrically spaced from the smallest to the largest."""
    shard_align_numel: int = 64
    """Chunk capacities are multiples of world_size * this, so every shard starts aligned."""
    cache_block_points: int = 24
    """Most cache-block counts tried per chunk size (all of them when there are fewer)."""
    prefetch_depths: tuple[int, ...] = (0, 1, 2)
    """Prefetch depths tried."""
    report_top: int = 10
    """Candidates listed in the report."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "prefetch_depths", tuple(sorted(set(self.prefetch_depths))))
        positive = ("world_size", "micro_batches", "chunk_size_steps", "shard_align_numel",
                    "cache_block_points", "report_top", "min_chunk_numel", "nvme_buffers")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"SearchOptions.{name} must be >= 1, got {getattr(self, name)}")
        non_negative = ("optimizer_bytes_per_numel", "whole_state_bytes_per_numel", "step_gather_bytes_per_numel",
                        "grad_bytes_per_numel", "margin_bytes", "reduce_buffers")
        for name in non_negative:
            if getattr(self, name) < 0:
                raise ValueError(f"SearchOptions.{name} must be >= 0, got {getattr(self, name)}")
        if self.master_bytes_per_numel is not None and self.master_bytes_per_numel < 0:
            raise ValueError(f"SearchOptions.master_bytes_per_numel must be >= 0, got {self.master_bytes_per_numel}")
        if self.host_memory_bytes is not None and self.host_memory_bytes < 0:
            raise ValueError(f"SearchOptions.host_memory_bytes must be >= 0, got {self.host_memory_bytes}")
        if not 0.0 <= self.min_offload_gain < 1.0:
            raise ValueError(f"SearchOptions.min_offload_gain must be in [0, 1), got {self.min_offload_gain}")
        if not 0.0 <= self.margin_fraction < 1.0:
            raise ValueError(f"SearchOptions.margin_fraction must be in [0, 1), got {self.margin_fraction}")
        if self.max_chunk_factor < 1.0:
            raise ValueError(f"SearchOptions.max_chunk_factor must be >= 1, got {self.max_chunk_factor}")
        if not self.prefetch_depths or self.prefetch_depths[0] < 0:
            raise ValueError(f"SearchOptions.prefetch_depths must be non-empty and >= 0, got {self.prefetch_depths}")

    @property
    def offload_placements(self) -> tuple[str, ...]:
        """Off-device placements allowed, cheapest first."""
        return tuple(p for p, ok in (("cpu", self.allow_cpu), ("nvme", self.nvme_available)) if ok)

    def master_bytes(self, compute_dtype: str) -> int:
        """Master bytes per element for a compute dtype (see ``master_bytes_per_numel``)."""
        if self.master_bytes_per_numel is not None:
            return self.master_bytes_per_numel
        return 0 if dtype_bytes(compute_dtype) >= 4 else 4
