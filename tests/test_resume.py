"""Resuming a fit from its checkpoints, full and sharded: exactly, and at another world size or plan.

Multi-rank fits run the Trainer in processes started and joined to a gloo group beforehand, as under
torchrun (``LOCAL_RANK`` set, so Lightning launches nothing): the fits of one world size share one start
of the processes, and each fit builds its model, strategy and Trainer afresh.

[Note: resumable test data]
Every step trains on one global batch of ``GLOBAL_BATCH`` token rows, drawn from a generator
seeded with the step number and the row's place in the batch. The loader yields only each row's
place: a DistributedSampler without shuffling (the module's own; Lightning's shuffles training data)
deals position ``i`` to rank ``i % world_size``, and ``i % GLOBAL_BATCH`` is the row's place in its
step's global batch, at any world size, when the per-rank batch size is ``GLOBAL_BATCH // world_size``.
Drawing rows from the step rather than from the loader's position matters: a plain DataLoader
restarts at its first batch after a mid-epoch resume (Lightning warns that it is not resumable), and
the checkpoint at ``SAVED_AT`` falls inside an epoch. The loss is the mean over the rank's rows and
gradients are averaged over ranks, so a step's update is that of the mean loss over the global batch
at every world size, and the mean of the ranks' losses is the loss of the global batch.

The model has no biases (see ``NO_BIAS`` in tests/runtime/workloads.py: attention's key bias has an
exactly zero true gradient, which Adam turns into full-size updates of rounding noise) and no
dropout (Lightning's checkpoints carry no RNG state under any strategy). The learning rate decays
every step, so a scheduler that restarted would change every loss after the resume.
"""

from __future__ import annotations

import json
import os
from datetime import timedelta
from pathlib import Path
from typing import Optional, Union

import lightning as L
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from lightning_elixir.demos.gpt import GPT, GPTConfig
from lightning_elixir import ElixirPlan, ElixirStrategy
from lightning_elixir.runtime.sharded import convert_sharded_to_full
from tests.distributed import fork_server, free_port

CONFIG = GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=16, bias=False)
GLOBAL_BATCH = 4
STEPS_PER_EPOCH = 6
EVERY_N = 5
"""Every fit saves a checkpoint every EVERY_N steps."""
SAVED_AT, LAST_STEP = 10, 20
"""Fits from scratch run to LAST_STEP; resumed ones start from the checkpoint saved at SAVED_AT, mid-epoch."""
CHANGED_UNTIL = 15
"""Fits resumed at another world size or plan train from SAVED_AT to here."""
ZERO3 = ElixirPlan(chunk_numel=1024, cache_blocks="min", name="zero3")
"""Small chunks, so that parameters straddle shard boundaries differently at every world size."""
FORMATS = ("full", "sharded")
COLLECTIVE_TIMEOUT = timedelta(seconds=120)
"""How long a rank waits for the others before the test fails (rather than hanging for gloo's 30 minutes)."""


def _row(step: int, place: int) -> torch.Tensor:
    """The tokens of row ``place`` of step ``step``'s global batch."""
    g = torch.Generator().manual_seed(step * GLOBAL_BATCH + place)
    return torch.randint(CONFIG.vocab_size, (CONFIG.block_size + 1,), generator=g)


class Places(Dataset):
    """Positions in an epoch; see [Note: resumable test data]."""

    def __len__(self) -> int:
        return STEPS_PER_EPOCH * GLOBAL_BATCH

    def __getitem__(self, i: int) -> int:
        return i


class TinyGPT(L.LightningModule):
    """A GPT without biases, trained with AdamW under a per-step exponential learning-rate decay."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.model = GPT(CONFIG)

    def train_dataloader(self) -> DataLoader:
        world_size = self.trainer.world_size
        sampler = DistributedSampler(Places(), num_replicas=world_size, rank=self.global_rank, shuffle=False)
        return DataLoader(Places(), batch_size=GLOBAL_BATCH // world_size, sampler=sampler)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        tokens = torch.stack([_row(self.global_step, int(i) % GLOBAL_BATCH) for i in batch])
        logits = self.model(tokens[:, :-1])
        return F.cross_entropy(logits.reshape(-1, CONFIG.vocab_size), tokens[:, 1:].reshape(-1))

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)
        scheduler = torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=0.9)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class RankLosses(Callback):
    """Appends (global_step, loss) of every rank to ``rank<r>.jsonl`` in a directory."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        with open(self.directory / f"rank{trainer.global_rank}.jsonl", "a") as f:
            f.write(json.dumps([trainer.global_step, outputs["loss"].item()]) + "\n")


