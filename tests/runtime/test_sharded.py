"""Sharded (DCP) checkpoints: saved under one layout, loaded under another; converted to one full file.

The example GPT trains two steps under a plan, is saved, and trains two more; the reference is those
last two steps. A fresh model of other initial weights under another world size, chunk size, cache
or placement loads the checkpoint: its full state dicts must equal the saved ones bit for bit, and
its next two steps must give the reference's losses. Every world size trains on the same global
batch, split over ranks, so the losses are comparable.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from typing import Any, Optional

import pytest
import torch

from lightning_elixir.demos.gpt import GPT
from lightning_elixir import cli
from lightning_elixir.plan import ElixirPlan
from lightning_elixir.runtime.layout import resolve_specs
from lightning_elixir.runtime.optim import optimizer_step, shard_optimizer
from lightning_elixir.runtime.runtime import ElixirRuntime
from lightning_elixir.runtime.sharded import (ShardedCheckpointError, convert_sharded_to_full, load_sharded,
                                              rank_pieces, save_sharded)
from lightning_elixir.runtime.state_dict import full_optimizer_state_dict, full_state_dict
from tests.distributed import run_distributed
from tests.runtime.workloads import NO_BIAS, loss_of, make_optimizer

GLOBAL_BATCH = 4
SAVED_AFTER = 2
RESUMED = range(SAVED_AFTER, SAVED_AFTER + 2)
"""The steps after the checkpoint, trained by the saving run (the reference) and by each loading run."""
EXTRA = {"epoch": 1, "global_step": SAVED_AFTER, "loops": {"fit_loop": {"epoch_progress": 1}},
         "hyper_parameters": {"lr": 3e-3}}


def make_plan(name: str, model: torch.nn.Module, world_size: int) -> ElixirPlan:
    """zero3: fewest cache blocks; zero2: whole model cached, other chunk size; mixed: device/cpu/nvme chunks."""
    if name == "zero3":
        return ElixirPlan(chunk_numel=4096, cache_blocks="min")
    if name == "zero2":
        return ElixirPlan(chunk_numel=6000, cache_blocks="all")
    specs = resolve_specs(model, ElixirPlan(chunk_numel=4097), world_size)
    placements = ("device", "cpu", "nvme")
    chunks = tuple(dataclasses.replace(s, placement=placements[i % 3]) for i, s in enumerate(specs))
    return ElixirPlan(chunks=chunks, world_size=world_size, cache_blocks="min+1", name="mixed")


def make_model(seed: int, marker: float) -> GPT:
    torch.manual_seed(seed)
    model = GPT(NO_BIAS)
    model.register_buffer("marker", torch.full((4,), marker))  # a buffer the checkpoint must carry
    return model


def build(world_size: int, plan_name: str, seed: int, marker: float, nvme: Optional[str]):
    """A model, its runtime under the named plan, and its sharded optimizer."""
    model = make_model(seed, marker)
    runtime = ElixirRuntime(model, make_plan(plan_name, model, world_size), nvme_path=nvme)
    return model, runtime, shard_optimizer(runtime, make_optimizer(model))


def train(rank: int, world_size: int, model, runtime, optimizer, steps: range) -> list[float]:
    """Each step: this rank's equal part of one global batch; returns this rank's losses."""
    losses = []
    rows = GLOBAL_BATCH // world_size
    for step in steps:
        g = torch.Generator().manual_seed(step)
        x = torch.randint(NO_BIAS.vocab_size, (GLOBAL_BATCH, NO_BIAS.block_size), generator=g)
        y = torch.roll(x, -1, dims=1)
        part = slice(rank * rows, (rank + 1) * rows)
        loss = loss_of(model, x[part], y[part], None)
        losses.append(loss.item())
        loss.backward()
        optimizer_step(runtime, optimizer)
        optimizer.zero_grad()
    return losses


def snapshot(runtime, optimizer) -> dict[str, Any]:
    return {"model": full_state_dict(runtime, everywhere=True),
            "optimizer": full_optimizer_state_dict(runtime, optimizer, everywhere=True)}


def save_runs(rank: int, world_size: int, root: str, plan_names: tuple[str, ...], nvme: Optional[str]) -> dict:
    """Per plan: train, save to ``root/<plan>``, snapshot, train on (the reference)."""
    out = {}
    for name in plan_names:
        model, runtime, optimizer = build(world_size, name, seed=0, marker=7.0, nvme=nvme)
        train(rank, world_size, model, runtime, optimizer, range(SAVED_AFTER))
        save_sharded(runtime, [optimizer], os.path.join(root, name), extra=EXTRA)
        out[name] = snapshot(runtime, optimizer)
        out[name]["losses"] = train(rank, world_size, model, runtime, optimizer, RESUMED)
        runtime.restore_module()
    return out


def resume_runs(rank: int, world_size: int, cases: list[tuple[str, str]], nvme: Optional[str]) -> list[dict]:
    """Per (checkpoint, plan): a differently initialised model loads it, is snapshot and trains on."""
    out = []
    for path, plan_name in cases:
        model, runtime, optimizer = build(world_size, plan_name, seed=1, marker=0.0, nvme=nvme)
        extra = load_sharded(runtime, [optimizer], path)
        result = {**snapshot(runtime, optimizer), "extra": extra}
        result["losses"] = train(rank, world_size, model, runtime, optimizer, RESUMED)
        runtime.restore_module()
        out.append(result)
    return out


def global_losses(per_rank: list[dict]) -> list[float]:
    """The loss of the global batch at each step: the mean of the ranks' equal parts."""
    return [sum(r["losses"][s] for r in per_rank) / len(per_rank) for s in range(len(RESUMED))]


