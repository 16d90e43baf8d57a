"""Models users write, on 2 gloo ranks against DDP: frozen parameters, activation checkpointing,
branches unused in some steps, a weight used outside its module, buffers, meta-device init; and
against one process on the whole batch: parameters frozen and unfrozen mid-training, and a branch
that no rank (or one rank only) uses under AdamW."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from lightning_elixir.demos.gpt import GPT, GPTConfig
from lightning_elixir.plan import CACHE_MIN, ElixirPlan
from lightning_elixir.runtime.optim import optimizer_step, shard_optimizer
from lightning_elixir.runtime.runtime import ElixirRuntime
from lightning_elixir.runtime.state_dict import full_state_dict
from tests.distributed import run_distributed

ZERO3 = ElixirPlan(chunk_numel=4097, cache_blocks=CACHE_MIN)


class Branchy(nn.Module):
    """A middle layer used only on even steps; a projection used outside its module; a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.even = nn.Linear(16, 16)
        self.proj = nn.Linear(16, 16)
        self.out = nn.Linear(16, 4)
        self.register_buffer("scale", torch.tensor(0.5))

    def forward(self, x: torch.Tensor, use_even: bool) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        if use_even:
            h = torch.tanh(self.even(h))
        h = torch.tanh(F.linear(h, self.proj.weight, self.proj.bias))  # outside the module that holds it
        return self.out(h) * self.scale


def _data(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)


def _branchy(rank: int, world_size: int) -> dict:
    torch.manual_seed(0)
    base = Branchy()
    model, ref = copy.deepcopy(base), copy.deepcopy(base)
    runtime = ElixirRuntime(model, ElixirPlan(chunk_numel=300, cache_blocks=2),
                            private_params=["proj.weight", "proj.bias"])
    opt = shard_optimizer(runtime, torch.optim.SGD(model.parameters(), lr=0.1))
    ddp = DistributedDataParallel(ref, find_unused_parameters=True)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    losses = []
    for step in range(6):
        x, y = _data(rank, step)
        loss = F.mse_loss(model(x, step % 2 == 0), y)
        loss.backward()
        optimizer_step(runtime, opt)
        opt.zero_grad()
        ref_loss = F.mse_loss(ddp(x, step % 2 == 0), y)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        losses.append((loss.item(), ref_loss.item()))
    return {"losses": losses, "state": full_state_dict(runtime, everywhere=True), "ref": ref.state_dict()}


def _gpt_variant(rank: int, world_size: int, config: GPTConfig, freeze: tuple[str, ...]) -> dict:
    torch.manual_seed(0)
    base = GPT(config)
    for name, p in base.named_parameters():
        p.requires_grad_(not name.startswith(freeze))
    model, ref = copy.deepcopy(base), copy.deepcopy(base)
    runtime = ElixirRuntime(model, ZERO3)
    opt = shard_optimizer(runtime, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2))
    ddp = DistributedDataParallel(ref)
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for step in range(5):
        g = torch.Generator().manual_seed(10 * step + rank)
        x = torch.randint(config.vocab_size, (4, config.block_size), generator=g)
        y = torch.roll(x, -1, 1)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        optimizer_step(runtime, opt)
        opt.zero_grad()
        ref_loss = F.cross_entropy(ddp(x).flatten(0, 1), y.flatten())
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        losses.append((loss.item(), ref_loss.item()))
    return {"losses": losses, "state": full_state_dict(runtime, everywhere=True), "ref": ref.state_dict(),
            "peak": runtime.memory_stats()["peak_gathered_public_chunks"], "capacity": runtime.cache.capacity}


