"""plan="auto" end to end: the search's simulation agrees with the runtime; planning through the Trainer."""

from __future__ import annotations

import copy
import dataclasses
import json
import os
from types import SimpleNamespace

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback

from lightning_elixir.demos.gpt import GPT, BigramDataModule, GPTConfig, GPTLightningModule
from lightning_elixir import ElixirPlan, ElixirStrategy, per_parameter_optimizer
from lightning_elixir import planner
from lightning_elixir.planner import OffloadSettings, budget_bytes, plan_automatically
from lightning_elixir.profile import profile_model
from lightning_elixir.runtime.collectives import Group
from lightning_elixir.runtime.optim import StateFootprint, optimizer_step, shard_optimizer
from lightning_elixir.runtime.runtime import ElixirRuntime
from lightning_elixir.search import NoPlanFitsError, build_layout, simulate_gathers
from lightning_elixir.search.layout import access_chunks
from lightning_elixir.search.simulate import min_cache_blocks
from tests.distributed import free_port, run_distributed

CONFIG = GPTConfig(vocab_size=64, block_size=16, n_layer=3, n_head=2, n_embd=32)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randint(64, (2, 16), generator=torch.Generator().manual_seed(0))
    return x, torch.roll(x, -1, 1)


def _step(model: torch.nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten())


@pytest.fixture(scope="module")
def gpt_profile():
    torch.manual_seed(0)
    return GPT(CONFIG), profile_model(GPT(CONFIG), _batch(), step_fn=_step)


GATHER_CASES = [(chunk_numel, blocks, prefetch) for chunk_numel in (4097, 12000)
                for blocks, prefetch in (("all", 1), ("min", 0), ("min", 1), ("min+1", 1), ("min+2", 2),
                                         (0, 0), (1, 1), (1, 2), (3, 2))]
"""(chunk_numel, cache blocks, prefetch depth); an int is that many blocks beyond the fewest, given as a count."""


def _gather_plan(profile, world_size: int, chunk_numel: int, blocks, prefetch: int) -> ElixirPlan:
    layout = build_layout(profile, chunk_numel, world_size=world_size)
    if isinstance(blocks, int):
        blocks += min_cache_blocks(access_chunks(layout, profile))
    return ElixirPlan(chunks=layout.chunks, world_size=world_size, cache_blocks=blocks, prefetch_depth=prefetch)


def _runtime_gathers(rank: int, world_size: int, base: torch.nn.Module, profile, cases: list) -> list:
    """Per case: the gathers of each of three steps and the cache's blocks."""
    out = []
    for case in cases:
        model = copy.deepcopy(base)
        runtime = ElixirRuntime(model, _gather_plan(profile, world_size, *case))
        opt = shard_optimizer(runtime, torch.optim.SGD(model.parameters(), lr=0.01))
        per_step = []
        for _ in range(3):
            before = runtime.cache.gathers + runtime.private_gathers
            _step(model, _batch()).backward()
            optimizer_step(runtime, opt)
            opt.zero_grad()
            per_step.append(runtime.cache.gathers + runtime.private_gathers - before)
        out.append((per_step, runtime.cache.capacity))
    return out


@pytest.mark.parametrize("world_size", [1, 2])
def test_simulated_gathers_equal_the_runtime_gathers(gpt_profile, world_size):
    """At one rank every plan here keeps its chunks gathered in their shards (no gathers at all,
    [Note: a world of one]); at two, each evicts and prefetches as its cache and depth say."""
    base, profile = gpt_profile
    if world_size == 1:
        got = _runtime_gathers(0, 1, base, profile, GATHER_CASES)
    else:
        got = run_distributed(_runtime_gathers, 2, base, profile, GATHER_CASES)[0]
    evicting = 0
    for case, (per_step, capacity) in zip(GATHER_CASES, got):
        simulated = simulate_gathers(_gather_plan(profile, world_size, *case), profile)
        assert per_step[1] == per_step[2] == simulated.gathers, case
        assert capacity == simulated.cache_blocks, case
        evicting += simulated.cache_blocks < len(build_layout(profile, case[0], world_size).public)
    assert evicting == 0 if world_size == 1 else evicting >= len(GATHER_CASES) - 4  # 12000: few chunks


