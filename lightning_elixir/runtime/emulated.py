"""An emulated device memory budget: ``torch.OutOfMemoryError`` on the CPU where a GPU would run out.

[Note: emulated device memory]
Running out of device memory, and recovering from it, is the situation the strategy exists for,
and a CPU has no device memory to run out of. ``emulated_device_memory(limit)`` gives the runs
inside it one: every operator dispatched during a training step (forward, backward, the runtime's
own gathers and reductions) is seen by a dispatch mode that counts the bytes of the storages it
creates while they live, on top of what the runtime holds on its device between steps (shards,
device masters, optimizer state and gradient shards, gathered blocks kept: the baseline the
strategy passes at each step's start). When the sum would exceed the limit the operator's result
is dropped and ``EmulatedOutOfMemoryError`` (a ``torch.OutOfMemoryError``) is raised, as the CUDA
allocator raises, with the bytes that were needed. The peak of the sum is the step's measured
peak, as ``torch.cuda.max_memory_allocated`` is on a GPU. What it leaves out: the allocator's
rounding and cache (a CPU has none), and the optimizer's update (run outside the count: its state
is in the baseline).

The limit may change with the step (``{1: 4 << 20, 6: 2 << 20}``: another process took memory
before step 6) and apply to some ranks only, so that tests can make a rank run out alone, at a
given step, or right after the plan changed.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Optional, Union

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

_active: Optional["EmulatedDeviceMemory"] = None


class EmulatedOutOfMemoryError(torch.OutOfMemoryError):
    """The emulated device budget was exceeded ([Note: emulated device memory])."""

    def __init__(self, message: str, needed_bytes: int, limit_bytes: int) -> None:
        super().__init__(message)
        self.needed_bytes = needed_bytes
        self.limit_bytes = limit_bytes


class EmulatedDeviceMemory:
    """A device budget on the CPU ([Note: emulated device memory]); see ``emulated_device_memory``."""

    def __init__(self, limit: Union[int, Mapping[int, int]], ranks: Optional[Iterable[int]] = None) -> None:
        limits = {1: limit} if isinstance(limit, int) else dict(limit)
        if not limits or any(not isinstance(s, int) or s < 1 for s in limits) or any(
                isinstance(b, bool) or not isinstance(b, int) or b <= 0 for b in limits.values()):
            raise ValueError(f"limit={limit!r}: use a positive number of bytes, or {{first step: bytes}} with steps "
                             "counted from 1")
        self.limits = dict(sorted(limits.items()))
        self.ranks = None if ranks is None else frozenset(ranks)
        self.baseline = 0
        self.live = 0
        self.peak = 0
        """The largest baseline plus live bytes since ``begin_step`` (the step's measured peak)."""
        self._limit: Optional[int] = None
        self._sizes: dict[int, int] = {}
        self._generation = 0
        self._open = 0
        self._lock = threading.Lock()

    def limit_at(self, step: int) -> int:
        """The limit in force at training step ``step`` (1-based)."""
        at = [b for s, b in self.limits.items() if s <= step]
        return at[-1] if at else next(iter(self.limits.values()))

    def begin_step(self, step: int, rank: int, baseline_bytes: int) -> None:
        """A training step starts: the runtime holds ``baseline_bytes`` on the device; nothing else is counted yet."""
        with self._lock:
            self._generation += 1
            self._sizes.clear()
            self.baseline, self.live = int(baseline_bytes), 0
            self.peak = self.baseline
            self._limit = self.limit_at(step) if self.ranks is None or rank in self.ranks else None

    @property
    def counting_now(self) -> bool:
        """Whether a ``counting`` block is open."""
        return self._open > 0

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        """Count (and bound) the storages that operators create inside the block."""
        self._open += 1
        try:
            with _Counter(self):
                yield
        finally:
            self._open -= 1

    def _created(self, storage: Any) -> None:
        nbytes = storage.nbytes()
        key = storage.data_ptr()
        if not nbytes or key in self._sizes:
            return
        with self._lock:
            self._sizes[key] = nbytes
            self.live += nbytes
            total = self.baseline + self.live
            self.peak = max(self.peak, total)
        weakref.finalize(storage, self._freed, key, self._generation)
        if self._limit is not None and total > self._limit:
            raise EmulatedOutOfMemoryError(
                f"out of memory (emulated device budget): tried to allocate {nbytes:,} bytes with "
                f"{total - nbytes:,} in use of a limit of {self._limit:,} bytes", total, self._limit)

    def _freed(self, key: int, generation: int) -> None:
        with self._lock:
            if generation == self._generation:
                self.live -= self._sizes.pop(key, 0)


class _Counter(TorchDispatchMode):
    """The dispatch mode that reports each operator's new storages to an ``EmulatedDeviceMemory``."""

    def __init__(self, memory: EmulatedDeviceMemory) -> None:
        super().__init__()
        self.memory = memory

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func._schema.is_mutable or any(r.alias_info is not None for r in func._schema.returns):
            return out  # writes into, or views of, existing storage: nothing new
        for value in tree_flatten(out)[0]:
            if isinstance(value, torch.Tensor) and not value.is_meta:
                self.memory._created(value.untyped_storage())
        return out


@contextlib.contextmanager
def emulated_device_memory(limit: Union[int, Mapping[int, int]],
                           ranks: Optional[Iterable[int]] = None) -> Iterator[EmulatedDeviceMemory]:
    """Give the Elixir runs inside the block an emulated device budget ([Note: emulated device memory]).

    Args:
        limit: bytes, or ``{first training step: bytes}`` for a limit that changes during the run.
        ranks: the ranks the limit applies to (default: all); the others count without a limit.

    Example (in each rank's process)::

        with emulated_device_memory(4 << 20):
            trainer.fit(model)  # runs out of memory as a 4 MiB device would, and recovers
    """
    global _active
    if _active is not None:
        raise RuntimeError("emulated_device_memory is already active; nest no second one")
    memory = _active = EmulatedDeviceMemory(limit, ranks)
    try:
        yield memory
    finally:
        _active = None


def active() -> Optional[EmulatedDeviceMemory]:
    """The emulated device budget in force, if any."""
    return _active