class StartWeights(Callback):
    """Rank 0 saves the full model state dict that training starts from (after a checkpoint loaded)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_start(self, trainer, pl_module) -> None:
        with trainer.strategy.gathered_params():  # every rank reads every parameter
            state = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}
        if trainer.is_global_zero:
            torch.save(state, self.path)


def fit(run: Path, world_size: int, plan: Union[str, ElixirPlan], state_dict_type: str, max_steps: int,
        ckpt_path: Optional[Path] = None) -> None:
    """One fit: losses in ``run/losses``, the starting weights in ``run/start.pt``, a checkpoint every
    EVERY_N steps in ``run/ckpt``. A resumed fit starts from other initial weights, so a load that did
    nothing cannot pass."""
    (run / "losses").mkdir(parents=True, exist_ok=True)
    checkpoints = ModelCheckpoint(dirpath=run / "ckpt", filename="{step}", every_n_train_steps=EVERY_N,
                                  save_top_k=-1)
    strategy = ElixirStrategy(plan=plan, state_dict_type=state_dict_type,
                              collective_timeout_s=COLLECTIVE_TIMEOUT.total_seconds())
    trainer = L.Trainer(accelerator="cpu", devices=world_size, strategy=strategy, max_steps=max_steps,
                        use_distributed_sampler=False, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=run,
                        callbacks=[checkpoints, RankLosses(run / "losses"), StartWeights(run / "start.pt")])
    trainer.fit(TinyGPT(seed=0 if ckpt_path is None else 1), ckpt_path=ckpt_path)


def fit_here(run: Path, *args, **kwargs) -> Path:
    """A one-rank fit in this process."""
    os.environ["MASTER_PORT"] = str(free_port())  # a fresh port per fit; Lightning reuses a set one
    fit(run, 1, *args, **kwargs)
    return run


def fit_on_ranks(world_size: int, fits: list[tuple], fit_fn=None) -> None:
    """Runs ``fit_fn(run, world_size, *rest)`` (default ``fit``) for each ``(run, *rest)`` in order, on
    ``world_size`` gloo ranks.

    The ranks are forked from multiprocessing's fork server, which imports this module and ``fit_fn``'s
    (and so torch and Lightning) once, rather than once per rank: on a machine with fewer cores than
    ranks, the imports would take most of the time."""
    fit_fn = fit_fn or fit
    fork_server(*sorted({__name__, fit_fn.__module__}))
    mp.start_processes(_fits_on_rank, args=(world_size, free_port(), fits, fit_fn), nprocs=world_size,
                       start_method="forkserver")


def _fits_on_rank(rank: int, world_size: int, port: int, fits: list[tuple], fit_fn) -> None:
    """One rank of fit_on_ranks: joins the group, then fits; Lightning joins the group it finds."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)  # the ranks share the machine's cores
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=COLLECTIVE_TIMEOUT)
    try:
        for run, *rest in fits:
            fit_fn(run, world_size, *rest)
    finally:
        dist.destroy_process_group()


def checkpoint_at(run: Path, step: int) -> Path:
    return run / "ckpt" / f"step={step}.ckpt"


def full_checkpoint(run: Path, step: int) -> dict:
    """The checkpoint a fit saved at ``step`` as one full dict (a sharded one converted first)."""
    path = checkpoint_at(run, step)
    if path.is_dir():
        converted = run / f"converted-{step}.ckpt"
        if not converted.exists():
            convert_sharded_to_full(path, converted)
        path = converted
    return torch.load(path, weights_only=False)


def rank_losses(run: Path) -> list[dict[int, float]]:
    """Each rank's loss per step."""
    out = []
    for path in sorted((run / "losses").glob("rank*.jsonl")):
        with open(path) as f:
            out.append(dict(tuple(json.loads(line)) for line in f))
    return out


def global_losses(run: Path) -> dict[int, float]:
    """The loss of the global batch per step: the mean of the ranks' losses over equal parts."""
    per_rank = rank_losses(run)
    return {step: sum(r[step] for r in per_rank) / len(per_rank) for step in per_rank[0]}


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("resume")


@pytest.fixture(scope="module")
def one_rank(root) -> dict[str, Path]:
    """Per format: SAVED_AT steps from scratch on one rank under zero2."""
    return {fmt: fit_here(root / f"one-rank-{fmt}", "zero2", fmt, SAVED_AT) for fmt in FORMATS}


