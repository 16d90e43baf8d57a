"""Full-size gradient buffers kept for reuse on the CPU ([Note: reused gradient buffers])."""

from __future__ import annotations

import torch


class GradBuffers:
    """Full-size gradient buffers, and those the peers' parts of a reduction arrive in, kept for reuse on the CPU.

    [Note: reused gradient buffers]
    A chunk's gradient is written into a full-size buffer and reduce-scattered from it; the buffer
    is dropped once the chunk's shard holds the result. On a GPU the caching allocator hands the
    same block back next time. On the CPU a freed buffer of a few MiB goes back to the operating
    system, and the next one is paid for again in page faults while the gradients are written (with
    the gradient copies, 10x the time of the same copies into reused memory, measured in a
    2-process step). So on the CPU the buffers a step used are kept, by size and dtype, and handed out
    again: at most as many as were alive at once (the reductions in flight and the chunks receiving
    gradients), the most DDP keeps in its buckets too. They are not counted as runtime-held between
    uses, as the allocator's cache is not on a GPU. The buffers a CPU reduction receives the peers'
    parts into ([Note: reduce-scatter on gloo] in collectives.py) are kept the same way: into new
    ones, 4 reductions of 16 MiB took 24-46 ms, into reused ones 26-28 ms
    (examples/benchmarks/collectives.py).
    """

    def __init__(self) -> None:
        self._free: dict[tuple[int, torch.dtype], list[torch.Tensor]] = {}

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A buffer of ``numel`` elements (uninitialised)."""
        free = self._free.get((numel, dtype))
        if device.type == "cpu" and free:
            return free.pop()
        return torch.empty(numel, dtype=dtype, device=device)

    def give(self, buffer: torch.Tensor) -> None:
        """``buffer`` is no longer used (kept for the next ``take`` on the CPU)."""
        if buffer.device.type == "cpu":
            self._free.setdefault((buffer.numel(), buffer.dtype), []).append(buffer)

    def clear(self) -> None:
        self._free.clear()