class ReentrantStack(nn.Module):
    """Residual blocks under torch.utils.checkpoint(use_reentrant=True), as Hugging Face models use it."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 32)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(32), nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
                                    for _ in range(4))
        self.out = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = h + torch.utils.checkpoint.checkpoint(block, h, use_reentrant=True)
        return self.out(h)


def _reentrant(rank: int, world_size: int) -> dict:
    torch.manual_seed(0)
    base = ReentrantStack()
    model, ref = copy.deepcopy(base), copy.deepcopy(base)
    runtime = ElixirRuntime(model, ElixirPlan(chunk_numel=4352, cache_blocks=CACHE_MIN))  # a block per chunk
    opt = shard_optimizer(runtime, torch.optim.AdamW(model.parameters(), lr=1e-2))
    ddp = DistributedDataParallel(ref)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    losses = []
    for step in range(4):
        x, y = _data(rank, step)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        optimizer_step(runtime, opt)
        opt.zero_grad()
        ref_loss = F.mse_loss(ddp(x), y)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        losses.append((loss.item(), ref_loss.item()))
    return {"losses": losses, "state": full_state_dict(runtime, everywhere=True), "ref": ref.state_dict(),
            "peak": runtime.memory_stats()["peak_gathered_public_chunks"], "capacity": runtime.cache.capacity,
            "chunks": len(runtime.public)}


class Toggled(nn.Module):
    """``aux`` joins only for the samples its mask marks, and not at all where none is marked."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.mid = nn.Linear(16, 16)
        self.aux = nn.Linear(16, 4)
        self.out = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, aux_mask: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.mid(torch.tanh(self.inp(x))))
        out = self.out(h)
        if aux_mask.any():
            out = out + self.aux(h) * aux_mask[:, None]
        return out


def _aux_mask(rank: int, step: int, one_rank: bool) -> torch.Tensor:
    """Steps 0, 3, 6: no rank uses ``aux``; 1, 4, 7: rank 0 only if ``one_rank``, else every rank with
    rank 1's samples masked out; 2, 5: every rank. (A module that one rank skips and another runs is
    fine only where its chunk stays gathered; under ZeRO-3 the ranks would gather differently.)"""
    if step % 3 == 1:
        return torch.full((6,), float(rank == 0)) if one_rank else torch.tensor([float(rank == 0)] * 5 + [1.0])
    return torch.full((6,), float(step % 3 == 2))


def _toggled(rank: int, world_size: int, plan: ElixirPlan, one_rank: bool) -> dict:
    """Against one process on the concatenated batch (the ranks' equal-sized means average to its mean)."""
    torch.manual_seed(0)
    base = Toggled()
    base.mid.requires_grad_(False)
    model, ref = copy.deepcopy(base), copy.deepcopy(base)
    runtime = ElixirRuntime(model, plan)
    # weight decay moves a parameter even with a zero gradient: a step that should skip it would show
    opt = shard_optimizer(runtime, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.5))
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.5)
    losses = []
    for step in range(8):
        if step == 2:  # unfreeze
            model.mid.requires_grad_(True)
            ref.mid.requires_grad_(True)
        if step == 5:  # freeze
            model.inp.requires_grad_(False)
            ref.inp.requires_grad_(False)
        x, y = _data(rank, step)
        loss = F.mse_loss(model(x, _aux_mask(rank, step, one_rank)), y)
        loss.backward()
        optimizer_step(runtime, opt)
        opt.zero_grad()
        data = [_data(r, step) for r in range(world_size)]
        full_x, full_y = torch.cat([d[0] for d in data]), torch.cat([d[1] for d in data])
        mask = torch.cat([_aux_mask(r, step, one_rank) for r in range(world_size)])
        ref_loss = F.mse_loss(ref(full_x, mask), full_y)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        losses.append((loss.item(), ref_loss.item()))
    gathered = [torch.zeros(1) for _ in range(world_size)]
    torch.distributed.all_gather(gathered, torch.tensor([losses[-1][0]]))
    losses[-1] = (sum(g.item() for g in gathered) / world_size, losses[-1][1])
    return {"losses": losses, "state": full_state_dict(runtime, everywhere=True), "ref": ref.state_dict(),
            "aux_steps": ref_opt.state[ref.aux.weight]["step"].item()}


