"""End-to-end runs through the Lightning Trainer: registry, checkpoints, resume (2 spawned CPU ranks)."""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.fabric.utilities.distributed import _destroy_dist_connection
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.strategies import StrategyRegistry

import lightning_elixir
from lightning_elixir.demos.gpt import BigramDataModule, BigramTokens, GPTLightningModule
from lightning_elixir import ElixirPlan, ElixirStrategy, PlanError
from lightning_elixir.runtime.layout import resolve_specs
from tests.distributed import free_port

MODEL = dict(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
DATA = dict(vocab_size=64, block_size=16, batch_size=4, num_samples=24)  # 3 steps per epoch on 2 ranks


class LossRecorder(Callback):
    """Appends (global_step, loss) of rank 0 to a JSON-lines file."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.is_global_zero:
            with open(self.path, "a") as f:
                f.write(json.dumps([trainer.global_step, outputs["loss"].item()]) + "\n")


class DestroyGroupAtExit(Callback):
    """For Lightning's own "ddp_spawn": it leaves a gloo group to the interpreter's finalization, which
    aborts the rank now and then (ElixirStrategy destroys the groups it makes at exit)."""

    def setup(self, trainer, pl_module, stage) -> None:
        atexit.register(_destroy_dist_connection)


def _losses(path) -> list:
    with open(path) as f:
        return [json.loads(line) for line in f]


def _trainer(tmp_path, strategy, max_epochs, callbacks, **kwargs) -> L.Trainer:
    os.environ["MASTER_PORT"] = str(free_port())  # a fresh port per fit; Lightning reuses a set one
    return L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_epochs=max_epochs, logger=False,
                     enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                     default_root_dir=tmp_path, callbacks=callbacks, **kwargs)


def test_strategy_names_are_registered():
    for name in ("elixir", "elixir_zero2", "elixir_zero3", "elixir_spawn", "elixir_notebook"):
        assert name in StrategyRegistry
    assert isinstance(StrategyRegistry.get("elixir_zero3"), ElixirStrategy)


def test_a_notebook_trains_with_elixir_notebook_as_with_ddp_notebook(tmp_path):
    """In an interactive session Lightning accepts only ranks that fork (spawn is refused, as it is for DDP,
    and the error names the strategy that works):
    "elixir_notebook" fits a module defined in ``__main__`` on two ranks, and the weights and loss that come
    back to the notebook's process are DDP's (tests/notebook_session.py)."""
    out = tmp_path / "results.json"
    done = subprocess.run([sys.executable, "-m", "tests.notebook_session", str(out)], capture_output=True, text=True,
                          timeout=300, cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(out.read_text())
    assert results["elixir_spawn"].startswith("ValueError: start_method='spawn' cannot start ranks from an interactive "
                                              "session (a Jupyter notebook): use Trainer(strategy='elixir_notebook')")
    elixir, ddp = results["elixir_notebook"], results["ddp_notebook"]
    assert elixir["loss"] == pytest.approx(ddp["loss"], rel=1e-5)
    for name, initial in results["initial"].items():
        torch.testing.assert_close(torch.tensor(elixir["weights"][name]), torch.tensor(ddp["weights"][name]),
                                   rtol=1e-5, atol=1e-6)
        assert not torch.equal(torch.tensor(elixir["weights"][name]), torch.tensor(initial)), name


def test_pytorch_lightning_trainer_runs_the_mirrored_strategy():
    pl = pytest.importorskip("pytorch_lightning")
    from pytorch_lightning.strategies import StrategyRegistry as PLRegistry

    assert {"elixir", "elixir_zero2", "elixir_zero3"} <= set(PLRegistry)

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            return torch.nn.functional.mse_loss(self.layer(batch[0]), batch[1])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = torch.utils.data.TensorDataset(torch.randn(16, 4), torch.randn(16, 1))
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy="elixir_zero3", max_steps=3, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Tiny(), torch.utils.data.DataLoader(data, batch_size=4))
    assert trainer.global_step == 3
    assert type(trainer.strategy).__module__ == "lightning_elixir.mirror.strategy"


def test_bad_plan_input_raises_before_any_work(tmp_path):
    with pytest.raises(PlanError, match="unknown plan key"):
        ElixirStrategy(plan={"chunk_size": 1024})
    with pytest.raises(PlanError, match="does not exist"):
        ElixirStrategy(plan=str(tmp_path / "missing.json"))
    path = tmp_path / "plan.json"
    ElixirPlan(chunk_numel=4096, cache_blocks=2).to_json(path)
    assert ElixirStrategy(plan=str(path)).plan == ElixirPlan(chunk_numel=4096, cache_blocks=2)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Two epochs uninterrupted, and one epoch + resume from its checkpoint for the second."""
    tmp = tmp_path_factory.mktemp("fit")
    full_log, resumed_log = tmp / "full.jsonl", tmp / "resumed.jsonl"
    L.seed_everything(0)
    model = GPTLightningModule(**MODEL)
    ckpt = ModelCheckpoint(dirpath=tmp / "ckpt", save_last=True, save_top_k=0)
    _trainer(tmp / "a", "elixir_spawn", 2, [LossRecorder(str(full_log)), ckpt]).fit(model, BigramDataModule(**DATA))
    L.seed_everything(0)
    first = GPTLightningModule(**MODEL)
    one = ModelCheckpoint(dirpath=tmp / "one", save_last=True, save_top_k=0)
    _trainer(tmp / "b", "elixir_spawn", 1, [one]).fit(first, BigramDataModule(**DATA))
    L.seed_everything(0)
    second = GPTLightningModule(**MODEL)
    _trainer(tmp / "c", "elixir_spawn", 2, [LossRecorder(str(resumed_log))]).fit(
        second, BigramDataModule(**DATA), ckpt_path=str(tmp / "one" / "last.ckpt"))
    return {"model": model, "ckpt": tmp / "ckpt" / "last.ckpt", "full": _losses(full_log),
            "resumed": _losses(resumed_log)}


def test_checkpoint_loads_into_plain_lightning_module(trained):
    checkpoint = torch.load(trained["ckpt"], weights_only=False)
    plain = GPTLightningModule(**MODEL)
    plain.load_state_dict(checkpoint["state_dict"])  # strict: the original names, tied weights included
    x = torch.randint(64, (2, 16))
    torch.testing.assert_close(plain(x), trained["model"](x))
    opt = checkpoint["optimizer_states"][0]
    params = list(plain.parameters())
    flat = [i for group in opt["param_groups"] for i in group["params"]]
    assert sorted(flat) == list(range(len(params)))
    order = [p for g in plain.configure_optimizers().param_groups for p in g["params"]]
    for i, p in zip(flat, order):
        assert opt["state"][i]["exp_avg"].shape == p.shape


def test_resume_continues_with_the_same_losses(trained):
    full, resumed = dict(map(tuple, trained["full"])), dict(map(tuple, trained["resumed"]))
    assert sorted(resumed) == [4, 5, 6]
    for step, loss in resumed.items():
        assert loss == pytest.approx(full[step], rel=1e-5)


def test_trainer_with_accumulation_and_clipping_tracks_ddp(tmp_path):
    """The same fit through Lightning's DDP and through Elixir: clipping and accumulation go through
    ElixirPrecision, the optimizer and LR scheduler are the user's objects."""
    logs = {}
    for strategy in ("ddp_spawn", "elixir_spawn"):
        logs[strategy] = tmp_path / f"{strategy}.jsonl"
        L.seed_everything(0)
        model = GPTLightningModule(**MODEL)
        trainer = _trainer(tmp_path / strategy, strategy, 1, [LossRecorder(str(logs[strategy])), DestroyGroupAtExit()],
                           accumulate_grad_batches=2, gradient_clip_val=0.05, max_steps=3)
        trainer.fit(model, BigramDataModule(**{**DATA, "num_samples": 48}))
    ddp, elixir = _losses(logs["ddp_spawn"]), _losses(logs["elixir_spawn"])
    assert len(ddp) == len(elixir) == 6
    for (step_a, a), (step_b, b) in zip(ddp, elixir):
        assert step_a == step_b and a == pytest.approx(b, rel=1e-4)


class _Linear(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 2)

    def training_step(self, batch, batch_idx):
        return torch.nn.functional.mse_loss(self.layer(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit_one_process(strategy, empty_init: bool = False, module: type = _Linear) -> tuple[L.Trainer, _Linear]:
    # the same batches under every strategy: no DistributedSampler (it reorders them)
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        use_distributed_sampler=False)
    torch.manual_seed(0)
    with trainer.init_module(empty_init=True) if empty_init else contextlib.nullcontext():
        model = module()
    assert model.layer.weight.is_meta == empty_init
    data = torch.utils.data.TensorDataset(torch.randn(8, 4), torch.randn(8, 2))
    trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=4))
    return trainer, model


