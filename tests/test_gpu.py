"""Tier 3: GPU-only checks, skipped without CUDA (run by examples/benchmarks/gpu_check.sh)."""

from __future__ import annotations

import copy
import dataclasses
import gc

import pytest
import torch
import torch.nn.functional as F

from lightning_elixir.demos.gpt import GPT, GPTConfig
from lightning_elixir.plan import ElixirPlan
from lightning_elixir.profile import profile_model
from lightning_elixir.runtime.layout import resolve_specs
from lightning_elixir.runtime.optim import optimizer_step, shard_optimizer
from lightning_elixir.runtime.runtime import ElixirRuntime
from lightning_elixir.search import SearchOptions, build_layout
from lightning_elixir.search.timeline import predict_timeline
from tests.plans import on_host

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
CONFIG = GPTConfig(vocab_size=1024, block_size=128, n_layer=4, n_head=8, n_embd=512)


def _train(model, runtime, opt, steps, autocast):
    losses = []
    for step in range(steps):
        x = torch.randint(1024, (4, 128), generator=torch.Generator().manual_seed(step)).cuda()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            loss = F.cross_entropy(model(x).float().flatten(0, 1), torch.roll(x, -1, 1).flatten())
        loss.backward()
        if runtime is None:
            opt.step()
        else:
            optimizer_step(runtime, opt)
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("blocks", ["all", "min"])
def test_cuda_fp32_matches_plain_training(blocks):
    """"min" with the state on the host: at one rank only a plan that offloads gathers and evicts."""
    torch.manual_seed(0)
    ref = GPT(CONFIG).cuda()
    model = copy.deepcopy(ref)
    plan = ElixirPlan(chunk_numel=1 << 20, cache_blocks=blocks)
    runtime = ElixirRuntime(model, plan if blocks == "all" else on_host(model, plan), device="cuda")
    assert runtime.resident == (blocks == "all")
    opt = shard_optimizer(runtime, torch.optim.AdamW(model.parameters(), lr=1e-3))
    ours = _train(model, runtime, opt, 5, autocast=False)
    theirs = _train(ref, None, torch.optim.AdamW(ref.parameters(), lr=1e-3), 5, autocast=False)
    assert ours == pytest.approx(theirs, rel=1e-4)


def test_cuda_one_hook_per_chunk_matches_plain_training():
    """[Note: one hook per chunk]: the learned order broken on purpose, in one process on the GPU."""
    from tests.runtime.test_watchers import _train, check

    result = _train(0, 1, "cuda")
    check(result)
    assert result["hooked"] == [2, 2, 2, 3, 2, 2, 2, 2, 2], result["hooked"]


def test_cuda_blocks_compiled_with_inductor_train_as_plain_compiled_training():
    """[Note: compiled models]: each block compiled in place, a gathering plan against no Elixir."""
    torch.manual_seed(0)
    ref = GPT(CONFIG).cuda()
    model = copy.deepcopy(ref)
    runtime = ElixirRuntime(model, on_host(model, ElixirPlan(chunk_numel=1 << 20, cache_blocks="min+1",
                                                             prefetch_depth=1)), device="cuda")
    for m in (ref, model):
        for block in m.h:
            block.compile()
    opt = shard_optimizer(runtime, torch.optim.AdamW(model.parameters(), lr=1e-3))
    ours = _train(model, runtime, opt, 5, autocast=False)
    theirs = _train(ref, None, torch.optim.AdamW(ref.parameters(), lr=1e-3), 5, autocast=False)
    assert ours == pytest.approx(theirs, rel=1e-4)


def test_cuda_one_device_keeps_its_shards_as_its_chunks():
    """[Note: a world of one]: with the state on the device "min" runs as "all" does, in the same memory;
    with the state on the host it gathers into fewer blocks."""
    chunks, allocated = {}, {}
    for name in ("all", "min", "min on host"):
        torch.manual_seed(0)
        model = GPT(CONFIG).cuda()
        torch.cuda.reset_peak_memory_stats()
        plan = ElixirPlan(chunk_numel=1 << 20, cache_blocks=name.split()[0])
        runtime = ElixirRuntime(model, on_host(model, plan) if "host" in name else plan, device="cuda",
                                compute_dtype=torch.bfloat16, master_dtype=torch.float32)
        opt = shard_optimizer(runtime, torch.optim.AdamW(model.parameters(), lr=1e-3))
        _train(model, runtime, opt, 2, autocast=True)
        chunks[name] = runtime.memory_stats()["peak_gathered_public_chunks"]
        allocated[name] = torch.cuda.max_memory_allocated()
        runtime.restore_module()
        del model, runtime, opt
        gc.collect()  # the hooks' closures hold the runtime in reference cycles
    assert chunks["min"] == chunks["all"] > chunks["min on host"]
    assert allocated["min"] <= allocated["all"] * 1.01


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_cuda_offloaded_chunks_train_as_device_chunks(tmp_path, precision):
    """Gradients land on the host through the copy stream, fused CPU updates run on the worker and
    upload to the device: the same curve as the all-device plan (CPU fused vs CUDA kernels: rounding)."""
    autocast = precision == "bf16-mixed"
    dtypes = dict(compute_dtype=torch.bfloat16, master_dtype=torch.float32) if autocast else {}
    losses, stats = {}, {}
    for name, placements in (("device", ("device",)), ("mixed", ("device", "cpu", "nvme"))):
        torch.manual_seed(0)
        model = GPT(CONFIG).cuda()
        specs = resolve_specs(model, ElixirPlan(chunk_numel=1 << 20), 1)
        chunks = tuple(dataclasses.replace(s, placement=placements[i % len(placements)]) for i, s in enumerate(specs))
        runtime = ElixirRuntime(model, ElixirPlan(chunks=chunks, world_size=1, cache_blocks="all"), device="cuda",
                                nvme_path=str(tmp_path), **dtypes)
        opt = shard_optimizer(runtime, torch.optim.AdamW(model.parameters(), lr=1e-3))
        losses[name] = _train(model, runtime, opt, 6, autocast=autocast)
        stats[name] = runtime.memory_stats()
        runtime.restore_module()
    assert losses["mixed"] == pytest.approx(losses["device"], rel=1e-3)
    assert stats["mixed"]["host_bytes"] > 0 and stats["mixed"]["nvme_bytes"] > 0
    assert stats["mixed"]["device_state_bytes"] < stats["device"]["device_state_bytes"]


