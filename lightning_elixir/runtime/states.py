"""The chunk state machine.

[Note: chunk states]
A public chunk is FREE (only this rank's shard exists), GATHERING (an all-gather into its block is
in flight), HOLD (gathered and evictable) or COMPUTE (gathered and pinned by at least one running
module, forward or backward). Private chunks never return to FREE within a step. After the
optimizer step every gathered chunk is stale: it goes back to FREE, or, in a plan whose chunks stay
gathered ([Note: resident plans] in protocol.py), back to GATHERING into the same block. Any other move is a bug in the
runtime and raises at once instead of computing with a released or half-gathered buffer.
"""

from __future__ import annotations

import enum


class ChunkState(enum.Enum):
    FREE = "free"
    GATHERING = "gathering"
    HOLD = "hold"
    COMPUTE = "compute"


_LEGAL: frozenset[tuple[ChunkState, ChunkState]] = frozenset({
    (ChunkState.FREE, ChunkState.GATHERING),
    (ChunkState.GATHERING, ChunkState.HOLD),
    (ChunkState.HOLD, ChunkState.COMPUTE),
    (ChunkState.COMPUTE, ChunkState.HOLD),
    (ChunkState.HOLD, ChunkState.FREE),
    (ChunkState.HOLD, ChunkState.GATHERING),
})


class IllegalTransition(RuntimeError):
    """A chunk was asked to move between states that the state machine does not connect."""


def check_transition(chunk_index: int, old: ChunkState, new: ChunkState) -> None:
    """Raise ``IllegalTransition`` unless ``old -> new`` is a legal move."""
    if (old, new) not in _LEGAL:
        raise IllegalTransition(f"chunk {chunk_index}: illegal transition {old.name} -> {new.name}")
