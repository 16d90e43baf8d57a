"""Offloaded chunks ("cpu", "nvme") train exactly as on the device: 2 gloo ranks, the example GPT.

Every case trains the same model twice from the same weights, once with every chunk's state on the
device and once with chunks spread over "device", "cpu" and "nvme", and compares losses and weights.
On a CPU-only machine the shadows run torch's CPU default, as the device chunks do, so the two
agree to rounding (see [Note: shadow optimizers]).
"""

from __future__ import annotations

import contextlib
import copy
import threading
import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

import pytest
import torch

from lightning_elixir.demos.gpt import GPT
from lightning_elixir.plan import ElixirPlan
from lightning_elixir.runtime.layout import resolve_specs
from lightning_elixir.runtime.nvme import NvmeError
from lightning_elixir.runtime.offload import worker_threads
from lightning_elixir.runtime.optim import DynamicLossScaler, optimizer_step, shard_optimizer
from lightning_elixir.runtime.runtime import ElixirRuntime
from lightning_elixir.runtime.state_dict import (full_optimizer_state_dict, full_state_dict,
                                                 load_full_optimizer_state_dict, load_full_state_dict)
from tests.distributed import run_distributed
from tests.optimizers import Lion, TrustRatioAdam
from tests.plans import on_host
from tests.runtime.workloads import NO_BIAS, Run, _dtypes, batches, loss_of

CHUNK_NUMEL = 4097
MIXED = ("device", "cpu", "nvme")


@dataclass(frozen=True)
class Case:
    """One training setup, run all-device and mixed."""

    optimizer: str = "adamw"
    steps: int = 6
    micro_batches: int = 1
    clip_norm: Optional[float] = None
    schedule: bool = False
    precision: str = "32-true"
    inf_grad_at: Optional[tuple[int, int]] = None
    assigned_every: int = 0
    """Every this many steps, gradients are assigned (``p.grad = g``) instead of computed by a backward."""


def make_optimizer(kind: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    if kind == "adam":
        return torch.optim.Adam(model.parameters(), lr=3e-3)
    if kind == "adamw":  # per-group weight decay and betas
        return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0,
                                  "betas": (0.8, 0.9)}], lr=3e-3, betas=(0.9, 0.95))
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-4)
    if kind == "adafactor":  # not element-wise: a step of the runtime's own ([Note: Adafactor on shards])
        return torch.optim.Adafactor([{"params": decay, "weight_decay": 0.1}, {"params": rest}], lr=3e-3)
    if kind == "lion":  # declared element-wise: the shadows are instances of a class torch does not ship
        return Lion(model.parameters(), lr=1e-3, weight_decay=0.1)
    if kind == "trust_ratio":  # declared per-parameter: its own step on whole parameters ([Note: per-parameter optimizers])
        return TrustRatioAdam([{"params": decay, "weight_decay": 0.1}, {"params": rest}], lr=3e-3)
    raise ValueError(kind)


def placed_plan(model: torch.nn.Module, world_size: int, placements: tuple[str, ...]) -> ElixirPlan:
    """The default packing with chunk ``i`` placed at ``placements[i % len(placements)]``."""
    specs = resolve_specs(model, ElixirPlan(chunk_numel=CHUNK_NUMEL), world_size)
    chunks = tuple(dataclasses.replace(s, placement=placements[i % len(placements)]) for i, s in enumerate(specs))
    return ElixirPlan(chunks=chunks, world_size=world_size, cache_blocks="min+1", name="placed")


def train(rank: int, model: torch.nn.Module, plan: ElixirPlan, case: Case, nvme_path: str,
          start: Optional[dict] = None, stop_after: Optional[int] = None) -> dict[str, Any]:
    """Train ``case`` on ``model`` under ``plan``; optionally resume from / stop into a full checkpoint."""
    compute, master, autocast = _dtypes(case.precision)
    runtime = ElixirRuntime(model, plan, compute_dtype=compute, master_dtype=master, nvme_path=nvme_path)
    if case.precision == "16-mixed":
        runtime.scaler = DynamicLossScaler(scale=2.0 ** 8)
    optimizer = shard_optimizer(runtime, make_optimizer(case.optimizer, model))
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5) if case.schedule else None
    first = 0
    if start is not None:
        load_full_state_dict(runtime, start["model"])
        load_full_optimizer_state_dict(runtime, optimizer, start["optimizer"])
        first = start["step"]
    run = Run(plan, micro_batches=case.micro_batches, config=NO_BIAS)
    losses, stepped = [], []
    for step in range(first, case.steps if stop_after is None else stop_after):
        handle = None
        if case.inf_grad_at == (step, rank):
            handle = next(p for p in model.parameters()).register_hook(lambda g: torch.full_like(g, float("inf")))
        if case.assigned_every and step % case.assigned_every == 0:  # no backward: every gradient assigned
            gen = torch.Generator().manual_seed(step)
            with runtime.step_region():
                runtime.begin_iteration()
                for p in model.parameters():
                    p.grad = 0.01 * torch.randn(p.shape, generator=gen)
        for x, y in [] if case.assigned_every and step % case.assigned_every == 0 else batches(rank, run, step):
            loss = loss_of(model, x, y, autocast) / case.micro_batches
            losses.append(loss.item())
            (runtime.scaler.scale_loss(loss) if runtime.scaler else loss).backward()
        if handle is not None:
            handle.remove()
        stepped.append(optimizer_step(runtime, optimizer, case.clip_norm))
        optimizer.zero_grad()
        if scheduler is not None:
            scheduler.step()
    out = {"losses": losses, "stepped": stepped, "stats": runtime.memory_stats(),
           "model": full_state_dict(runtime, everywhere=True),
           "optimizer": full_optimizer_state_dict(runtime, optimizer, everywhere=True), "step": step + 1}
    runtime.restore_module()
    return out


