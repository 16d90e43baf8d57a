"""Lightning's BackboneFinetuning on sharded parameters ([Note: finetuning callbacks] in
lightning_elixir/finetuning.py), on two gloo ranks under the zero3 plan (every rank holds a part of
each parameter, so no shard view is a parameter):

- the backbone, frozen for the first epoch and then given to the optimizer as a new param group
  whose learning rate the callback raises every epoch, trains to the weights of one process that
  sees both ranks' batches. (Not DDP's: DDP leaves parameters frozen when it wraps the module out of
  its gradient reduction, so after the unfreezing each rank trains the backbone on its own batches.)
- a fit resumed after the unfreezing, from a full or a sharded checkpoint, ends with the
  uninterrupted fit's weights bit for bit (the added group rebuilt before its moments are loaded);
- plan="auto" plans for the backbone as trainable, though the callback froze it before planning.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import BackboneFinetuning, ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, Subset, TensorDataset

from lightning_elixir import ElixirStrategy
from lightning_elixir.finetuning import planned_trainable
from tests.search.profiles import hardware
from tests.test_resume import COLLECTIVE_TIMEOUT, fit_on_ranks

EPOCHS = 3
UNFREEZE_AT = 1


class Finetuned(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.backbone = nn.Sequential(nn.Linear(6, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 8))
        self.head = nn.Linear(8, 3)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.head(self.backbone(x)), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(filter(lambda p: p.requires_grad, self.parameters()), lr=0.05)

    def train_dataloader(self):
        """8 samples a step, dealt out to the ranks in turn."""
        g = torch.Generator().manual_seed(1)
        data = TensorDataset(torch.randn(32, 6, generator=g), torch.randint(0, 3, (32,), generator=g))
        ranks = self.trainer.world_size
        return DataLoader(Subset(data, range(self.trainer.global_rank, 32, ranks)), batch_size=8 // ranks)


def fit(run: Path, world_size: int, strategy: str, fmt: str, ckpt_path: Optional[Path] = None) -> None:
    """EPOCHS epochs of ``Finetuned`` with the backbone unfrozen at UNFREEZE_AT (``strategy`` "auto": one
    process); checkpoints at epoch ends; rank 0 saves the final weights to ``run/final.pt``."""
    if strategy not in ("auto", "ddp"):
        strategy = ElixirStrategy(plan=strategy, state_dict_type=fmt,
                                  collective_timeout_s=COLLECTIVE_TIMEOUT.total_seconds())
    trainer = L.Trainer(accelerator="cpu", devices=world_size, strategy=strategy, max_epochs=EPOCHS, logger=False,
                        use_distributed_sampler=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=run,
                        callbacks=[BackboneFinetuning(unfreeze_backbone_at_epoch=UNFREEZE_AT, backbone_initial_lr=0.01),
                                   ModelCheckpoint(dirpath=run / "ckpt", filename="{epoch}", save_top_k=-1)])
    model = Finetuned()
    trainer.fit(model, ckpt_path=ckpt_path)
    if trainer.is_global_zero:
        torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, run / "final.pt")
        groups = trainer.optimizers[0].param_groups
        torch.save([g["lr"] for g in groups], run / "lrs.pt")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("finetuning")
    runs = {name: root / name for name in ("single", "full", "sharded", "resumed-full", "resumed-sharded")}
    after_unfreezing = f"epoch={UNFREEZE_AT}.ckpt"  # saved at the end of the epoch that unfroze
    fit_on_ranks(1, [(runs["single"], "auto", "full")], fit_fn=fit)
    fit_on_ranks(2, [(runs["full"], "zero3", "full"),
                     (runs["sharded"], "zero3", "sharded"),
                     (runs["resumed-full"], "zero3", "full", runs["full"] / "ckpt" / after_unfreezing),
                     (runs["resumed-sharded"], "zero3", "sharded", runs["sharded"] / "ckpt" / after_unfreezing)],
                 fit_fn=fit)
    return runs


def _final(run: Path) -> dict[str, torch.Tensor]:
    return torch.load(run / "final.pt")


def test_the_unfrozen_backbone_trains_to_the_weights_of_one_process(runs):
    single, start = _final(runs["single"]), Finetuned().state_dict()
    assert not torch.equal(single["backbone.0.weight"], start["backbone.0.weight"])  # the backbone trained
    assert len(torch.load(runs["single"] / "lrs.pt")) == 2  # the callback added a group
    for fmt in ("full", "sharded"):
        ours = _final(runs[fmt])
        for key, value in single.items():
            torch.testing.assert_close(ours[key], value, rtol=1e-5, atol=1e-6, msg=f"{fmt} {key}")
        assert torch.load(runs[fmt] / "lrs.pt") == torch.load(runs["single"] / "lrs.pt")


@pytest.mark.parametrize("fmt", ["full", "sharded"])
def test_a_fit_resumed_after_the_unfreezing_ends_with_the_uninterrupted_weights(runs, fmt):
    uninterrupted, resumed = _final(runs[fmt]), _final(runs[f"resumed-{fmt}"])
    for key, value in uninterrupted.items():
        assert torch.equal(resumed[key], value), key
    assert torch.load(runs[f"resumed-{fmt}"] / "lrs.pt") == torch.load(runs[fmt] / "lrs.pt")


def test_auto_plans_for_the_backbone_the_callback_will_unfreeze(caplog):
    """The callback freezes the backbone before planning; the plan still counts its gradients and optimizer
    state, which it needs once the backbone trains (no warning that memory may exceed the plan then)."""
    model = Finetuned()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        strategy=ElixirStrategy(plan="auto", hardware_profile=hardware(), replan=False),
                        callbacks=[BackboneFinetuning(unfreeze_backbone_at_epoch=1)])
    with caplog.at_level(logging.WARNING):
        trainer.fit(model)
    assert all(info.requires_grad for info in trainer.strategy.planning.model_profile.params)
    assert not any("frozen when the plan was made" in r.getMessage() for r in caplog.records)
    assert all(p.requires_grad for p in model.parameters())  # unfrozen, and trained: the flags are the module's


def test_planning_as_trainable_leaves_integer_parameters_and_restores_the_flags():
    module = nn.Linear(2, 2)
    module.index = nn.Parameter(torch.arange(3), requires_grad=False)  # an index table cannot require gradients
    module.weight.requires_grad_(False)

    class WithCallback:
        callbacks = [BackboneFinetuning()]

    with planned_trainable(module, WithCallback()):
        assert module.weight.requires_grad and not module.index.requires_grad
    assert not module.weight.requires_grad and module.bias.requires_grad
