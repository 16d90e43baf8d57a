"""The cache policy: which gathered chunk to evict, and what to prefetch. Pure: chunk ids only.

[Note: one cache policy]
The runtime's cache (runtime/cache.py) executes this policy on real chunks; the search's
simulation (search/simulate.py) replays it over the profiled access sequence to count gathers.
Both take their decisions from these functions, so the simulation follows the runtime by
construction:

- eviction (Belady): among the unpinned gathered chunks, the one whose next use is furthest
  ahead; a chunk with no next use is furthest; ties go to the lower chunk index;
- prefetch: the next ``depth`` distinct chunks of the sequence that are not gathered, in order
  of next use (within one access, ascending index); a prefetch may evict only a chunk whose next
  use comes later than its own, and the first prefetch that cannot be placed ends the look-ahead.

This module imports nothing from torch or the rest of the package.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable, Sequence
from typing import Optional

NEVER = 1 << 62
"""The next use of a chunk that is not used again: further than any position."""


def furthest(candidates: Iterable[int], next_use: Callable[[int], int]) -> Optional[int]:
    """The candidate chunk used furthest ahead (ties: the lower index), or None without candidates."""
    return max(candidates, key=lambda c: (next_use(c), -c), default=None)


def prefetch_may_evict(victim_next_use: int, prefetch_use: int) -> bool:
    """Whether a prefetch for a use at ``prefetch_use`` may evict a chunk next used at ``victim_next_use``."""
    return victim_next_use > prefetch_use


class AccessOrder:
    """A recorded access sequence (the public chunk ids of each access) with next-use lookups."""

    def __init__(self, sequence: Sequence[tuple[int, ...]]) -> None:
        self.sequence = list(sequence)
        self._positions: dict[int, list[int]] = {}
        for i, ids in enumerate(self.sequence):
            for c in ids:
                self._positions.setdefault(c, []).append(i)

    def next_use(self, chunk: int, after: int) -> int:
        """The first position after ``after`` that uses ``chunk`` (NEVER if none)."""
        positions = self._positions.get(chunk, ())
        i = bisect.bisect_right(positions, after)
        return positions[i] if i < len(positions) else NEVER

    def upcoming(self, after: int, depth: int, wanted: Callable[[int], bool]) -> list[tuple[int, int]]:
        """The next ``depth`` distinct chunks after ``after`` for which ``wanted`` holds, with their use."""
        found: dict[int, int] = {}
        for pos in range(after + 1, len(self.sequence)):
            for c in self.sequence[pos]:
                if c not in found and wanted(c):
                    found[c] = pos
                    if len(found) == depth:
                        return list(found.items())
        return list(found.items())
