"""state_dict_type="sharded" through the Trainer: exact resume, resume at another world size, convert, killed saves."""

from __future__ import annotations

import contextlib
import itertools
import os
import random
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Optional

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.distributed.checkpoint.api import CheckpointException

from lightning_elixir.demos.gpt import BigramDataModule, GPTLightningModule
from lightning_elixir import ElixirPlan, ElixirStrategy
from lightning_elixir.checkpoint_io import AtomicCheckpointIO, is_temp_name
from lightning_elixir.runtime.runtime import ElixirRuntime
from lightning_elixir.runtime.sharded import convert_sharded_to_full, read_checkpoint
from tests.distributed import fork_server, free_port
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


def test_validate_after_fit_loads_the_best_sharded_checkpoint_into_the_model(tmp_path):
    """Outside fit only the model is loaded: the fit's optimizers (views of the fit's chunks) are left alone."""
    L.seed_everything(0)
    best = ModelCheckpoint(dirpath=tmp_path / "ckpt", monitor="val_loss", save_top_k=1)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=3, logger=False, enable_progress_bar=False,
                        strategy=ElixirStrategy(plan="zero3", state_dict_type="sharded"), enable_model_summary=False,
                        num_sanity_val_steps=0, default_root_dir=tmp_path, callbacks=[best])
    module, data = GPTLightningModule(**MODEL), BigramDataModule(**DATA)
    trainer.fit(module, data)
    score = float(best.best_model_score)  # the validation loss when the best checkpoint was saved
    validated = trainer.validate(module, data, ckpt_path="best", verbose=False)
    assert Path(best.best_model_path).is_dir()
    assert validated[0]["val_loss"] == pytest.approx(score, rel=1e-6)


class _Marked(L.LightningModule):
    """A 1024x1024 weight and a 16 MiB buffer: 24 MiB a checkpoint with SGD's momentum, of which a step
    updates 8, so that a step is mostly its save."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(1024, 1024, bias=False)
        self.register_buffer("ballast", torch.zeros(4 * 2**20))

    def training_step(self, batch, batch_idx):
        return self.layer(batch[0]).square().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0, momentum=0.9)  # momentum: per-element state to save


class _MarkAndReport(Callback):
    """Sets the tensors to the step number before its save; reports each step once the save before it finished."""

    def __init__(self, report: Connection) -> None:
        self.report = report

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.report.send(trainer.global_step)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # before ModelCheckpoint's
        with trainer.strategy.gathered_params(), torch.no_grad():
            pl_module.layer.weight.fill_(trainer.global_step)  # a checkpoint's tensors say which step's save wrote it
        pl_module.ballast.fill_(trainer.global_step)


def _save_every_step(directory: str, root: str, port: int, ckpt_path: Optional[str], report: Connection) -> None:
    """A fit that saves a sharded checkpoint every step, under a new name, until it is killed.

    Without last.ckpt and without removing older checkpoints: replacing and removing a sharded
    checkpoint have tests of their own below, which a kill at a random point rarely reaches."""
    os.environ["MASTER_PORT"] = str(port)
    checkpoints = ModelCheckpoint(dirpath=directory, filename="{step}", save_top_k=-1, every_n_train_steps=1)
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=ElixirStrategy(plan="zero3", state_dict_type="sharded"),
                        max_steps=10**6, logger=False, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=root, callbacks=[checkpoints, _MarkAndReport(report)])
    data = torch.utils.data.TensorDataset(torch.randn(8, 1024))
    trainer.fit(_Marked(), torch.utils.data.DataLoader(data, batch_size=1), ckpt_path=ckpt_path)


def _whole_step(path: Path, scratch: Path) -> int:
    """The step of a complete checkpoint whose tensors all hold it; raises if a file of it is missing."""
    convert_sharded_to_full(path, scratch)  # reads every tensor
    checkpoint = torch.load(scratch, weights_only=False)
    step = checkpoint["global_step"]
    for key in ("layer.weight", "ballast"):
        assert bool((checkpoint["state_dict"][key] == step).all()), f"{path.name}, {key}: a mix of two saves"
    return step


def _check_sharded_dir(directory: Path, scratch: Path, last_reported: int) -> tuple[list[str], str, int]:
    """Every directory with .metadata is a complete checkpoint whose tensors all hold its step; every
    other entry is temporary; checkpoints are named after their step, the newest being the step last
    reported or the next. Returns the temporary names and the newest checkpoint's name and step."""
    steps = {}
    for name in os.listdir(directory):
        complete = (directory / name / ".metadata").exists()
        if is_temp_name(name) and not complete:
            continue  # an unfinished save's leftover, for the next setup to remove
        assert complete, f"{name} looks unfinished under a checkpoint's name"
        step = _whole_step(directory / name, scratch)  # a save killed before its rename is whole, too
        if not is_temp_name(name):
            assert re.fullmatch(rf"step={step}(-v\d+)?\.ckpt", name), name  # -v1: saved again after a resume
            steps[name] = step
    newest = max(steps, key=steps.get)
    assert steps[newest] in (last_reported, last_reported + 1)  # the save of step last_reported + 1 may have finished
    return [n for n in os.listdir(directory) if is_temp_name(n)], newest, steps[newest]