def _parity(rank: int, world_size: int, cases: list[Case], nvme_path: str) -> list[dict]:
    results = []
    for case in cases:
        torch.manual_seed(0)
        base = GPT(NO_BIAS)
        out = {}
        for name, placements in (("device", ("device",)), ("mixed", MIXED)):
            model = copy.deepcopy(base)
            out[name] = train(rank, model, placed_plan(model, world_size, placements), case, nvme_path)
        results.append(out)
    return results


CASES = {
    "adam": Case("adam"),
    "adamw-groups": Case("adamw"),
    "sgd-momentum": Case("sgd"),
    "declared-lion": Case("lion"),
    "lr-schedule": Case("adamw", schedule=True),
    "clip-norm": Case("adamw", clip_norm=0.05),
    "accumulation": Case("adamw", micro_batches=3, steps=4),
    "16-mixed-overflow": Case("adamw", precision="16-mixed", inf_grad_at=(2, 1)),
    "assigned-without-backward": Case("adamw", assigned_every=2, clip_norm=0.05),
}


@pytest.fixture(scope="module")
def parity(tmp_path_factory):
    nvme = tmp_path_factory.mktemp("nvme")
    results = run_distributed(_parity, 2, list(CASES.values()), str(nvme))
    assert not any(nvme.iterdir()), "the runtime left NVMe files behind"
    return dict(zip(CASES, zip(*results)))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


def _assert_same(a: dict, b: dict, tol: float) -> None:
    assert len(a["losses"]) == len(b["losses"])
    for x, y in zip(a["losses"], b["losses"]):
        assert abs(x - y) <= tol * abs(y), (x, y)
    assert a["model"].keys() == b["model"].keys()
    for key, ref in b["model"].items():
        assert _rel(a["model"][key], ref) <= tol, key


@pytest.mark.parametrize("name", list(CASES))
def test_mixed_placement_trains_as_all_device(parity, name):
    for rank_result in parity[name]:
        _assert_same(rank_result["mixed"], rank_result["device"], 1e-6)


def test_optimizer_state_matches_all_device(parity):
    for rank_result in parity["adamw-groups"]:
        mixed, device = rank_result["mixed"]["optimizer"], rank_result["device"]["optimizer"]
        assert mixed["param_groups"] == device["param_groups"]
        assert mixed["state"].keys() == device["state"].keys()
        for i, ref in device["state"].items():
            assert _rel(mixed["state"][i]["exp_avg_sq"], ref["exp_avg_sq"]) <= 1e-6, i


def test_overflow_step_is_skipped_everywhere(parity):
    for rank_result in parity["16-mixed-overflow"]:
        assert rank_result["mixed"]["stepped"] == rank_result["device"]["stepped"]
        assert rank_result["mixed"]["stepped"][2] is False


def test_byte_counters_follow_placement(parity):
    stats = parity["adam"][0]["mixed"]["stats"]
    assert stats["host_bytes"] > 0 and stats["nvme_bytes"] > 0 and stats["device_state_bytes"] > 0
    device = parity["adam"][0]["device"]["stats"]
    assert device["host_bytes"] == 0 and device["nvme_bytes"] == 0


def _resume(rank: int, world_size: int, nvme_path: str) -> dict:
    """Train 2 steps under one placement, resume from the full checkpoint under the other, and back."""
    case = Case("adamw", steps=5)
    torch.manual_seed(0)
    base = GPT(NO_BIAS)
    out = {}
    for first, second in ((MIXED, ("device",)), (("device",), MIXED)):
        model = copy.deepcopy(base)
        head = train(rank, model, placed_plan(model, world_size, first), case, nvme_path, stop_after=2)
        plain = copy.deepcopy(base)
        plain.load_state_dict(head["model"])  # the full checkpoint is a plain module's state dict
        tail = train(rank, plain, placed_plan(plain, world_size, second), case, nvme_path, start=head)
        out[first[-1]] = head["losses"] + tail["losses"]
    model = copy.deepcopy(base)
    out["reference"] = train(rank, model, placed_plan(model, world_size, ("device",)), case, nvme_path)["losses"]
    return out