def test_teardown_gives_the_module_back_or_keeps_the_shards_when_asked():
    from lightning_elixir.runtime.access import OutsideStepError
    from lightning_elixir.runtime.params import ChunkedParameter

    _, plain = _fit_one_process(ElixirStrategy(plan="zero3"))
    assert all(type(p) is torch.nn.Parameter for p in plain.parameters())
    _, reference = _fit_one_process("auto")
    torch.testing.assert_close(plain.layer.weight, reference.layer.weight)

    trainer, sharded = _fit_one_process(ElixirStrategy(plan="zero3", unshard_on_teardown=False))
    assert all(isinstance(p, ChunkedParameter) for p in sharded.parameters())
    with pytest.raises(OutsideStepError, match="gathered_params"):
        sharded.layer.weight.sum()
    with trainer.strategy.gathered_params():
        torch.testing.assert_close(sharded.layer.weight.detach(), reference.layer.weight.detach())


class _ClampedAfterStep(_Linear):
    def optimizer_step(self, *args, **kwargs):
        super().optimizer_step(*args, **kwargs)
        with torch.no_grad():
            self.layer.weight.clamp_(-0.1, 0.1)
            self.seen = float(self.layer.weight.abs().max())


def test_writes_after_the_step_in_an_optimizer_step_override_are_kept_and_the_hook_given_back():
    _, reference = _fit_one_process("auto", module=_ClampedAfterStep)
    _, model = _fit_one_process(ElixirStrategy(plan="zero3"), module=_ClampedAfterStep)
    assert "optimizer_step" not in model.__dict__  # the module's own method again
    assert model.seen == reference.seen == pytest.approx(0.1)  # read after the write, the box reached
    torch.testing.assert_close(model.layer.weight, reference.layer.weight)