def assert_equal_state(loaded: dict, saved: dict) -> None:
    assert loaded["model"].keys() == saved["model"].keys()
    for key, ref in saved["model"].items():
        assert torch.equal(loaded["model"][key], ref), key
    assert loaded["optimizer"]["param_groups"] == saved["optimizer"]["param_groups"]
    assert loaded["optimizer"]["state"].keys() == saved["optimizer"]["state"].keys()
    for i, ref in saved["optimizer"]["state"].items():
        assert loaded["optimizer"]["state"][i].keys() == ref.keys(), i
        for key, value in ref.items():
            assert torch.equal(torch.as_tensor(loaded["optimizer"]["state"][i][key]), torch.as_tensor(value)), (i, key)


def assert_resumed(loaded: list[dict], saved: list[dict]) -> None:
    """``loaded``: every rank of the loading run; ``saved``: every rank of the saving run."""
    assert_equal_state(loaded[0], saved[0])
    assert loaded[0]["extra"] == EXTRA
    assert global_losses(loaded) == pytest.approx(global_losses(saved), rel=1e-5)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("sharded")


RESUMED_AT_TWO = {"1->2": ("ws1/zero3", "zero3"), "zero3->zero2": ("ws2/zero3", "zero2"),
                  "device->mixed": ("ws2/zero3", "mixed")}


def two_ranks(rank: int, world_size: int, root: str, nvme: str) -> dict:
    """One spawn for every 2-rank case: save ``zero3`` and ``mixed``, then load the RESUMED_AT_TWO cases."""
    saved = save_runs(rank, world_size, os.path.join(root, "ws2"), ("zero3", "mixed"), nvme)
    cases = [(os.path.join(root, path), plan) for path, plan in RESUMED_AT_TWO.values()]
    return {"saved": saved, "resumed": dict(zip(RESUMED_AT_TWO, resume_runs(rank, world_size, cases, nvme)))}


@pytest.fixture(scope="module")
def saved1(root):
    """A checkpoint saved by a single process (no process group)."""
    return [save_runs(0, 1, str(root / "ws1"), ("zero3",), None)["zero3"]]


@pytest.fixture(scope="module")
def at_two(root, saved1, tmp_path_factory):
    results = run_distributed(two_ranks, 2, str(root), str(tmp_path_factory.mktemp("nvme")))
    return {"saved": {name: [r["saved"][name] for r in results] for name in ("zero3", "mixed")},
            "resumed": {case: [r["resumed"][case] for r in results] for case in RESUMED_AT_TWO}}


@pytest.fixture(scope="module")
def saved2(at_two):
    """Checkpoints saved by 2 ranks: ``zero3`` (all on the device) and ``mixed`` (device, cpu and nvme chunks)."""
    return at_two["saved"]


