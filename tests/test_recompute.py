"""Recomputation chosen by the search ([Note: searched recomputation] in recompute.py).

- The search picks recomputation when that is the only way to fit a budget, and says so.
- A plan that recomputes blocks trains exactly as the same plan without (two gloo ranks, dropout on,
  a plan that gathers per block and one that keeps everything gathered), also when the model
  checkpoints its blocks itself.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from lightning_elixir import ElixirPlan, PlanError
from lightning_elixir.demos.gpt import GPT, GPTConfig
from lightning_elixir.planner import plan_automatically
from lightning_elixir.profile import profile_model
from lightning_elixir.recompute import Recomputation, recomputing
from lightning_elixir.runtime.collectives import Group
from lightning_elixir.search import NoPlanFitsError, search
from lightning_elixir.units import block_names
from tests.test_oom_recovery import fit, result
from tests.test_resume import fit_on_ranks

LONG = GPTConfig(vocab_size=64, block_size=256, n_layer=4, n_head=2, n_embd=32, bias=False)
"""Long sequences on a narrow model: the activations dwarf the parameters."""


def _step(module, batch):
    logits = module(batch[:, :-1])
    return F.cross_entropy(logits.reshape(-1, LONG.vocab_size), batch[:, 1:].reshape(-1))


def _batch() -> torch.Tensor:
    return torch.randint(LONG.vocab_size, (8, LONG.block_size + 1), generator=torch.Generator().manual_seed(0))


def _least_need(model, names=()) -> int:
    with recomputing(model, names):
        profile = profile_model(model, _batch(), _step, device="cpu")
    from lightning_elixir.planner import search_options
    options = search_options(1, 1, torch.float32, None)
    from tests.search.profiles import hardware
    with pytest.raises(NoPlanFitsError) as err:
        search(profile, hardware(world_size=1), 1, options)
    return err.value.min_device_bytes


def test_the_search_recomputes_when_nothing_else_fits_and_says_so():
    torch.manual_seed(0)
    model = GPT(LONG)
    blocks = block_names(model)
    assert blocks == ("h.0", "h.1", "h.2", "h.3")
    plain, recomputed = _least_need(model), _least_need(model, blocks)
    assert recomputed < plain  # recomputation is the lever here
    result_ = plan_automatically(model, _batch(), device=torch.device("cpu"), group=Group(None, 0, 1),
                                 compute_dtype=torch.float32, autocast_dtype=None, micro_batches=1,
                                 memory_limit=(plain + recomputed) // 2, step_fn=_step)
    assert result_.plan.recompute and set(result_.plan.recompute) <= set(blocks)
    assert any("without it no plan fits the budget" in note for note in result_.notes)
    assert result_.report.winner.peak_bytes <= (plain + recomputed) // 2
    # with room for everything, nothing is recomputed
    roomy = plan_automatically(model, _batch(), device=torch.device("cpu"), group=Group(None, 0, 1),
                               compute_dtype=torch.float32, autocast_dtype=None, micro_batches=1,
                               memory_limit=plain * 4, step_fn=_step)
    assert roomy.plan.recompute == () and not roomy.notes


def test_recomputation_hooks_give_the_same_gradients_and_come_off():
    torch.manual_seed(0)
    model = GPT(dataclasses.replace(LONG, dropout=0.2))
    batch = _batch()
    torch.manual_seed(1)
    _step(model, batch).backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    hooks = Recomputation(model, block_names(model))
    torch.manual_seed(1)
    _step(model, batch).backward()
    assert all(torch.equal(e, p.grad) for e, p in zip(expected, model.parameters()))
    hooks.remove()
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules())
    with pytest.raises(ValueError, match="does not have"):
        Recomputation(model, ["h.9"])


def test_a_plan_names_distinct_modules_to_recompute():
    assert ElixirPlan.from_dict({"recompute": ["model.h.0"]}).recompute == ("model.h.0",)
    with pytest.raises(PlanError, match="recompute"):
        ElixirPlan.from_dict({"recompute": "model.h.0"})
    with pytest.raises(PlanError, match="distinct"):
        ElixirPlan(recompute=("a", "a"))


BLOCKS = ("model.h.0", "model.h.1")
PLANS = {"gathered_per_block": ElixirPlan(chunk_numel=12 << 10, cache_blocks="min", name="per block"),
         "resident": ElixirPlan(cache_blocks="all", name="resident")}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("recompute")
    fits = []
    for name, plan in PLANS.items():
        for recompute in (False, True):
            for own in (False, True):
                chosen = dataclasses.replace(plan, recompute=BLOCKS) if recompute else plan
                fits.append((root / f"{name}_{recompute}_{own}", chosen, None, None, 4, 1, True, 0, False, own))
    into = dataclasses.replace(PLANS["gathered_per_block"], recompute=BLOCKS)  # from a resident plan, after step 2
    fits.append((root / "switched_in", PLANS["resident"], None, None, 4, 1, True, 2, False, False, 0, 0, 0, into))
    fit_on_ranks(2, fits, fit_fn=fit)
    return root


@pytest.mark.parametrize("own", [False, True], ids=["model_as_is", "model_checkpoints_itself"])
@pytest.mark.parametrize("name", list(PLANS))
def test_recomputing_blocks_trains_exactly_as_without(runs, name, own):
    for rank in (0, 1):
        assert not (runs / f"{name}_True_{own}" / f"error{rank}.txt").exists()
        got, want = result(runs / f"{name}_True_{own}", rank), result(runs / f"{name}_False_{own}", rank)
        assert got["plan"]["recompute"] == list(BLOCKS) and want["plan"]["recompute"] == []
        assert [r[2] for r in got["rows"]] == pytest.approx([r[2] for r in want["rows"]], rel=1e-6)
        assert {r[6] for r in got["rows"]} == {2} and {r[6] for r in want["rows"]} == {2 if own else 1}  # calls
    weights = torch.load(runs / f"{name}_True_{own}" / "weights.pt")
    for key, value in torch.load(runs / f"{name}_False_{own}" / "weights.pt").items():
        torch.testing.assert_close(weights[key], value, rtol=1e-6, atol=1e-7, msg=key)


def test_a_switch_into_recomputation_trains_as_its_plan_from_the_start(runs):
    """A plan switch that starts recomputing blocks (as a self-correction or a recovery may) checkpoints them
    from then on, and trains exactly as the new plan does from the start."""
    for rank in (0, 1):
        assert not (runs / "switched_in" / f"error{rank}.txt").exists()
        got, want = result(runs / "switched_in", rank), result(runs / "gathered_per_block_True_False", rank)
        assert got["plan"] == want["plan"] and got["plan"]["recompute"] == list(BLOCKS)
        assert [r[2] for r in got["rows"]] == pytest.approx([r[2] for r in want["rows"]], rel=1e-6)
        assert [r[6] for r in got["rows"]] == [1, 1, 2, 2] and [r[6] for r in want["rows"]] == [2, 2, 2, 2]
    weights = torch.load(runs / "switched_in" / "weights.pt")
    for key, value in torch.load(runs / "gathered_per_block_True_False" / "weights.pt").items():
        torch.testing.assert_close(weights[key], value, rtol=1e-6, atol=1e-7, msg=key)


class _Layer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.calls = torch.nn.Linear(8, 8), 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x + torch.tanh(self.fc(x))


class _Staged(torch.nn.Module):
    """Stages kept as a list of lists of layers (as Funnel Transformer keeps its blocks): the blocks
    are the inner lists, which are never called themselves."""

    def __init__(self) -> None:
        super().__init__()
        self.stages = torch.nn.ModuleList(torch.nn.ModuleList(_Layer() for _ in range(2)) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for stage in self.stages:
            for layer in stage:
                x = layer(x)
        return x


def test_blocks_that_are_lists_of_layers_recompute_their_layers():
    from lightning_elixir.recompute import recompute_candidates

    torch.manual_seed(0)
    model, x = _Staged(), torch.randn(4, 8)
    assert block_names(model) == ("stages.0", "stages.1")
    names = recompute_candidates(model)
    assert names == ("stages.0.0", "stages.0.1", "stages.1.0", "stages.1.1")
    model(x).square().sum().backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    layers = [m for m in model.modules() if isinstance(m, _Layer)]
    before = [layer.calls for layer in layers]
    with recomputing(model, names):
        model(x).square().sum().backward()
    assert [layer.calls - b for layer, b in zip(layers, before)] == [2] * 4  # forward, then the recomputation
    assert all(torch.equal(e, p.grad) for e, p in zip(expected, model.parameters()))


class _Cache:
    """A key-value cache a model passes to each of its layers (as Hugging Face models do in training too)."""

    def __init__(self) -> None:
        self.seen: list[torch.Tensor] = []


class _CachedLayer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.out = torch.nn.Linear(8, 64), torch.nn.Linear(64, 8)

    def forward(self, x: torch.Tensor, cache=None) -> torch.Tensor:
        if cache is not None:
            cache.seen.append(x.detach())
        return x + self.out(torch.tanh(self.fc(x)))


class _CachedModel(torch.nn.Module):
    def __init__(self, use_cache: bool) -> None:
        super().__init__()
        self.use_cache = use_cache
        self.layers = torch.nn.ModuleList(_CachedLayer() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cache = _Cache() if self.use_cache else None
        for layer in self.layers:
            x = layer(x, cache=cache)
        return x


@pytest.mark.parametrize("use_cache", [True, False])
def test_the_planner_says_when_blocks_called_with_an_object_cannot_recompute(use_cache):
    """Such calls run without recomputation; when the search would recompute, it says which blocks and why."""
    torch.manual_seed(0)
    model, batch = _CachedModel(use_cache), torch.randn(4, 16, 8)
    with pytest.raises(NoPlanFitsError) as err:
        plan_automatically(model, batch, device=torch.device("cpu"), group=Group(None, 0, 1),
                           compute_dtype=torch.float32, autocast_dtype=None, micro_batches=1, memory_limit=1,
                           step_fn=lambda module, x: module(x).square().mean())
    told = "called with _Cache among their arguments" in str(err.value)
    assert told == use_cache, str(err.value)
    assert told == any("use_cache=False" in lever for lever in err.value.levers)


@pytest.fixture(scope="module")
def recomputing_planning():
    """plan="auto" for a budget only recomputation fits (as the first test), and the budget."""
    torch.manual_seed(0)
    model = GPT(LONG)
    blocks = block_names(model)
    budget = (_least_need(model) + _least_need(model, blocks)) // 2
    planning = plan_automatically(model, _batch(), device=torch.device("cpu"), group=Group(None, 0, 1),
                                  compute_dtype=torch.float32, autocast_dtype=None, micro_batches=1,
                                  memory_limit=budget, step_fn=_step)
    assert planning.plan.recompute
    return planning


def test_a_recovery_from_a_recomputing_plan_keeps_recomputing(recomputing_planning):
    """The profile a recovery searches again was traced with the plan's blocks recomputing: its plan
    must recompute them too, or the redo keeps the activations its prediction leaves out."""
    from lightning_elixir.recovery import OutOfMemoryRecovery

    planning = recomputing_planning
    peak = planning.report.winner.peak_bytes
    plan, report = OutOfMemoryRecovery()._shared_plan(planning, peak - 1, peak, Group(None, 0, 1), RuntimeError())
    assert plan.recompute == planning.plan.recompute
    assert report.winner.peak_bytes <= peak - 1 and report.winner.chunk_numel == plan.chunk_numel


def test_the_self_correction_keeps_recomputing_what_the_profile_recomputes(recomputing_planning, monkeypatch):
    """So does a plan the self-correction switches to (here: the search's best with one more prefetch, so
    that it differs from the running plan)."""
    from lightning_elixir.search import variants
    from lightning_elixir.search.calibrate import StepMeasurement, reconsider

    planning = recomputing_planning
    searched = variants.search

    def other(*args, **kwargs):
        plan, report = searched(*args, **kwargs)
        return dataclasses.replace(plan, prefetch_depth=plan.prefetch_depth + 1), report

    monkeypatch.setattr(variants, "search", other)
    decision = reconsider(planning.plan, planning.model_profile, planning.hardware_profile, planning.budget_bytes,
                          planning.options, StepMeasurement(step_s=planning.report.winner.step_s / 2),
                          threshold=0.1, margin=0.0)
    assert decision.plan is not None, decision.reason
    assert decision.plan.recompute == planning.plan.recompute


def _least_needs(planning) -> dict[tuple[str, ...], int]:
    """What each traced variant's most frugal plan needs (what a search's NoPlanFitsError reports)."""
    from lightning_elixir.search.errors import frugal_plan

    return {v.recompute: frugal_plan(v.profile, planning.hardware_profile, planning.options).memory.peak_bytes
            for v in planning.variants}


def _running(planning, recompute, budget):
    """``planning`` as it would be while running its variant ``recompute``'s best plan for ``budget``."""
    from lightning_elixir.search.variants import search_variants, variant_for

    found = search_variants([variant_for(planning.variants, recompute)], planning.hardware_profile, budget,
                            planning.options)
    return planning.switched_to(found.plan, budget_bytes=budget, report=found.report)