def test_a_model_built_without_memory_starts_from_the_weights_of_a_real_build():
    _, reference = _fit_one_process("auto")
    _, deferred = _fit_one_process(ElixirStrategy(plan="zero3"), empty_init=True)
    torch.testing.assert_close(deferred.layer.weight, reference.layer.weight, rtol=0, atol=0)
    torch.testing.assert_close(deferred.layer.bias, reference.layer.bias, rtol=0, atol=0)


def _placed(placements: tuple[str, ...]) -> ElixirPlan:
    """The default packing of the test GPT on 2 ranks, chunk i placed at placements[i % len]."""
    specs = resolve_specs(GPTLightningModule(**MODEL), ElixirPlan(chunk_numel=4097), world_size=2)
    chunks = tuple(dataclasses.replace(s, placement=placements[i % len(placements)]) for i, s in enumerate(specs))
    return ElixirPlan(chunks=chunks, world_size=2, cache_blocks="min+1")


def test_offloaded_plan_trains_through_the_trainer_as_the_device_plan(tmp_path):
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    logs = {}
    for name, placements in (("device", ("device",)), ("mixed", ("cpu", "device", "nvme"))):
        log = tmp_path / f"{name}.jsonl"
        L.seed_everything(0)
        ckpt = ModelCheckpoint(dirpath=tmp_path / name, save_last=True, save_top_k=0)
        strategy = ElixirStrategy(plan=_placed(placements), start_method="spawn", nvme_path=nvme)
        _trainer(tmp_path / name, strategy, 1, [LossRecorder(str(log)), ckpt], gradient_clip_val=0.5).fit(
            GPTLightningModule(**MODEL), BigramDataModule(**DATA))
        logs[name] = _losses(log)
        logs[name + "-state"] = torch.load(tmp_path / name / "last.ckpt", weights_only=False)["state_dict"]
    assert [s for s, _ in logs["mixed"]] == [s for s, _ in logs["device"]] == [1, 2, 3]
    for (_, a), (_, b) in zip(logs["mixed"], logs["device"]):
        assert a == pytest.approx(b, rel=1e-6)
    for key, ref in logs["device-state"].items():
        torch.testing.assert_close(logs["mixed-state"][key], ref, rtol=1e-6, atol=1e-7)
    assert not any(nvme.iterdir()), "teardown leaves no NVMe files"


