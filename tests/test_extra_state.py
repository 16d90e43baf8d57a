"""A module's extra state (``get_extra_state``/``set_extra_state``) in full and sharded checkpoints ([Note: extra state])."""

from __future__ import annotations

import os
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_elixir import ElixirStrategy
from lightning_elixir.runtime.sharded import convert_sharded_to_full
from tests.distributed import free_port


class CountingLinear(nn.Linear):
    """Counts its forward calls and keeps the count as extra state: a tensor, or a dict."""

    def __init__(self, *args: Any, as_tensor: bool, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.as_tensor, self.calls = as_tensor, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return super().forward(x)

    def get_extra_state(self) -> Any:
        return torch.tensor(float(self.calls)) if self.as_tensor else {"calls": self.calls}

    def set_extra_state(self, state: Any) -> None:
        self.calls = int(state) if self.as_tensor else state["calls"]


class Counting(L.LightningModule):
    def __init__(self, as_tensor: bool) -> None:
        super().__init__()
        self.inp = CountingLinear(8, 16, as_tensor=as_tensor)
        self.out = nn.Linear(16, 4)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.out(torch.relu(self.inp(x))), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _trainer(root, state_dict_type: str, callbacks=()) -> L.Trainer:
    os.environ["MASTER_PORT"] = str(free_port())
    return L.Trainer(accelerator="cpu", devices=1, strategy=ElixirStrategy(plan="zero3", state_dict_type=state_dict_type),
                     max_steps=3, logger=False, enable_progress_bar=False, enable_model_summary=False,
                     default_root_dir=root, callbacks=list(callbacks), enable_checkpointing=bool(callbacks))


@pytest.mark.parametrize("as_tensor", [True, False], ids=["tensor", "object"])
@pytest.mark.parametrize("state_dict_type", ["full", "sharded"])
def test_extra_state_is_saved_and_given_back_on_resume(tmp_path, state_dict_type, as_tensor):
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(12, 8), torch.randint(4, (12,))),
                                       batch_size=4)
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    model = Counting(as_tensor)
    _trainer(tmp_path, state_dict_type, [checkpoint]).fit(model, data)
    assert model.inp.calls == 3
    path = checkpoint.last_model_path
    if state_dict_type == "sharded":
        convert_sharded_to_full(path, tmp_path / "full.ckpt")
        saved = torch.load(tmp_path / "full.ckpt", weights_only=False)["state_dict"]["inp._extra_state"]
    else:
        saved = torch.load(path, weights_only=False)["state_dict"]["inp._extra_state"]
    assert (int(saved) if as_tensor else saved["calls"]) == 3

    model.inp.calls = 0
    _trainer(tmp_path, state_dict_type).fit(model, data, ckpt_path=path)  # at max_steps already: loads, no step
    assert model.inp.calls == 3
