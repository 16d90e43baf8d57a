"""torch's and Hugging Face's Adafactor on sharded parameters ([Note: Adafactor on shards] in
lightning_elixir/runtime/factored.py).

A convolution (a factored 3-D weight), linear layers and a LayerNorm (vectors, whose second moment is
per element) under Adafactor with two parameter groups (weight decay on the matrices only) and a step
schedule, clipped by norm, on two gloo ranks against DDP:
- zero3, and a plan of small chunks whose parameters straddle the ranks' shards with every chunk's
  state on the host, train to DDP's weights, and their full checkpoints hold DDP's factored moments
  and variances in a plain torch optimizer state dict;
- a fit resumed from a full or a sharded checkpoint ends with the uninterrupted fit's weights bit for
  bit, and one resumed on one rank from the two ranks' sharded checkpoint with the weights of DDP
  resumed on one rank;
- Hugging Face's Adafactor (a first moment, parameter scaling) under the small plan trains to DDP's
  weights and resumes bit for bit.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import pytest
import torch

from lightning_elixir.plan import slot_offsets
from tests.epoch_fits import GLOBAL_BATCH, SAMPLES, ConvClassifier, final_weights, fit_epochs
from tests.plans import split_on_host
from tests.test_resume import fit_on_ranks

pytestmark = pytest.mark.skipif(not hasattr(torch.optim, "Adafactor"), reason="torch.optim.Adafactor is new in torch 2.5")

EPOCHS = 3


class WithAdafactor(ConvClassifier):
    def __init__(self, flavor: str = "torch") -> None:
        super().__init__()
        self.flavor = flavor

    def configure_optimizers(self):
        matrices = [p for p in self.parameters() if p.ndim > 1]
        rest = [p for p in self.parameters() if p.ndim <= 1]
        groups = [{"params": matrices, "weight_decay": 0.05}, {"params": rest, "lr": 0.02}]
        if self.flavor == "huggingface":
            from transformers.optimization import Adafactor

            optimizer = Adafactor(groups, lr=0.01, relative_step=False, beta1=0.9)
        else:
            optimizer = torch.optim.Adafactor(groups, lr=0.01, foreach=False)
        return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 4, gamma=0.7)}


def fit(run: Path, world_size: int, plan: str, fmt: str, ckpt_path: Optional[Path] = None,
        flavor: str = "torch") -> None:
    """EPOCHS epochs of ``WithAdafactor(flavor)`` under DDP, "zero3" or "small" (``split_on_host``); a
    checkpoint at each epoch's end; rank 0 saves the final weights to ``run/final.pt``."""
    model = WithAdafactor(flavor)
    plan = split_on_host(model, world_size, 1200) if plan == "small" else plan
    fit_epochs(model, run, world_size, plan, fmt, EPOCHS, ckpt_path, gradient_clip_val=0.5)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adafactor")
    runs = {name: root / name for name in ("ddp", "zero3", "small", "zero3-resumed", "small-resumed", "one-rank",
                                           "one-rank-ddp", "hf-ddp", "hf-small", "hf-small-resumed")}
    first = "epoch=0.ckpt"
    fit_on_ranks(2, [(runs["ddp"], "ddp", "full"), (runs["zero3"], "zero3", "full"),
                     (runs["small"], "small", "sharded"),
                     (runs["zero3-resumed"], "zero3", "full", runs["zero3"] / "ckpt" / first),
                     (runs["small-resumed"], "small", "sharded", runs["small"] / "ckpt" / first),
                     (runs["hf-ddp"], "ddp", "full", None, "huggingface"),
                     (runs["hf-small"], "small", "sharded", None, "huggingface"),
                     (runs["hf-small-resumed"], "small", "sharded", runs["hf-small"] / "ckpt" / first, "huggingface")],
                 fit_fn=fit)
    fit_on_ranks(1, [(runs["one-rank"], "zero2", "full", runs["small"] / "ckpt" / first),
                     (runs["one-rank-ddp"], "ddp", "full", runs["zero3"] / "ckpt" / first)], fit_fn=fit)
    return runs


def test_the_small_plan_splits_matrices_over_the_shards():
    model = WithAdafactor()
    split = []
    for spec in split_on_host(model, 2, 1200).chunks:
        numels = [model.get_parameter(name).numel() for name in spec.params]
        for name, offset, numel in zip(spec.params, slot_offsets(numels), numels):
            if offset < spec.numel // 2 < offset + numel:
                split.append(name)
    assert any(model.get_parameter(name).ndim > 1 for name in split), split


@pytest.mark.parametrize("plan", ["zero3", "small", "hf-small"])
def test_adafactor_trains_to_ddps_weights(runs, plan):
    ddp, start = final_weights(runs["hf-ddp" if plan.startswith("hf") else "ddp"]), WithAdafactor().state_dict()
    assert not torch.allclose(ddp["conv.weight"], start["conv.weight"])
    for key, value in final_weights(runs[plan]).items():
        torch.testing.assert_close(value, ddp[key], rtol=1e-5, atol=1e-6, msg=key)


def test_the_full_checkpoint_holds_a_plain_adafactor_state_dict_with_ddps_moments(runs):
    ours = torch.load(runs["zero3"] / "ckpt" / f"epoch={EPOCHS - 1}.ckpt", weights_only=False)["optimizer_states"][0]
    ddp = torch.load(runs["ddp"] / "ckpt" / f"epoch={EPOCHS - 1}.ckpt", weights_only=False)["optimizer_states"][0]
    assert ours["param_groups"] == ddp["param_groups"] and ours["state"].keys() == ddp["state"].keys()
    assert {"row_var", "col_var"} <= ddp["state"][0].keys() and "variance" in ddp["state"][len(ddp["state"]) - 1]
    for index, state in ddp["state"].items():
        assert ours["state"][index].keys() == state.keys()
        for key, value in state.items():
            assert ours["state"][index][key].shape == value.shape, (index, key)
            torch.testing.assert_close(ours["state"][index][key], value, rtol=1e-5, atol=1e-7, msg=f"{index} {key}")


@pytest.mark.parametrize("plan", ["zero3", "small", "hf-small"])
def test_a_resumed_fit_ends_with_the_uninterrupted_weights(runs, plan):
    for key, value in final_weights(runs[plan]).items():
        assert torch.equal(final_weights(runs[f"{plan}-resumed"])[key], value), key


def test_a_fit_resumed_on_one_rank_from_two_ranks_sharded_checkpoint_continues_as_ddp_does(runs):
    ddp = final_weights(runs["one-rank-ddp"])
    resumed_from = torch.load(runs["zero3"] / "ckpt" / "epoch=0.ckpt", weights_only=False)["state_dict"]
    assert not torch.allclose(ddp["net.2.weight"], resumed_from["net.2.weight"], rtol=1e-3, atol=1e-4)
    for key, value in ddp.items():
        torch.testing.assert_close(final_weights(runs["one-rank"])[key], value, rtol=1e-5, atol=1e-6, msg=key)