def test_an_unusable_nvme_path_fails_at_construction(tmp_path):
    with pytest.raises(ValueError, match=str(tmp_path / "missing")):
        ElixirStrategy(nvme_path=tmp_path / "missing")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match=str(tmp_path / "file")):
        ElixirStrategy(nvme_path=tmp_path / "file")
    with pytest.raises(ValueError, match="host_memory_limit"):
        ElixirStrategy(plan="zero3", host_memory_limit="1GiB")


def test_an_nvme_path_that_a_fixed_plan_never_uses_is_named(tmp_path):
    with pytest.warns(UserWarning, match="places no chunk on NVMe"):
        ElixirStrategy(plan="zero3", nvme_path=tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ElixirStrategy(plan="auto", nvme_path=tmp_path)  # the search may place chunks there


class TwoValidationSets(BigramDataModule):
    """Two validation loaders of uneven lengths: 7 and 5 samples, batches of 2, over 2 ranks."""

    def val_dataloader(self):
        sets = [BigramTokens(64, 16, n, seed) for n, seed in ((7, 1), (5, 2))]
        return [torch.utils.data.DataLoader(s, batch_size=2) for s in sets]


class MultiValidation(GPTLightningModule):
    def validation_step(self, batch, batch_idx, dataloader_idx=0):
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self(x).flatten(0, 1), y.flatten())
        self.log(f"val_loss_{dataloader_idx}", loss, sync_dist=True, add_dataloader_idx=False)


def test_validation_with_several_uneven_dataloaders_completes(tmp_path):
    L.seed_everything(0)
    trainer = _trainer(tmp_path, "elixir_spawn", 1, [], limit_train_batches=2)
    trainer.limit_val_batches = 1.0
    trainer.fit(MultiValidation(**MODEL), TwoValidationSets(**DATA))
    metrics = trainer.callback_metrics
    assert {"val_loss_0", "val_loss_1"} <= set(metrics)
    assert all(torch.isfinite(metrics[k]) for k in ("val_loss_0", "val_loss_1"))


class _Table(torch.nn.Module):
    """A buffer its __init__ computes, and no reset_parameters() to compute it again."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("table", torch.arange(2.0))


class _MetaOutsideTheStrategy(L.LightningModule):
    """Builds part of its model on the plain meta device itself, where nothing records its values."""

    def __init__(self) -> None:
        super().__init__()
        with torch.device("meta"):
            self.layer = torch.nn.Linear(4, 2)
            self.scale = _Table()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x) * self.scale.table, y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_an_unmaterialisable_meta_module_fails_with_its_own_error():
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(8, 4), torch.randn(8, 2))
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=ElixirStrategy(plan="zero3"), max_steps=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    # Not "Cannot copy out of meta tensor" from teardown moving the half-built module to the CPU.
    with pytest.raises(TypeError, match="_Table has meta buffers but no reset_parameters"):
        trainer.fit(_MetaOutsideTheStrategy(), torch.utils.data.DataLoader(data, batch_size=4))


def test_a_plan_that_would_evict_at_one_rank_says_it_keeps_every_chunk():
    """[Note: a world of one]: the running plan's description says why the asked cache was not used."""
    from lightning_elixir.runtime.runtime import ElixirRuntime
    from lightning_elixir.strategy import describe_runtime

    torch.manual_seed(0)
    module = GPTLightningModule(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
    runtime = ElixirRuntime(module, ElixirPlan(chunk_numel=4096, cache_blocks="min+1", prefetch_depth=1))
    assert runtime.resident and len(runtime.public) > 2
    assert "blocks=all (asked min+1; one rank: each shard is its chunk) prefetch=1" in describe_runtime(runtime)


def test_the_fp16_loss_scale_crosses_to_and_from_lightnings_mixed_precision_checkpoints():
    """A checkpoint saved with 16-mixed under this strategy holds the scale as Lightning's plugin keeps it
    (a torch GradScaler's state under "MixedPrecision"), and one saved by that plugin gives us its scale."""
    from lightning_elixir import ElixirPrecision

    ours = ElixirPrecision("16-mixed")
    ours.scaler.scale, ours.scaler._good_steps = 2.0 ** 13, 7
    checkpoint = {"ElixirPrecision": ours.state_dict()}
    ours.on_save_checkpoint(checkpoint)
    theirs = torch.amp.GradScaler("cpu")
    theirs.load_state_dict(checkpoint["MixedPrecision"])
    assert theirs.get_scale() == 2.0 ** 13 and theirs._get_growth_tracker() == 7

    saved = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10).state_dict()  # as Lightning's MixedPrecision saves it
    resumed = ElixirPrecision("16-mixed")
    resumed.on_load_checkpoint({"MixedPrecision": saved})
    assert resumed.scaler.scale == 2.0 ** 10 and resumed.scaler._good_steps == 0
    ours_first = ElixirPrecision("16-mixed")  # our own state wins where both are there
    ours_first.on_load_checkpoint({**checkpoint, "MixedPrecision": saved})
    ours_first.load_state_dict(checkpoint["ElixirPrecision"])
    assert ours_first.scaler.scale == 2.0 ** 13