def _received(receiver: Connection) -> list[int]:
    """Everything sent to ``receiver`` by a process that has ended."""
    out = []
    with contextlib.suppress(EOFError):
        while receiver.poll():
            out.append(receiver.recv())
    return out


def test_sharded_saves_killed_at_random_points_leave_whole_checkpoints_and_the_next_run_clears_leftovers(tmp_path):
    """A fit saving a sharded checkpoint every step (_save_every_step), killed with SIGKILL at a random
    point after its first save, ten times in a row: each time, the checks of _check_sharded_dir hold; the
    next fit resumes from the newest checkpoint at its step, and its setup has removed the temporary
    directories the killed one left.

    The fits are forked from multiprocessing's fork server, which imports torch and Lightning once. Between
    fits, the test deletes the checkpoints it checked but the newest, to bound the disk space used."""
    context = fork_server(__name__)
    directory = tmp_path / "ckpt"
    leftovers, newest, newest_step, swept = [], None, 0, 0
    for seed in range(10):
        receiver, sender = context.Pipe(duplex=False)
        resume = None if newest is None else str(directory / newest)
        proc = context.Process(target=_save_every_step, args=(str(directory), str(tmp_path / "root"), free_port(),
                                                              resume, sender))
        proc.start()
        sender.close()  # the fit holds the only sending end: its death ends the pipe
        reported = [receiver.recv()]  # its setup has swept the directory; EOFError: it died first
        assert reported[0] == newest_step, "the fit resumes from the newest checkpoint"
        assert not [n for n in leftovers if (directory / n).exists()], "setup removes the leftovers of killed saves"
        swept += bool(leftovers)
        reported.append(receiver.recv())  # a step's save finished: there is a checkpoint to keep whole
        proc.join(timeout=random.Random(seed).uniform(0.0, 1.0))  # a step takes about 0.1 s, mostly saving
        proc.kill()
        proc.join()
        assert proc.exitcode == -signal.SIGKILL  # killed, not failed
        reported += _received(receiver)
        leftovers, newest, newest_step = _check_sharded_dir(directory, tmp_path / "converted.ckpt", reported[-1])
        for name in set(os.listdir(directory)) - {newest, *leftovers}:
            shutil.rmtree(directory / name)
    assert swept, "no kill landed inside a save; the loop should spend most of its time saving"


def _sharded_strategy() -> ElixirStrategy:
    """A strategy with a runtime of a small model, as a one-process fit sets it up: enough for its save path."""
    strategy = ElixirStrategy(plan="zero3", state_dict_type="sharded")
    strategy.runtime = ElixirRuntime(torch.nn.Linear(64, 64), ElixirPlan(cache_blocks="min"))
    return strategy


