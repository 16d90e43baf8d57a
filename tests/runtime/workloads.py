"""Training workloads run inside spawned ranks: Elixir's runtime against DDP on the same data."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from lightning_elixir.demos.gpt import GPT, GPTConfig
from lightning_elixir.plan import ElixirPlan
from lightning_elixir.runtime.optim import DynamicLossScaler, shard_optimizer
from lightning_elixir.runtime.optim import optimizer_step as elixir_step
from lightning_elixir.runtime.runtime import ElixirRuntime
from lightning_elixir.runtime.state_dict import full_state_dict

TINY = GPTConfig(vocab_size=96, block_size=16, n_layer=2, n_head=2, n_embd=32)
# Attention's key bias has an exactly zero true gradient (softmax ignores a shift shared by all
# keys), so Adam turns its rounding noise into full-size updates: any change in summation order
# (reducing each micro-batch as ZeRO does instead of accumulating first as DDP's no_sync does, or
# computing in bf16) sends that one parameter elsewhere. Without biases every weight is well
# conditioned, so comparisons that change the arithmetic use this config.
NO_BIAS = GPTConfig(vocab_size=96, block_size=16, n_layer=2, n_head=2, n_embd=32, bias=False)


@dataclass
class Run:
    """What one comparison run does."""

    plan: ElixirPlan
    steps: int = 20
    micro_batches: int = 1
    batch: int = 4
    clip_norm: Optional[float] = None
    clip_value: Optional[float] = None
    precision: str = "32-true"
    config: GPTConfig = field(default_factory=lambda: TINY)
    inf_grad_at: Optional[tuple[int, int]] = None
    """(step, rank): poison one gradient with inf on that rank at that step."""


def make_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=3e-3, betas=(0.9, 0.95))


def batches(rank: int, run: Run, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's micro-batches for one optimizer step (every rank sees different data)."""
    out = []
    for micro in range(run.micro_batches):
        g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
        x = torch.randint(run.config.vocab_size, (run.batch, run.config.block_size), generator=g)
        out.append((x, torch.roll(x, -1, dims=1)))
    return out


def loss_of(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, autocast: Optional[torch.dtype]) -> torch.Tensor:
    with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
        logits = model(x)
    return F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.view(-1))


def _dtypes(precision: str) -> tuple[torch.dtype, torch.dtype, Optional[torch.dtype]]:
    """(compute, master, autocast) dtypes for a precision flag."""
    return {
        "32-true": (torch.float32, torch.float32, None),
        "bf16-mixed": (torch.bfloat16, torch.float32, torch.bfloat16),
        "16-mixed": (torch.float16, torch.float32, torch.float16),
        "bf16-true": (torch.bfloat16, torch.bfloat16, None),
    }[precision]


def train_elixir(rank: int, world_size: int, run: Run, model: torch.nn.Module) -> dict[str, Any]:
    compute, master, autocast = _dtypes(run.precision)
    if run.precision == "bf16-true":
        model = model.to(torch.bfloat16)
    runtime = ElixirRuntime(model, run.plan, compute_dtype=compute, master_dtype=master)
    if run.precision == "16-mixed":
        runtime.scaler = DynamicLossScaler(scale=2.0 ** 8)
    optimizer = shard_optimizer(runtime, make_optimizer(model))
    losses, peak, stepped = [], 0, []
    for step in range(run.steps):
        handle = None
        if run.inf_grad_at == (step, rank):
            handle = next(p for p in model.parameters() if p.requires_grad).register_hook(
                lambda g: torch.full_like(g, float("inf")))
        for x, y in batches(rank, run, step):
            loss = loss_of(model, x, y, autocast) / run.micro_batches
            losses.append(loss.item())
            (runtime.scaler.scale_loss(loss) if runtime.scaler else loss).backward()
            peak = max(peak, runtime.memory_stats()["peak_gathered_public_chunks"])
        if handle is not None:
            handle.remove()
        stepped.append(elixir_step(runtime, optimizer, run.clip_norm, run.clip_value))
        optimizer.zero_grad()
    state = full_state_dict(runtime, everywhere=True)
    return {"losses": losses, "state": state, "stats": runtime.memory_stats(), "stepped": stepped,
            "capacity": runtime.cache.capacity, "num_public": len(runtime.public)}


def train_ddp(rank: int, world_size: int, run: Run, model: torch.nn.Module) -> dict[str, Any]:
    _, _, autocast = _dtypes(run.precision)
    if run.precision == "bf16-true":
        model = model.to(torch.bfloat16)
    ddp = DistributedDataParallel(model)
    optimizer = make_optimizer(model)
    losses = []
    for step in range(run.steps):
        for i, (x, y) in enumerate(batches(rank, run, step)):
            loss = loss_of(ddp, x, y, autocast) / run.micro_batches
            losses.append(loss.item())
            if i + 1 < run.micro_batches:
                with ddp.no_sync():
                    loss.backward()
            else:
                loss.backward()
        if run.clip_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), run.clip_norm)
        if run.clip_value is not None:
            torch.nn.utils.clip_grad_value_(model.parameters(), run.clip_value)
        optimizer.step()
        optimizer.zero_grad()
    return {"losses": losses, "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def compare(rank: int, world_size: int, runs: list[Run], with_ddp: bool = True) -> list[dict[str, Any]]:
    """Train each run with Elixir (and DDP) from the same initial weights; return both results."""
    results = []
    for run in runs:
        torch.manual_seed(0)
        base = GPT(run.config)
        out = {"elixir": train_elixir(rank, world_size, run, copy.deepcopy(base))}
        if with_ddp:
            out["ddp"] = train_ddp(rank, world_size, run, copy.deepcopy(base))
        results.append(out)
    return results
