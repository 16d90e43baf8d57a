"""Single-process checks: state machine, cache bound, bad input, state-dict round trips."""

from __future__ import annotations

import copy
import dataclasses
import warnings
from typing import Any, Callable

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from lightning_elixir.demos.gpt import GPT, GPTConfig
from lightning_elixir.plan import ChunkSpec, ElixirPlan, PlanError
from lightning_elixir.runtime.cache import CacheTooSmallError
from lightning_elixir.runtime.optim import elementwise_optimizer, optimizer_step, shard_optimizer
from lightning_elixir.runtime.params import ChunkedParameter
from lightning_elixir.runtime.runtime import ElixirRuntime
from lightning_elixir.runtime.state_dict import (
    full_optimizer_state_dict,
    full_state_dict,
    load_full_optimizer_state_dict,
    load_full_state_dict,
)
from lightning_elixir.runtime.access import OutsideStepError
from lightning_elixir.runtime.states import ChunkState, IllegalTransition, check_transition
from tests.plans import on_host

CONFIG = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)


def _gpt(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(CONFIG)


def _step(model, runtime, opt, seed: int) -> float:
    x = torch.randint(64, (2, 16), generator=torch.Generator().manual_seed(seed))
    loss = F.cross_entropy(model(x).flatten(0, 1), torch.roll(x, -1, 1).flatten())
    loss.backward()
    optimizer_step(runtime, opt)
    opt.zero_grad()
    return loss.item()


def test_state_machine_rejects_illegal_moves():
    check_transition(0, ChunkState.FREE, ChunkState.GATHERING)
    check_transition(0, ChunkState.HOLD, ChunkState.GATHERING)  # a resident chunk gathered again in place
    for old, new in [(ChunkState.FREE, ChunkState.COMPUTE), (ChunkState.GATHERING, ChunkState.FREE),
                     (ChunkState.COMPUTE, ChunkState.FREE), (ChunkState.COMPUTE, ChunkState.GATHERING),
                     (ChunkState.GATHERING, ChunkState.COMPUTE)]:
        with pytest.raises(IllegalTransition, match=f"{old.name} -> {new.name}"):
            check_transition(3, old, new)


def test_building_holds_one_chunks_block_at_a_time(monkeypatch):
    """A model that fits the device only sharded must be buildable: the chunks' gathered blocks are
    allocated one at a time while the parameters are copied in, never all at once."""
    from lightning_elixir.runtime.chunk import Chunk

    built: list[Chunk] = []
    most = [0]
    init, fill = Chunk.__init__, Chunk.fill

    def count() -> None:
        most[0] = max(most[0], sum(c.full.untyped_storage().nbytes() > 0 for c in built))

    def counting_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        built.append(self)
        count()

    def counting_fill(self, values):
        fill(self, values)
        count()

    monkeypatch.setattr(Chunk, "__init__", counting_init)
    monkeypatch.setattr(Chunk, "fill", counting_fill)
    expected = _gpt().state_dict()
    model = _gpt()
    runtime = ElixirRuntime(model, on_host(model, ElixirPlan(chunk_numel=4096, cache_blocks="min")))
    assert len(built) > 3 and most[0] == 1
    assert all(c.state is ChunkState.FREE and c.full.untyped_storage().nbytes() == 0 for c in built)
    got = full_state_dict(runtime)
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=0, msg=name)


def test_releasing_a_pinned_chunk_raises():
    runtime = ElixirRuntime(_gpt(), ElixirPlan(chunk_numel=4096, cache_blocks="min"))
    chunk = runtime.public[0]
    runtime.cache.acquire((chunk.index,))
    with pytest.raises(IllegalTransition):
        chunk.release()


