"""Random small models get the same gradients under Elixir as in one plain process.

Models are stacks of 1-4 Linear layers (widths 4-32) with an activation, optionally with an
Embedding tied to the output Linear (as GPT's ``wte`` and ``lm_head``) and a random subset of
frozen parameters; plans draw chunk sizes from one parameter per chunk to the whole model, the
cache size and the prefetch depth. World size 1 runs in-process under hypothesis. World size 2
runs one spawned job over cases drawn up front from a seeded generator (a process pair per
example would take minutes): each rank runs half the batch, and the gradient Elixir averages
over ranks must equal the single process's gradient of the mean loss over the whole batch.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Optional, Union

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_elixir.plan import CACHE_ALL, CACHE_MIN, ElixirPlan, chunk_used_numel
from lightning_elixir.runtime.runtime import ElixirRuntime
from tests.distributed import run_distributed

VOCAB = 11
BATCH = 8
ACTIVATIONS = {"tanh": torch.tanh, "gelu": F.gelu, "sigmoid": torch.sigmoid, "identity": lambda h: h}
"""Smooth ones only: the halves of a batch round differently from the whole, and a kink (ReLU at 0)
could turn that rounding into a different gradient."""
CACHES = (CACHE_ALL, CACHE_MIN, "min+1", 1, 2, 3)
SPAWNED_CASES = 25


@dataclass(frozen=True)
class Case:
    """One model, its data and its plan."""

    widths: tuple[int, ...]
    """Feature sizes: the input, then each Linear's output."""
    activation: str
    """A key of ACTIVATIONS, applied after every Linear."""
    tied: bool
    """Token ids in through an Embedding whose weight is also the output Linear's."""
    frozen: tuple[bool, ...]
    """requires_grad=False, per parameter in ``named_parameters()`` order."""
    chunk_numel: int
    cache_blocks: Union[int, str]
    prefetch_depth: int
    seed: int
    """Weights and batch."""


class Net(nn.Module):
    def __init__(self, case: Case) -> None:
        super().__init__()
        self.activation = case.activation
        if case.tied:
            self.embed = nn.Embedding(VOCAB, case.widths[0])
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(case.widths, case.widths[1:]))
        if case.tied:
            self.head = nn.Linear(case.widths[-1], VOCAB, bias=False)
            self.head.weight = self.embed.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) if hasattr(self, "embed") else x
        for layer in self.layers:
            h = ACTIVATIONS[self.activation](layer(h))
        return self.head(h) if hasattr(self, "head") else h


# ---- drawing cases: one recipe, fed by hypothesis or by a seeded generator ---------------------------


class _Hypothesis:
    def __init__(self, draw: Any) -> None:
        self.draw = draw

    def int(self, lo: int, hi: int) -> int:
        return self.draw(st.integers(lo, hi))

    def choice(self, options: tuple) -> Any:
        return self.draw(st.sampled_from(options))


class _Seeded:
    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def int(self, lo: int, hi: int) -> int:
        return self.rng.randint(lo, hi)

    def choice(self, options: tuple) -> Any:
        return self.rng.choice(options)


def _public_numels(widths: list[int]) -> list[int]:
    """Numels of the parameters in public chunks (the tied weight gets a private chunk)."""
    return [n for a, b in zip(widths, widths[1:]) for n in (a * b, b)]


def make_case(pick: Any) -> Case:
    depth = pick.int(1, 4)
    widths = [pick.int(4, 32) for _ in range(depth + 1)]
    tied = pick.choice((False, True))
    if tied:
        widths[-1] = widths[0]
    frozen = [pick.int(0, 3) == 0 for _ in range(int(tied) + 2 * depth)]
    if all(frozen):
        frozen[-1] = False  # something must train
    public = _public_numels(widths)
    smallest, largest = max(public), chunk_used_numel(public)  # one parameter per chunk .. the whole model
    size = pick.choice(("smallest", "largest", "between"))
    chunk_numel = {"smallest": smallest, "largest": largest}.get(size) or pick.int(smallest, largest)
    return Case(tuple(widths), pick.choice(tuple(ACTIVATIONS)), tied, tuple(frozen), chunk_numel,
                pick.choice(CACHES), pick.int(0, 2), pick.int(0, 2 ** 16))