class _Killed(BaseException):
    """Stands for SIGKILL: no handler runs, nothing after it happens."""


def _killed_at(call: int, function: Callable) -> Callable:
    """``function``, except that its ``call``-th call raises _Killed instead."""
    calls = itertools.count(1)

    def function_or_die(*args, **kwargs):
        if next(calls) == call:
            raise _Killed
        return function(*args, **kwargs)

    return function_or_die


def _calls(function: Callable, calls: list) -> Callable:
    """``function``, counting its calls in ``calls``."""
    def counted(*args, **kwargs):
        calls.append(args)
        return function(*args, **kwargs)

    return counted


def test_a_replacing_save_interrupted_at_any_rename_keeps_a_checkpoint_in_place(tmp_path, monkeypatch):
    """last.ckpt saved again by the strategy, the save stopped at each of its renames in turn: last.ckpt is
    then the previous checkpoint or the new one, whole, and stays after the next setup's sweep."""
    strategy, replace, renames = _sharded_strategy(), os.replace, []
    strategy.save_checkpoint({"global_step": 1}, tmp_path / "counted" / "last.ckpt")
    monkeypatch.setattr(os, "replace", _calls(replace, renames))
    strategy.save_checkpoint({"global_step": 2}, tmp_path / "counted" / "last.ckpt")
    assert renames  # the swap into place itself is one atomic exchange where the system has one (Linux)
    assert read_checkpoint(tmp_path / "counted" / "last.ckpt")[0]["extra"]["global_step"] == 2
    for stop_at in range(1, len(renames) + 1):
        directory = tmp_path / f"stopped-{stop_at}"
        monkeypatch.setattr(os, "replace", replace)
        strategy.save_checkpoint({"global_step": 1}, directory / "last.ckpt")
        monkeypatch.setattr(os, "replace", _killed_at(stop_at, replace))
        with pytest.raises((_Killed, CheckpointException)):  # DCP wraps what stops it inside its own steps
            strategy.save_checkpoint({"global_step": 2}, directory / "last.ckpt")
        monkeypatch.setattr(os, "replace", replace)
        AtomicCheckpointIO().remove_leftovers(directory)  # the next setup
        assert (directory / "last.ckpt").exists(), f"stopped at rename {stop_at} of {len(renames)}"
        meta, _ = read_checkpoint(directory / "last.ckpt")
        assert meta["extra"]["global_step"] in (1, 2)


def test_a_removal_interrupted_half_way_leaves_nothing_that_looks_complete(tmp_path, monkeypatch):
    """A sharded checkpoint removed by the strategy, the removal stopped before each of its file deletions
    in turn: the checkpoint's name then holds nothing, or a directory without .metadata, or every file."""
    strategy, unlink = _sharded_strategy(), os.unlink
    strategy.save_checkpoint({"global_step": 1}, tmp_path / "saved")
    saved = sorted(os.listdir(tmp_path / "saved"))
    for stop_at in range(1, len(saved) + 1):
        path = tmp_path / f"step={stop_at}.ckpt"
        shutil.copytree(tmp_path / "saved", path)
        monkeypatch.setattr(os, "unlink", _killed_at(stop_at, unlink))
        with pytest.raises(_Killed):
            strategy.remove_checkpoint(path)
        monkeypatch.setattr(os, "unlink", unlink)
        if (path / ".metadata").exists():
            assert sorted(os.listdir(path)) == saved, f"stopped before deleting file {stop_at} of {len(saved)}"


class _Head(L.LightningModule):
    """A two-layer classifier whose ``on_load_checkpoint`` edits the checkpoint as fine-tuning does."""

    def __init__(self, classes: int = 4, edit: str = "") -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, classes))
        self.edit = edit
        self.seen: dict = {}
        self.strict_loading = edit != "new_head"

    def training_step(self, batch, batch_idx):
        return torch.nn.functional.cross_entropy(self.net(batch[0]), batch[1])

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.training_step(batch, batch_idx))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.05)

    def on_load_checkpoint(self, checkpoint) -> None:
        state = checkpoint["state_dict"]
        self.seen = {k: tuple(v.shape) for k, v in state.items()}
        if self.edit == "zero_head":  # a head's weights put in, a smaller learning rate
            state["net.2.weight"] = torch.zeros(4, 16)
            for group in checkpoint["optimizer_states"][0]["param_groups"]:
                group["lr"] = 1e-3
        if self.edit == "new_head":  # a head of another shape: its saved weights dropped
            del state["net.2.weight"], state["net.2.bias"]


