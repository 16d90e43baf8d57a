"""One hook per chunk in resident plans ([Note: one hook per chunk] in runtime/grads.py).

A resident plan learns which parameter's gradient completes each chunk and keeps only that hook.
These steps break the learned order on purpose, on 2 gloo ranks and in one process: a backward that
reaches no watcher (its gradients are found before the optimizer step, the next forward or a read),
a watcher that reports while other parameters of its chunk have no gradient (the chunk waits for
the end of backward and learns again), ranks that use different parameters in the same step, and
accumulation over a micro-batch that reached no watcher. Every step must give the weights,
gradients and optimizer state of one process that trains on all the ranks' rows.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from lightning_elixir.plan import CACHE_ALL, ElixirPlan
from lightning_elixir.runtime.optim import optimizer_step, shard_optimizer
from tests.distributed import run_distributed

ROWS = 4
WIDTH = 8

# Per step, what each micro-batch computes on rank 0 and on rank 1 (a single process uses the rank's rows).
# In a full forward the gradients arrive head, middle, trunk: the head's hook begins backward, the trunk's
# completes the chunk (its watcher).
STEPS: list[list[tuple[str, str]]] = [
    [("full", "full")],  # learning: every parameter hooked
    [("full", "full")],  # watching: the head's hook and the trunk's
    [("middle", "middle")],  # no hooked parameter gets a gradient: nothing reports this backward
    [("trunk", "trunk")],  # the watcher reports, the others have no gradient: wait for the end, learn again
    [("full", "full")],  # learning again
    [("middle", "full")],  # rank 0 reports nothing, rank 1 reduces during backward
    [("middle", "middle"), ("full", "full")],  # accumulation: the first micro-batch reports nothing
    [("head", "head")],  # backward begins, the watcher never reports: the chunk is reduced at its end
    [("full", "full")],
]


class Layers(nn.Module):
    """Three layers in one module, so in one chunk."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Parameter(torch.randn(WIDTH, WIDTH) / WIDTH**0.5)
        self.middle = nn.Parameter(torch.randn(WIDTH, WIDTH) / WIDTH**0.5)
        self.head = nn.Parameter(torch.randn(WIDTH, WIDTH) / WIDTH**0.5)

    def forward(self, x: torch.Tensor, mode: str) -> torch.Tensor:
        if mode != "full":
            return F.linear(x, getattr(self, mode))
        x = torch.relu(F.linear(x, self.trunk))
        x = torch.relu(F.linear(x, self.middle))
        return F.linear(x, self.head)


def _batch(step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + micro)
    return torch.randn(2 * ROWS, WIDTH, generator=g), torch.randn(2 * ROWS, WIDTH, generator=g)


def _ranks_loss(forward: Callable[[int, torch.Tensor], torch.Tensor], x: torch.Tensor, y: torch.Tensor,
                world_size: int) -> torch.Tensor:
    """The loss every rank's rows give together (``forward(rank, rows)``), averaged over the ranks as the
    gradients are."""
    return sum(F.mse_loss(forward(r, x[r * ROWS:(r + 1) * ROWS]), y[r * ROWS:(r + 1) * ROWS])
               for r in range(world_size)) / world_size


def _elixir_backward(runtime: Any, model: nn.Module, x: torch.Tensor, y: torch.Tensor, *args: Any) -> None:
    """A forward of ``model`` on this rank's rows in a step region, and its backward."""
    with runtime.step_region():
        runtime.begin_iteration()
        loss = F.mse_loss(model(x, *args), y)
    loss.backward()


def _train_both(runtime: Any, optimizer: Any, model: nn.Module, reference: nn.Module, ref_opt: Any,
                x: torch.Tensor, y: torch.Tensor, rank: int, world_size: int) -> None:
    """One step of the runtime on this rank's rows, and of the reference on every rank's."""
    rows = slice(rank * ROWS, (rank + 1) * ROWS)
    _elixir_backward(runtime, model, x[rows], y[rows])
    optimizer_step(runtime, optimizer)
    optimizer.zero_grad()
    _ranks_loss(lambda r, h: reference(h), x, y, world_size).backward()
    ref_opt.step()
    ref_opt.zero_grad()


