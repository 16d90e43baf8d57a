"""Ranks that issue different collectives fail on every rank within the collective timeout, with an
error that says so; training that agrees across ranks never trips the timeout."""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any, Optional

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from lightning_elixir.plan import CACHE_MIN, ElixirPlan
from lightning_elixir.runtime import collectives
from lightning_elixir.runtime.collectives import Group, Pending, RankDivergenceError
from lightning_elixir.runtime.optim import optimizer_step, shard_optimizer
from lightning_elixir.runtime.runtime import ElixirRuntime
from tests.distributed import run_distributed

TIMEOUT_S = 3.0
BOUND_S = 30.0
"""Every rank must have raised this long after the divergent step began (the timeout plus slack)."""
LAYER_NUMEL = 16 * 16 + 64  # a Linear(16, 16): the weight, then its bias at the next 64-element boundary


class Stack(nn.Module):
    """Four Linear layers; ``skip`` leaves one out (data-dependent control flow in a user's model)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(4))

    def forward(self, x: torch.Tensor, skip: Optional[int] = None) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            if i != skip:
                x = torch.tanh(layer(x))
        return x


def _train(rank: int, group: Group, plan: ElixirPlan, skip_on_rank1_at: Optional[int] = None,
           late_rank1_s: float = 0.0, steps: int = 4) -> dict[str, Any]:
    """Train ``steps`` steps; rank 1 skips layer 2 at step ``skip_on_rank1_at`` and sleeps ``late_rank1_s``
    before each step. A RankDivergenceError is caught and returned with the seconds since that step began."""
    torch.manual_seed(0)
    model = Stack()
    runtime = ElixirRuntime(model, plan, group=group)
    opt = shard_optimizer(runtime, torch.optim.SGD(model.parameters(), lr=0.1))
    losses, began = [], time.monotonic()
    try:
        for step in range(steps):
            if rank == 1:
                time.sleep(late_rank1_s)
            began = time.monotonic()
            x = torch.randn(4, 16, generator=torch.Generator().manual_seed(10 * step + rank))
            skip = 2 if rank == 1 and step == skip_on_rank1_at else None
            loss = model(x, skip).pow(2).mean()
            loss.backward()
            optimizer_step(runtime, opt)
            opt.zero_grad()
            losses.append(loss.item())
    except RankDivergenceError as err:
        return {"error": str(err), "elapsed_s": time.monotonic() - began, "losses": losses,
                "next_collective_s": _time_next_collective(group)}
    return {"error": None, "losses": losses}


def _time_next_collective(group: Group) -> Optional[float]:
    """Seconds until a collective after the divergence fails (a teardown that gathers must not wait
    again); None if it completes."""
    began = time.monotonic()
    try:
        collectives.all_reduce_sum(torch.ones(1), group)
    except RankDivergenceError:
        return time.monotonic() - began
    return None


def _fresh_group(rank: int, world_size: int, timeout_s: Optional[float]) -> Group:
    """A new gloo group per scenario: a divergence leaves its group's connections closed. Its own
    timeout of a minute keeps a regression from hanging the suite for the default half hour."""
    pg = dist.new_group(list(range(world_size)), timeout=timedelta(seconds=60))
    return Group(pg, rank, world_size, timeout_s)


def _evaluate_swapped(rank: int, group: Group, plan: ElixirPlan) -> dict[str, Any]:
    """Forward-only steps; in step 1 rank 0 skips layer 2 and rank 1 skips layer 1: as many gathers of
    chunks of one size on each rank, so every collective completes. The loop ends with the check the
    strategy runs after an evaluation loop."""
    torch.manual_seed(0)
    model = Stack()
    runtime = ElixirRuntime(model, plan, group=group)
    outputs = []
    with torch.no_grad():
        for step in range(3):
            x = torch.randn(4, 16, generator=torch.Generator().manual_seed(step))
            outputs.append(model(x, (2 - rank) if step == 1 else None))
    try:
        collectives.agreed_max(torch.zeros(0), group)
    except RankDivergenceError as err:
        return {"error": str(err), "outputs": outputs}
    return {"error": None, "outputs": outputs}


def _signatures(rank: int, group: Group) -> dict[str, Any]:
    """``agreed_max`` on equal and on different signatures (set by hand), then the values it returns."""
    out = {}
    group.note(0, 3)
    out["equal"] = collectives.agreed_max(torch.tensor([float(rank), 1.0 - rank]), group)
    group.note(1, 5 + rank)
    try:
        collectives.agreed_max(torch.zeros(1), group)
        out["different"] = None
    except RankDivergenceError as err:
        out["different"] = str(err)
    out["reset"] = collectives.agreed_max(torch.zeros(1), group)  # the failed check started afresh
    return out


def _lrs_differ(rank: int, group: Group, plan: ElixirPlan, lr_by_rank: tuple[float, float]) -> bool:
    """One step with this rank's lr; whether the runtime noticed the ranks' hyperparameters differ."""
    torch.manual_seed(0)
    model = Stack()
    runtime = ElixirRuntime(model, plan, group=group)
    opt = shard_optimizer(runtime, torch.optim.SGD(model.parameters(), lr=lr_by_rank[rank], momentum=0.9))
    model(torch.randn(4, 16, generator=torch.Generator().manual_seed(rank))).pow(2).mean().backward()
    optimizer_step(runtime, opt)
    return runtime.hyperparameters_differ


def _read_later(rank: int, group: Group, plan: ElixirPlan) -> dict[str, Any]:
    """With the agreement read at the next step ([Note: reading the agreement later] in grads.py, on by
    default on a GPU): different lrs, then reduce-scatters that differ by hand. Each step completes; the
    next step's read (or ``read_agreement``) notices."""
    torch.manual_seed(0)
    model = Stack()
    runtime = ElixirRuntime(model, plan, group=group)
    runtime.grads.read_later = True
    opt = shard_optimizer(runtime, torch.optim.SGD(model.parameters(), lr=(0.1, 0.05)[rank]))

    def step(seed: int) -> None:
        model(torch.randn(4, 16, generator=torch.Generator().manual_seed(seed + rank))).pow(2).mean().backward()
        optimizer_step(runtime, opt)
        opt.zero_grad()

    out = {}
    step(0)
    out["noticed_after_the_step"] = runtime.hyperparameters_differ
    step(10)  # reads the first step's agreement
    out["noticed_at_the_next"] = runtime.hyperparameters_differ
    group.note(1, 5 + rank)  # as if the ranks had reduce-scattered different chunks
    step(20)
    try:
        runtime.read_agreement()
        out["error"] = None
    except RankDivergenceError as err:
        out["error"] = str(err)
    return out


