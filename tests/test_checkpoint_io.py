"""Checkpoints through the Trainer's checkpoint_io: remote paths, AsyncCheckpointIO, killed saves, bad directories."""

from __future__ import annotations

import os
import random
import re
import subprocess
import sys
import uuid
from pathlib import Path

import fsspec
import lightning as L
import pytest
import torch
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.plugins.io import AsyncCheckpointIO

from lightning_elixir.demos.gpt import BigramDataModule, GPTLightningModule
from lightning_elixir import ElixirStrategy
from lightning_elixir.checkpoint_io import AtomicCheckpointIO, checkpoint_dir_problem, is_temp_name, temp_name
from tests.distributed import free_port

MODEL = dict(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
DATA = dict(vocab_size=64, block_size=16, batch_size=4, num_samples=24)  # 6 steps per epoch on one rank
REPO = Path(__file__).resolve().parents[1]


def _fit(tmp_path, callbacks, **kwargs) -> L.Trainer:
    """Four steps on one CPU rank: one process is the test's own, so its memory:// file system is shared."""
    os.environ["MASTER_PORT"] = str(free_port())
    L.seed_everything(0)
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=ElixirStrategy(plan="zero3"), max_steps=4,
                        logger=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        default_root_dir=tmp_path, callbacks=callbacks, **kwargs)
    trainer.fit(GPTLightningModule(**MODEL), BigramDataModule(**DATA))
    return trainer


def _loads_into_a_plain_module(checkpoint: dict) -> None:
    GPTLightningModule(**MODEL).load_state_dict(checkpoint["state_dict"])  # strict


def test_temp_names_are_hidden_unmatched_by_resume_and_recognised():
    name = temp_name()
    assert name.startswith(".") and not name.endswith(".ckpt") and not re.search(r"\d|hpc_ckpt_", name)
    assert name != temp_name()
    assert is_temp_name(name) and is_temp_name(".last.ckpt.tmp")  # the scheme before this one
    assert not any(map(is_temp_name, ("last.ckpt", ".notes.tmp", "notes.tmp", ".elixir-partial-abc.tmp")))