def test_released_parameters_keep_their_metadata_and_refuse_value_reads_outside_the_step():
    model = _gpt()
    reference = {n: p.detach().clone() for n, p in model.named_parameters()}
    runtime = ElixirRuntime(model, ElixirPlan(chunk_numel=4096, cache_blocks="min"))
    for name, p in model.named_parameters():
        assert p.shape == reference[name].shape and p.dim() == reference[name].dim() and p.numel() > 0
        with pytest.raises(OutsideStepError, match="gathered_params"):
            torch.isnan(p)
        with pytest.raises(OutsideStepError, match=name.replace(".", r"\.")):
            p.data.sum()
    with runtime.gathered():  # reads gather on demand; the values are the real ones
        for name, p in model.named_parameters():
            torch.testing.assert_close(p.detach(), reference[name])
    assert runtime.cache.gathered == {} or all(c.pins == 0 for c in runtime.cache.gathered.values())


def test_too_small_cache_says_how_many_blocks_are_needed():
    class Wide(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(64, 64)
            self.b = nn.Linear(64, 64)
            self.c = nn.Linear(64, 64)

    class Outer(nn.Module):  # one hook unit: it holds a parameter and no block, so it owns Wide's linears
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.ones(64))
            self.inner = Wide()

        def forward(self, x):
            return self.inner.c(self.inner.b(self.inner.a(x))) * self.scale

    model = Outer()
    runtime = ElixirRuntime(model, on_host(model, ElixirPlan(chunk_numel=64 * 64 + 64, cache_blocks=1)))
    with pytest.raises(CacheTooSmallError, match=r"4 chunks \[0, 1, 2, 3\].*at least 4"):
        model(torch.randn(2, 64))
    assert runtime.cache.capacity == 1


def test_lbfgs_is_rejected_with_the_supported_list():
    model = _gpt()
    runtime = ElixirRuntime(model, ElixirPlan(chunk_numel=4096))
    with pytest.raises(TypeError, match="LBFGS is not element-wise.*AdamW.*@lightning_elixir.per_parameter_optimizer"):
        shard_optimizer(runtime, torch.optim.LBFGS(model.parameters()))


@pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch.optim.Muon is new in torch 2.9")
def test_muon_and_adafactor_subclasses_with_a_step_of_their_own_are_rejected():
    class OwnStep(torch.optim.Muon):
        def step(self, closure=None):
            return super().step(closure)

    class OwnAdafactor(torch.optim.Adafactor):
        def step(self, closure=None):
            return super().step(closure)

    model = nn.Sequential(nn.Linear(8, 8, bias=False), nn.Linear(8, 8, bias=False))
    runtime = ElixirRuntime(model, ElixirPlan(chunk_numel=64))
    with pytest.raises(TypeError, match="OwnStep is not element-wise.*Muon or Adafactor"):
        shard_optimizer(runtime, OwnStep(model.parameters()))
    with pytest.raises(TypeError, match="OwnAdafactor is not element-wise"):
        shard_optimizer(runtime, OwnAdafactor(model.parameters()))


@pytest.mark.skipif(not hasattr(torch.optim, "Adafactor"), reason="torch.optim.Adafactor is new in torch 2.5")
def test_adafactor_matches_torch_over_chunks_that_split_its_matrices_and_refuses_nvme(tmp_path):
    """A 3-D weight, matrices, vectors, every chunk's state on the host; then chunks on NVMe, which it cannot
    update. (Matrices split over ranks' shards: tests/test_adafactor.py.)"""
    def make():
        torch.manual_seed(0)
        return nn.Sequential(nn.Conv1d(3, 5, 3), nn.Flatten(), nn.Linear(20, 7), nn.LayerNorm(7), nn.Linear(7, 2))

    model, ref = make(), make()
    runtime = ElixirRuntime(model, on_host(model, ElixirPlan(chunk_numel=150, cache_blocks=2)))
    opt = shard_optimizer(runtime, torch.optim.Adafactor(model.parameters(), lr=0.05, weight_decay=0.1))
    ref_opt = torch.optim.Adafactor(ref.parameters(), lr=0.05, weight_decay=0.1, foreach=False)
    for seed in range(4):
        x = torch.randn(4, 3, 6, generator=torch.Generator().manual_seed(seed))
        model(x).square().mean().backward()
        ref(x).square().mean().backward()
        optimizer_step(runtime, opt)
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
    ours, theirs = full_state_dict(runtime), ref.state_dict()
    for key, value in theirs.items():
        torch.testing.assert_close(ours[key], value, rtol=1e-5, atol=1e-6, msg=key)
    state, ref_state = full_optimizer_state_dict(runtime, opt)["state"], ref_opt.state_dict()["state"]
    for index, values in ref_state.items():
        for key, value in values.items():
            torch.testing.assert_close(state[index][key], value, rtol=1e-5, atol=1e-7, msg=f"{index} {key}")

    model = make()
    plan = on_host(model, ElixirPlan(chunk_numel=150, cache_blocks=2))
    plan = dataclasses.replace(plan, chunks=tuple(dataclasses.replace(c, placement="nvme") for c in plan.chunks))
    runtime = ElixirRuntime(model, plan, nvme_path=str(tmp_path))
    with pytest.raises(ValueError, match="Adafactor optimizer and is placed on NVMe"):
        shard_optimizer(runtime, torch.optim.Adafactor(model.parameters()))


@pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch.optim.Muon is new in torch 2.9")
@pytest.mark.parametrize("kind", ["Muon", "Adafactor"])
@pytest.mark.parametrize("made", ["before", "after"])
def test_lr_schedulers_made_before_or_after_sharding_see_the_runtimes_own_step(kind, made):
    """A scheduler made in configure_optimizers (before) or later (after a plan switch): neither fails nor
    warns that the step was replaced, and both follow their schedule."""
    model = nn.Sequential(nn.Linear(8, 8, bias=False), nn.Linear(8, 8, bias=False))
    runtime = ElixirRuntime(model, ElixirPlan(chunk_numel=64))
    optimizer = getattr(torch.optim, kind)(model.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        if made == "before":
            scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        shard_optimizer(runtime, optimizer)
        if made == "after":
            scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        for seed in range(2):
            model(torch.randn(2, 8, generator=torch.Generator().manual_seed(seed))).sum().backward()
            optimizer_step(runtime, optimizer)
            optimizer.zero_grad()
            scheduler.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.025)


def test_a_full_optimizer_state_dict_of_groups_with_other_state_keys_in_one_chunk():
    """Adam with amsgrad in one group only: one chunk's parameters hold different per-element keys."""
    def make():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(6, 6), nn.Linear(6, 2))

    def groups(m):
        return [{"params": [m[0].weight, m[1].weight], "amsgrad": True}, {"params": [m[0].bias, m[1].bias]}]

    model, ref = make(), make()
    runtime = ElixirRuntime(model, ElixirPlan(chunk_numel=1024))
    assert len(runtime.chunks) == 1
    opt = shard_optimizer(runtime, torch.optim.Adam(groups(model), lr=0.1))
    ref_opt = torch.optim.Adam(groups(ref), lr=0.1)
    for seed in range(2):
        x = torch.randn(3, 6, generator=torch.Generator().manual_seed(seed))
        model(x).sum().backward()
        ref(x).sum().backward()
        optimizer_step(runtime, opt)
        ref_opt.step()
    state, ref_state = full_optimizer_state_dict(runtime, opt)["state"], ref_opt.state_dict()["state"]
    assert "max_exp_avg_sq" in ref_state[0] and "max_exp_avg_sq" not in ref_state[2]
    for index, values in ref_state.items():
        assert state[index].keys() == values.keys()
        for key, value in values.items():
            torch.testing.assert_close(state[index][key], value, msg=f"{index} {key}")


