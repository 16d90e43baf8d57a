"""Host wall time by phase of a step: waits for gathers, reduce-scatters and offloaded updates, the optimizer.

The runtime adds to one ``PhaseClock`` where it waits; the planning callback takes the sums once per
training step and reports the rest of the step as compute. On the CPU (gloo) a wait is the time the
step is exposed to that collective. On GPUs collectives are stream-ordered: a host wait returns once
the wait is queued, so these are host times, not exposed device time.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

PHASES = ("gather_wait", "reduce_wait", "offload_wait", "optimizer")
"""gather_wait: waiting for an all-gather of a chunk needed now; reduce_wait: for a gradient
reduce-scatter; offload_wait: for an offloaded chunk's update on the host worker; optimizer: the
optimizer step itself (offloaded chunks' updates are launched there and run behind it)."""


class PhaseClock:
    """Seconds spent in each phase since the last ``take()``."""

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(PHASES, 0.0)

    @contextmanager
    def timing(self, phase: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] += time.perf_counter() - start

    def take(self) -> dict[str, float]:
        """The sums so far, and start again from zero."""
        out, self.seconds = self.seconds, dict.fromkeys(PHASES, 0.0)
        return out
