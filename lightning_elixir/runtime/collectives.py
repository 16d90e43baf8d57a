"""Every collective the runtime issues, as free functions over one process group.

With a world size of 1 (or no initialised process group) each one degenerates to a local copy,
so a single process runs the same code path without ``torch.distributed``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.autograd.profiler import record_function


@dataclass(frozen=True)
class Group:
    """The data-parallel process group the chunks are sharded over."""

    pg: Optional[Any]
    """The torch process group (None: the default group, or no distributed at all)."""
    rank: int
    """This process's rank in the group."""
    world_size: int
    """Number of ranks in the group."""

    @classmethod
    def default(cls) -> "Group":
        """The default (world) group, or a single-process group when distributed is not initialised."""
        if not (dist.is_available() and dist.is_initialized()):
            return cls(None, 0, 1)
        return cls(None, dist.get_rank(), dist.get_world_size())


# torch 2.13 renamed the *_into_tensor / *_tensor collectives; keep working on both sides of it.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class _Done:
    """A finished work handle, for the single-process path."""

    def wait(self) -> bool:
        return True


def all_gather(out: torch.Tensor, shard: torch.Tensor, group: Group, async_op: bool = False) -> Any:
    """Gather every rank's ``shard`` into ``out`` (rank order). Returns a work handle if async."""
    with record_function("Elixir::all_gather"):
        if group.world_size == 1:
            out.copy_(shard)
            return _Done() if async_op else None
        return _all_gather_flat(out, shard, group=group.pg, async_op=async_op)


def reduce_scatter(out: torch.Tensor, full: torch.Tensor, group: Group, async_op: bool = False) -> Any:
    """Sum ``full`` over ranks and leave this rank's slice in ``out``."""
    with record_function("Elixir::reduce_scatter"):
        if group.world_size == 1:
            out.copy_(full)
            return _Done() if async_op else None
        return _reduce_scatter_flat(out, full, op=dist.ReduceOp.SUM, group=group.pg, async_op=async_op)


def all_reduce_sum(tensor: torch.Tensor, group: Group) -> torch.Tensor:
    """Sum ``tensor`` over ranks in place."""
    if group.world_size > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group.pg)
    return tensor


def all_reduce_max(tensor: torch.Tensor, group: Group) -> torch.Tensor:
    """Take the elementwise max of ``tensor`` over ranks in place."""
    if group.world_size > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group.pg)
    return tensor


def broadcast(tensor: torch.Tensor, group: Group, src: int = 0) -> torch.Tensor:
    """Overwrite ``tensor`` with rank ``src``'s copy (``src`` is a rank of the group)."""
    if group.world_size > 1:
        global_src = src if group.pg is None else dist.get_global_rank(group.pg, src)
        dist.broadcast(tensor, global_src, group=group.pg)
    return tensor