def test_checkpoints_move_between_placements(tmp_path):
    for result in run_distributed(_resume, 2, str(tmp_path)):
        for name in ("nvme", "device"):
            assert result[name] == pytest.approx(result["reference"], rel=1e-6), name


def _corrupt_then_step(rank: int, world_size: int, nvme_path: str, how: str) -> str:
    torch.manual_seed(0)
    model = GPT(NO_BIAS)
    runtime = ElixirRuntime(model, placed_plan(model, world_size, ("nvme",)), nvme_path=nvme_path)
    optimizer = shard_optimizer(runtime, make_optimizer("adam", model))
    record = runtime.offload.store.record_path(runtime.offload.nvme[-1].index)
    data = bytearray(record.read_bytes())
    if how == "truncate":
        record.write_bytes(bytes(data[: len(data) // 2]))
    else:
        data[-100] ^= 0x01
        record.write_bytes(bytes(data))
    x, y = batches(rank, Run(ElixirPlan(), config=NO_BIAS), 0)[0]
    loss_of(model, x, y, None).backward()
    try:
        optimizer_step(runtime, optimizer)
        loss_of(model, x, y, None)  # the next gather of the chunk waits for its update
        runtime.offload.settle()
    except NvmeError as err:
        return str(err)
    finally:
        with contextlib.suppress(NvmeError):  # the failed update's error is raised again on close
            runtime.offload.close()
    return "no error"


@pytest.mark.parametrize("how", ["truncate", "flip"])
def test_corrupted_nvme_record_is_a_clear_error(tmp_path, how):
    messages = run_distributed(_corrupt_then_step, 1, str(tmp_path), how)
    assert "chunk" in messages[0] and str(tmp_path) in messages[0], messages[0]


def test_the_worker_leaves_a_core_to_the_thread_that_feeds_an_accelerator():
    assert worker_threads(torch.device("cuda"), 16) == 15 and worker_threads(torch.device("cuda"), 1) == 1
    assert worker_threads(torch.device("cpu"), 16) == 16  # there the compute wants every core
    main = torch.get_num_threads()
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    runtime = ElixirRuntime(model, on_host(model, ElixirPlan(chunk_numel=80, cache_blocks="all")))
    try:
        assert runtime.offload._worker.submit(torch.get_num_threads).result() == main
        assert torch.get_num_threads() == main
    finally:
        runtime.offload.close()
        runtime.restore_module()


def test_the_worker_takes_the_landed_update_needed_first():
    # Every chunk's update starts in backward while the worker is held busy: gradients land last layer
    # first, and the worker, once free, takes them in the forward's order ([Note: updates started in backward]).
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(8, 8) for _ in range(4)))
    runtime = ElixirRuntime(model, on_host(model, ElixirPlan(chunk_numel=72, cache_blocks="all")))
    optimizer = shard_optimizer(runtime, torch.optim.AdamW(model.parameters(), lr=1e-2))
    engine, order, gate = runtime.offload, [], threading.Event()
    update = engine._update
    engine._update = lambda job, read: (order.append(job.chunk.index), update(job, read))
    try:
        engine._worker.submit(gate.wait)
        engine.early = True
        try:
            model(torch.randn(2, 8)).square().mean().backward()
        finally:
            engine.early = False
            gate.set()
        optimizer_step(runtime, optimizer)
        engine.settle()
        assert engine.early_updates == len(runtime.chunks) == 4
        assert order == sorted(order)  # landed 3, 2, 1, 0; run 0, 1, 2, 3
    finally:
        engine.close()
        runtime.restore_module()


def test_host_updates_drop_the_settings_only_a_gpu_accepts():
    """A user's optimizer made for GPU tensors (capturable, an lr tensor, a fused kernel the host lacks)
    steps the offloaded chunks' host shadows with settings the host accepts: same values otherwise."""
    from lightning_elixir.runtime.shadow import host_hyperparameters

    group = {"params": [], "lr": torch.tensor(0.01), "capturable": True, "fused": True, "betas": (0.9, 0.99)}
    adamw = host_hyperparameters(group, torch.optim.AdamW)
    assert adamw == {"lr": pytest.approx(0.01), "capturable": False, "fused": True, "betas": (0.9, 0.99)}
    assert type(adamw["lr"]) is float
    assert host_hyperparameters(group, torch.optim.RMSprop)["fused"] is None  # no fused RMSprop on the host
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.ones(3)
    torch.optim.AdamW([{**adamw, "params": [p]}]).step()  # the host accepts them
    assert torch.isfinite(p).all() and not torch.equal(p.detach(), torch.ones(3))
