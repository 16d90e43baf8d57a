"""Reads the hooks do not see, on 2 gloo ranks against DDP: every value is the true one.

Each model is run with one parameter per chunk and the fewest cache blocks (the plan under which
a read outside the hooks is most likely to meet a released chunk), next to DDP on the same data.
"""

from __future__ import annotations

import copy
from typing import Callable

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from lightning_elixir.plan import CACHE_MIN, ChunkSpec, ElixirPlan, round_up
from lightning_elixir.runtime.access import OutsideStepError
from lightning_elixir.runtime.layout import shared_param_names
from lightning_elixir.runtime.optim import optimizer_step, shard_optimizer
from lightning_elixir.runtime.params import ChunkedParameter
from lightning_elixir.runtime.runtime import ElixirRuntime
from tests.distributed import run_distributed


def one_param_per_chunk(model: nn.Module, world_size: int) -> ElixirPlan:
    """ZeRO-3 with every parameter in a chunk of its own (shared ones private)."""
    shared = shared_param_names(model)
    chunks = [ChunkSpec((n,), round_up(p.numel(), world_size), private=n in shared) for n, p in model.named_parameters()]
    return ElixirPlan(chunks=tuple(chunks), world_size=world_size, cache_blocks=CACHE_MIN, prefetch_depth=1)


class Attention(nn.Module):
    """nn.MultiheadAttention reads out_proj's weight in its own forward, not out_proj's."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
        self.out = nn.Linear(16, 8)

    def forward(self, x):
        h = self.inp(x)
        return self.out(self.attn(h, h, h, need_weights=False)[0])


class TiedHead(nn.Module):
    """A head that reads the embedding's weight from another module's forward."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.mix = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)

    def forward(self, x):
        h = self.norm(torch.tanh(self.mix(self.emb(x))))
        return F.linear(h, self.emb.weight)


class Norms(nn.Module):
    """BatchNorm running statistics: DDP broadcasts rank 0's buffers before each forward."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.bn = nn.BatchNorm1d(16)
        self.b = nn.Linear(16, 8)

    def forward(self, x):
        return self.b(torch.relu(self.bn(self.a(x))))


class MaskedFrames(nn.Module):
    """wav2vec2's SpecAugment: frames of a projection's output overwritten in place by a learned embedding.
    On a contiguous 3-D input, ``nn.Linear`` returns a view of its matmul's 2-D result, so the write
    replaces the view's place in the graph."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.proj = nn.Linear(8, 16)
        self.embed = nn.Parameter(torch.rand(16))
        self.layers = nn.Sequential(*(nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(3)))
        self.out = nn.Linear(16, 8)

    def forward(self, x):
        h = self.proj(self.norm(x.view(2, 3, 8)))
        mask = torch.zeros(2, 3, dtype=torch.bool)
        mask[:, 1] = True
        h[mask] = self.embed
        return self.out(self.layers(h)).view(6, 8)