class _LoggingSGD(torch.optim.SGD):
    """Sets defaults only: SGD's own step runs."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, lr=lr, momentum=0.9)


class _TrustRatioSGD(torch.optim.SGD):
    """Overrides step with a per-parameter norm: not element-wise."""

    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.mul_(p.norm() / (p.grad.norm() + 1e-6))
        return super().step(closure)


def test_a_subclass_that_overrides_step_must_be_declared_element_wise():
    model = _gpt()
    runtime = ElixirRuntime(model, ElixirPlan(chunk_numel=4096))
    with pytest.raises(TypeError, match=r"_TrustRatioSGD overrides SGD.step.*@lightning_elixir.elementwise_optimizer"):
        shard_optimizer(runtime, _TrustRatioSGD(model.parameters(), lr=0.1))
    assert shard_optimizer(runtime, _LoggingSGD(model.parameters())).param_groups[0]["momentum"] == 0.9


def test_a_declared_optimizer_runs_on_shards_and_the_declaration_checks_its_argument():
    from tests.optimizers import Lion

    model = _gpt()
    runtime = ElixirRuntime(model, ElixirPlan(chunk_numel=4096))
    shard_optimizer(runtime, Lion(model.parameters()))
    with pytest.raises(TypeError, match="expects a torch.optim.Optimizer subclass"):
        elementwise_optimizer(object)


def _small_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.LayerNorm(16), nn.Linear(16, 16), nn.Linear(16, 2))


def _beside_torch(make: Callable[[], nn.Module], plan: ElixirPlan, optimizer_of: Callable[[nn.Module], Any],
                  inputs: int, before: Callable[[Any], None] = lambda opt: None,
                  each_step: Callable[[int, nn.Module], None] = lambda seed, m: None) -> tuple[Any, Any]:
    """Three steps of ``make()`` under ``plan`` (every chunk's state on the host) with ``optimizer_of``'s
    optimizer sharded, and of another ``make()`` with it unsharded; asserts that the weights and the full
    optimizer state dicts (keys, shapes, values) are torch's; returns the two optimizers."""
    model, ref = make(), make()
    runtime = ElixirRuntime(model, on_host(model, plan))
    opt, ref_opt = shard_optimizer(runtime, optimizer_of(model)), optimizer_of(ref)
    before(opt)
    for seed in range(3):
        x = torch.randn(4, inputs, generator=torch.Generator().manual_seed(seed))
        for m in (model, ref):
            each_step(seed, m)
            m(x).square().mean().backward()
        optimizer_step(runtime, opt)
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
    for key, value in ref.state_dict().items():
        torch.testing.assert_close(full_state_dict(runtime)[key], value, rtol=1e-5, atol=1e-6, msg=key)
    ours, theirs = full_optimizer_state_dict(runtime, opt), ref_opt.state_dict()
    assert str(ours["param_groups"]) == str(theirs["param_groups"])
    for index, values in theirs["state"].items():
        assert ours["state"][index].keys() == values.keys()
        for key, value in values.items():
            assert ours["state"][index][key].shape == value.shape, (index, key)
            torch.testing.assert_close(ours["state"][index][key], value, rtol=1e-5, atol=1e-6, msg=f"{index} {key}")
    return opt, ref_opt


def test_a_per_parameter_optimizer_matches_torch_runs_its_step_hooks_once_and_refuses_nvme(tmp_path):
    """Its own step runs once per chunk on whole parameters: chunks smaller than the model, every chunk's
    state on the host, a parameter left without a gradient. The step hooks run once per step, as torch's
    run them, and the step the param groups count advances once."""
    from lightning_elixir.runtime.per_parameter import per_parameter_optimizer
    from tests.optimizers import TrustRatioAdam

    calls = []

    def hooked(opt):
        opt.register_step_pre_hook(lambda o, args, kwargs: calls.append("pre"))
        opt.register_step_post_hook(lambda o, args, kwargs: calls.append("post"))

    def no_grad_in_one_step(seed, m):  # skipped there, as torch skips it
        m[3].bias.requires_grad_(seed != 1)

    assert len(ElixirRuntime(_small_mlp(), ElixirPlan(chunk_numel=300)).chunks) > 2
    opt, ref_opt = _beside_torch(_small_mlp, ElixirPlan(chunk_numel=300, cache_blocks=2),
                                 lambda m: TrustRatioAdam(m.parameters(), weight_decay=0.1), 6, hooked,
                                 no_grad_in_one_step)
    assert calls == ["pre", "post"] * 3 and opt.param_groups[0]["step"] == ref_opt.param_groups[0]["step"] == 3

    model = _small_mlp()
    plan = on_host(model, ElixirPlan(chunk_numel=300, cache_blocks=2))
    plan = dataclasses.replace(plan, chunks=tuple(dataclasses.replace(c, placement="nvme") for c in plan.chunks))
    with pytest.raises(ValueError, match="TrustRatioAdam cannot update it"):
        shard_optimizer(ElixirRuntime(model, plan, nvme_path=str(tmp_path)), TrustRatioAdam(model.parameters()))
    with pytest.raises(TypeError, match="LBFGS: its step flattens every parameter"):
        per_parameter_optimizer(torch.optim.LBFGS)
    with pytest.raises(TypeError, match="expects a torch.optim.Optimizer subclass"):
        per_parameter_optimizer(object)


@pytest.mark.parametrize("name", ["CountedInPlace", "AxisAccumulated"])
def test_a_per_parameter_optimizer_with_group_tensors_or_state_of_its_parameters_axes_matches_torch(name):
    """A count the param groups keep in a tensor advanced in place advances once a step, not once per chunk;
    a state key per-element for a vector and held whole for the matrix beside it in the same chunk (SM3's
    and Shampoo's state per axis) is gathered only where it is per-element. Then the full optimizer state
    dict holds torch's."""
    from tests import optimizers

    cls = getattr(optimizers, name)
    _beside_torch(_small_mlp, ElixirPlan(chunk_numel=300, cache_blocks=2), lambda m: cls(m.parameters()), 6)


def test_a_per_parameter_optimizer_sees_one_whole_parameter_object_per_parameter_across_steps():
    """What a step caches per parameter object (Kron's expressions) stays one entry per parameter, as under
    torch, rather than one per step holding that step's gathered chunk."""
    from tests.optimizers import CachesPerParameter

    opt, ref_opt = _beside_torch(_small_mlp, ElixirPlan(chunk_numel=300, cache_blocks=2),
                                 lambda m: CachesPerParameter(m.parameters()), 6)
    assert len(opt.cache) == len(ref_opt.cache) == len(list(_small_mlp().parameters()))
    assert all(p.numel() == 0 and p.grad is None for p in opt.cache)  # none holds a gathered chunk after its step


def test_a_per_parameter_optimizers_tensor_step_of_a_0_d_parameter_is_kept_whole():
    """A 0-d parameter (CLIP's logit scale) has the shape of a 0-d ``step``: the step is still held whole,
    as everywhere else, not kept as the parameter's one element (of shape (1,) then, wrong in its update and
    its checkpoint)."""
    from tests.optimizers import TensorStepMomentum

    class WithScale(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.lin, self.scale = nn.Linear(3, 4), nn.Parameter(torch.tensor(1.5))

        def forward(self, x):
            return self.lin(x) * self.scale

    _beside_torch(WithScale, ElixirPlan(chunk_numel=16, cache_blocks="all"),
                  lambda m: TensorStepMomentum(m.parameters()), 3)


def test_a_per_parameter_optimizer_with_state_under_no_parameter_is_refused():
    """MADGRAD counts its steps in ``self.state["k"]``: made afresh in each chunk's call it would never count,
    so the step is refused rather than trained wrong."""
    from tests.optimizers import SharedCount

    model = nn.Sequential(nn.Linear(6, 16), nn.Linear(16, 2))
    runtime = ElixirRuntime(model, on_host(model, ElixirPlan(chunk_numel=120, cache_blocks=2)))
    opt = shard_optimizer(runtime, SharedCount(model.parameters()))
    model(torch.randn(4, 6)).square().mean().backward()
    with pytest.raises(TypeError, match="SharedCount's step keeps state under 'k'"):
        optimizer_step(runtime, opt)


def test_optimizer_over_foreign_parameters_is_rejected():
    model = _gpt()
    runtime = ElixirRuntime(model, ElixirPlan(chunk_numel=4096))
    with pytest.raises(ValueError, match="not a parameter of the model"):
        shard_optimizer(runtime, torch.optim.SGD([nn.Parameter(torch.ones(3))], lr=0.1))


def test_unknown_plan_key_is_rejected():
    with pytest.raises(PlanError, match="unknown plan key.*cache_size"):
        ElixirPlan.from_dict({"cache_size": 3})
    with pytest.raises(PlanError, match="unknown chunk key"):
        ElixirPlan.from_dict({"chunks": [{"params": ["a"], "numel": 2, "where": "gpu"}], "world_size": 1})


def test_plan_for_another_model_is_rejected():
    plan = ElixirPlan(chunks=(ChunkSpec(("encoder.weight",), 64),), world_size=1)
    with pytest.raises(PlanError, match="does not match the model.*encoder.weight"):
        ElixirRuntime(_gpt(), plan)


def test_plan_for_another_world_size_is_rejected():
    model = _gpt()
    specs = tuple(ChunkSpec((n,), p.numel() + p.numel() % 2, private=n == "wte.weight")
                  for n, p in model.named_parameters())
    with pytest.raises(PlanError, match="world_size=2") as raised:
        ElixirRuntime(model, ElixirPlan(chunks=specs, world_size=2))
    assert "--devices 1" in str(raised.value)  # how to make a plan file for the ranks running


def test_explicit_layout_runs_and_matches_implicit_one():
    model, ref = _gpt(), _gpt()
    specs = tuple(ChunkSpec((n,), p.numel(), private=n == "wte.weight") for n, p in model.named_parameters())
    explicit = ElixirRuntime(model, ElixirPlan(chunks=specs, world_size=1, cache_blocks="min+1"))
    implicit = ElixirRuntime(ref, ElixirPlan(chunk_numel=4096, cache_blocks="min+1"))
    x = torch.randint(64, (2, 16))
    explicit.begin_iteration(), implicit.begin_iteration()
    torch.testing.assert_close(model(x), ref(x))


def test_plan_json_round_trip(tmp_path):
    plan = ElixirPlan(chunk_numel=1024, cache_blocks="min", prefetch_depth=2,
                      chunks=(ChunkSpec(("a", "b"), 1024), ChunkSpec(("c",), 8, private=True, placement="cpu")),
                      world_size=2, name="x")
    assert ElixirPlan.from_json(plan.to_json()) == plan
    plan.to_json(tmp_path / "p.json")
    assert ElixirPlan.from_json(str(tmp_path / "p.json")) == plan


def test_nvme_placement_without_a_path_is_refused_before_any_work():
    model = _gpt()
    specs = tuple(ChunkSpec((n,), p.numel(), private=n == "wte.weight", placement="nvme")
                  for n, p in model.named_parameters())
    with pytest.raises(PlanError, match="nvme_path"):
        ElixirRuntime(model, ElixirPlan(chunks=specs, world_size=1))
    assert not any(isinstance(p, ChunkedParameter) for p in model.parameters())


def test_state_dicts_round_trip_into_a_fresh_runtime():
    model = _gpt()
    runtime = ElixirRuntime(model, ElixirPlan(chunk_numel=4096, cache_blocks="min"))
    opt = shard_optimizer(runtime, torch.optim.AdamW(model.parameters(), lr=1e-2))
    for step in range(3):
        _step(model, runtime, opt, step)
    weights, optim = full_state_dict(runtime), full_optimizer_state_dict(runtime, opt)
    plain = _gpt(1)
    plain.load_state_dict(weights)
    assert set(weights) == set(plain.state_dict())
    x = torch.randint(64, (2, 16))
    runtime.begin_iteration()
    torch.testing.assert_close(plain(x), model(x))

    other = _gpt(7)
    other_rt = ElixirRuntime(other, ElixirPlan(chunk_numel=8192, cache_blocks="all"))
    other_opt = shard_optimizer(other_rt, torch.optim.AdamW(other.parameters(), lr=1e-2))
    load_full_state_dict(other_rt, weights)
    load_full_optimizer_state_dict(other_rt, other_opt, optim)
    for step in range(3, 6):
        assert _step(other, other_rt, other_opt, step) == pytest.approx(_step(model, runtime, opt, step), rel=1e-6)


def test_loading_a_mismatched_state_dict_fails_before_changing_anything():
    model = _gpt()
    runtime = ElixirRuntime(model, ElixirPlan(chunk_numel=4096))
    before = full_state_dict(runtime)
    bad = dict(before)
    bad.pop("wpe.weight")
    with pytest.raises(RuntimeError, match="wpe.weight"):
        load_full_state_dict(runtime, bad)
    after = full_state_dict(runtime)
    assert all(torch.equal(before[k], after[k]) for k in before)


class _Twice(nn.Module):
    """One layer applied twice per forward, beside another layer: they share a public chunk."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        return self.head(torch.tanh(self.lin(torch.tanh(self.lin(x)))))


@pytest.mark.parametrize("private", [False, True])
def test_module_called_twice_in_one_forward_trains_like_the_plain_module(private):
    torch.manual_seed(0)
    ref = _Twice()
    model = copy.deepcopy(ref)
    runtime = ElixirRuntime(model, ElixirPlan(chunk_numel=64, cache_blocks=1), grow_cache=True,
                            private_params=["lin.weight", "lin.bias"] if private else ())
    opt = shard_optimizer(runtime, torch.optim.SGD(model.parameters(), lr=0.1))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(4):
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(step))
        loss = model(x).square().sum()
        loss.backward()
        optimizer_step(runtime, opt)
        opt.zero_grad()
        ref_loss = ref(x).square().sum()
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-6)
    for chunk in runtime.chunks:
        assert chunk.pins == 0
    runtime.restore_module()
    for (name, a), b in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, msg=name)


def test_lr_scheduler_drives_the_sharded_optimizer():
    model, ref = _gpt(), _gpt()
    runtime = ElixirRuntime(model, ElixirPlan(chunk_numel=4096, cache_blocks="min"))
    opt = shard_optimizer(runtime, torch.optim.AdamW(model.parameters(), lr=1e-2))
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.3) for o in (opt, ref_opt)]
    for step in range(4):
        ours = _step(model, runtime, opt, step)
        x = torch.randint(64, (2, 16), generator=torch.Generator().manual_seed(step))
        loss = F.cross_entropy(ref(x).flatten(0, 1), torch.roll(x, -1, 1).flatten())
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        assert ours == pytest.approx(loss.item(), rel=1e-6)
        for sched in scheds:
            sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-2 * 0.3 ** 4)


def test_unknown_private_param_names_are_rejected():
    with pytest.raises(PlanError, match=r"private_params names \['lm_head.wieght'\] are not parameters"):
        ElixirRuntime(_gpt(), ElixirPlan(chunk_numel=4096), private_params=["lm_head.wieght"])


def test_a_checkpoint_of_another_shape_is_refused_before_anything_loads():
    model = _gpt()
    runtime = ElixirRuntime(model, ElixirPlan(chunk_numel=4096, cache_blocks="min"))
    before = full_state_dict(runtime, everywhere=True)
    bad = {k: v.clone() + 1 for k, v in before.items()}
    name = next(k for k in bad if k.endswith("c_fc.weight"))
    bad[name] = torch.zeros(bad[name].shape[0] + 1, bad[name].shape[1])
    with pytest.raises(ValueError, match="shapes do not match.*c_fc.weight"):
        load_full_state_dict(runtime, bad)
    after = full_state_dict(runtime, everywhere=True)
    assert all(torch.equal(after[k], v) for k, v in before.items())


class _Strided(nn.Module):
    """A channels_last convolution and a parameter registered as a transposed view: dense, not contiguous."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1).to(memory_format=torch.channels_last)
        self.w = nn.Parameter(torch.randn(4, 8).t() * 0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.conv(x)).mean((2, 3)) @ self.w


@pytest.mark.parametrize("switch", [False, True], ids=["one-plan", "switched"])
def test_the_module_gets_its_parameters_back_in_their_own_layout(switch):
    """Teardown gives a channels_last or transposed parameter back with its strides, as DDP leaves it
    (values contiguous inside the chunks), also after a switch of plans re-chunked it."""
    from lightning_elixir.runtime.replan import switch_plan

    torch.manual_seed(0)
    model = _Strided()
    reference = copy.deepcopy(model)
    strides = {n: p.stride() for n, p in model.named_parameters()}
    assert not model.conv.weight.is_contiguous() and not model.w.is_contiguous()
    runtime = ElixirRuntime(model, ElixirPlan(chunk_numel=256, cache_blocks="min"))
    opt = shard_optimizer(runtime, torch.optim.SGD(model.parameters(), lr=0.1))
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(2):
        x = torch.randn(2, 3, 6, 6, generator=torch.Generator().manual_seed(step))
        if switch and step == 1:
            runtime = switch_plan(runtime, ElixirPlan(chunk_numel=1024, cache_blocks="all"))
        model(x).square().mean().backward()
        optimizer_step(runtime, opt)
        opt.zero_grad()
        reference(x).square().mean().backward()
        ref_opt.step()
        ref_opt.zero_grad()
    runtime.restore_module()
    for name, p in model.named_parameters():
        assert p.stride() == strides[name], name
        torch.testing.assert_close(p, dict(reference.named_parameters())[name], msg=name)
    assert not hasattr(model.w, "_elixir_stride")


def test_switches_of_plans_let_the_old_runtimes_go_and_add_param_group_still_works():
    """Each switch of plans shards the same optimizer again: the old runtimes are not kept alive by it (their
    chunks and state freed), and a group added after the switches takes the module's parameters."""
    import gc
    import weakref

    from lightning_elixir.runtime.replan import switch_plan

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 1))
    reference = copy.deepcopy(model)
    model[0].requires_grad_(False)
    reference[0].requires_grad_(False)
    runtime = ElixirRuntime(model, ElixirPlan(chunk_numel=64))
    opt = shard_optimizer(runtime, torch.optim.SGD(model[1].parameters(), lr=0.1, momentum=0.9))
    ref_opt = torch.optim.SGD(reference[1].parameters(), lr=0.1, momentum=0.9)
    old = []
    for step in range(4):
        if step in (1, 2):
            old.append(weakref.ref(runtime))
            runtime = switch_plan(runtime, ElixirPlan(chunk_numel=64 + 32 * step))
        if step == 3:
            for m, o in ((model, opt), (reference, ref_opt)):
                m[0].requires_grad_(True)
                o.add_param_group({"params": m[0].parameters(), "lr": 0.5})
        x = torch.full((2, 8), 1.0 + step)
        model(x).sum().backward()
        optimizer_step(runtime, opt)
        opt.zero_grad()
        reference(x).sum().backward()
        ref_opt.step()
        ref_opt.zero_grad()
    gc.collect()
    assert [r() for r in old] == [None, None]
    runtime.restore_module()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p, dict(reference.named_parameters())[name], msg=name)


