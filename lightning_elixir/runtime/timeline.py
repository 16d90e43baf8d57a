"""Measuring the memory timeline of one optimizer step ([Note: timeline positions] in timeline.py).

The runtime reports each training iteration, each cache acquisition and each optimizer step to a
``TimelineRecorder`` while one is attached (``ElixirRuntime.record_timeline()``); without one, each
of those places costs one attribute check. The bytes are counted from the tensors the runtime
holds, as ``ElixirRuntime.memory_stats()`` counts them, so they are exact and need no allocator.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional

import torch

from lightning_elixir.runtime.states import ChunkState
from lightning_elixir.timeline import MemoryTimeline, position_label

if TYPE_CHECKING:
    from lightning_elixir.runtime.cache import ChunkCache
    from lightning_elixir.runtime.table import ChunkTable


class TimelineRecorder:
    """The device bytes the runtime holds at every cache acquisition of one optimizer step.

    It starts with the first training forward that begins an optimizer step, records every
    micro-batch of that step (forwards without grad, such as evaluation, are skipped) and stops at
    the step's ``optimizer.step()`` (or its skip); ``done`` is then True and ``timeline`` complete.
    Record a step after the first: the cache learns the access order on the first iteration and only
    replays it, prefetching, from the second on, and the optimizer state exists after the first step.

    On CUDA the activations are what the caching allocator holds beyond the runtime's bytes (inputs,
    activations, temporaries, module buffers); elsewhere they are left unknown.
    """

    def __init__(self, table: "ChunkTable", cache: "ChunkCache", device: torch.device, steps: Callable[[], int],
                 optimizer_bytes: Callable[[], int], budget_bytes: Optional[int] = None) -> None:
        """``steps()``: the optimizer steps taken so far; ``optimizer_bytes()``: the separate masters and
        optimizer state of the device chunks (asked again only after a step)."""
        self.table, self.cache, self.device = table, cache, device
        self._steps, self._optimizer_bytes_now = steps, optimizer_bytes
        self.budget_bytes = budget_bytes
        self.started = False
        """The recorded step has begun."""
        self.done = False
        """The recorded step has ended: ``timeline`` is complete."""
        self._recording = False
        self._micro_batches = 0
        self._allocator = device.type == "cuda"
        self._optimizer: Optional[tuple[int, int]] = None
        self._labels: list[str] = []
        self._series: dict[str, list[int]] = {"params": [], "grads": [], "optimizer": [], "activations": []}

    @property
    def timeline(self) -> MemoryTimeline:
        """What has been recorded (the whole step once ``done``)."""
        s = self._series
        return MemoryTimeline(self._labels, s["params"], s["grads"], s["optimizer"],
                              s["activations"] if self._allocator else None, self.budget_bytes,
                              max(self._micro_batches, 1))

    def begin_iteration(self, training: bool, starts_step: bool) -> None:
        """A forward begins; ``starts_step``: no training iteration has run since the last optimizer step."""
        if self.done:
            return
        self._recording = training and (self.started or starts_step)
        if self._recording:
            self.started = True
            self._micro_batches += 1

    def acquired(self, phase: str, module: str) -> None:
        """The cache has gathered a module's chunks and issued its prefetches: count the bytes."""
        if not self._recording:
            return
        params, grads, optimizer = self._params_bytes(), self._grads_bytes(), self._optimizer_bytes()
        self._labels.append(position_label(phase, module))
        self._series["params"].append(params)
        self._series["grads"].append(grads)
        self._series["optimizer"].append(optimizer)
        if self._allocator:
            held = torch.cuda.memory_allocated(self.device)
            # The allocator rounds every block up, so it never holds less than the runtime counts.
            self._series["activations"].append(max(held - params - grads - optimizer, 0))

    def end_step(self) -> None:
        """The optimizer step (or its skip) ends the recorded step, if it has begun."""
        if self.started:
            self.done, self._recording = True, False

    def _params_bytes(self) -> int:
        """Parameter shards, gathered public chunks and gathered private chunks."""
        gathered = sum(c.block_bytes for c in self.cache.gathered.values())
        private = sum(c.block_bytes for c in self.table.private if c.state is not ChunkState.FREE)
        return sum(c.shard.nbytes for c in self.table.chunks) + gathered + private

    def _grads_bytes(self) -> int:
        """Device gradient shards, full gradient buffers, and the outputs of started reduce-scatters."""
        total = 0
        for c in self.table.chunks:
            if not c.offloaded:
                total += c.grad_shard.nbytes
            if c.grad_full is not None:
                total += c.grad_full.nbytes
            if c.reduce_started and c.group.world_size > 1:  # its shard-size output, on the device until the
                total += c.shard_numel * c.reduce_dtype.itemsize  # reduction finishes (one rank: the buffer)
        return total

    def _optimizer_bytes(self) -> int:
        """Separate masters and optimizer state of the device chunks (recounted after each optimizer step)."""
        steps = self._steps()
        if self._optimizer is None or self._optimizer[0] != steps:
            self._optimizer = (steps, self._optimizer_bytes_now())
        return self._optimizer[1]