def test_rank_pieces_cover_a_parameter_across_shards():
    assert rank_pieces(offset=100, numel=300, shard_numel=128) == [(0, 0, 28), (1, 28, 156), (2, 156, 284),
                                                                   (3, 284, 300)]
    assert rank_pieces(offset=0, numel=64, shard_numel=128) == [(0, 0, 64)]
    assert rank_pieces(offset=128, numel=0, shard_numel=128) == []


def test_checkpoint_files(root, saved2):
    names = sorted(os.listdir(root / "ws2" / "mixed"))
    assert names == [".metadata", "__0_0.distcp", "__1_0.distcp", "elixir_meta.pt"]


def test_two_ranks_to_one(root, saved2):
    model, runtime, optimizer = build(1, "zero3", seed=1, marker=0.0, nvme=None)
    extra = load_sharded(runtime, [optimizer], root / "ws2" / "zero3")
    loaded = {**snapshot(runtime, optimizer), "extra": extra}
    loaded["losses"] = train(0, 1, model, runtime, optimizer, RESUMED)
    runtime.restore_module()
    assert_resumed([loaded], saved2["zero3"])


def test_model_only_load(root, saved2):
    model, runtime, optimizer = build(1, "zero2", seed=1, marker=0.0, nvme=None)
    extra = load_sharded(runtime, [], root / "ws2" / "zero3")
    loaded = full_state_dict(runtime, everywhere=True)
    runtime.restore_module()
    assert extra == EXTRA and not optimizer.state
    assert all(torch.equal(loaded[k], v) for k, v in saved2["zero3"][0]["model"].items())


@pytest.mark.parametrize("case", list(RESUMED_AT_TWO))
def test_two_rank_loads(at_two, saved1, case):
    saved = saved1 if case == "1->2" else at_two["saved"]["zero3"]
    assert_resumed(at_two["resumed"][case], saved)


def test_two_ranks_to_four_from_mixed_placement(root, saved2, tmp_path):
    loaded = run_distributed(resume_runs, 4, [(str(root / "ws2" / "mixed"), "zero3")], str(tmp_path))
    assert_resumed([r[0] for r in loaded], saved2["mixed"])


def test_convert_gives_a_plain_lightning_checkpoint(root, saved2, tmp_path):
    out = tmp_path / "full.ckpt"
    cli.main(["convert", str(root / "ws2" / "mixed"), str(out)])
    ckpt = torch.load(out, weights_only=False)
    saved = saved2["mixed"][0]
    plain = make_model(seed=1, marker=0.0)
    plain.load_state_dict(ckpt["state_dict"], strict=True)
    assert_equal_state({"model": plain.state_dict(), "optimizer": ckpt["optimizer_states"][0]}, saved)
    assert plain.lm_head.weight is plain.wte.weight
    optimizer = make_optimizer(plain)
    optimizer.load_state_dict(ckpt["optimizer_states"][0])  # a plain torch optimizer takes it as is
    assert {k: ckpt[k] for k in EXTRA} == EXTRA


def _damage(root, tmp_path, kind: str):
    """A copy of a 2-rank checkpoint with one rank's file gone, cut short, or without ``.metadata``."""
    target = tmp_path / "damaged"
    shutil.copytree(root / "ws2" / "zero3", target)
    if kind == "truncated":
        with open(target / "__0_0.distcp", "r+b") as f:
            f.truncate(os.path.getsize(target / "__0_0.distcp") // 2)
    else:
        os.remove(target / kind)
    return target


@pytest.mark.parametrize("kind, message", [("__1_0.distcp", r"missing __1_0\.distcp"), (".metadata", r"no \.metadata"),
                                           ("truncated", r"__0_0\.distcp is shorter")])
def test_damaged_checkpoint_is_refused_before_loading(root, saved2, tmp_path, kind, message):
    path = _damage(root, tmp_path, kind)
    model, runtime, optimizer = build(1, "zero3", seed=1, marker=0.0, nvme=None)
    before = full_state_dict(runtime, everywhere=True)
    with pytest.raises(ShardedCheckpointError, match=message):
        load_sharded(runtime, [optimizer], path)
    after = full_state_dict(runtime, everywhere=True)
    runtime.restore_module()
    assert all(torch.equal(before[k], after[k]) for k in before)
    with pytest.raises(ShardedCheckpointError, match=message):
        convert_sharded_to_full(path, tmp_path / "out.ckpt")
    assert not (tmp_path / "out.ckpt").exists()