def test_cuda_timeline_matches_the_prediction_and_sees_activations():
    """The recorded step holds the predicted bytes on a GPU too (side-stream prefetch, landed gradients),
    and the allocator shows activations beyond them."""
    torch.manual_seed(0)
    model = GPT(CONFIG).cuda()
    x = torch.randint(1024, (4, 128), generator=torch.Generator().manual_seed(0)).cuda()

    def loss_fn(module, batch):
        return F.cross_entropy(module(batch).float().flatten(0, 1), torch.roll(batch, -1, 1).flatten())

    profile = profile_model(copy.deepcopy(model), x, step_fn=loss_fn)
    layout = build_layout(profile, 1 << 20, world_size=1)
    chunks = tuple(dataclasses.replace(s, placement="cpu") if i == 1 else s for i, s in enumerate(layout.chunks))
    plan = ElixirPlan(chunks=chunks, world_size=1, cache_blocks="min", prefetch_depth=1)
    runtime = ElixirRuntime(model, plan, device="cuda")
    opt = shard_optimizer(runtime, torch.optim.AdamW(model.parameters(), lr=1e-3))
    recorder = None
    for step in range(3):
        recorder = runtime.record_timeline() if step == 2 else None
        loss_fn(model, x).backward()
        optimizer_step(runtime, opt)
        opt.zero_grad()
    predicted = predict_timeline(profile, plan, SearchOptions(optimizer_bytes_per_numel=8))
    measured = recorder.timeline
    assert measured.labels == predicted.labels and measured.differences(predicted) == ()
    assert measured["activations"] is not None and max(measured["activations"]) > 0


class _OwnDtypes(torch.nn.Module):
    """A frozen integer index table, a frozen bf16 table and a float64 layer beside fp32 ones."""

    def __init__(self) -> None:
        super().__init__()
        self.perm = torch.nn.Parameter(torch.randperm(16), requires_grad=False)
        self.table = torch.nn.Parameter((torch.randn(32, 32) * 0.2).to(torch.bfloat16), requires_grad=False)
        self.inp = torch.nn.Linear(16, 32)
        self.wide = torch.nn.Linear(32, 32).double()
        self.head = torch.nn.Linear(32, 4)

    def forward(self, x):
        h = torch.tanh(self.inp(x[:, self.perm]))
        h = (h.to(torch.bfloat16) @ self.table).float()
        return self.head(torch.tanh(self.wide(h.double())).float())


@pytest.mark.parametrize("placement", ["device", "cpu"])
def test_cuda_parameters_of_their_own_dtype_train_as_plain_training(placement):
    """[Note: parameters of other dtypes]: each dtype in chunks of its own, on the GPU and offloaded."""
    torch.manual_seed(0)
    ref = _OwnDtypes().cuda()
    model = copy.deepcopy(ref)
    plan = ElixirPlan(chunk_numel=4096)
    runtime = ElixirRuntime(model, plan if placement == "device" else on_host(model, plan), device="cuda")
    assert model.perm.dtype == torch.int64 and model.wide.weight.dtype == torch.float64
    opt = shard_optimizer(runtime, torch.optim.AdamW(model.parameters(), lr=1e-2))
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for step in range(4):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step)).cuda()
        y = torch.randint(4, (8,), generator=torch.Generator().manual_seed(step)).cuda()
        for m, o in ((model, opt), (ref, ref_opt)):
            F.cross_entropy(m(x), y).backward()
            optimizer_step(runtime, o) if m is model else o.step()
            o.zero_grad()
    from lightning_elixir.runtime.state_dict import full_state_dict

    state = full_state_dict(runtime)
    for key, value in ref.state_dict().items():
        assert state[key].dtype == value.dtype, key
        torch.testing.assert_close(state[key].cuda(), value, rtol=1e-5, atol=1e-6, msg=key)
