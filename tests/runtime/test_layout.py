"""The runtime's chunk layouts without a plan's own: every shard on the 64-element grid."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from lightning_elixir import ElixirPlan
from lightning_elixir.plan import ALIGN_NUMEL, ChunkSpec
from lightning_elixir.runtime.layout import resolve_specs


class _Mixed(nn.Module):
    """Public fp32 layers, a tied embedding and head (a private chunk), a layer kept in bf16 (its own chunk)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(37, 12)
        self.inp = nn.Linear(12, 20)
        self.mid = nn.Linear(20, 20).to(torch.bfloat16)
        self.head = nn.Linear(12, 37, bias=False)
        self.head.weight = self.embed.weight


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("chunk_numel", [None, 301])
def test_every_shard_of_a_default_packing_starts_on_the_grid(world_size, chunk_numel):
    """[Note: shards on the vector grid]: public, tied and own-dtype chunks alike."""
    specs = resolve_specs(_Mixed(), ElixirPlan(chunk_numel=chunk_numel), world_size)
    assert {n for s in specs for n in s.params} == {n for n, _ in _Mixed().named_parameters()}
    assert any(s.private for s in specs) and any(not s.private for s in specs)
    assert all(s.numel % (world_size * ALIGN_NUMEL) == 0 for s in specs), [s.numel for s in specs]


def test_a_layout_given_in_the_plan_runs_as_given():
    model = _Mixed()
    chunks = tuple(ChunkSpec((name,), -(-p.numel() // 2) * 2, private=name == "embed.weight")
                   for name, p in model.named_parameters())
    assert resolve_specs(model, ElixirPlan(chunks=chunks, world_size=2), 2) == chunks