def _batch(model: nn.Module, rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    if isinstance(model, TiedHead):
        x = torch.randint(16, (4, 6), generator=g)
        return x, torch.roll(x, 1, dims=1)
    return torch.randn(4, 6, 8, generator=g) if isinstance(model, Attention) else torch.randn(6, 8, generator=g), None


def _loss(model: nn.Module, x: torch.Tensor, y, penalty: bool) -> torch.Tensor:
    out = model(x)
    loss = F.cross_entropy(out.reshape(-1, 16), y.reshape(-1)) if y is not None else out.square().mean()
    if penalty:  # an L2 penalty over every parameter, read outside any module's forward
        loss = loss + 1e-2 * sum(p.square().sum() for p in model.parameters())
    return loss


def _train(rank: int, model: nn.Module, elixir: bool, penalty: bool, clamp: bool) -> dict:
    runtime = ElixirRuntime(model, one_param_per_chunk(model, 2)) if elixir else None
    net = model if elixir else DistributedDataParallel(model)
    # SGD: attention's key bias has an exactly zero true gradient, which Adam turns into full-size noise
    opt = torch.optim.SGD(model.parameters(), lr=5e-2, momentum=0.9)
    opt = shard_optimizer(runtime, opt) if elixir else opt
    losses, norms = [], []
    for step in range(4):
        x, y = _batch(model, rank, step)
        with runtime.step_region() if elixir else torch.enable_grad():
            loss = _loss(net, x, y, penalty)
        loss.backward()
        with runtime.gathered() if elixir else torch.enable_grad():  # grad_norm and clipping by hand
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5).item())
        if elixir:
            optimizer_step(runtime, opt)
        else:
            opt.step()
        opt.zero_grad()
        if clamp:  # weight clipping (WGAN): an in-place write through .data, after the step
            with runtime.gathered() if elixir else torch.no_grad():
                for p in model.parameters():
                    p.data.clamp_(-0.3, 0.3)
        losses.append(loss.item())
    model.eval()
    with torch.no_grad():
        x, _ = _batch(model, 1, 99)
        evaluated = net(x)
    if elixir:
        runtime.restore_module()
    return {"losses": losses, "norms": norms, "eval": evaluated,
            "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "plain": all(type(p) is nn.Parameter for p in model.parameters())}


CASES: dict[str, tuple[Callable[[], nn.Module], bool, bool]] = {
    "attention": (Attention, False, False),
    "tied-head+penalty": (TiedHead, True, False),
    "batchnorm+clamp": (Norms, False, True),
    "written-view-output": (MaskedFrames, False, False),
}


def _compare_all(rank: int, world_size: int) -> dict:
    out = {}
    for name, (make, penalty, clamp) in CASES.items():
        torch.manual_seed(0)
        base = make()
        out[name] = {"elixir": _train(rank, copy.deepcopy(base), True, penalty, clamp),
                     "ddp": _train(rank, copy.deepcopy(base), False, penalty, clamp)}
    return out


@pytest.fixture(scope="module")
def results():
    return run_distributed(_compare_all, 2)


@pytest.mark.parametrize("case", list(CASES))
def test_reads_outside_the_hooks_match_ddp(results, case):
    for rank in range(2):
        el, ddp = results[rank][case]["elixir"], results[rank][case]["ddp"]
        assert el["losses"] == pytest.approx(ddp["losses"], rel=1e-5)
        assert el["norms"] == pytest.approx(ddp["norms"], rel=1e-5)
        torch.testing.assert_close(el["eval"], ddp["eval"], rtol=1e-5, atol=1e-6)
        assert el["state"].keys() == ddp["state"].keys()
        for key, ref in ddp["state"].items():
            torch.testing.assert_close(el["state"][key], ref, rtol=1e-5, atol=1e-6, msg=f"{case} rank {rank} {key}")
        assert el["plain"], "restore_module leaves plain nn.Parameter objects"


def test_reads_outside_any_region_raise_and_detached_reads_are_copies():
    torch.manual_seed(0)
    model = TiedHead()
    runtime = ElixirRuntime(model, one_param_per_chunk(model, 1))
    weight = model.mix.weight
    assert isinstance(weight, ChunkedParameter) and isinstance(weight, nn.Parameter)
    with pytest.raises(OutsideStepError, match="mix.weight.*gathered_params"):
        weight.sum()
    x = torch.randint(16, (2, 6))
    model(x).sum().backward()
    with pytest.raises(OutsideStepError, match="gradient of 'mix.weight'"):
        _ = weight.grad
    with runtime.gathered():
        snapshot = model.state_dict()  # detach() outside the owner's forward copies
        grad = weight.grad.clone()
    runtime.release_all()
    assert all(torch.isfinite(v).all() for v in snapshot.values())
    assert grad.abs().sum() > 0
    runtime.restore_module()
    torch.testing.assert_close(model.mix.weight, snapshot["mix.weight"])
    model(x)  # a plain module again: no hooks, no collectives


class _RenormedInForward(nn.Linear):
    def __init__(self, given: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__(4, 3, bias=False)
        self.given = given

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.weight.data = self.given(self.weight.data)  # where nothing intercepts it
        return super().forward(x)


def test_data_that_does_not_fit_the_layout_is_refused_wherever_it_is_assigned():
    torch.manual_seed(0)
    model = _RenormedInForward(lambda w: torch.cat([w, w]))
    runtime = ElixirRuntime(model, ElixirPlan(cache_blocks="all"))
    with runtime.gathered(), pytest.raises(RuntimeError, match=r"'weight'.data = a tensor of shape \(2, 4\)"):
        model.weight.data = torch.zeros(2, 4)  # outside the hooks: the runtime copies it in, or refuses
    with runtime.gathered(), pytest.raises(RuntimeError, match="complex64.*fixed layout"):
        model.weight.data = torch.zeros(3, 4, dtype=torch.complex64)
    model(torch.randn(2, 4))  # inside its own forward: found when the chunk is written back
    with pytest.raises(RuntimeError, match=r"'weight'.data = a tensor of shape \(6, 4\).*fixed layout"):
        runtime.release_all()


def test_module_zero_grad_clears_the_sharded_gradients():
    torch.manual_seed(0)
    model = TiedHead()
    runtime = ElixirRuntime(model, one_param_per_chunk(model, 1))
    opt = shard_optimizer(runtime, torch.optim.SGD(model.parameters(), lr=0.1))
    model(torch.randint(16, (2, 6))).sum().backward()
    model.mix.zero_grad()  # as LightningModule.on_validation_model_zero_grad does for the whole module
    with runtime.gathered():
        assert model.mix.weight.grad is None or not model.mix.weight.grad.any()
        assert model.norm.weight.grad.abs().sum() > 0
    views = {id(v): v for g in opt.param_groups for v in g["params"]}
    assert sum(v.grad is not None for v in views.values()) == len(views) - 2


def test_a_gradient_changed_in_the_step_keeps_the_change_under_the_next_micro_batch():
    """Reductions retire during backward (one chunk per parameter: more chunks than may be in flight):
    a gradient read and changed in the step, before the next backward, reaches the shard first."""
    torch.manual_seed(0)
    model = TiedHead()
    reference = copy.deepcopy(model)
    runtime = ElixirRuntime(model, one_param_per_chunk(model, 1))
    shard_optimizer(runtime, torch.optim.SGD(model.parameters(), lr=0.1))
    first, second = (torch.randint(16, (2, 6), generator=torch.Generator().manual_seed(s)) for s in range(2))
    for m in (model, reference):
        m(first).sum().backward()
    for p in reference.parameters():
        p.grad.mul_(0.5)
    reference(second).sum().backward()
    with runtime.step_region():  # as the strategy's training_step: its loss is backpropagated after it
        runtime.begin_iteration()
        for p in model.parameters():
            p.grad.mul_(0.5)
        loss = model(second).sum()
    loss.backward()
    with runtime.gathered():
        for (name, p), ref in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, ref.grad, msg=lambda m: f"{name}: {m}")


def test_copies_and_pickles_of_chunked_parameters_are_plain_values():
    import copy as copy_module
    import io

    torch.manual_seed(0)
    model = TiedHead()
    reference = copy_module.deepcopy(model)
    runtime = ElixirRuntime(model, one_param_per_chunk(model, 1))
    with pytest.raises(OutsideStepError, match="gathered_params"):
        copy_module.deepcopy(model)
    with runtime.gathered():  # e.g. an EMA callback's copy of the module
        twin = copy_module.deepcopy(model)
        buffer = io.BytesIO()
        torch.save(model.mix.weight, buffer)
    for (name, p), ref in zip(twin.named_parameters(), reference.parameters()):
        assert type(p) is nn.Parameter
        torch.testing.assert_close(p, ref, msg=name)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert type(loaded) is nn.Parameter
    torch.testing.assert_close(loaded, reference.mix.weight)


def _read_on_one_rank_in_a_nested_region(rank: int, world_size: int) -> tuple:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 6))
    plain = copy.deepcopy(model)
    runtime = ElixirRuntime(model, one_param_per_chunk(model, world_size))
    seen = None
    with runtime.gathered():  # the strategy's, around a hook every rank runs ([Note: hooks every rank runs])
        with runtime.gathered(params=[model[1].weight]):  # the user's, for a read on rank 0 only
            if rank == 0:
                seen = model[1].weight.sum().item()
        total = model[0].weight.sum().item()  # then a read on every rank
    runtime.restore_module()
    return seen, total, plain[1].weight.sum().item(), plain[0].weight.sum().item()


def test_a_nested_region_gathers_its_params_up_front_for_reads_on_some_ranks():
    """Without the up-front gather the read on rank 0 gathers alone, and its all-gather meets another chunk's."""
    (seen, total, want_seen, want_total), (other, other_total, _, _) = run_distributed(
        _read_on_one_rank_in_a_nested_region, 2)
    assert seen == pytest.approx(want_seen) and other is None
    assert total == pytest.approx(want_total) and other_total == pytest.approx(want_total)
