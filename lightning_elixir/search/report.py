"""What the search reports: the top candidates, the winner's cost and memory, and the lower bound."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from lightning_elixir.search.cost import CostBreakdown
from lightning_elixir.search.memory import MemoryBreakdown

def format_bytes(nbytes: float) -> str:
    """Bytes in the largest binary unit that keeps the number >= 1, two decimals."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(nbytes) >= size:
            return f"{nbytes / size:.2f} {unit}"
    return f"{int(nbytes)} B"


@dataclass(frozen=True)
class Candidate:
    """One evaluated plan: a chunk size, cache size, prefetch depth and placement."""

    chunk_numel: int
    """Public chunk capacity."""
    cache_blocks: int
    """Cache blocks (equal to the public chunk count when every chunk stays gathered)."""
    all_gathered: bool
    """Every public chunk stays gathered all step (the plan says cache_blocks="all")."""
    prefetch_depth: int
    """Chunks gathered ahead of use."""
    cpu_chunks: int
    """Chunks whose sharded state lives in host memory."""
    nvme_chunks: int
    """Chunks whose sharded state lives on NVMe."""
    chunks: int
    """Chunks in the layout (public and private)."""
    gathers: int
    """All-gathers per step."""
    gathered_bytes: int
    """Bytes all-gathered per step."""
    step_s: float
    """Predicted step time in seconds."""
    peak_bytes: int
    """Predicted device peak in bytes."""

    def __post_init__(self) -> None:
        if self.step_s < 0 or self.peak_bytes < 0 or self.cache_blocks < 0:
            raise ValueError("a candidate's time, memory and cache blocks must be >= 0")
        if self.cpu_chunks + self.nvme_chunks > self.chunks:
            raise ValueError("more offloaded chunks than chunks")

    @property
    def offloaded(self) -> int:
        """Chunks whose state is off the device."""
        return self.cpu_chunks + self.nvme_chunks

    def describe(self) -> str:
        """One line for logs."""
        blocks = "all" if self.all_gathered else str(self.cache_blocks)
        return (f"chunk={self.chunk_numel:,} blocks={blocks} prefetch={self.prefetch_depth} "
                f"offload={self.cpu_chunks}cpu+{self.nvme_chunks}nvme/{self.chunks} "
                f"gathers={self.gathers} step={format_ms(self.step_s)} peak={format_bytes(self.peak_bytes)}")


@dataclass(frozen=True)
class LayoutSummary:
    """A chunk size the search tried and the padding it costs."""

    chunk_numel: int
    """Public chunk capacity."""
    public_chunks: int
    """Public chunks."""
    private_chunks: int
    """Private chunks (shared parameters)."""
    padding_numel: int
    """Elements of padding over all chunks."""
    waste_fraction: float
    """Padding as a fraction of all chunk elements."""

    def __post_init__(self) -> None:
        if self.padding_numel < 0 or not 0.0 <= self.waste_fraction <= 1.0:
            raise ValueError("padding must be >= 0 and the waste fraction in [0, 1]")


