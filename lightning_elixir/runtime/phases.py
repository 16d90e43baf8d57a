"""Wall time by phase of a step: waits for gathers, reduce-scatters and offloaded updates, the optimizer.

The runtime adds to one ``PhaseClock`` where it waits; the planning callback takes the sums once per
training step and reports the rest of the step as compute. On the CPU (gloo) a wait is the time the
step is exposed to that collective, measured on the host.

[Note: phases timed on the device]
On a GPU, collectives are stream-ordered: waiting for an all-gather makes the compute stream wait
and returns at once, so the host's time of that wait is nearly zero whatever the stream lost, and
the optimizer's host time is the time to launch its kernels, not to run them. The self-correction
read those host times as "no exposed communication" and folded what the stream lost into compute.
So while ``device_timing`` is set (the self-correction's measured steps), the waits that are stream
waits and the optimizer are timed with CUDA events on the stream that waits: the time between the
stream reaching the wait and getting past it (its stall), and the optimizer's span on the stream.
They are read when the sums are taken, which waits for the device once per measured step; outside
those steps the clock times the host only and costs nothing on the device. Waits on the host (an
offloaded update's future, a shard landing in host memory) are timed on the host always.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Optional

import torch

PHASES = ("gather_wait", "reduce_wait", "offload_wait", "optimizer")
"""gather_wait: waiting for an all-gather of a chunk needed now; reduce_wait: for a gradient
reduce-scatter; offload_wait: for an offloaded chunk's update on the host worker; optimizer: the
optimizer step itself (offloaded chunks' updates are launched there and run behind it)."""


class PhaseClock:
    """Seconds spent in each phase since the last ``take()``."""

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.device_timing = False
        """Time stream waits and the optimizer on the device ([Note: phases timed on the device])."""
        self._spans: list[tuple[str, Any, Any]] = []

    @contextmanager
    def timing(self, phase: str, device: Optional[torch.device] = None) -> Iterator[None]:
        """Time the block on the host; with a GPU ``device`` while ``device_timing`` is set, on its
        current stream instead (for waits that make the stream wait, and the optimizer)."""
        if self.device_timing and device is not None and device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            stream = torch.cuda.current_stream(device)
            start.record(stream)
            try:
                yield
            finally:
                end.record(stream)
                self._spans.append((phase, start, end))
            return
        start_s = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] += time.perf_counter() - start_s

    def take(self) -> dict[str, float]:
        """The sums so far, and start again from zero (waiting for the device's timed spans, if any)."""
        spans, self._spans = self._spans, []
        for phase, start, end in spans:
            end.synchronize()
            self.seconds[phase] += start.elapsed_time(end) / 1e3
        out, self.seconds = self.seconds, dict.fromkeys(PHASES, 0.0)
        return out
