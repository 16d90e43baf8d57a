"""The bottom of the step protocol: every chunk, every hook unit, and where each parameter lives.

The layers above read and change this table and nothing else of each other's: the cache
(cache.py) gathers and evicts its public chunks, the read guard (access.py) serves reads the hooks
do not cover, the gradient flow (grads.py) lands gradients in the chunks' shards, and the hook
protocol (protocol.py) drives all three from the module's hooks. See [Note: the step protocol] in
protocol.py for the picture.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Optional

import torch.nn as nn
from torch.utils.hooks import RemovableHandle

from lightning_elixir.runtime.chunk import Chunk, Slot
from lightning_elixir.runtime.states import ChunkState


@dataclass(eq=False)
class UnitState:
    """One hook unit ([Note: hook units] in units.py) of the running module and its bookkeeping."""

    name: str
    module: nn.Module
    params: tuple[nn.Parameter, ...]
    """The parameters it owns (its subtree's, less those of units inside it)."""
    chunks: tuple[Chunk, ...]
    """The chunks holding them."""
    public_ids: tuple[int, ...]
    """The public chunks among them, ascending: what the unit gathers and pins."""
    param_ids: frozenset[int]
    trainable: frozenset[int] = frozenset()
    """ids of its trainable parameters in public chunks (what its backward waits for)."""
    active: int = 0
    """Forward calls of this unit running right now (its chunks are pinned, its parameters plain)."""
    calls: list[Any] = field(default_factory=list)
    """Calls of this step whose backward has not finished (``protocol.BackwardCall``)."""
    handles: list[RemovableHandle] = field(default_factory=list)

    @property
    def gathered(self) -> bool:
        """Whether every chunk it needs is gathered (its parameters can be read without asking)."""
        return all(c.state in (ChunkState.HOLD, ChunkState.COMPUTE) for c in self.chunks)


class ChunkTable:
    """The chunks of a runtime, its hook units and the optimizer's shard views, with lookups."""

    def __init__(self, chunks: list[Chunk]) -> None:
        self.chunks = chunks
        self.public = [c for c in chunks if not c.private]
        self.private = [c for c in chunks if c.private]
        self._where: dict[int, tuple[Chunk, Slot]] = {id(s.param): (c, s) for c in chunks for s in c.slots}
        self.units: list[UnitState] = []
        self._owner: dict[int, UnitState] = {}
        self.views: dict[int, nn.Parameter] = {}
        """The optimizer's shard view of each parameter (by the parameter's id), made once."""
        self.private_gathers = 0

    # ---- parameters ---------------------------------------------------------------------------

    def where(self, param: nn.Parameter) -> tuple[Chunk, Slot]:
        """The chunk and slot of one of the module's parameters."""
        return self._where[id(param)]

    def holds(self, param: nn.Parameter) -> bool:
        return id(param) in self._where

    def is_public(self, param: nn.Parameter) -> bool:
        return not self._where[id(param)][0].private

    def public_chunk_ids(self, params: Iterable[nn.Parameter]) -> tuple[int, ...]:
        """The public chunks holding ``params``, in chunk order."""
        return tuple(sorted({c.index for c, _ in (self._where[id(p)] for p in params) if not c.private}))

    def param_ids(self) -> set[int]:
        """ids of every parameter the chunks hold."""
        return set(self._where)

    def parameters(self) -> list[nn.Parameter]:
        return [s.param for c in self.chunks for s in c.slots]

    # ---- units --------------------------------------------------------------------------------

    def set_units(self, units: list[UnitState]) -> None:
        self.units = units
        self._owner = {id(p): unit for unit in units for p in unit.params}

    def owner(self, param: nn.Parameter) -> Optional[UnitState]:
        """The hook unit that owns ``param`` (None for a parameter no unit owns)."""
        return self._owner.get(id(param))

    def owner_of(self, pid: int) -> Optional[UnitState]:
        """``owner`` by the parameter's id."""
        return self._owner.get(pid)

    # ---- chunks -------------------------------------------------------------------------------

    def gather_private(self, chunk: Chunk) -> None:
        chunk.start_gather(async_op=False)
        chunk.finish_gather()
        self.private_gathers += 1

    def chunk_views(self, chunk: Chunk) -> list[tuple[Slot, nn.Parameter]]:
        """The optimizer's shard views of ``chunk``'s parameters, with their slots."""
        return [(s, self.views[id(s.param)]) for s in chunk.slots if id(s.param) in self.views]

    def view_index(self) -> dict[int, tuple[Chunk, Slot]]:
        """For each optimizer shard view (by id), the chunk and slot of its parameter."""
        return {id(view): self._where[pid] for pid, view in self.views.items()}

    def clear(self) -> None:
        """Forget every chunk (the module was detached from them)."""
        self.chunks, self.public, self.private = [], [], []
        self._where.clear()
        self.views.clear()
        self.units, self._owner = [], {}
