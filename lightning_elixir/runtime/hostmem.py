"""Host memory for offloaded shards, asked for once and cut from a few slabs.

[Note: pinned memory in slabs]
An offloaded chunk keeps its gradient shard (and its master, where the master has the compute dtype)
in page-locked host memory, so that its copies to and from the device are asynchronous. torch's
pinned allocator rounds every block up to a power of two and keeps it when it is freed: a shard of
33.6 MB holds 64 MiB, and 23 of them held 1.54 GB for 0.77 GB of state, host memory that neither the
plan nor the runtime's own count saw (cut from three slabs, they hold 0.87 GB). So the runtime asks
for its pinned tensors once, when it builds the chunks, as views into a few slabs whose sizes are
powers of two (``slab_plan``): while what is left is more than one power of two holds with less
slack than its largest tensor, the next slab is the largest power of two not above it, filled
largest tensor first; the last slab holds the rest.
Each slab's slack is then under one tensor, the slabs are few (about log2 of the tensor count), and
the runtime counts the slack as host memory it holds (``HostArena.slack_bytes``). On a CPU-only
machine nothing is pinned and there is nothing to round: the arena is one slab of exactly the bytes
asked, cut the same way, so the tests run the code a GPU runs.

What goes in is what stays in host memory for the whole run: gradient shards of every offloaded
chunk and the masters of chunks offloaded to the CPU. An NVMe chunk's master goes to its file after
the build and lives in the store's pages after that, so it is an ordinary tensor, freed then. A
switch of plan drops the old runtime's slabs; ``devices.release_pinned_cache`` then gives them back
to the system (the allocator would keep them for blocks of their sizes, which the new plan's slabs
are not).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

ALIGN = 64
"""Bytes each tensor's offset in its slab is a multiple of (a cache line; every element size divides it)."""


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def pow2_ceil(n: int) -> int:
    """The smallest power of two not below ``n``: what torch's pinned allocator holds for a block of ``n`` bytes."""
    return 1 << max(n - 1, 0).bit_length()


def slab_plan(sizes: Sequence[int], rounds: bool) -> list[tuple[int, list[int]]]:
    """Slabs for tensors of ``sizes`` bytes: (slab bytes, indices of the tensors it holds) each.

    ``rounds``: the allocator rounds each block up to a power of two (pinned memory), so every slab is
    one ([Note: pinned memory in slabs]); otherwise one slab holds everything, aligned.
    """
    todo = sorted((i for i, size in enumerate(sizes) if size > 0), key=lambda i: -sizes[i])
    if not todo:
        return []
    if not rounds:
        return [(sum(_aligned(sizes[i]) for i in todo), todo)]
    slabs = []
    while todo:
        left = sum(_aligned(sizes[i]) for i in todo)
        largest = _aligned(sizes[todo[0]])
        whole = pow2_ceil(left)
        if whole - left <= largest:  # one more slab holds the rest with no more slack than a step down would
            slabs.append((whole, todo))
            break
        room = whole // 2  # the largest power of two not above ``left``; it holds ``largest`` at least
        taken, used = [], 0
        for i in todo:
            if used + _aligned(sizes[i]) <= room:
                taken.append(i)
                used += _aligned(sizes[i])
        slabs.append((room, taken))
        chosen = set(taken)
        todo = [i for i in todo if i not in chosen]
    return slabs


class HostArena:
    """Host tensors for the requests made when it was planned, cut from slabs, handed out in order.

    Args:
        requests: (numel, dtype) of each tensor, in the order ``zeros`` will be called.
        pin: page-locked memory (a GPU run); the slabs are then powers of two.
    """

    def __init__(self, requests: Sequence[tuple[int, torch.dtype]], pin: bool) -> None:
        self.requests = list(requests)
        sizes = [numel * dtype.itemsize for numel, dtype in self.requests]
        self._views: list[torch.Tensor] = [torch.empty(0, dtype=dtype) for _, dtype in self.requests]
        self.slabs: list[torch.Tensor] = []
        for nbytes, members in slab_plan(sizes, rounds=pin):
            slab = torch.zeros(nbytes, dtype=torch.uint8, pin_memory=pin)
            self.slabs.append(slab)
            offset = 0
            for i in members:
                numel, dtype = self.requests[i]
                self._views[i] = slab[offset:offset + sizes[i]].view(dtype)
                offset += _aligned(sizes[i])
        self._next = 0
        self.slack_bytes = sum(s.numel() for s in self.slabs) - sum(sizes)
        """Bytes of the slabs that hold no tensor: host memory held, counted with the runtime's."""

    def zeros(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """The next request's tensor (zero-filled); ``numel`` and ``dtype`` must be what it asked for."""
        i = self._next
        assert i < len(self.requests) and self.requests[i] == (numel, dtype), \
            f"host tensor {i} asked as {(numel, dtype)}, planned as {self.requests[i] if i < len(self.requests) else None}"
        self._next += 1
        return self._views[i]