def test_a_budget_below_the_minimum_fails_before_training_with_the_minimum():
    torch.manual_seed(0)
    model = GPT(CONFIG)
    with pytest.raises(NoPlanFitsError, match="(?s)needs at least .*MiB.*more devices"):
        plan_automatically(model, _batch()[0], device=torch.device("cpu"), group=Group(None, 0, 1),
                           compute_dtype=torch.float32, autocast_dtype=None, micro_batches=1,
                           memory_limit=64 * 1024)


class PlanRecorder(Callback):
    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_end(self, trainer, pl_module) -> None:
        strategy = trainer.strategy
        with open(f"{self.path}.rank{trainer.global_rank}", "w") as f:
            json.dump({"plan": strategy.planning.plan.to_dict(), "summary": strategy.planning.report.summary(),
                       "loss": trainer.callback_metrics["train_loss"].item()}, f)


def test_auto_plans_through_the_trainer_and_every_rank_runs_the_same_plan(tmp_path):
    os.environ["MASTER_PORT"] = str(free_port())
    L.seed_everything(0)
    model = GPTLightningModule(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
    record = str(tmp_path / "plan")
    trainer = L.Trainer(accelerator="cpu", devices=2, max_steps=4, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        strategy=ElixirStrategy(plan="auto", start_method="spawn", device_memory_limit="2GiB"),
                        callbacks=[PlanRecorder(record)])
    trainer.fit(model, BigramDataModule(vocab_size=64, block_size=16, batch_size=4, num_samples=64))
    ranks = [json.load(open(f"{record}.rank{r}")) for r in range(2)]
    assert ranks[0]["plan"] == ranks[1]["plan"]
    plan = ElixirPlan.from_dict(ranks[0]["plan"])
    assert plan.name == "auto" and plan.world_size == 2 and plan.chunks
    assert any(spec.private and spec.params == ("model.wte.weight",) for spec in plan.chunks)
    assert "budget 2.00 GiB" in ranks[0]["summary"]
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in ranks)


def _auto_offload(rank: int, world_size: int, nvme_path: str) -> dict:
    """plan='auto' below the all-device minimum: the plan offloads, trains, and the runtime holds
    on the device, in host memory and on NVMe the bytes the plan predicted."""
    group = Group.default()
    settings = dict(device=torch.device("cpu"), group=group, compute_dtype=torch.float32, autocast_dtype=None,
                    micro_batches=1, step_fn=_step)
    torch.manual_seed(0)
    model = GPT(CONFIG)
    with pytest.raises(NoPlanFitsError) as device_only:
        plan_automatically(model, _batch(), memory_limit=1 << 20, offload=OffloadSettings(allow_cpu=False),
                           **settings)
    minimum = device_only.value.min_device_bytes  # the least any all-device plan needs
    result = plan_automatically(model, _batch(), memory_limit=minimum - 1,
                                offload=OffloadSettings(nvme_path=nvme_path), **settings)
    runtime = ElixirRuntime(model, result.plan, nvme_path=nvme_path)
    opt = shard_optimizer(runtime, torch.optim.AdamW(model.parameters(), lr=1e-3))
    losses = []
    for _ in range(3):
        loss = _step(model, _batch())
        losses.append(loss.item())
        loss.backward()
        optimizer_step(runtime, opt)
        opt.zero_grad()
    stats = runtime.memory_stats()
    # The plan counts optimizer state for whole shards; torch holds it for parameters only, not for
    # the padding between and after them (which differs by rank).
    padding = {"device": 0, "cpu": 0}
    for chunk in runtime.chunks:
        used = sum(end - begin for begin, end in map(chunk.shard_range, chunk.slots))
        padding[chunk.placement if chunk.placement != "nvme" else "cpu"] += (chunk.shard_numel - used) * 8
    runtime.restore_module()
    return {"plan": result.plan.to_dict(), "memory": dataclasses.asdict(result.report.memory), "stats": stats,
            "losses": losses, "summary": result.report.summary(), "padding": padding}


