"""Mixed precision on 2 gloo ranks: bf16/fp16 track DDP's curve; an inf gradient on one rank skips the step on all."""

from __future__ import annotations

import pytest
import torch

from lightning_elixir.plan import CACHE_MIN, ElixirPlan
from tests.distributed import run_distributed
from tests.runtime.workloads import NO_BIAS, Run, compare

PLAN = ElixirPlan(chunk_numel=4097, cache_blocks=CACHE_MIN)


@pytest.fixture(scope="module")
def results():
    runs = [
        Run(PLAN, steps=12, precision="bf16-mixed", config=NO_BIAS),
        Run(PLAN, steps=12, precision="16-mixed", config=NO_BIAS),
        Run(PLAN, steps=6, precision="16-mixed", inf_grad_at=(2, 1)),
        Run(PLAN, steps=12, precision="bf16-true", config=NO_BIAS),
    ]
    return run_distributed(compare, 2, runs)


@pytest.mark.parametrize("index", [0, 1], ids=["bf16-mixed", "16-mixed"])
def test_mixed_precision_tracks_ddp(results, index):
    for rank_result in results:
        el, ddp = rank_result[index]["elixir"], rank_result[index]["ddp"]
        assert all(el["stepped"])
        for a, b in zip(el["losses"], ddp["losses"]):
            assert a == pytest.approx(b, rel=2e-2)
        for key, ref in ddp["state"].items():  # fp32 masters stay close to DDP's fp32 weights
            diff = (el["state"][key].float() - ref).norm() / ref.norm().clamp_min(1e-6)
            assert diff < 5e-2, key


def test_inf_gradient_on_one_rank_skips_the_step_on_every_rank(results):
    stepped = [rank_result[2]["elixir"]["stepped"] for rank_result in results]
    assert stepped[0] == stepped[1] == [True, True, False, True, True, True]
    assert results[0][2]["elixir"]["state"].keys() == results[1][2]["elixir"]["state"].keys()
    for key, value in results[0][2]["elixir"]["state"].items():
        assert torch.equal(value, results[1][2]["elixir"]["state"][key]), key


def test_bf16_true_tracks_ddp_in_bf16_and_ranks_agree(results):
    first, second = results[0][3]["elixir"], results[1][3]["elixir"]
    assert all(v.dtype == torch.bfloat16 for v in first["state"].values())
    for key, value in first["state"].items():
        assert torch.equal(value, second["state"][key]), key
    for a, b in zip(first["losses"], results[0][3]["ddp"]["losses"]):
        assert a == pytest.approx(b, rel=2e-2)
