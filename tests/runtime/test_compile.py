"""torch.compile under the runtime ([Note: compiled models] in runtime/hotpath.py): a model compiled per
block or whole trains as the same model compiled without Elixir, under resident and gathering plans.

"aot_eager" runs Dynamo and AOTAutograd, where the runtime's hooks and parameters meet the compiler,
without the C++ build of CPU inductor kernels (tests/test_gpu.py compiles with inductor on CUDA).
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F

from lightning_elixir.demos.gpt import GPT, GPTConfig
from lightning_elixir import ElixirPlan
from lightning_elixir.runtime.optim import optimizer_step, shard_optimizer
from lightning_elixir.runtime.runtime import ElixirRuntime
from lightning_elixir.runtime.state_dict import full_state_dict

CONFIG = GPTConfig(vocab_size=64, block_size=16, n_layer=3, n_head=2, n_embd=32, bias=False)
PLANS = {
    "resident": ElixirPlan(cache_blocks="all"),
    "gathering": ElixirPlan(chunk_numel=4096, cache_blocks="min+1", prefetch_depth=1),
    "gathering_checkpointed": ElixirPlan(chunk_numel=4096, cache_blocks="min", prefetch_depth=1),
}


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randint(CONFIG.vocab_size, (2, CONFIG.block_size), generator=torch.Generator().manual_seed(step))
    return x, torch.roll(x, -1, 1)


def _compiled(model: GPT, how: str) -> torch.nn.Module:
    if how == "blocks":
        for block in model.h:
            block.compile(backend="aot_eager")
        return model
    return torch.compile(model, backend="aot_eager")


def _train(model: GPT, how: str, plan: ElixirPlan = None, steps: int = 4) -> tuple[list[float], dict]:
    runtime = ElixirRuntime(model, plan) if plan is not None else None
    compiled = _compiled(model, how)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if runtime is not None:
        optimizer = shard_optimizer(runtime, optimizer)
    losses = []
    for step in range(steps):
        x, y = _batch(step)
        loss = F.cross_entropy(compiled(x).flatten(0, 1), y.flatten())
        loss.backward()
        optimizer_step(runtime, optimizer) if runtime is not None else optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    state = full_state_dict(runtime) if runtime is not None else model.state_dict()
    return losses, {k: v.detach().clone() for k, v in state.items()}


@pytest.mark.parametrize("how,plan", [("blocks", "resident"), ("blocks", "gathering"), ("whole", "resident"),
                                      ("whole", "gathering"), ("blocks", "gathering_checkpointed")])
def test_a_compiled_model_trains_as_without_elixir(how, plan):
    torch._dynamo.reset()
    torch.manual_seed(0)
    checkpointed = plan.endswith("checkpointed")
    base = GPT(dataclasses.replace(CONFIG, activation_checkpointing=checkpointed))
    want_losses, want = _train(copy.deepcopy(base), how)
    got_losses, got = _train(copy.deepcopy(base), how, PLANS[plan])
    assert got_losses == pytest.approx(want_losses, rel=1e-6, abs=1e-6)
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=1e-6, msg=name)