def test_auto_offloads_below_the_all_device_minimum_and_counts_what_it_predicted(tmp_path):
    for result in run_distributed(_auto_offload, 2, str(tmp_path)):
        plan = ElixirPlan.from_dict(result["plan"])
        assert plan.offloads, result["summary"]
        assert "placement:" in result["summary"] and "over the budget" in result["summary"]
        predicted, counted, padding = result["memory"], result["stats"], result["padding"]
        assert counted["param_shard_bytes"] == predicted["param_shard_bytes"]
        assert counted["nvme_bytes"] == predicted["nvme_bytes"]
        for key, where in (("device_state_bytes", "device"), ("host_bytes", "cpu")):
            assert predicted[key] - padding[where] == counted[key], (key, counted[key], predicted[key])
        assert result["losses"][-1] < result["losses"][0]


@pytest.mark.parametrize("limit, fraction, budget_gib", [
    (None, 1.0, 72),      # the device's 80 GiB, but 8 GiB are held outside this process's allocator
    ("40GiB", 1.0, 40),   # a limit below what the process can have stands
    ("79GiB", 1.0, 72),   # one above it is lowered
    (None, 0.25, 20),     # a per-process memory fraction caps what the allocator may reserve
])
def test_a_gpu_budget_is_no_more_than_the_process_can_have(monkeypatch, limit, fraction, budget_gib):
    gib = 1 << 30
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=80 * gib))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "a GPU")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (70 * gib, 80 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 2 * gib)
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device: fraction, raising=False)
    assert budget_bytes(torch.device("cuda", 0), limit, 1) == budget_gib * gib


def _plan_with_own_host_memory(rank: int, world_size: int) -> int:
    available = (64 << 30, 4 << 30)[rank]  # node 1 has less memory available than node 0
    planner._available_host_bytes = lambda: available  # a spawned process: nothing to restore
    torch.manual_seed(0)
    result = plan_automatically(GPT(CONFIG), _batch(), device=torch.device("cpu"), group=Group.default(),
                                compute_dtype=torch.float32, autocast_dtype=None, micro_batches=1, step_fn=_step,
                                memory_limit=1 << 30, offload=OffloadSettings())
    return result.options.host_memory_bytes


def test_host_memory_for_offloaded_state_is_the_least_over_machines():
    """Every rank runs rank 0's plan, so it must fit the tightest machine: each rank searched with its own
    machine's available host memory, and rank 0's plan ran on a node with less (emulated per rank)."""
    assert run_distributed(_plan_with_own_host_memory, 2) == [int(0.8 * (4 << 30))] * 2


def test_optimizer_state_is_measured_per_group_and_unmeasurable_classes_are_none():
    from lightning_elixir.runtime.optim import StateFootprint, state_footprint
    from tests.optimizers import TrustRatioAdam

    def sharded(optimizer):
        return state_footprint([optimizer]).sharded

    matrix, vector = torch.nn.Parameter(torch.zeros(30, 10)), torch.nn.Parameter(torch.zeros(100))
    assert state_footprint([torch.optim.AdamW([matrix])]) == StateFootprint(2.0)
    assert sharded(torch.optim.SGD([matrix], lr=0.1)) == 0.0
    assert sharded(torch.optim.SGD([matrix], lr=0.1, momentum=0.9)) == 1.0
    # two moments sharded, a flat trace held whole, and the step gathers masters, gradients and moments
    assert state_footprint([TrustRatioAdam([matrix])]) == StateFootprint(2.0, 1.0, 4.0)
    assert state_footprint([TrustRatioAdam([vector])]) == StateFootprint(2.0, 0.0, 4.0)  # no trace for a vector
    if hasattr(torch.optim, "Adafactor"):
        factored = state_footprint([torch.optim.Adafactor([matrix])])
        assert factored.sharded == 0.0 and 0 < factored.whole < 0.1 and not factored.gathered  # a row and a column
        assert state_footprint([torch.optim.Adafactor([vector])]) == StateFootprint(1.0)  # a vector's is per element
    if hasattr(torch.optim, "Muon"):
        assert state_footprint([torch.optim.Muon([matrix])]) == StateFootprint(1.0, 0.0, 1.0)  # momentum; the update
    # weighted by the trainable elements of each group: 300 with amsgrad's third moment, 100 without
    groups = torch.optim.Adam([{"params": [matrix], "amsgrad": True}, {"params": [vector]}])
    assert sharded(groups) == (3 * 300 + 2 * 100) / 400
    assert sharded(_SgdWithoutDefaultLr([matrix], 0.1)) == 1.0  # lr given again, by name
    assert state_footprint([]) == StateFootprint(0.0)  # configure_optimizers returned None: nothing to keep
    assert state_footprint([torch.optim.LBFGS([matrix])]) is None  # needs a closure