def test_later_searches_weigh_every_traced_variant(recomputing_planning):
    """Planning keeps the step as traced with each set of blocks recomputing; a switch describes the new
    plan by its own variant ([Note: recomputation variants] in search/variants.py)."""
    from lightning_elixir.search.variants import variant_for

    planning = recomputing_planning
    blocks = block_names(GPT(LONG))
    assert [v.recompute for v in planning.variants] == [(), blocks[1::2], blocks]
    assert planning.model_profile is variant_for(planning.variants, planning.plan.recompute).profile
    running = _running(planning, blocks[1::2], planning.budget_bytes * 2)
    assert running.plan.recompute == blocks[1::2]
    assert running.model_profile is variant_for(planning.variants, blocks[1::2]).profile


def test_a_recovery_recomputes_more_blocks_when_that_is_what_fits(recomputing_planning):
    """Running every other block recomputed, a recovery whose lowered budget only the plans recomputing every
    block fit switches to one of those, not to a failure."""
    from lightning_elixir.recovery import OutOfMemoryRecovery

    blocks = block_names(GPT(LONG))
    needs = _least_needs(recomputing_planning)
    assert needs[blocks] < needs[blocks[1::2]] < needs[()]
    running = _running(recomputing_planning, blocks[1::2], (needs[blocks[1::2]] + needs[()]) // 2)
    plan, _ = OutOfMemoryRecovery()._shared_plan(running, (needs[blocks] + needs[blocks[1::2]]) // 2,
                                                 running.report.winner.peak_bytes, Group(None, 0, 1), RuntimeError())
    assert plan.recompute == blocks
    # below every variant's most frugal plan: the advice does not suggest the recomputation already weighed
    from lightning_elixir.recovery import ElixirOutOfMemoryError
    with pytest.raises(ElixirOutOfMemoryError, match="already weighed recomputing") as err:
        OutOfMemoryRecovery()._shared_plan(running, needs[blocks] // 2, 1, Group(None, 0, 1), RuntimeError())
    assert "torch.utils.checkpoint" not in str(err.value)


def test_the_self_correction_may_recompute_fewer_blocks(recomputing_planning):
    """Running every block recomputed where recomputing every other block fits and is faster (as after a
    recovery), the calibrated search weighs the variants again and switches to the faster one; the planning
    then describes the new plan by its variant, calibrated as the running one was."""
    from lightning_elixir.search import evaluate_plan
    from lightning_elixir.search.calibrate import StepMeasurement, reconsider
    from lightning_elixir.search.variants import variant_for

    blocks = block_names(GPT(LONG))
    needs = _least_needs(recomputing_planning)
    running = _running(recomputing_planning, blocks, (needs[blocks[1::2]] + needs[()]) // 2)
    decision = reconsider(running.plan, running.model_profile, running.hardware_profile, running.budget_bytes,
                          running.options, StepMeasurement(step_s=running.report.winner.step_s * 2), threshold=0.1,
                          margin=0.0, variants=running.searchable)
    assert decision.outcome == "switch" and decision.plan.recompute == blocks[1::2], decision.reason
    assert "recomputing 2 blocks (instead of 4)" in decision.reason
    calibrated = decision.calibration.variants(running.searchable)
    after = running.switched_to(decision.plan, variants=calibrated, hardware_profile=decision.calibration.hardware)
    assert after.model_profile is variant_for(calibrated, blocks[1::2]).profile
    predicted = evaluate_plan(decision.plan, after.model_profile, after.hardware_profile, after.options).cost.step_s
    assert predicted == pytest.approx(decision.report.winner.step_s, rel=1e-9)


def test_a_plan_near_its_budget_keeps_the_variants_for_its_recovery():
    """A plan that fits without offloading but near its budget runs as it is, with the variants traced: when
    it runs out of memory, the recovery may recompute where the plans without recomputation no longer fit."""
    from lightning_elixir.planner import NEAR_BUDGET
    from lightning_elixir.recovery import OutOfMemoryRecovery

    torch.manual_seed(0)
    model = GPT(LONG)
    blocks = block_names(model)

    def planned(limit):
        return plan_automatically(model, _batch(), device=torch.device("cpu"), group=Group(None, 0, 1),
                                  compute_dtype=torch.float32, autocast_dtype=None, micro_batches=1,
                                  memory_limit=limit, step_fn=_step)

    roomy = planned(_least_need(model) * 4)
    peak = roomy.report.winner.peak_bytes
    assert not roomy.plan.offloads and [v.recompute for v in roomy.variants] == [()]
    near = planned(int(peak / (NEAR_BUDGET + 0.05)))
    assert near.plan == roomy.plan and not near.notes
    assert [v.recompute for v in near.variants] == [(), blocks[1::2], blocks]
    needs = _least_needs(near)
    plan, _ = OutOfMemoryRecovery()._shared_plan(near, (needs[blocks] + needs[()]) // 2, peak, Group(None, 0, 1),
                                                 RuntimeError())
    assert plan.recompute


class _SelfCheckpointing(torch.nn.Module):
    """A layer that checkpoints inside its own forward, as Hugging Face layers do after
    ``gradient_checkpointing_enable()``: its forward hooks stay outside the checkpoint, so they do not fire
    when it is recomputed."""

    def __init__(self, reentrant) -> None:
        super().__init__()
        self.fc, self.reentrant = torch.nn.Linear(16, 16), reentrant

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.reentrant is None or not torch.is_grad_enabled():
            return self._forward(x)
        return torch.utils.checkpoint.checkpoint(self._forward, x, use_reentrant=self.reentrant)


@pytest.mark.parametrize("reentrant", [None, False, True], ids=["as_is", "non_reentrant", "reentrant"])
def test_a_model_that_checkpoints_inside_its_layers_is_left_as_it_is(reentrant):
    """The trace sees forward operators re-run in backward although no layer's forward hook fires: the model
    recomputes on its own, so the search does not stack its own checkpointing on it."""
    from lightning_elixir.planner import search_options, search_with_recomputation
    from tests.search.profiles import hardware

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), *(_SelfCheckpointing(reentrant) for _ in range(4)))

    def step(module, x):
        return module(x).square().mean()

    def traced(names=()):
        with recomputing(model, names):
            return profile_model(model, torch.randn(64, 8), step, device="cpu")

    profile = traced()
    assert profile.recomputes == (reentrant is not None)
    assert not any(a.phase == "recompute" for a in profile.accesses)  # what a hook would have seen
    asked = []

    def counted(names):
        asked.append(names)
        return traced(names)

    with pytest.raises(NoPlanFitsError):
        search_with_recomputation(model, profile, counted, hardware(world_size=1), 1,
                                  search_options(1, 1, torch.float32, None))
    assert asked == ([] if reentrant is not None else [("2", "4"), ("1", "2", "3", "4")])


class _GatedGPT(torch.nn.Module):
    """The long GPT and an expert that runs only when the batch says so (a value-dependent module call)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.gpt = GPT(LONG)
        self.expert = torch.nn.Linear(LONG.vocab_size, LONG.vocab_size)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        logits = self.gpt(idx)
        if bool((idx[:, 0] == 0).any()):
            logits = logits + self.expert(logits)
        return logits


def test_recomputation_variants_reuse_the_value_dependent_modules_found_once(monkeypatch):
    """Finding the modules whose calls depend on values takes a second trace of the step; a recomputation
    variant makes the same module calls, so its trace takes the finding over instead of tracing twice."""
    import lightning_elixir.profile.model as model_module

    calls = []
    found = model_module._value_dependent
    monkeypatch.setattr(model_module, "_value_dependent", lambda *args: calls.append(1) or found(*args))
    model = _GatedGPT()
    blocks = block_names(model)
    budget = (_least_need(model) + _least_need(model, blocks)) // 2
    calls.clear()
    planning = plan_automatically(model, _batch(), device=torch.device("cpu"), group=Group(None, 0, 1),
                                  compute_dtype=torch.float32, autocast_dtype=None, micro_batches=1,
                                  memory_limit=budget, step_fn=_step)
    assert planning.plan.recompute and len(planning.variants) == 3
    assert calls == [1]
    for variant in planning.variants:
        assert variant.profile.conditional_params == ("expert.weight", "expert.bias")
        assert {"expert.weight", "expert.bias"} <= set(variant.profile.shared_params)  # given private chunks