@dataclass(frozen=True)
class SearchReport:
    """Why the search chose its plan."""

    budget_bytes: int
    """The device memory the search planned for, per rank."""
    world_size: int
    """Ranks the plan shards over."""
    micro_batches: int
    """Micro-batches per optimizer step."""
    candidates: tuple[Candidate, ...]
    """The best candidates, best first (the winner is the first)."""
    cost: CostBreakdown
    """The winner's predicted cost."""
    memory: MemoryBreakdown
    """The winner's predicted memory."""
    layouts: tuple[LayoutSummary, ...]
    """Every chunk size tried, with its padding."""
    lower_bound_s: float
    """Physical lower bound on the step time for this budget: the largest of pure compute, the
    collectives every fitting plan of the search space must run (measured launch latency, bytes at
    the best measured bandwidths) with the compute they cannot hide behind (``comm_overlap``), and
    the host work the budget forces (gradient copies, and the worker's CPU optimizer updates,
    uploads and NVMe paging of the state that cannot stay on the device: each needs its time every
    step even where it hides, see [Note: overlap] in cost.py)."""
    lower_bound_reason: str
    """Which of "compute", "network", "host" sets the lower bound."""
    evaluated: int
    """Candidates evaluated (chunk size x cache blocks x prefetch depth x placement)."""
    placement_reason: str = ""
    """Why the winner's state sits where it does, e.g. what keeping it all on the device would need."""
    min_offload_gain: float = 0.0
    """How much faster a plan that offloads more chunks must be predicted to win ([Note: offloading for
    speed] in search.py): candidates listed faster than the winner were overruled by it."""
    updates_in_backward: bool = False
    """Whether host-memory chunks' updates were priced to start as their gradients land in backward
    (``SearchOptions.updates_in_backward``)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "candidates", tuple(self.candidates))
        object.__setattr__(self, "layouts", tuple(self.layouts))
        if not self.candidates:
            raise ValueError("a report needs at least the winning candidate")
        if self.lower_bound_reason not in ("compute", "network", "host"):
            raise ValueError(f"unknown lower bound reason {self.lower_bound_reason!r}")

    @property
    def winner(self) -> Candidate:
        """The chosen candidate."""
        return self.candidates[0]

    @property
    def lower_bound_ratio(self) -> float:
        """Predicted step time over the lower bound (>= 1; how much is left to gain)."""
        return self.winner.step_s / self.lower_bound_s if self.lower_bound_s > 0 else 1.0

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return dataclasses.asdict(self)

    def placement_summary(self) -> str:
        """Where the winner's chunks went, why, and what the host work costs."""
        w, c = self.winner, self.cost
        counts = f"placement: {w.chunks - w.offloaded} device, {w.cpu_chunks} cpu, {w.nvme_chunks} nvme"
        reason = f": {self.placement_reason}" if self.placement_reason else ""
        if not w.offloaded:
            return counts + reason
        m = self.memory
        started = " (started in backward)" if self.updates_in_backward and w.cpu_chunks else ""
        return (f"{counts}{reason}; host work {format_ms(c.host_work_s)}{started}, exposed "
                f"{format_ms(c.exposed_host_s)}; "
                f"host memory {format_bytes(m.host_bytes)}, nvme {format_bytes(m.nvme_bytes)}")

    def summary(self) -> str:
        """A few lines for logs: budget, lower bound, winner breakdown, the top candidates."""
        c, m = self.cost, self.memory
        lines = [
            f"Elixir search: budget {format_bytes(self.budget_bytes)}/rank, world size {self.world_size}, "
            f"{self.micro_batches} micro-batch(es), {self.evaluated} candidates",
            f"lower bound {format_ms(self.lower_bound_s)} ({self.lower_bound_reason}); "
            f"predicted/lower bound = {self.lower_bound_ratio:.2f}",
            f"step {format_ms(c.step_s)}: compute {format_ms(c.compute_s)}, all-gather {format_ms(c.all_gather_s)}, "
            f"reduce-scatter {format_ms(c.reduce_scatter_s)}, fwd+bwd {format_ms(c.forward_backward_s)} "
            f"(contention {format_ms(c.contention_s)}), "
            f"optimizer {format_ms(c.device_optimizer_s)} device",
            self.placement_summary(),
            f"peak {format_bytes(m.peak_bytes)}: shards {format_bytes(m.param_shard_bytes)}, "
            f"state {format_bytes(m.device_state_bytes)}, cache {format_bytes(m.cache_bytes)}, "
            f"private {format_bytes(m.private_bytes)}, reduce buffers {format_bytes(m.reduce_buffer_bytes)}, "
            f"activations {format_bytes(m.activation_bytes)}, "
            + (f"optimizer state held whole {format_bytes(m.whole_state_bytes)}, " if m.whole_state_bytes else "")
            + (f"gathered at the step {format_bytes(m.step_gather_bytes)}, " if m.step_gather_bytes else "")
            + f"margin {format_bytes(m.margin_bytes)}",
        ]
        lines += [f"  {i}. {cand.describe()}{self._overruled(cand)}" for i, cand in enumerate(self.candidates, 1)]
        return "\n".join(lines)

    def _overruled(self, cand: Candidate) -> str:
        """Why a candidate predicted faster than the winner lost: it offloads more, for too little gain."""
        w = self.winner
        if cand is w or cand.step_s >= w.step_s:
            return ""
        gain = 1.0 - cand.step_s / w.step_s
        more = cand.offloaded - w.offloaded
        return (f"  <- {gain:.1%} faster but offloads {more} more chunk(s); offloading must gain "
                f"{self.min_offload_gain:.0%} to win")


def format_ms(seconds: float) -> str:
    """Seconds as milliseconds with two decimals."""
    return f"{seconds * 1e3:.2f}ms"


def format_names(names: Sequence[str], shown: int = 3) -> str:
    """The first ``shown`` names, comma-separated, and ", ..." when there are more."""
    return ", ".join(names[:shown]) + (", ..." if len(names) > shown else "")