def test_state_of_other_shapes_is_measured_at_each_parameters_own_shape():
    """A preconditioner per side of a matrix holds rows^2 + columns^2 values: of a tall matrix, many per
    element, all held whole. Measured at the parameter's shape (on fake tensors: a large one costs no
    memory), not at a square stand-in's, where both would have the parameter's shape and pass as sharded."""
    from lightning_elixir.runtime.optim import StateFootprint, state_footprint

    tall, vector = torch.nn.Parameter(torch.zeros(300, 10)), torch.nn.Parameter(torch.zeros(10))
    assert state_footprint([_Shampoo([tall])]) == StateFootprint(0.0, pytest.approx((300 ** 2 + 10 ** 2) / 3000), 2.0)
    assert state_footprint([_Shampoo([vector])]) == StateFootprint(1.0, 0.0, 3.0)  # one side, the vector's shape
    large = torch.nn.Parameter(torch.empty(50_000, 4096, device="meta"))  # 1.6e11 values of preconditioner
    assert state_footprint([_Shampoo([large])]).whole == pytest.approx((50_000 ** 2 + 4096 ** 2) / (50_000 * 4096))


@per_parameter_optimizer
class _Shampoo(torch.optim.Optimizer):
    """Shampoo's statistics: a preconditioner per side of a matrix (rows x rows, columns x columns) and one
    per element of a vector, each gradient preconditioned by their inverse fourth roots."""

    def __init__(self, params, lr: float = 0.01, eps: float = 1e-4):
        super().__init__(params, dict(lr=lr, eps=eps))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                g, state = p.grad, self.state[p]
                if p.dim() < 2:
                    state.setdefault("accumulated", torch.zeros_like(p)).addcmul_(g, g)
                    p.addcdiv_(g, state["accumulated"].add(group["eps"]).pow(0.25), value=-group["lr"])
                    continue
                g = g.reshape(g.shape[0], -1)
                left = state.setdefault("left", g.new_zeros(g.shape[0], g.shape[0])).addmm_(g, g.T)
                right = state.setdefault("right", g.new_zeros(g.shape[1], g.shape[1])).addmm_(g.T, g)
                update = _inverse_root(left, group["eps"]) @ g @ _inverse_root(right, group["eps"])
                p.add_(update.view_as(p), alpha=-group["lr"])
        return None


def _inverse_root(matrix: torch.Tensor, eps: float) -> torch.Tensor:
    values, vectors = torch.linalg.eigh(matrix + eps * torch.eye(matrix.shape[0], dtype=matrix.dtype))
    return vectors @ torch.diag(values.clamp_min(eps).pow(-0.25)) @ vectors.T


class _SgdWithoutDefaultLr(torch.optim.SGD):
    def __init__(self, params, lr):
        super().__init__(params, lr=lr, momentum=0.9)


def _plan_gpt(model, budget, states=None, **more):
    """plan='auto' of the GPT in one process at ``budget`` bytes, its optimizer priced at ``states`` (None: Adam)."""
    return plan_automatically(model, _batch(), memory_limit=budget, optimizer_states=states, device=torch.device("cpu"),
                              group=Group.default(), compute_dtype=torch.float32, autocast_dtype=None,
                              micro_batches=1, step_fn=_step, **more)