class _FailsOnce(_Linear):
    """Raises in its second training step the first time it is fitted."""

    failed = False

    def training_step(self, batch, batch_idx):
        if batch_idx == 1 and not self.failed:
            self.failed = True
            raise RuntimeError("a bug in the step")
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("placement", ["device", "nvme"])
def test_a_module_whose_fit_failed_is_fitted_again_from_where_it_stopped(tmp_path, placement):
    """The failed stage keeps the module's shards, NVMe files included, and the next fit of the module gathers
    them back: it ends where the same fits of a device plan end."""
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    torch.manual_seed(0)
    model = _FailsOnce()
    specs = resolve_specs(model, ElixirPlan(), world_size=1)
    plan = ElixirPlan(chunks=tuple(dataclasses.replace(s, placement=placement) for s in specs), world_size=1)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 4), torch.randn(8, 2)),
                                       batch_size=4)
    for attempt in range(2):
        os.environ["MASTER_PORT"] = str(free_port())
        trainer = L.Trainer(accelerator="cpu", devices=1, strategy=ElixirStrategy(plan=plan, nvme_path=nvme),
                            max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, use_distributed_sampler=False)
        with pytest.raises(RuntimeError, match="a bug in the step") if attempt == 0 else contextlib.nullcontext():
            trainer.fit(model, data)
    assert all(type(p) is torch.nn.Parameter for p in model.parameters())
    assert not any(nvme.iterdir()), "the last fit's teardown leaves no NVMe files"
    torch.manual_seed(0)
    reference = _Linear()
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for x, y in [*list(data)[:1], *list(data)]:  # the failed fit's one step, then the second fit's two
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(reference.layer(x), y).backward()
        optimizer.step()
    torch.testing.assert_close(model.layer.weight, reference.layer.weight)
    torch.testing.assert_close(model.layer.bias, reference.layer.bias)


def test_a_rank_started_for_the_strategy_gets_its_share_of_the_cores_as_under_ddp(monkeypatch):
    """Ranks that torchrun, SLURM or the script's own copies start: each runs cores // ranks threads, as DDP
    gives them, not every core beside the other ranks (which also changed the order of CPU reductions)."""
    from lightning.fabric.plugins.environments import LightningEnvironment

    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    environment = LightningEnvironment()
    assert environment.creates_processes_externally
    strategy = ElixirStrategy(plan="zero2", parallel_devices=[torch.device("cpu")] * 2,
                              cluster_environment=environment)
    strategy._configure_launcher()
    before = torch.get_num_threads()
    try:
        threads = strategy.launcher.launch(torch.get_num_threads)
        expected = max(1, len(os.sched_getaffinity(0)) // 2)
        assert threads == expected and os.environ["OMP_NUM_THREADS"] == str(expected)
    finally:
        torch.set_num_threads(before)