@pytest.fixture(scope="module")
def two_ranks(root, one_rank) -> dict[str, dict[str, Path]]:
    """Per format, on 2 ranks under ZERO3: LAST_STEP steps from scratch ("uninterrupted"); the same fit
    resumed from its checkpoint at SAVED_AT ("resumed"); one_rank's checkpoint resumed ("one-to-two")."""
    runs = {fmt: {name: root / f"{name}-{fmt}" for name in ("uninterrupted", "resumed", "one-to-two")}
            for fmt in FORMATS}
    fits = []
    for fmt, run in runs.items():
        fits += [(run["uninterrupted"], ZERO3, fmt, LAST_STEP),
                 (run["resumed"], ZERO3, fmt, LAST_STEP, checkpoint_at(run["uninterrupted"], SAVED_AT)),
                 (run["one-to-two"], ZERO3, fmt, CHANGED_UNTIL, checkpoint_at(one_rank[fmt], SAVED_AT))]
    fit_on_ranks(2, fits)
    return runs


@pytest.fixture(scope="module")
def uninterrupted(two_ranks) -> dict[str, Path]:
    return {fmt: runs["uninterrupted"] for fmt, runs in two_ranks.items()}


@pytest.fixture(scope="module")
def one_to_two(two_ranks) -> dict[str, Path]:
    return {fmt: runs["one-to-two"] for fmt, runs in two_ranks.items()}


@pytest.fixture(scope="module")
def two_to_one(root, uninterrupted) -> dict[str, Path]:
    """Per format: the 2-rank ZERO3 checkpoint at SAVED_AT resumed on one rank under zero2."""
    return {fmt: fit_here(root / f"two-to-one-{fmt}", "zero2", fmt, CHANGED_UNTIL,
                          ckpt_path=checkpoint_at(uninterrupted[fmt], SAVED_AT)) for fmt in FORMATS}


@pytest.fixture(scope="module")
def two_to_four(root, uninterrupted) -> dict[str, Path]:
    """Per format: the 2-rank checkpoint at SAVED_AT resumed on 4 ranks."""
    runs = {fmt: root / f"two-to-four-{fmt}" for fmt in FORMATS}
    fit_on_ranks(4, [(runs[fmt], ZERO3, fmt, CHANGED_UNTIL, checkpoint_at(uninterrupted[fmt], SAVED_AT))
                     for fmt in FORMATS])
    return runs


@pytest.mark.parametrize("fmt", FORMATS)
def test_resume_gives_the_same_losses_bit_for_bit(two_ranks, fmt):
    """On every rank, every step after the resume has exactly the loss of the uninterrupted fit."""
    full, again = rank_losses(two_ranks[fmt]["uninterrupted"]), rank_losses(two_ranks[fmt]["resumed"])
    assert len(full) == len(again) == 2
    for rank in range(2):
        assert sorted(full[rank]) == list(range(1, LAST_STEP + 1))
        assert sorted(again[rank]) == list(range(SAVED_AT + 1, LAST_STEP + 1))
        assert again[rank] == {step: full[rank][step] for step in again[rank]}, f"rank {rank}"


@pytest.mark.parametrize("fmt", FORMATS)
def test_resume_ends_with_the_same_weights_and_optimizer_state_bit_for_bit(two_ranks, fmt):
    """The final checkpoints of the resumed and the uninterrupted fit hold equal tensors (weights,
    AdamW's moments and step counts), the same LR scheduler state and the same epoch."""
    full = full_checkpoint(two_ranks[fmt]["uninterrupted"], LAST_STEP)
    again = full_checkpoint(two_ranks[fmt]["resumed"], LAST_STEP)
    assert again["global_step"] == full["global_step"] == LAST_STEP
    assert again["epoch"] == full["epoch"] == LAST_STEP // STEPS_PER_EPOCH
    assert again["state_dict"].keys() == full["state_dict"].keys()
    for key, value in full["state_dict"].items():
        assert torch.equal(again["state_dict"][key], value), key
    (optimizer,), (optimizer_again,) = full["optimizer_states"], again["optimizer_states"]
    assert optimizer_again["param_groups"] == optimizer["param_groups"]
    assert optimizer_again["state"].keys() == optimizer["state"].keys()
    for i, state in optimizer["state"].items():
        assert optimizer_again["state"][i].keys() == state.keys()
        for key, value in state.items():
            assert torch.equal(optimizer_again["state"][i][key], value), (i, key)
    assert again["lr_schedulers"] == full["lr_schedulers"]