def _least_all_device(model, states=None):
    """The least budget at which every chunk's state stays on the device."""
    with pytest.raises(NoPlanFitsError) as device_only:
        _plan_gpt(model, 1 << 20, states, offload=OffloadSettings(allow_cpu=False))
    return device_only.value.min_device_bytes


def _plan_for_sgd(optimizer_states):
    """plan='auto' of the GPT, with the budget one byte below the least all-device plan priced as Adam."""
    torch.manual_seed(0)
    model = GPT(CONFIG)
    return model, _plan_gpt(model, _least_all_device(model) - 1, optimizer_states)


def test_a_plan_priced_for_sgd_keeps_on_the_device_what_adams_price_offloads_and_counts_its_state():
    _, adam = _plan_for_sgd(None)
    assert adam.plan.offloads
    model, sgd = _plan_for_sgd(StateFootprint(1.0))  # SGD with momentum: one value per element
    assert not sgd.plan.offloads and sgd.options.optimizer_bytes_per_numel == 4
    runtime = ElixirRuntime(model, sgd.plan)
    opt = shard_optimizer(runtime, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9))
    _step(model, _batch()).backward()
    optimizer_step(runtime, opt)
    padding = sum((c.shard_numel - sum(e - b for b, e in map(c.shard_range, c.slots))) * 4 for c in runtime.chunks)
    assert sgd.report.memory.device_state_bytes - padding == runtime.memory_stats()["device_state_bytes"]
    runtime.restore_module()


def test_state_held_whole_and_the_steps_gathers_are_in_the_predicted_peak():
    """A per-parameter optimizer's state of other shapes is held whole by every rank, and its step gathers a
    chunk's masters, gradients and moments: both are in the peak, so where Adam's price keeps every chunk's
    state on the device, the real price offloads some."""
    torch.manual_seed(0)
    model, heavy = GPT(CONFIG), StateFootprint(2.0, 1.0, 2.0)
    least_adam, least_heavy = _least_all_device(model), _least_all_device(model, heavy)
    assert least_heavy > least_adam
    budget = least_heavy - 1
    adam, real = _plan_gpt(model, budget), _plan_gpt(model, budget, heavy)
    memory = real.report.memory
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert memory.whole_state_bytes == trained * 4 and memory.step_gather_bytes > memory.activation_bytes
    assert not adam.plan.offloads and real.plan.offloads and memory.peak_bytes <= budget


class _CountsConfigure(GPTLightningModule):
    def __init__(self) -> None:
        super().__init__(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
        self.configured: list[torch.optim.Optimizer] = []

    def configure_optimizers(self):
        _CONFIGURE_CALLS.append(type(self).__name__)  # outside the module: the planning trace restores its state
        self.configured.append(torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9))
        return self.configured[-1]


_CONFIGURE_CALLS: list[str] = []


class _ManualCountsConfigure(_CountsConfigure):
    """Manual optimization: the planning trace asks for ``self.optimizers()``, and gets the configured ones."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        loss = super().training_step(batch, batch_idx)
        self.manual_backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        return loss


class _BuiltInConfigureModel(_CountsConfigure):
    """Its model is built in configure_model, on the meta device under the strategy: priced as Adam."""

    def __init__(self) -> None:
        super().__init__()
        self.model = None

    def configure_model(self) -> None:
        if self.model is None:
            self.model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32))


@pytest.mark.parametrize("module, priced", [(_CountsConfigure, 4), (_ManualCountsConfigure, 4),
                                            (_BuiltInConfigureModel, 8)])
def test_auto_prices_the_configured_optimizer_and_configures_it_once(module, priced):
    model = module()
    _CONFIGURE_CALLS.clear()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        strategy=ElixirStrategy(plan="auto"))
    trainer.fit(model, BigramDataModule(vocab_size=64, block_size=16, batch_size=4, num_samples=32))
    assert len(_CONFIGURE_CALLS) == 1 and trainer.optimizers == model.configured
    assert trainer.strategy.planning.options.optimizer_bytes_per_numel == priced
