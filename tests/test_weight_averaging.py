"""Lightning's EMAWeightAveraging on sharded parameters, through checkpoints.

The fits of tests/test_resume.py (same model, data and plans; [Note: resumable test data] there),
with ``EMAWeightAveraging`` added ([Note: sharded weight averaging] in lightning_elixir/averaging.py):

- checkpoints hold the average as Lightning lays it out, with DDP's values: the average under
  ``state_dict``, the trained weights under ``current_model_state``, ``n_averaged`` under
  ``averaging_state`` (a sharded checkpoint converted to a full file too);
- a fit resumed from a full or a sharded checkpoint ends with the uninterrupted fit's averaged
  weights bit for bit, and one resumed at another world size and plan to fp32 rounding.
The catalog (tests/catalog) compares EMA and SWA with DDP under every plan, validation included.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Union

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import EMAWeightAveraging, ModelCheckpoint

from lightning_elixir import ElixirPlan, ElixirStrategy
from tests.test_resume import (COLLECTIVE_TIMEOUT, EVERY_N, FORMATS, LAST_STEP, SAVED_AT, ZERO3, RankLosses, TinyGPT,
                               checkpoint_at, fit_on_ranks, full_checkpoint, rank_losses)

DECAY = 0.8
"""Far from 1, so that the average differs clearly from the trained weights within a few steps."""


def fit(run: Path, world_size: int, plan: Union[str, ElixirPlan], state_dict_type: str, max_steps: int,
        ckpt_path: Optional[Path] = None) -> None:
    """tests/test_resume.py's fit with EMA weight averaging (plan "ddp": under DDP); rank 0 saves the module's
    weights after fit (the average: Lightning copies it in at the end) to ``run/final.pt``."""
    (run / "losses").mkdir(parents=True, exist_ok=True)
    checkpoints = ModelCheckpoint(dirpath=run / "ckpt", filename="{step}", every_n_train_steps=EVERY_N,
                                  save_top_k=-1)
    strategy = "ddp" if plan == "ddp" else ElixirStrategy(
        plan=plan, state_dict_type=state_dict_type, collective_timeout_s=COLLECTIVE_TIMEOUT.total_seconds())
    trainer = L.Trainer(accelerator="cpu", devices=world_size, strategy=strategy, max_steps=max_steps,
                        use_distributed_sampler=False, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=run,
                        callbacks=[checkpoints, RankLosses(run / "losses"), EMAWeightAveraging(decay=DECAY)])
    model = TinyGPT(seed=0 if ckpt_path is None else 1)
    trainer.fit(model, ckpt_path=ckpt_path)
    if trainer.is_global_zero:
        torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, run / "final.pt")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict[str, Path]]:
    """Per format, on 2 ranks: DDP to SAVED_AT; ZERO3 to LAST_STEP; the latter resumed from SAVED_AT, on 2
    ranks under ZERO3 and on 1 rank under zero2."""
    root = tmp_path_factory.mktemp("averaging")
    runs = {fmt: {name: root / f"{name}-{fmt}" for name in ("ddp", "uninterrupted", "resumed", "two-to-one")}
            for fmt in FORMATS}
    fits = [(runs["full"]["ddp"], "ddp", "full", SAVED_AT)]
    runs["sharded"]["ddp"] = runs["full"]["ddp"]  # DDP writes one format
    for fmt, run in runs.items():
        fits += [(run["uninterrupted"], ZERO3, fmt, LAST_STEP),
                 (run["resumed"], ZERO3, fmt, LAST_STEP, checkpoint_at(run["uninterrupted"], SAVED_AT))]
    fit_on_ranks(2, fits, fit_fn=fit)
    fit_on_ranks(1, [(run["two-to-one"], "zero2", fmt, LAST_STEP, checkpoint_at(run["uninterrupted"], SAVED_AT))
                     for fmt, run in runs.items()], fit_fn=fit)
    return runs


@pytest.mark.parametrize("fmt", FORMATS)
def test_checkpoint_holds_the_average_as_lightning_does_with_ddps_values(runs, fmt):
    ours, ddp = full_checkpoint(runs[fmt]["uninterrupted"], SAVED_AT), full_checkpoint(runs[fmt]["ddp"], SAVED_AT)
    assert int(ours["averaging_state"]["n_averaged"]) == int(ddp["averaging_state"]["n_averaged"]) == SAVED_AT
    assert ours["averaging_state"].keys() == ddp["averaging_state"].keys()
    for part in ("state_dict", "current_model_state"):
        assert ours[part].keys() == ddp[part].keys(), part
        for key, value in ddp[part].items():
            torch.testing.assert_close(ours[part][key], value, rtol=1e-4, atol=1e-5, msg=f"{part} {key}")
    # the average is not the trained weights (a save that wrote the masters twice cannot pass)
    differ = [k for k, v in ours["state_dict"].items() if v.is_floating_point()
              and not torch.allclose(v, ours["current_model_state"][k], rtol=1e-3, atol=1e-4)]
    assert len(differ) >= len(ours["state_dict"]) // 2, differ


@pytest.mark.parametrize("fmt", FORMATS)
def test_resume_ends_with_the_same_average_bit_for_bit(runs, fmt):
    full, again = runs[fmt]["uninterrupted"], runs[fmt]["resumed"]
    for rank, (want, got) in enumerate(zip(rank_losses(full), rank_losses(again))):
        assert got == {step: want[step] for step in got}, f"rank {rank}"
    want, got = torch.load(full / "final.pt"), torch.load(again / "final.pt")
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert torch.equal(got[key], value), key
    # and the final checkpoints' averages and trained weights match too
    end, end_again = full_checkpoint(full, LAST_STEP), full_checkpoint(again, LAST_STEP)
    for part in ("state_dict", "current_model_state"):
        for key, value in end[part].items():
            assert torch.equal(end_again[part][key], value), f"{part} {key}"


@pytest.mark.parametrize("fmt", FORMATS)
def test_resume_on_one_rank_under_another_plan(runs, fmt):
    want, got = torch.load(runs[fmt]["uninterrupted"] / "final.pt"), torch.load(runs[fmt]["two-to-one"] / "final.pt")
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=1e-4, atol=1e-5, msg=key)