def test_the_checkpoint_format_does_not_change_training(uninterrupted):
    """Saving full or sharded checkpoints every few steps gives the same losses."""
    assert rank_losses(uninterrupted["full"]) == rank_losses(uninterrupted["sharded"])


def test_one_rank_trains_as_two_on_the_same_global_batches(one_rank, uninterrupted):
    """The ground for comparing world sizes ([Note: resumable test data]): from the same initial weights,
    one rank's losses are the 2-rank fit's global-batch losses, to fp32 rounding, until SAVED_AT."""
    for fmt in FORMATS:
        one, two = global_losses(one_rank[fmt]), global_losses(uninterrupted[fmt])
        assert sorted(one) == list(range(1, SAVED_AT + 1))
        assert one == pytest.approx({step: two[step] for step in one}, rel=1e-5, abs=1e-6)


CHANGES = {"2->1, zero3->zero2": ("two_to_one", "uninterrupted"), "1->2, zero2->zero3": ("one_to_two", "one_rank"),
           "2->4": ("two_to_four", "uninterrupted")}
"""Each resume at another world size or plan: the fixture of its fit, and that of the fit it resumed."""


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("change", list(CHANGES))
def test_resume_at_another_world_size_or_plan(request, uninterrupted, change, fmt):
    """The weights training restarts from are the checkpoint's bit for bit; the global-batch losses
    after the resume are the uninterrupted 2-rank fit's to fp32 rounding, and so are the weights
    CHANGED_UNTIL - SAVED_AT steps later (which also needs AdamW's moments and the LR schedule)."""
    resumed_fixture, source_fixture = CHANGES[change]
    run = request.getfixturevalue(resumed_fixture)[fmt]
    source = request.getfixturevalue(source_fixture)[fmt]
    saved = full_checkpoint(source, SAVED_AT)["state_dict"]
    start = torch.load(run / "start.pt")
    assert start.keys() == saved.keys()
    for key, value in saved.items():
        assert torch.equal(start[key], value), key
    reference, losses = global_losses(uninterrupted[fmt]), global_losses(run)
    assert sorted(losses) == list(range(SAVED_AT + 1, CHANGED_UNTIL + 1))
    assert losses == pytest.approx({step: reference[step] for step in losses}, rel=1e-5, abs=1e-6)
    end, expected = full_checkpoint(run, CHANGED_UNTIL), full_checkpoint(uninterrupted[fmt], CHANGED_UNTIL)
    assert end["global_step"] == CHANGED_UNTIL
    for key, value in expected["state_dict"].items():
        torch.testing.assert_close(end["state_dict"][key], value, rtol=1e-4, atol=1e-5, msg=key)
    assert end["lr_schedulers"] == expected["lr_schedulers"] and end["epoch"] == expected["epoch"]


def test_a_weights_only_sharded_checkpoint_holds_no_optimizer_state_and_refuses_a_resume_as_ddp_does(tmp_path):
    """ModelCheckpoint(save_weights_only=True) with state_dict_type="sharded": the directory holds the model
    only, as DDP's file does: converted, it has no optimizer or scheduler state, and a fit resumed from it
    fails with Lightning's own error instead of silently restoring an optimizer state it was told not to keep."""
    def fit_weights_only(ckpt_path=None):
        os.environ["MASTER_PORT"] = str(free_port())
        checkpoints = ModelCheckpoint(dirpath=tmp_path / "ckpt", filename="{step}", every_n_train_steps=EVERY_N,
                                      save_top_k=-1, save_weights_only=True)
        trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=EVERY_N, logger=False,
                            strategy=ElixirStrategy(plan=ZERO3, state_dict_type="sharded"),
                            use_distributed_sampler=False, enable_progress_bar=False, enable_model_summary=False,
                            enable_checkpointing=True, callbacks=[checkpoints], default_root_dir=tmp_path)
        trainer.fit(TinyGPT(seed=0), ckpt_path=ckpt_path)

    fit_weights_only()
    saved = tmp_path / "ckpt" / f"step={EVERY_N}.ckpt"
    convert_sharded_to_full(saved, tmp_path / "full.ckpt")
    full = torch.load(tmp_path / "full.ckpt", weights_only=True)
    assert "optimizer_states" not in full and "lr_schedulers" not in full
    assert set(full["state_dict"]) == set(TinyGPT(seed=0).state_dict())
    with pytest.raises(KeyError, match="contains only the model"):
        fit_weights_only(ckpt_path=saved)