def test_one_rank_keeps_the_agreement_on_the_host(monkeypatch):
    """With one rank the agreement reduces nothing: its values are not copied to the device and back
    (on a GPU, a pinned buffer, a copy each way and an event per optimizer step)."""
    from lightning_elixir.runtime import grads as grads_module

    moved = []
    monkeypatch.setattr(grads_module, "to_device", lambda tensor, device: moved.append(device) or tensor)
    model = _gpt()
    runtime = ElixirRuntime(model, ElixirPlan(chunk_numel=4096))
    opt = shard_optimizer(runtime, torch.optim.AdamW(model.parameters(), lr=1e-3))
    for seed in range(2):
        _step(model, runtime, opt, seed)
    runtime.read_agreement()
    assert moved == []


def test_an_offloaded_launch_records_one_ready_event_for_all_its_chunks(monkeypatch):
    """Nothing is queued on the device between the jobs of one launch: one event (on a GPU, made and
    recorded per call) tells every upload of the step when the shards may be overwritten."""
    model = _gpt()
    runtime = ElixirRuntime(model, on_host(model, ElixirPlan(chunk_numel=4096, cache_blocks="min")))
    opt = shard_optimizer(runtime, torch.optim.AdamW(model.parameters(), lr=1e-3))
    ready = runtime.offload.uploads.ready
    calls = []
    monkeypatch.setattr(runtime.offload.uploads, "ready", lambda: calls.append(1) or ready())
    _step(model, runtime, opt, 0)
    runtime.offload.settle()
    assert runtime.offload.updates > 1 and len(calls) == 1
