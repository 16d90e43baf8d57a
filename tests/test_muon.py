"""torch.optim.Muon on sharded parameters ([Note: Muon on shards] in lightning_elixir/runtime/whole.py).

Muon (matrices) beside AdamW (the rest) under manual optimization, as Muon is used, on two gloo
ranks, against DDP:
- zero3, and a plan of small chunks whose parameters straddle the ranks' shards with every chunk's
  state on the host, train to DDP's weights, and their full checkpoints hold DDP's momentum buffers
  in a plain torch optimizer state dict;
- a fit resumed from a full or a sharded checkpoint ends with the uninterrupted fit's weights bit for
  bit, and one resumed on one rank from the two ranks' sharded checkpoint with the weights of DDP
  resumed on one rank.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Subset, TensorDataset

from tests.epoch_fits import final_weights, fit_epochs
from tests.plans import split_on_host
from tests.test_resume import fit_on_ranks

pytestmark = pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch.optim.Muon is new in torch 2.9")

EPOCHS = 3
SAMPLES = 48
GLOBAL_BATCH = 8


class WithMuon(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 24), nn.LayerNorm(24), nn.Linear(24, 3))
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        muon, adamw = self.optimizers()
        muon.zero_grad()
        adamw.zero_grad()
        self.manual_backward(loss)
        muon.step()
        adamw.step()

    def configure_optimizers(self):
        matrices = [p for p in self.parameters() if p.ndim == 2]
        rest = [p for p in self.parameters() if p.ndim != 2]
        return [torch.optim.Muon(matrices, lr=0.02, weight_decay=0.01, nesterov=True),
                torch.optim.AdamW(rest, lr=0.01)]

    def train_dataloader(self):
        """GLOBAL_BATCH samples a step, dealt out to the ranks in turn (one process sees them all)."""
        g = torch.Generator().manual_seed(1)
        data = TensorDataset(torch.randn(SAMPLES, 8, generator=g), torch.randint(0, 3, (SAMPLES,), generator=g))
        ranks = self.trainer.world_size
        return DataLoader(Subset(data, range(self.trainer.global_rank, SAMPLES, ranks)), batch_size=GLOBAL_BATCH // ranks)


def fit(run: Path, world_size: int, plan: str, fmt: str, ckpt_path: Optional[Path] = None) -> None:
    """EPOCHS epochs of ``WithMuon`` under DDP, "zero2", "zero3" or "small" (``split_on_host``); a checkpoint at
    each epoch's end; rank 0 saves the final weights to ``run/final.pt``."""
    model = WithMuon()
    plan = split_on_host(model, world_size, 800) if plan == "small" else plan
    fit_epochs(model, run, world_size, plan, fmt, EPOCHS, ckpt_path)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("muon")
    runs = {name: root / name for name in ("ddp", "zero3", "small", "zero3-resumed", "small-resumed", "one-rank",
                                                 "one-rank-ddp")}
    first = "epoch=0.ckpt"
    fit_on_ranks(2, [(runs["ddp"], "ddp", "full"), (runs["zero3"], "zero3", "full"),
                     (runs["small"], "small", "sharded"),
                     (runs["zero3-resumed"], "zero3", "full", runs["zero3"] / "ckpt" / first),
                     (runs["small-resumed"], "small", "sharded", runs["small"] / "ckpt" / first)], fit_fn=fit)
    fit_on_ranks(1, [(runs["one-rank"], "zero2", "full", runs["small"] / "ckpt" / first),
                     (runs["one-rank-ddp"], "ddp", "full", runs["zero3"] / "ckpt" / first)], fit_fn=fit)
    return runs


@pytest.mark.parametrize("plan", ["zero3", "small"])
def test_muon_trains_to_ddps_weights(runs, plan):
    ddp, start = final_weights(runs["ddp"]), WithMuon().state_dict()
    assert not torch.allclose(ddp["net.2.weight"], start["net.2.weight"])
    for key, value in final_weights(runs[plan]).items():
        torch.testing.assert_close(value, ddp[key], rtol=1e-5, atol=1e-6, msg=key)


def test_the_full_checkpoint_holds_a_plain_muon_state_dict_with_ddps_momentum(runs):
    ours = torch.load(runs["zero3"] / "ckpt" / f"epoch={EPOCHS - 1}.ckpt", weights_only=False)["optimizer_states"][0]
    ddp = torch.load(runs["ddp"] / "ckpt" / f"epoch={EPOCHS - 1}.ckpt", weights_only=False)["optimizer_states"][0]
    assert ours["param_groups"] == ddp["param_groups"] and ours["state"].keys() == ddp["state"].keys() == {0, 1, 2}
    for index, state in ddp["state"].items():
        torch.testing.assert_close(ours["state"][index]["momentum_buffer"], state["momentum_buffer"], rtol=1e-5,
                                   atol=1e-6)


@pytest.mark.parametrize("plan", ["zero3", "small"])
def test_a_resumed_fit_ends_with_the_uninterrupted_weights(runs, plan):
    for key, value in final_weights(runs[plan]).items():
        assert torch.equal(final_weights(runs[f"{plan}-resumed"])[key], value), key


def test_a_fit_resumed_on_one_rank_from_two_ranks_sharded_checkpoint_continues_as_ddp_does(runs):
    """Against DDP resumed on one rank from the zero3 fit's full checkpoint of the same step (the same
    values): not against the two ranks' fit, which sums each gradient in another order, a rounding that
    Muon's orthogonalisation in bf16 turns into differences of 1e-3 (as between DDP on one and two ranks)."""
    ddp = final_weights(runs["one-rank-ddp"])
    assert not torch.allclose(ddp["net.2.weight"], final_weights(runs["small"])["net.2.weight"], rtol=1e-5, atol=1e-6)
    for key, value in ddp.items():
        torch.testing.assert_close(final_weights(runs["one-rank"])[key], value, rtol=1e-5, atol=1e-6, msg=key)