def _scenarios(rank: int, world_size: int) -> dict[str, Any]:
    zero3 = ElixirPlan(chunk_numel=LAYER_NUMEL, cache_blocks=CACHE_MIN)
    two_blocks = ElixirPlan(chunk_numel=LAYER_NUMEL, cache_blocks=2)
    return {
        "signatures": _signatures(rank, _fresh_group(rank, world_size, TIMEOUT_S)),
        "lrs_differ": _lrs_differ(rank, _fresh_group(rank, world_size, TIMEOUT_S), zero3, (0.1, 0.05)),
        "lrs_agree": _lrs_differ(rank, _fresh_group(rank, world_size, TIMEOUT_S), zero3, (0.1, 0.1)),
        "read_later": _read_later(rank, _fresh_group(rank, world_size, TIMEOUT_S), zero3),
        "evaluate_swapped": _evaluate_swapped(rank, _fresh_group(rank, world_size, TIMEOUT_S), zero3),
        "bounded": _train(rank, _fresh_group(rank, world_size, TIMEOUT_S), zero3),
        "unbounded": _train(rank, _fresh_group(rank, world_size, None), zero3),
        "late": _train(rank, _fresh_group(rank, world_size, TIMEOUT_S), zero3, late_rank1_s=TIMEOUT_S / 3, steps=3),
        "diverged_min": _train(rank, _fresh_group(rank, world_size, TIMEOUT_S), zero3, skip_on_rank1_at=1),
        "diverged_two": _train(rank, _fresh_group(rank, world_size, TIMEOUT_S), two_blocks, skip_on_rank1_at=1),
    }


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_distributed(_scenarios, 2)


@pytest.mark.parametrize("scenario", ["diverged_min", "diverged_two"])
def test_a_rank_skipping_a_module_fails_every_rank_in_bounded_time(results, scenario):
    for rank, result in enumerate(results):
        outcome = result[scenario]
        assert outcome["error"] is not None, f"rank {rank} finished a step the other rank diverged from"
        assert len(outcome["losses"]) == 1, "the first step agreed; the second raised"
        assert outcome["elapsed_s"] < BOUND_S
        message = outcome["error"]
        assert message.startswith(f"rank {rank}: the ")
        assert "did not issue the same collectives" in message
        assert "one rank ran a module that holds parameters, another skipped it" in message
        assert "of chunk " in message and " s" in message
        assert f"collective_timeout_s (now {TIMEOUT_S:g} s)" in message