cases = st.composite(lambda draw: make_case(_Hypothesis(draw)))


# ---- gradients ----------------------------------------------------------------------------------------


def _model_and_batch(case: Case) -> tuple[Net, torch.Tensor, torch.Tensor]:
    torch.manual_seed(case.seed)
    model = Net(case)
    for p, frozen in zip(model.parameters(), case.frozen):
        p.requires_grad_(not frozen)
    g = torch.Generator().manual_seed(case.seed)
    x = torch.randint(VOCAB, (BATCH,), generator=g) if case.tied else torch.randn(BATCH, case.widths[0], generator=g)
    y = torch.randn(BATCH, VOCAB if case.tied else case.widths[-1], generator=g)
    return model, x, y


def _grads(model: nn.Module) -> dict[str, Optional[torch.Tensor]]:
    return {n: None if p.grad is None else p.grad.detach().clone() for n, p in model.named_parameters()}


def reference_grads(case: Case) -> dict[str, Optional[torch.Tensor]]:
    """The gradient of the mean loss over the whole batch, in one plain process."""
    model, x, y = _model_and_batch(case)
    F.mse_loss(model(x), y).backward()
    return _grads(model)


def elixir_grads(case: Case, rank: int = 0, world_size: int = 1, iterations: int = 2) -> list[dict[str, Any]]:
    """This rank's share of the batch through ElixirRuntime; the full gradients read from the shards.

    Two iterations: the first runs before the access order is known (LRU, no prefetch), the
    second replays it (furthest-next-use eviction, prefetch).
    """
    model, x, y = _model_and_batch(case)
    plan = ElixirPlan(chunk_numel=case.chunk_numel, cache_blocks=case.cache_blocks, prefetch_depth=case.prefetch_depth)
    runtime = ElixirRuntime(model, plan, grow_cache=True)
    rows = slice(rank * BATCH // world_size, (rank + 1) * BATCH // world_size)
    out = []
    for _ in range(iterations):
        F.mse_loss(model(x[rows]), y[rows]).backward()
        with runtime.gathered(grads=True):
            out.append(_grads(model))
        runtime.zero_grad()
    return out


def assert_same_grads(ours: dict[str, Any], ref: dict[str, Any], case: Case) -> None:
    assert ours.keys() == ref.keys(), case
    for name, grad in ref.items():
        if grad is None:
            assert ours[name] is None, f"{name} is frozen but got a gradient: {case}"
        else:
            torch.testing.assert_close(ours[name], grad, msg=lambda m: f"{name}: {m}\n{case}")


@settings(max_examples=100, deadline=None, derandomize=True)
@given(case=cases())
def test_one_process_gives_the_plain_gradients(case):
    ref = reference_grads(case)
    for grads in elixir_grads(case):
        assert_same_grads(grads, ref, case)


def _spawned(rank: int, world_size: int, drawn: list[Case]) -> list[list[dict[str, Any]]]:
    return [elixir_grads(case, rank, world_size) for case in drawn]


@pytest.fixture(scope="module")
def drawn() -> list[Case]:
    rng = random.Random(20240611)
    return [make_case(_Seeded(rng)) for _ in range(SPAWNED_CASES)]


def test_two_ranks_average_to_the_plain_gradients_of_the_whole_batch(drawn):
    assert {c.tied for c in drawn} == {False, True} and any(any(c.frozen) for c in drawn)
    assert {c.cache_blocks for c in drawn} >= {CACHE_ALL, CACHE_MIN, "min+1"}
    per_rank = run_distributed(_spawned, 2, drawn)
    for i, case in enumerate(drawn):
        ref = reference_grads(case)
        for rank_results in per_rank:
            for grads in rank_results[i]:
                assert_same_grads(grads, ref, case)