def test_remote_checkpoints_stay_remote_and_top_k_removes_them(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a path taken for local would land here, as a "memory:" folder
    url = f"memory://elixir-{uuid.uuid4().hex}"
    fs = fsspec.filesystem("memory")
    try:
        trainer = _fit(tmp_path, [ModelCheckpoint(dirpath=url, save_top_k=1, every_n_train_steps=1)])
        names = [p.rpartition("/")[2] for p in fs.ls(url, detail=False)]
        assert names == ["epoch=0-step=4.ckpt"]
        with fs.open(f"{url}/{names[0]}", "rb") as f:
            checkpoint = torch.load(f, weights_only=False)
        assert checkpoint["global_step"] == trainer.global_step == 4
        _loads_into_a_plain_module(checkpoint)
    finally:
        fs.rm(url, recursive=True)
    assert not [p for p in tmp_path.rglob("*") if "memory" in p.name]


class _ListDir(Callback):
    def __init__(self, path: Path) -> None:
        self.path, self.at_train_start = path, None

    def on_train_start(self, trainer, pl_module) -> None:
        self.at_train_start = sorted(os.listdir(self.path))


def test_async_saves_are_whole_and_leftovers_of_killed_saves_go_at_setup(tmp_path):
    ckpts = tmp_path / "ckpts"
    ckpts.mkdir()
    for name in (temp_name(), ".last.ckpt.tmp", "notes.tmp"):  # two leftovers and a user's file
        (ckpts / name).write_bytes(b"x" * 1000)
    async_io, listing = AsyncCheckpointIO(), _ListDir(ckpts)
    trainer = _fit(tmp_path, [ModelCheckpoint(dirpath=ckpts, save_top_k=-1, every_n_train_steps=1), listing],
                   plugins=[async_io])
    assert listing.at_train_start == ["notes.tmp"]  # removed before any save
    assert trainer.strategy.checkpoint_io is async_io
    assert type(async_io.checkpoint_io) is TorchCheckpointIO  # the user's chain is given back at teardown
    names = sorted(os.listdir(ckpts))
    assert names == [f"epoch=0-step={step}.ckpt" for step in range(1, 5)] + ["notes.tmp"]
    for step in range(1, 5):
        checkpoint = torch.load(ckpts / f"epoch=0-step={step}.ckpt", weights_only=False)
        assert checkpoint["global_step"] == step
        _loads_into_a_plain_module(checkpoint)


class _FailingIO(TorchCheckpointIO):
    def save_checkpoint(self, checkpoint, path, storage_options=None) -> None:
        Path(path).write_bytes(b"half a checkpoint")
        raise OSError("disk full")


def test_a_failed_write_leaves_the_previous_checkpoint_and_no_temporary_file(tmp_path):
    target = tmp_path / "last.ckpt"
    AtomicCheckpointIO(TorchCheckpointIO()).save_checkpoint({"step": 1}, target)
    with pytest.raises(OSError, match="disk full"):
        AtomicCheckpointIO(_FailingIO()).save_checkpoint({"step": 2}, target)
    assert os.listdir(tmp_path) == ["last.ckpt"]
    assert torch.load(target)["step"] == 1


_SAVER = """
import sys, torch
from lightning_elixir import ElixirStrategy

directory, first_step, strategy = sys.argv[1], int(sys.argv[2]), ElixirStrategy(plan="zero3")
payload = torch.empty(8 * 2**20)  # 32 MiB, so that most of the loop is spent writing
for step in range(first_step, first_step + 10**6):
    payload.fill_(step)
    for name in ("last.ckpt", f"step={step}.ckpt"):
        strategy.save_checkpoint({"step": step, "payload": payload}, f"{directory}/{name}")
    if step >= first_step + 2:
        strategy.remove_checkpoint(f"{directory}/step={step - 2}.ckpt")
    print(step, flush=True)
"""


def _check_complete(directory: Path, last_printed: int) -> list[str]:
    """Every .ckpt file loads whole; last.ckpt is the newest save. Returns the temporary files left."""
    names = os.listdir(directory)
    for name in (n for n in names if n.endswith(".ckpt")):
        checkpoint = torch.load(directory / name)
        assert bool((checkpoint["payload"] == checkpoint["step"]).all()), name
        if name == "last.ckpt":
            assert checkpoint["step"] in (last_printed, last_printed + 1)  # killed after the rename, before the print
    leftovers = [n for n in names if is_temp_name(n)]
    steps = [int(m[1]) for m in map(re.compile(r"step=(\d+)\.ckpt").fullmatch, names) if m]
    assert len(leftovers) + len(steps) + 1 == len(names) and max(steps) <= last_printed + 1
    return leftovers


def test_saves_killed_at_random_points_leave_whole_checkpoints_and_the_next_run_clears_leftovers(tmp_path):
    leftovers, killed_mid_write = [], 0
    for seed in range(5):
        first_step = seed * 10**4  # above every step of the runs before, whose files stay
        proc = subprocess.Popen([sys.executable, "-c", _SAVER, str(tmp_path), str(first_step)], cwd=REPO,
                                stdout=subprocess.PIPE, text=True)
        printed = [proc.stdout.readline()]  # its first save has swept the directory
        assert printed[0].strip(), "the saving process died before its first checkpoint"
        assert not [n for n in leftovers if (tmp_path / n).exists()]
        random_delay_s = random.Random(seed).uniform(0.05, 0.6)
        try:
            proc.wait(timeout=random_delay_s)
        except subprocess.TimeoutExpired:
            proc.kill()
        assert proc.wait() != 0  # killed, not finished
        printed += proc.stdout.readlines()
        leftovers = _check_complete(tmp_path, int(printed[-1]))
        killed_mid_write += bool(leftovers)
    assert killed_mid_write, "no kill landed inside a write; the loop should spend most of its time writing"
    AtomicCheckpointIO().remove_leftovers(tmp_path)  # what a run's setup does for ModelCheckpoint's directory
    assert not [n for n in os.listdir(tmp_path) if is_temp_name(n)]


def test_an_unwritable_checkpoint_directory_fails_before_training(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("a file, so no directory can be created under it")
    assert checkpoint_dir_problem(tmp_path / "fine" / "ckpts") is None and checkpoint_dir_problem("memory://x") is None
    assert not (tmp_path / "fine").exists()  # made for the probe only: ModelCheckpoint makes it when it saves
    started = _ListDir(tmp_path)
    with pytest.raises(ValueError, match=re.escape(repr(str(blocker / "ckpts")))):
        _fit(tmp_path, [ModelCheckpoint(dirpath=blocker / "ckpts"), started])
    assert started.at_train_start is None