@pytest.mark.parametrize("scenario", ["diverged_min", "diverged_two"])
def test_collectives_after_a_divergence_fail_at_once(results, scenario):
    for result in results:
        seconds = result[scenario]["next_collective_s"]
        assert seconds is not None and seconds < TIMEOUT_S


def test_training_that_agrees_never_trips_the_timeout_and_computes_the_same(results):
    for result in results:
        assert result["bounded"]["error"] is None and result["unbounded"]["error"] is None
        assert result["bounded"]["losses"] == result["unbounded"]["losses"]
        assert len(result["bounded"]["losses"]) == 4


def test_a_rank_arriving_late_within_the_timeout_does_not_trip_it(results):
    for result in results:
        assert result["late"]["error"] is None
        assert result["late"]["losses"] == result["bounded"]["losses"][:3]


def test_the_check_returns_the_maximum_when_ranks_agree_and_raises_on_every_rank_when_not(results):
    for rank, result in enumerate(results):
        outcome = result["signatures"]
        assert outcome["equal"] == [1.0, 1.0]
        assert outcome["different"] is not None and outcome["different"].startswith(f"rank {rank}: ")
        assert "reduce-scatters for different chunks" in outcome["different"]
        assert outcome["reset"] == [0.0]


def test_hyperparameters_that_differ_between_ranks_are_noticed(results):
    """A warning, not an error: DDP trains on (its replicas drift apart)."""
    assert [r["lrs_differ"] for r in results] == [True, True]
    assert [r["lrs_agree"] for r in results] == [False, False]


def test_evaluation_that_gathered_different_chunks_on_each_rank_is_an_error_not_silent(results):
    """The swapped step completes (and computes with mixed chunks): the check after the loop says so."""
    for rank, result in enumerate(results):
        outcome = result["evaluate_swapped"]
        assert outcome["error"] is not None, f"rank {rank} did not notice"
        assert "all-gathers for different chunks" in outcome["error"]
        assert "private_params" in outcome["error"] and "mixture-of-experts" in outcome["error"]
        assert len(outcome["outputs"]) == 3


# ---- the bounded wait, on work handles that stand in for a backend's -----------------------------


class _Work:
    """A work handle that completes after ``done_after`` waits, fails with ``fails``, or never completes."""

    def __init__(self, done_after: Optional[int] = None, fails: Optional[str] = None) -> None:
        self.done_after, self.fails, self.waits = done_after, fails, 0

    def is_completed(self) -> bool:
        return self.fails is not None or (self.done_after is not None and self.waits >= self.done_after)

    def wait(self, timeout: Any = None) -> bool:
        self.waits += 1
        if self.fails is not None:
            raise RuntimeError(self.fails)
        if self.is_completed():
            return True
        time.sleep(min(timeout.total_seconds(), 0.01))
        raise RuntimeError("Operation timed out!")


def _pending(work: _Work, timeout_s: Optional[float] = 0.2) -> Pending:
    return Pending(work, Group(None, 1, 2, timeout_s), "the all-gather of chunk 5 (64 elements, 256 B)", on_host=True)


def test_a_wait_that_never_completes_raises_after_the_timeout():
    began = time.monotonic()
    with pytest.raises(RankDivergenceError, match=r"rank 1: the all-gather of chunk 5 .* did not complete within 0\.2 s"):
        _pending(_Work()).wait()
    assert 0.2 <= time.monotonic() - began < 2.0


def test_a_collective_that_completes_after_several_slices_is_not_an_error():
    work = _Work(done_after=3)
    _pending(work, timeout_s=60.0).wait()
    assert work.waits >= 3


def test_a_failed_collective_raises_at_once_with_the_backends_words():
    began = time.monotonic()
    with pytest.raises(RankDivergenceError, match=r"failed after 0\.0 s \(Connection closed by peer\)"):
        _pending(_Work(fails="Connection closed by peer"), timeout_s=60.0).wait()
    assert time.monotonic() - began < 1.0


def test_the_timeout_is_validated():
    for bad in (0, -1.0, float("inf"), float("nan"), True, "300"):
        with pytest.raises(ValueError, match="timeout_s"):
            Group(None, 0, 1, bad)
    assert Group(None, 0, 1).timeout_s == collectives.DEFAULT_TIMEOUT_S
    assert Group(None, 0, 1, None).timeout_s is None


def test_an_agreement_read_at_the_next_step_still_notices_what_differs(results):
    for rank, result in enumerate(results):
        outcome = result["read_later"]
        assert not outcome["noticed_after_the_step"] and outcome["noticed_at_the_next"]
        assert outcome["error"] is not None and outcome["error"].startswith(f"rank {rank}: ")
        assert "reduce-scatters for different chunks" in outcome["error"]
