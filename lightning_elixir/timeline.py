"""Memory timelines: the device bytes of one optimizer step, position by position, by kind.

The search predicts one (search/timeline.py) and the runtime measures one (runtime/timeline.py) at
the same positions, so the two can be compared and logged side by side. This module imports nothing
from torch or the rest of the package: a timeline is plain data with a JSON round-trip.

[Note: timeline positions]
A position is one acquisition of public chunks by the runtime's cache: a module with parameters in
public chunks starting its forward (or its recomputation), or its backward. The positions of one
optimizer step are those of each micro-batch, concatenated. Accesses that need no public chunk
(modules holding only private parameters) are not positions: the cache does nothing there. The
bytes of a position are counted once the cache has gathered what the access needs and issued its
prefetches, before the module computes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Optional

RUNTIME_KINDS = ("params", "grads", "optimizer")
"""The kinds of bytes the runtime holds on the device, which a prediction must match exactly."""
KINDS = RUNTIME_KINDS + ("runtime", "activations", "total")
"""Every kind a timeline reports (``timeline[kind]``)."""


PHASE_LABELS = MappingProxyType({"forward": "fwd", "backward": "bwd", "recompute": "recompute"})
"""How a position's label names the phase of its access."""


def position_label(phase: str, module: str) -> str:
    """The label of a position: its phase and the qualified name of the module ("<root>" for the root)."""
    return f"{PHASE_LABELS[phase]} {module or '<root>'}"


class TimelineError(ValueError):
    """A timeline is malformed (series of different lengths, negative bytes, unknown keys)."""


@dataclass(frozen=True)
class MemoryTimeline:
    """Device bytes of one rank at every position of one optimizer step ([Note: timeline positions])."""

    labels: tuple[str, ...]
    """Per position, what acquires the chunks: "fwd h.0.attn", "bwd h.0.attn" or "recompute h.0.attn"."""
    params_bytes: tuple[int, ...]
    """Compute-dtype parameter shards of every chunk, gathered public chunks and gathered private chunks."""
    grads_bytes: tuple[int, ...]
    """Gradient shards on the device, plus the full-chunk gradient buffers and reduce-scatter outputs
    held at that point of backward."""
    optimizer_bytes: tuple[int, ...]
    """fp32 masters held apart from the parameter shards, and per-element optimizer state, of the
    chunks whose state is on the device."""
    activation_bytes: Optional[tuple[int, ...]] = None
    """Activations and temporaries alive at the position: the profile's for a prediction, what the
    device's allocator holds beyond the runtime's bytes for a measurement. None: not known (a
    measurement on a device without allocator statistics)."""
    budget_bytes: Optional[int] = None
    """Device memory the plan was searched for, if known."""
    micro_batches: int = 1
    """Micro-batches in the step (each contributes the same number of positions)."""

    def __post_init__(self) -> None:
        n = len(self.labels)
        object.__setattr__(self, "labels", tuple(str(label) for label in self.labels))
        for name in ("params_bytes", "grads_bytes", "optimizer_bytes", "activation_bytes"):
            series = getattr(self, name)
            if series is None:
                continue
            series = tuple(series)
            object.__setattr__(self, name, series)
            if len(series) != n:
                raise TimelineError(f"{name} has {len(series)} positions, labels have {n}")
            if any(not _is_int(v) or v < 0 for v in series):
                raise TimelineError(f"{name} must hold ints >= 0")
        if self.budget_bytes is not None and (not _is_int(self.budget_bytes) or self.budget_bytes <= 0):
            raise TimelineError(f"budget_bytes must be a positive int or None, got {self.budget_bytes!r}")
        if not _is_int(self.micro_batches) or self.micro_batches < 1:
            raise TimelineError(f"micro_batches must be an int >= 1, got {self.micro_batches!r}")

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, kind: str) -> Optional[tuple[int, ...]]:
        """The series of one of ``KINDS`` (None for "activations" and "total" when activations are unknown)."""
        if kind not in KINDS:
            raise KeyError(f"unknown kind {kind!r}; use one of {KINDS}")
        if kind in ("runtime", "total"):
            return getattr(self, f"{kind}_bytes")
        return getattr(self, "activation_bytes" if kind == "activations" else f"{kind}_bytes")

    @property
    def runtime_bytes(self) -> tuple[int, ...]:
        """Everything the runtime holds on the device: params + grads + optimizer."""
        return tuple(map(sum, zip(self.params_bytes, self.grads_bytes, self.optimizer_bytes)))

    @property
    def total_bytes(self) -> Optional[tuple[int, ...]]:
        """Runtime bytes plus activations (None when activations are unknown)."""
        if self.activation_bytes is None:
            return None
        return tuple(r + a for r, a in zip(self.runtime_bytes, self.activation_bytes))

    def peak(self, kind: str = "total") -> Optional[tuple[int, str]]:
        """The largest value of ``kind`` and the label of its first position (None if unknown or empty)."""
        series = self[kind]
        if not series:
            return None
        i = max(range(len(series)), key=lambda p: (series[p], -p))
        return series[i], self.labels[i]

    def differences(self, other: "MemoryTimeline", kinds: Sequence[str] = RUNTIME_KINDS
                    ) -> tuple[tuple[int, str, int, int], ...]:
        """Where ``other`` disagrees with this timeline: (position, kind, this value, other value).

        Raises:
            TimelineError: when the two have different numbers of positions.
        """
        if len(other) != len(self):
            raise TimelineError(f"timelines of {len(self)} and {len(other)} positions cannot be compared position "
                                f"by position; were they recorded for the same plan and micro-batches?")
        return tuple((p, kind, a, b) for kind in kinds for p, (a, b) in enumerate(zip(self[kind], other[kind]))
                     if a != b)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (lists for the series)."""
        data = dataclasses.asdict(self)
        return {k: list(v) if isinstance(v, tuple) else v for k, v in data.items()}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "MemoryTimeline":
        """The timeline ``to_dict`` wrote.

        Raises:
            TimelineError: on unknown or missing keys, or malformed series.
        """
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise TimelineError(f"unknown MemoryTimeline key(s) {unknown}; known keys are {sorted(known)}")
        try:
            return cls(**data)
        except TypeError as err:
            raise TimelineError(f"not a MemoryTimeline: {err}") from None


def _is_int(value: Any) -> bool:
    """An int that is not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)
