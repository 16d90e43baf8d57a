"""state_dict_type="sharded" through the Trainer: exact resume, resume at another world size, convert."""

from __future__ import annotations

import os
import subprocess
import sys

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from examples.gpt import BigramDataModule, GPTLightningModule
from lightning_elixir import ElixirStrategy
from tests.distributed import free_port
from tests.test_strategy import DATA, MODEL, LossRecorder, _losses


def _fit(root, devices: int, epochs: int, log=None, ckpt_path=None, plan="zero2") -> ModelCheckpoint:
    os.environ["MASTER_PORT"] = str(free_port())
    L.seed_everything(0)
    ckpt = ModelCheckpoint(dirpath=root / "ckpt", save_last=True, save_top_k=0)
    callbacks = [ckpt] + ([LossRecorder(str(log))] if log else [])
    strategy = ElixirStrategy(plan=plan, state_dict_type="sharded", start_method="spawn" if devices > 1 else "popen")
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_epochs=epochs, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        default_root_dir=root, callbacks=callbacks)
    trainer.fit(GPTLightningModule(**MODEL), BigramDataModule(**DATA), ckpt_path=ckpt_path)
    return ckpt


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sharded")
    _fit(tmp / "full", 2, 2, log=tmp / "full.jsonl")
    _fit(tmp / "one", 2, 1)
    last = tmp / "one" / "ckpt" / "last.ckpt"
    _fit(tmp / "resumed", 2, 2, log=tmp / "resumed.jsonl", ckpt_path=str(last), plan="zero3")
    return {"tmp": tmp, "last": last, "full": _losses(tmp / "full.jsonl"), "resumed": _losses(tmp / "resumed.jsonl")}


def test_a_sharded_checkpoint_is_a_complete_directory(sharded):
    last = sharded["last"]
    assert last.is_dir() and (last / ".metadata").exists()
    assert {p.name for p in last.iterdir()} >= {"__0_0.distcp", "__1_0.distcp"}
    assert not [p for p in last.parent.iterdir() if p.name.startswith(".")], "no temporary leftovers"


def test_resume_from_shards_under_another_plan_continues_the_losses(sharded):
    full, resumed = dict(map(tuple, sharded["full"])), dict(map(tuple, sharded["resumed"]))
    assert sorted(resumed) == [4, 5, 6]
    for step, loss in resumed.items():
        assert loss == pytest.approx(full[step], rel=1e-5)


def test_resume_from_shards_at_world_size_one(sharded, tmp_path):
    ckpt = _fit(tmp_path, 1, 2, ckpt_path=str(sharded["last"]))
    assert torch.isfinite(torch.tensor(float(ckpt.current_score or 0.0)))
    assert (tmp_path / "ckpt" / "last.ckpt" / ".metadata").exists()


def test_convert_gives_a_full_checkpoint_for_the_plain_module(sharded, tmp_path):
    out = tmp_path / "full.ckpt"
    subprocess.run([sys.executable, "-m", "lightning_elixir.cli", "convert", str(sharded["last"]), str(out)],
                   check=True)
    checkpoint = torch.load(out, weights_only=False)
    plain = GPTLightningModule(**MODEL)
    plain.load_state_dict(checkpoint["state_dict"])  # strict
    assert checkpoint["global_step"] == 3 and len(checkpoint["optimizer_states"]) == 1
