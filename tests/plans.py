"""Plans the tests build by hand."""

from __future__ import annotations

import dataclasses

import torch.nn as nn

from lightning_elixir.plan import ElixirPlan
from lightning_elixir.runtime.layout import resolve_specs


def on_host(module: nn.Module, plan: ElixirPlan) -> ElixirPlan:
    """``plan`` for one rank with every chunk's state on the host: at one rank only a plan that offloads
    gathers and releases chunks ([Note: a world of one] in runtime/chunk.py), so a test of eviction on
    one process offloads."""
    specs = resolve_specs(module, plan, 1)
    return dataclasses.replace(plan, world_size=1, chunks=tuple(dataclasses.replace(s, placement="cpu") for s in specs))


def split_on_host(module: nn.Module, world_size: int, chunk_numel: int) -> ElixirPlan:
    """Chunks of ``chunk_numel`` elements (parameters split over the ranks' shards where the packing puts
    them across a shard's end), every chunk's state on the host, two cache blocks."""
    plan = ElixirPlan(chunk_numel=chunk_numel, cache_blocks=2, prefetch_depth=1)
    specs = resolve_specs(module, plan, world_size)
    return dataclasses.replace(plan, world_size=world_size,
                               chunks=tuple(dataclasses.replace(s, placement="cpu") for s in specs))
