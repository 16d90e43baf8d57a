"""Shard views held elsewhere: empty on this rank, skipped by the optimizer, their scalars agreed on reads.

A model of several layers in one chunk on 2 ranks: each rank's shard holds about half of the
parameters, so the other half are empty views here ([Note: shard views held elsewhere] in optim.py).
The full optimizer state must still be the one a single process computes, ``step`` included, also for
a layer that first trains in the second step.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from lightning_elixir.plan import CACHE_ALL, ElixirPlan
from lightning_elixir.runtime.optim import optimizer_step, shard_optimizer
from lightning_elixir.runtime.state_dict import full_optimizer_state_dict
from tests.distributed import run_distributed

STEPS = 3
ROWS = 4


class Layers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(*(nn.Linear(8, 8) for _ in range(4)))
        self.late = nn.Linear(8, 8)  # unused in the first step, on every rank

    def forward(self, x: torch.Tensor, step: int) -> torch.Tensor:
        x = self.body(x)
        return self.late(x) if step > 0 else x


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(2 * ROWS, 8, generator=g), torch.randn(2 * ROWS, 8, generator=g)


def _train(rank: int, world_size: int) -> dict:
    from lightning_elixir.runtime.collectives import Group
    from lightning_elixir.runtime.runtime import ElixirRuntime

    torch.manual_seed(0)
    model = Layers()
    reference = Layers()
    reference.load_state_dict(model.state_dict())
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    runtime = ElixirRuntime(model, ElixirPlan(chunk_numel=640, cache_blocks=CACHE_ALL), group=Group.default())
    optimizer = shard_optimizer(runtime, torch.optim.AdamW(model.parameters(), lr=1e-2))
    rows = slice(rank * ROWS, (rank + 1) * ROWS)
    for step in range(STEPS):
        x, y = _batch(step)
        with runtime.step_region():
            runtime.begin_iteration()
            loss = F.mse_loss(model(x[rows], step), y[rows])
        loss.backward()
        optimizer_step(runtime, optimizer)
        optimizer.zero_grad()
        F.mse_loss(reference(x, step), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    views = [view for group in optimizer.param_groups for view in group["params"]]
    local_steps = [optimizer.state[v]["step"].item() if v.numel() == 0 else None for v in views]
    full = full_optimizer_state_dict(runtime, optimizer, everywhere=True)
    agreed_steps = [optimizer.state[v]["step"].item() for v in views]
    return {"local_steps": local_steps, "agreed_steps": agreed_steps, "full": full,
            "reference": ref_opt.state_dict()}


def test_views_held_elsewhere_skip_updates_and_agree_on_reads():
    for result in run_distributed(_train, 2):
        held_elsewhere = [s for s in result["local_steps"] if s is not None]
        assert held_elsewhere, "every view holds elements: the case is not exercised"
        assert all(s == 1 for s in held_elsewhere)  # stepped once, to make its state, then skipped
        ref, full = result["reference"]["state"], result["full"]["state"]
        assert sorted(full) == sorted(ref)
        for i, values in ref.items():
            assert full[i]["step"].item() == values["step"].item(), i
            for key in ("exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(full[i][key], values[key], rtol=1e-5, atol=1e-7)
        assert result["agreed_steps"] == [ref[i]["step"].item() for i in range(len(ref))]
        assert result["agreed_steps"][-1] == STEPS - 1  # the late layer first trained in the second step