def _meta_init(rank: int, world_size: int) -> dict:
    config = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32, bias=False)
    with torch.device("meta"):
        model = GPT(config)
    torch.manual_seed(1234 + rank)  # ranks disagree on purpose: rank 0's values must win
    runtime = ElixirRuntime(model, ZERO3)
    x = torch.randint(64, (2, 16), generator=torch.Generator().manual_seed(0))
    logits = model(x)
    return {"state": full_state_dict(runtime, everywhere=True), "logits": logits.detach(),
            "tied": model.lm_head.weight is model.wte.weight}


def _all(rank: int, world_size: int) -> dict:
    small = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
    return {
        "branchy": _branchy(rank, world_size),
        "frozen": _gpt_variant(rank, world_size, small, freeze=("wpe", "h.0.attn", "ln_f")),
        "checkpointed": _gpt_variant(rank, world_size, GPTConfig(**{**small.__dict__, "activation_checkpointing": True}), ()),
        "meta": _meta_init(rank, world_size),
        "reentrant": _reentrant(rank, world_size),
        "toggled": _toggled(rank, world_size, ElixirPlan(), one_rank=True),
        "toggled_zero3": _toggled(rank, world_size, ElixirPlan(chunk_numel=320, cache_blocks=CACHE_MIN), one_rank=False),
    }


@pytest.fixture(scope="module")
def results():
    return run_distributed(_all, 2)


def _assert_matches(result: dict, tol: float = 1e-5) -> None:
    for ours, ref in result["losses"]:
        assert ours == pytest.approx(ref, rel=tol)
    for key, ref in result["ref"].items():
        assert torch.allclose(result["state"][key], ref, rtol=tol, atol=1e-7), key


def test_unused_branch_outside_use_and_buffers_match_ddp(results):
    for rank_result in results:
        _assert_matches(rank_result["branchy"])
        assert rank_result["branchy"]["state"]["scale"].item() == 0.5


def test_frozen_parameters_stay_frozen_and_match_ddp(results):
    for rank_result in results:
        frozen = rank_result["frozen"]
        _assert_matches(frozen)


def test_activation_checkpointing_matches_ddp_within_the_cache(results):
    for rank_result in results:
        checkpointed = rank_result["checkpointed"]
        _assert_matches(checkpointed)
        assert checkpointed["peak"] <= checkpointed["capacity"]


def test_reentrant_checkpointing_matches_ddp_within_the_cache(results):
    for rank_result in results:
        reentrant = rank_result["reentrant"]
        _assert_matches(reentrant)
        assert reentrant["chunks"] >= 4
        assert reentrant["peak"] <= reentrant["capacity"] < reentrant["chunks"]


def test_meta_init_materialises_rank0_values_on_every_rank(results):
    first, second = results[0]["meta"], results[1]["meta"]
    assert first["tied"]
    for key, value in first["state"].items():
        assert torch.equal(value, second["state"][key]), key
        assert torch.isfinite(value).all(), key
    torch.testing.assert_close(first["logits"], second["logits"])
    assert first["state"]["wte.weight"].std() > 0.1  # nn.Embedding's own N(0, 1) init ran


@pytest.mark.parametrize("variant", ["toggled", "toggled_zero3"])
def test_freezing_unfreezing_and_unused_parameters_match_one_process(results, variant):
    for rank_result in results:
        result = rank_result[variant]
        assert result["aux_steps"] == 5  # the reference skipped aux in the 3 steps no rank used it
        ours, ref = result["losses"][-1]  # the mean over ranks of the last step, before its update
        assert ours == pytest.approx(ref, rel=1e-5)
        for key, value in result["ref"].items():
            torch.testing.assert_close(result["state"][key], value, rtol=1e-5, atol=1e-6, msg=key)