def _paired_weights(runtime: Any, model: nn.Module, reference: nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
    with runtime.gathered():
        return [(p.detach().clone(), r.detach().clone()) for p, r in zip(model.parameters(), reference.parameters())]


def _train(rank: int, world_size: int, device: str = "cpu") -> dict:
    """Also run in one process on a GPU (tests/test_gpu.py)."""
    from lightning_elixir.runtime.collectives import Group
    from lightning_elixir.runtime.runtime import ElixirRuntime

    torch.manual_seed(0)
    model = Layers().to(device)
    reference = Layers().to(device)
    reference.load_state_dict(model.state_dict())
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    runtime = ElixirRuntime(model, ElixirPlan(chunk_numel=1024, cache_blocks=CACHE_ALL), group=Group.default(),
                            device=device)
    assert runtime.resident and len(runtime.chunks) == 1
    optimizer = shard_optimizer(runtime, torch.optim.AdamW(model.parameters(), lr=1e-2))
    rows = slice(rank * ROWS, (rank + 1) * ROWS)
    hooked, grads, weights = [], [], []
    for step, micro_batches in enumerate(STEPS):
        for micro, modes in enumerate(micro_batches):
            x, y = (t.to(device) for t in _batch(step, micro))
            _elixir_backward(runtime, model, x[rows], y[rows], modes[rank])
        with runtime.gathered():  # what a callback before the optimizer step reads
            grads.append([None if p.grad is None else p.grad.clone() for p in model.parameters()])
        optimizer_step(runtime, optimizer)
        optimizer.zero_grad()
        hooked.append(runtime.trainable.hooked)
        for micro, modes in enumerate(micro_batches):
            x, y = (t.to(device) for t in _batch(step, micro))
            _ranks_loss(lambda r, h: reference(h, modes[r]), x, y, world_size).backward()
        grads[-1] = (grads[-1], [None if p.grad is None else p.grad.clone() for p in reference.parameters()])
        ref_opt.step()
        ref_opt.zero_grad()
        weights.append(_paired_weights(runtime, model, reference))
    return {"hooked": hooked, "grads": grads, "weights": weights}


def check(result: dict) -> None:
    for step, ((got, want), weights) in enumerate(zip(result["grads"], result["weights"])):
        for g, r in zip(got, want):  # read before the step, a gradient no rank got reads as zero, not None
            if r is None:
                assert g is None or not g.any(), f"step {step}: a gradient where none was computed"
            else:
                torch.testing.assert_close(g, r, rtol=1e-6, atol=1e-7, msg=lambda m: f"step {step} grads: {m}")
        for p, r in weights:
            torch.testing.assert_close(p, r, rtol=1e-6, atol=1e-7, msg=lambda m: f"step {step} weights: {m}")


@pytest.mark.parametrize("world_size", [1, 2])
def test_one_hook_per_chunk_matches_one_process(world_size):
    results = run_distributed(_train, world_size)
    for result in results:
        check(result)
    # 3 parameters in one chunk: all hooked while learning, two while watching (the first to arrive, the
    # watcher); the step whose watcher reported early (the trunk alone) hooks them all again.
    assert results[0]["hooked"] == [2, 2, 2, 3, 2, 2, 2, 2, 2], results[0]["hooked"]


class Checkpointed(nn.Module):
    """Blocks under reentrant checkpointing (Hugging Face's default), then a head that is not: every
    block's gradients arrive in a backward nested in the step's."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(4))
        self.head = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.utils.checkpoint.checkpoint(lambda h, b=block: torch.relu(b(h)), x, use_reentrant=True)
        return self.head(x)


def _train_checkpointed(rank: int, world_size: int) -> dict:
    from lightning_elixir.runtime.collectives import Group
    from lightning_elixir.runtime.runtime import ElixirRuntime

    torch.manual_seed(0)
    model, reference = Checkpointed(), Checkpointed()
    reference.load_state_dict(model.state_dict())
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    # three blocks per chunk: the last chunk's watcher is a block's, inside a nested backward
    runtime = ElixirRuntime(model, ElixirPlan(chunk_numel=3 * 128, cache_blocks=CACHE_ALL), group=Group.default())
    optimizer = shard_optimizer(runtime, torch.optim.AdamW(model.parameters(), lr=1e-2))
    steps = 4
    for step in range(steps):
        x, y = _batch(step, 0)
        x.requires_grad_()  # reentrant checkpointing needs an input that requires grad
        _train_both(runtime, optimizer, model, reference, ref_opt, x, y, rank, world_size)
    return {"weights": _paired_weights(runtime, model, reference), "retired": runtime.grads.reductions.retired, "steps": steps,
            "chunks": len(runtime.chunks), "hooked": runtime.trainable.hooked}


@pytest.mark.parametrize("world_size", [1, 2])
def test_one_hook_per_chunk_under_reentrant_checkpointing(world_size):
    for result in run_distributed(_train_checkpointed, world_size):
        for p, r in result["weights"]:
            torch.testing.assert_close(p, r, rtol=1e-6, atol=1e-7)
        assert result["chunks"] > 1
        assert result["hooked"] < 10  # of 10 parameters: the chunks' watchers and the first to arrive
        # one reduction per chunk and backward: the backward ends once, where the step's ends
        assert result["retired"] == result["steps"] * result["chunks"], result


class TwoParts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH))
        self.second = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.relu(self.first(x)))


def _train_toggled(rank: int, world_size: int, chunk_numel: int = 256) -> dict:
    """Each step trains one part with the other frozen, as Lightning's ``toggle_optimizer`` does."""
    from lightning_elixir.runtime.collectives import Group
    from lightning_elixir.runtime.runtime import ElixirRuntime

    torch.manual_seed(0)
    model, reference = TwoParts(), TwoParts()
    reference.load_state_dict(model.state_dict())
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    runtime = ElixirRuntime(model, ElixirPlan(chunk_numel=chunk_numel, cache_blocks=CACHE_ALL), group=Group.default())
    optimizer = shard_optimizer(runtime, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    hooked, registered = [], []
    for step in range(6):
        for m in (model, reference):
            m.first.requires_grad_(step % 2 == 0)
            m.second.requires_grad_(step % 2 == 1)
        x, y = _batch(step, 0)
        _train_both(runtime, optimizer, model, reference, ref_opt, x, y, rank, world_size)
        hooked.append(runtime.trainable.hooked)
        registered.append(runtime.trainable.registered)
    return {"weights": _paired_weights(runtime, model, reference), "hooked": hooked, "registered": registered, "chunks": len(runtime.chunks)}


@pytest.mark.parametrize("world_size", [1, 2])
def test_watchers_are_kept_while_their_parameters_are_frozen(world_size):
    for result in run_distributed(_train_toggled, world_size):
        for p, r in result["weights"]:
            torch.testing.assert_close(p, r, rtol=1e-6, atol=1e-7)
        assert result["chunks"] == 2
        # 8 parameters hooked at the start; each part learns once, then toggling back and forth registers no
        # hook again, and each part keeps two (its watcher and the first parameter to arrive)
        assert result["registered"] == [8] * 6, result["registered"]
        assert result["hooked"][1:] == [4] * 5, result["hooked"]


@pytest.mark.parametrize("world_size", [1, 2])
def test_watchers_are_kept_for_each_part_of_a_chunk_toggled_in_turn(world_size):
    for result in run_distributed(_train_toggled, world_size, 4096):
        for p, r in result["weights"]:
            torch.testing.assert_close(p, r, rtol=1e-6, atol=1e-7)
        assert result["chunks"] == 1
        # one chunk holds both parts: each part learns its watcher once (every parameter is hooked at the
        # start), then switching parts registers no hook
        assert result["registered"] == [8] * 6, result["registered"]
        assert max(result["hooked"][1:]) <= 4, result["hooked"]
