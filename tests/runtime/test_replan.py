"""Switching plans in place (runtime/replan.py): 2 gloo ranks, the example GPT, AdamW with a schedule.

Each case trains the same model from the same weights twice: under plan B from the start, and under
plan A for a few steps, switched to B, then on. After the switch the losses, weights and full
optimizer state match the uninterrupted run of B within fp32 rounding, and so does a companion
shard (a running sum of the weights, as an EMA keeps); the optimizer objects are the same ones (a
scheduler built on them keeps working).
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Optional

import pytest
import torch

from lightning_elixir.demos.gpt import GPT
from lightning_elixir.plan import CACHE_ALL, CACHE_MIN, ElixirPlan
from lightning_elixir.runtime.layout import resolve_specs
from lightning_elixir.runtime.optim import optimizer_step, shard_optimizer
from lightning_elixir.runtime.replan import new_ranges, switch_plan
from lightning_elixir.runtime.runtime import ElixirRuntime
from lightning_elixir.runtime.state_dict import full_optimizer_state_dict, full_state_dict
from tests.distributed import run_distributed
from tests.runtime.test_offload import make_optimizer
from tests.runtime.workloads import NO_BIAS, Run, batches, loss_of

STEPS, SWITCH_AT = 6, 3
ZERO3 = ElixirPlan(chunk_numel=4096, cache_blocks=CACHE_MIN, prefetch_depth=1, name="small-zero3")
ZERO2 = ElixirPlan(chunk_numel=8192, cache_blocks=CACHE_ALL, name="large-zero2")


def offload_plan(world_size: int, placements: tuple[str, ...]) -> ElixirPlan:
    specs = resolve_specs(GPT(NO_BIAS), ElixirPlan(chunk_numel=5000), world_size)
    chunks = tuple(dataclasses.replace(s, placement=placements[i % len(placements)]) for i, s in enumerate(specs))
    return ElixirPlan(chunks=chunks, world_size=world_size, cache_blocks="min", name="offloaded")


def _train(rank: int, model: torch.nn.Module, first: ElixirPlan, then: Optional[ElixirPlan],
           nvme_path: Optional[str], kind: str = "adamw") -> dict[str, Any]:
    runtime = ElixirRuntime(model, first, nvme_path=nvme_path)
    runtime.add_companion("sum")  # a running sum of the weights: the switch must carry it
    optimizer = shard_optimizer(runtime, make_optimizer(kind, model))
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    run = Run(first, config=NO_BIAS)
    losses = []
    for step in range(STEPS):
        if step == SWITCH_AT and then is not None:
            runtime = switch_plan(runtime, then)
        for x, y in batches(rank, run, step):
            loss = loss_of(model, x, y, None)
            losses.append(loss.item())
            loss.backward()
        optimizer_step(runtime, optimizer)
        optimizer.zero_grad()
        scheduler.step()
        with torch.no_grad():
            for chunk, shard in zip(runtime.chunks, runtime.companions["sum"]):
                with runtime.offload.resident(chunk):
                    shard.add_(chunk.master.to(shard.device))
    out = {"losses": losses, "sum": _companion(runtime, "sum"), "model": full_state_dict(runtime, everywhere=True),
           "optimizer": full_optimizer_state_dict(runtime, optimizer, everywhere=True),
           "plan": runtime.plan.name, "chunks": len(runtime.chunks), "in_optimizer": runtime.optimizers == [optimizer],
           "placements": sorted({c.placement for c in runtime.chunks})}
    runtime.restore_module()
    return out


def _companion(runtime: ElixirRuntime, name: str) -> dict[str, torch.Tensor]:
    """A companion's full value per parameter name, gathered on every rank."""
    out = {}
    for chunk, shard in zip(runtime.chunks, runtime.companions[name]):
        full = chunk.gather_full(shard).cpu()
        out.update({slot.name: full[slot.offset:slot.end].clone() for slot in chunk.slots})
    return out


def _cases(rank: int, world_size: int, pairs: list[tuple[ElixirPlan, ElixirPlan, str]], nvme_path: str) -> list[dict]:
    results = []
    for first, then, kind in pairs:
        torch.manual_seed(0)
        base = GPT(NO_BIAS)
        results.append({"switched": _train(rank, copy.deepcopy(base), first, then, nvme_path, kind),
                        "reference": _train(rank, copy.deepcopy(base), then, None, nvme_path, kind)})
    return results


def _pairs() -> list[tuple[ElixirPlan, ElixirPlan, str]]:
    """AdamW's; a per-parameter optimizer's, with state of another shape than its parameter held whole; and
    Adafactor's, whose factored moments every rank holds whole (neither on NVMe, which they refuse)."""
    mixed = offload_plan(2, ("device", "cpu", "nvme"))
    pairs = [(ZERO3, ZERO2, "adamw"), (ZERO2, ZERO3, "adamw"), (ZERO2, mixed, "adamw"), (mixed, ZERO3, "adamw"),
             (offload_plan(2, ("device", "cpu")), ZERO3, "trust_ratio")]
    if hasattr(torch.optim, "Adafactor"):
        pairs.append((ZERO3, offload_plan(2, ("device", "cpu")), "adafactor"))
    return pairs


@pytest.fixture(scope="module")
def switched(tmp_path_factory):
    nvme = tmp_path_factory.mktemp("nvme")
    return run_distributed(_cases, 2, _pairs(), str(nvme))


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.allclose(a.float(), b.float(), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("case", range(6), ids=["zero3-to-zero2", "zero2-to-zero3", "zero2-to-offload",
                                                  "offload-to-zero3", "offload-to-zero3-per-parameter",
                                                  "zero3-to-offload-adafactor"])
def test_switch_continues_as_the_new_plan(switched, case):
    if case >= len(switched[0]):
        pytest.skip("torch.optim.Adafactor is new in torch 2.5")
    for rank in switched:
        switched_run, reference = rank[case]["switched"], rank[case]["reference"]
        assert switched_run["plan"] == reference["plan"] and switched_run["chunks"] == reference["chunks"]
        assert switched_run["placements"] == reference["placements"]
        assert switched_run["in_optimizer"]
        torch.testing.assert_close(torch.tensor(switched_run["losses"]), torch.tensor(reference["losses"]),
                                   rtol=1e-5, atol=1e-6)
        for key, value in reference["model"].items():
            assert _close(switched_run["model"][key], value), key
        assert switched_run["sum"].keys() == reference["sum"].keys()
        for key, value in reference["sum"].items():  # the companion went along ([Note: companion shards])
            assert _close(switched_run["sum"][key], value), key
        ref_state, got_state = reference["optimizer"]["state"], switched_run["optimizer"]["state"]
        assert sorted(ref_state) == sorted(got_state)
        for i, entries in ref_state.items():
            assert sorted(entries) == sorted(got_state[i])
            for key, value in entries.items():
                assert _close(torch.as_tensor(got_state[i][key]), torch.as_tensor(value)), (i, key)
        assert [g["lr"] for g in switched_run["optimizer"]["param_groups"]] == \
            [g["lr"] for g in reference["optimizer"]["param_groups"]]


def test_new_ranges_cover_every_element_once():
    model = GPT(NO_BIAS)
    numels = {n: p.numel() for n, p in model.named_parameters()}
    specs = resolve_specs(model, ElixirPlan(chunk_numel=5000), 3)
    covered = {n: 0 for n in numels}
    for rank in range(3):
        for name, (begin, end) in new_ranges(specs, numels, rank, 3).items():
            assert 0 <= begin <= end <= numels[name]
            covered[name] += end - begin
    assert covered == numels