class _AtStart(Callback):
    def on_train_start(self, trainer, pl_module) -> None:
        with trainer.strategy.gathered_params():
            pl_module.at_start = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}
        pl_module.lr_at_start = trainer.optimizers[0].param_groups[0]["lr"]


def _head_data() -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g))
    return torch.utils.data.DataLoader(data, batch_size=4)


def _head_trainer(root: Path, fmt: str, steps: int = 2) -> L.Trainer:
    return L.Trainer(accelerator="cpu", devices=1, strategy=ElixirStrategy(plan="zero3", state_dict_type=fmt),
                     max_steps=steps, logger=False, enable_progress_bar=False, enable_model_summary=False,
                     default_root_dir=root, callbacks=[ModelCheckpoint(dirpath=root / fmt, save_last=True),
                                                       _AtStart()])


def test_on_load_checkpoint_edits_a_sharded_checkpoint_as_a_full_one(tmp_path):
    """The hooks see every key (shapes included) and their edits take effect in both formats alike: a head's
    weights and a learning rate replaced when resuming; a head of another shape left out of a model load."""
    out = {}
    for fmt in ("full", "sharded"):
        L.seed_everything(0)
        _head_trainer(tmp_path, fmt).fit(_Head(), _head_data())
        last = str(tmp_path / fmt / "last.ckpt")
        L.seed_everything(1)
        resumed = _Head(4, "zero_head")
        _head_trainer(tmp_path, fmt, steps=3).fit(resumed, _head_data(), ckpt_path=last)
        L.seed_everything(1)
        other = _Head(6, "new_head")
        _head_trainer(tmp_path, fmt).validate(other, _head_data(), ckpt_path=last, verbose=False)
        out[fmt] = resumed, other
    (full, full_other), (sharded, sharded_other) = out["full"], out["sharded"]
    assert sharded.seen == full.seen and full.seen["net.2.weight"] == (4, 16)
    assert sharded.lr_at_start == full.lr_at_start == 1e-3
    for key, value in full.at_start.items():
        torch.testing.assert_close(sharded.at_start[key], value, msg=key)
    assert not sharded.at_start["net.2.weight"].any()
    for key, value in full_other.state_dict().items():
        torch.testing.assert_close(sharded_other.state_dict()[key], value, msg=key)
    assert sharded_other.net[2].weight.shape == (6, 16)


def test_replacing_an_optimizer_state_of_a_sharded_checkpoint_is_refused(tmp_path):
    class Resets(_Head):
        def on_load_checkpoint(self, checkpoint) -> None:
            checkpoint["optimizer_states"][0]["state"] = {}

    L.seed_everything(0)
    _head_trainer(tmp_path, "sharded").fit(_Head(), _head_data())
    with pytest.raises(ValueError, match=r"replaced checkpoint\['optimizer_states'\]\[0\]\['state'\]"):
        _head_trainer(tmp_path, "sharded", steps=3).fit(Resets(), _head_data(),
                                                        ckpt_path=str(tmp_path / "sharded" / "last.ckpt"))


def test_entries_put_in_a_sharded_save_are_refused_not_dropped(tmp_path):
    class Renames(_Head):
        def on_save_checkpoint(self, checkpoint) -> None:
            checkpoint["state_dict"]["renamed.weight"] = torch.zeros(1)

    L.seed_everything(0)
    with pytest.raises(ValueError, match="edit the state when loading"):
        _head_trainer(tmp_path, "sharded").fit(Renames(), _head_data())
