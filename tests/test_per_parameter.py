"""Optimizers declared per-parameter run their own step on whole parameters gathered chunk by chunk
([Note: per-parameter optimizers] in lightning_elixir/runtime/per_parameter.py).

``TrustRatioAdam``, a LAMB-like optimizer (each update scaled by the ratio of the parameter's norm to
the update's, which no shard can compute alone; a trace of each matrix's flattened update, state of
another shape than its parameter; the step counted in the param group, as timm's LAMB counts it),
with two parameter groups and a step schedule, clipped by norm, on two gloo ranks against DDP:
- zero3, and a plan of small chunks whose parameters straddle the ranks' shards with every chunk's
  state on the host, train to DDP's weights, and their full checkpoints hold DDP's state dict;
- a fit resumed from a full or a sharded checkpoint ends with the uninterrupted fit's weights bit for
  bit, and one resumed on one rank from the two ranks' sharded checkpoint with those of DDP resumed
  on one rank.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import pytest
import torch

from tests.epoch_fits import GLOBAL_BATCH, SAMPLES, ConvClassifier, final_weights, fit_epochs
from tests.optimizers import TrustRatioAdam
from tests.plans import split_on_host
from tests.test_resume import fit_on_ranks

EPOCHS = 3


class WithTrustRatio(ConvClassifier):
    def configure_optimizers(self):
        matrices = [p for p in self.parameters() if p.ndim > 1]
        rest = [p for p in self.parameters() if p.ndim <= 1]
        optimizer = TrustRatioAdam([{"params": matrices, "weight_decay": 0.05}, {"params": rest, "lr": 0.02}])
        return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 4, gamma=0.7)}


def fit(run: Path, world_size: int, plan: str, fmt: str, ckpt_path: Optional[Path] = None) -> None:
    """EPOCHS epochs under DDP, "zero3" or "small" (``split_on_host``); a checkpoint at each epoch's end."""
    model = WithTrustRatio()
    plan = split_on_host(model, world_size, 1200) if plan == "small" else plan
    fit_epochs(model, run, world_size, plan, fmt, EPOCHS, ckpt_path, gradient_clip_val=0.5)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("per_parameter")
    runs = {name: root / name for name in ("ddp", "zero3", "small", "zero3-resumed", "small-resumed", "one-rank",
                                           "one-rank-ddp")}
    first = "epoch=0.ckpt"
    fit_on_ranks(2, [(runs["ddp"], "ddp", "full"), (runs["zero3"], "zero3", "full"),
                     (runs["small"], "small", "sharded"),
                     (runs["zero3-resumed"], "zero3", "full", runs["zero3"] / "ckpt" / first),
                     (runs["small-resumed"], "small", "sharded", runs["small"] / "ckpt" / first)],
                 fit_fn=fit)
    fit_on_ranks(1, [(runs["one-rank"], "zero2", "full", runs["small"] / "ckpt" / first),
                     (runs["one-rank-ddp"], "ddp", "full", runs["zero3"] / "ckpt" / first)], fit_fn=fit)
    return runs


@pytest.mark.parametrize("plan", ["zero3", "small"])
def test_a_per_parameter_optimizer_trains_to_ddps_weights(runs, plan):
    ddp, start = final_weights(runs["ddp"]), WithTrustRatio().state_dict()
    assert not torch.allclose(ddp["conv.weight"], start["conv.weight"])
    for key, value in final_weights(runs[plan]).items():
        torch.testing.assert_close(value, ddp[key], rtol=1e-5, atol=1e-6, msg=key)


@pytest.mark.parametrize("plan", ["zero3", "small"])
def test_the_full_checkpoint_holds_ddps_optimizer_state_dict(runs, plan):
    """Per-element moments full-shaped, each matrix's trace flat as the optimizer made it, the step the
    param groups counted once a step."""
    last = f"epoch={EPOCHS - 1}.ckpt"
    ddp = torch.load(runs["ddp"] / "ckpt" / last, weights_only=False)["optimizer_states"][0]
    if plan == "small":  # sharded: converted to a full state dict first
        from lightning_elixir.runtime.sharded import convert_sharded_to_full

        convert_sharded_to_full(runs["small"] / "ckpt" / last, runs["small"] / "full.ckpt")
        ours = torch.load(runs["small"] / "full.ckpt", weights_only=False)["optimizer_states"][0]
    else:
        ours = torch.load(runs[plan] / "ckpt" / last, weights_only=False)["optimizer_states"][0]
    assert ours["param_groups"] == ddp["param_groups"] and ddp["param_groups"][0]["step"] == EPOCHS * SAMPLES // GLOBAL_BATCH
    assert ours["state"].keys() == ddp["state"].keys() and "trace" in ddp["state"][0]
    for index, state in ddp["state"].items():
        assert ours["state"][index].keys() == state.keys()
        for key, value in state.items():
            assert ours["state"][index][key].shape == value.shape, (index, key)
            # the update divides by the root of the second moment: where that is near zero, the gradients'
            # rounding (a reduce-scatter here, an all-reduce under DDP) shows at 1e-6 of the largest value
            atol = 2e-6 * float(value.abs().max()) if value.dim() else 0.0
            torch.testing.assert_close(ours["state"][index][key], value, rtol=1e-5, atol=atol, msg=f"{index} {key}")


@pytest.mark.parametrize("plan", ["zero3", "small"])
def test_a_resumed_fit_ends_with_the_uninterrupted_weights(runs, plan):
    for key, value in final_weights(runs[plan]).items():
        assert torch.equal(final_weights(runs[f"{plan}-resumed"])[key], value), key


def test_a_fit_resumed_on_one_rank_from_two_ranks_sharded_checkpoint_continues_as_ddp_does(runs):
    ddp = final_weights(runs["one-rank-ddp"])
    for key, value in ddp.items():
        torch.testing.assert_close(final_weights(runs["one-rank"])[key], value, rtol=1e-5, atol=1e-6, msg=key)
