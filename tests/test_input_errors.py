"""Wrong inputs fail at construction, before any work, with a message that says what to do."""

from __future__ import annotations

import dataclasses
import json
from datetime import timedelta

import lightning as L
import pytest
import torch
from lightning.pytorch.core.optimizer import _MockOptimizer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_elixir import ElixirPlan, ElixirStrategy, PlanError
from lightning_elixir.plan import ChunkSpec, check_private_params, resolve_plan
from lightning_elixir.profile.types import ProfileError
from lightning_elixir.runtime.cache import CacheTooSmallError
from lightning_elixir.runtime.optim import shard_optimizer
from lightning_elixir.runtime.runtime import ElixirRuntime
from lightning_elixir.search.budget import check_memory_limit, parse_memory_limit
from tests.plans import on_host
from tests.search.profiles import hardware

# ---- 1. configure_optimizers returning None ---------------------------------------------------


class NoOptimizer(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(8, 8)
        self.steps = 0

    def training_step(self, batch, batch_idx):
        self.steps += 1
        return self.layer(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return None

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.randn(8, 8)), batch_size=2)


def test_mock_optimizer_is_returned_unchanged():
    model = nn.Linear(8, 8)
    runtime = ElixirRuntime(model, ElixirPlan())
    mock = _MockOptimizer()
    params = [p for group in mock.param_groups for p in group["params"]]
    assert shard_optimizer(runtime, mock) is mock
    assert [p for group in mock.param_groups for p in group["params"]] == params


def test_module_without_optimizer_trains_without_updates_like_ddp():
    torch.manual_seed(0)
    model = NoOptimizer()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy="elixir_zero2", max_steps=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    with pytest.warns(UserWarning, match="configure_optimizers"):  # Lightning's own note, as under DDP
        trainer.fit(model)
    assert model.steps == 2  # forward and backward ran; nothing stepped
    after = trainer.strategy.lightning_module_state_dict()
    assert after.keys() == before.keys()
    for name, value in before.items():
        torch.testing.assert_close(after[name], value, rtol=0, atol=0)


def test_module_without_optimizer_saves_a_checkpoint(tmp_path):
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy="elixir_zero2", max_steps=1, logger=False,
                        default_root_dir=tmp_path, enable_progress_bar=False, enable_model_summary=False)
    with pytest.warns(UserWarning, match="configure_optimizers"):
        trainer.fit(NoOptimizer())
    assert list((tmp_path / "checkpoints").glob("*.ckpt"))


# ---- 2. too small an int cache ----------------------------------------------------------------


def test_too_small_cache_counts_the_chunks_acquired_together():
    # One module whose weight and bias land in two chunks: both are needed at once, neither is
    # pinned yet when the second is gathered.
    model = nn.Linear(64, 64)
    runtime = ElixirRuntime(model, on_host(model, ElixirPlan(chunk_numel=64 * 64, cache_blocks=1)))
    assert len(runtime.public) == 2
    with pytest.raises(CacheTooSmallError, match=r"cache_blocks=1 is too small: 2 chunks \[0, 1\] are needed at once; "
                                                 r"set cache_blocks to at least 2, or use cache_blocks='min' .*grown as "
                                                 r"needed.*cache_blocks='all'"):
        model(torch.randn(2, 64))


def test_enough_blocks_and_min_run():
    for blocks in (2, "min"):
        model = nn.Linear(64, 64)
        ElixirRuntime(model, ElixirPlan(chunk_numel=64 * 64, cache_blocks=blocks))
        model(torch.randn(2, 64)).sum().backward()


# ---- 3. plan names ---------------------------------------------------------------------------


def test_unknown_plan_name_lists_the_valid_ones():
    with pytest.raises(PlanError, match=r"plan='bogus' is not a plan name \(valid: 'auto', 'zero2', 'zero3'\) "
                                        r"nor an existing plan JSON file$"):
        ElixirStrategy(plan="bogus")


@pytest.mark.parametrize("name, meant", [("zero-3", "zero3"), ("elixir_zero2", "zero2"), ("Auto", "auto")])
def test_near_miss_plan_name_suggests_the_name(name, meant):
    with pytest.raises(PlanError, match=f"not a plan name.*did you mean '{meant}'"):
        resolve_plan(name)


def test_missing_plan_file_says_so_and_lists_the_names(tmp_path):
    with pytest.raises(PlanError, match=r"plan file .*missing\.json' does not exist; plan= takes a plan name "
                                        r"\('auto', 'zero2', 'zero3'\)"):
        resolve_plan(str(tmp_path / "missing.json"))
    with pytest.raises(PlanError, match="does not exist"):
        resolve_plan(tmp_path / "missing.json")  # an os.PathLike


def test_plan_of_another_type_is_rejected():
    with pytest.raises(PlanError, match=r"plan must be 'auto', 'zero2', 'zero3', an ElixirPlan, a dict.*got int 3"):
        ElixirStrategy(plan=3)


def test_plan_from_file_and_json_text(tmp_path):
    plan = ElixirPlan(chunk_numel=4096, cache_blocks=2, name="mine")
    path = tmp_path / "plan.json"
    plan.to_json(path)
    assert resolve_plan(str(path)) == plan
    assert resolve_plan(path) == plan
    assert resolve_plan(plan.to_json()) == plan
    with pytest.raises(PlanError, match="must be an object"):
        resolve_plan("[1, 2]")


# ---- 4. types of plan fields -----------------------------------------------------------------

BAD_FIELDS = [
    ({"chunk_numel": "big"}, r"plan field 'chunk_numel' must be an int >= 1 or None, got str 'big'"),
    ({"chunk_numel": 1.5e6}, r"plan field 'chunk_numel' must be an int >= 1 or None, got float 1500000.0"),
    ({"chunk_numel": True}, r"plan field 'chunk_numel' must be an int >= 1 or None, got bool True"),
    ({"chunk_numel": 0}, r"plan field 'chunk_numel' must be an int >= 1 or None, got 0"),
    ({"prefetch_depth": 1.5}, r"plan field 'prefetch_depth' must be an int >= 0, got float 1.5"),
    ({"prefetch_depth": -1}, r"plan field 'prefetch_depth' must be an int >= 0, got -1"),
    ({"prefetch_depth": None}, r"plan field 'prefetch_depth' must be an int >= 0, got NoneType None"),
    ({"cache_blocks": [1]}, r"plan field 'cache_blocks' must be an int >= 1, 'all', 'min' or 'min\+K' \(K an int\), got list \[1\]"),
    ({"cache_blocks": "max"}, r"plan field 'cache_blocks' must be an int >= 1, 'all', 'min' or 'min\+K' \(K an int\), got str 'max'"),
    ({"cache_blocks": "min+"}, r"plan field 'cache_blocks' must be an int >= 1, 'all', 'min' or 'min\+K' \(K an int\), "
                               r"got str 'min\+'"),
    ({"cache_blocks": "min-1"}, r"plan field 'cache_blocks' must be .*got str 'min-1'"),
    ({"cache_blocks": False}, r"plan field 'cache_blocks' must be an int >= 1, 'all', 'min' or 'min\+K' \(K an int\), got bool False"),
    ({"cache_blocks": 0}, r"plan field 'cache_blocks' must be an int >= 1, got 0"),
    ({"reduce_in_fp32": "yes"}, r"plan field 'reduce_in_fp32' must be a bool \(true/false\), got str 'yes'"),
    ({"reduce_in_fp32": 1}, r"plan field 'reduce_in_fp32' must be a bool \(true/false\), got int 1"),
    ({"name": 7}, r"plan field 'name' must be a string, got int 7"),
    ({"world_size": "2"}, r"plan field 'world_size' must be an int >= 1 or None, got str '2'"),
    ({"world_size": 0}, r"plan field 'world_size' must be an int >= 1 or None, got 0"),
    ({"chunks": "a,b"}, r"plan field 'chunks' must be a list of chunk objects, got str 'a,b'"),
    ({"chunks": {"params": ["a"], "numel": 2}}, r"plan field 'chunks' must be a list of chunk objects, got dict"),
    ({"chunks": [1], "world_size": 1}, r"chunk 0 of the plan must be an object with keys "
                                       r"\['numel', 'params', 'placement', 'private'\], got int 1"),
    ({"chunks": [{"params": "a", "numel": "x"}], "world_size": 1},
     r"chunk 0 of the plan: chunk field 'params' must be a list of parameter names \(strings\), got str 'a'"),
    ({"chunks": [{"params": ["a", 1], "numel": 2}], "world_size": 1},
     r"chunk 0 of the plan: chunk field 'params' must be a list of parameter names \(strings\), got int 1"),
    ({"chunks": [{"params": ["a"], "numel": 2}, {"params": ["b"], "numel": "x"}], "world_size": 1},
     r"chunk 1 of the plan: chunk field 'numel' must be an int >= 1, got str 'x'"),
    ({"chunks": [{"params": ["a"], "numel": 2.0}], "world_size": 1},
     r"chunk 0 of the plan: chunk field 'numel' must be an int >= 1, got float 2.0"),
    ({"chunks": [{"params": ["a"], "numel": 2, "private": "no"}], "world_size": 1},
     r"chunk 0 of the plan: chunk field 'private' must be a bool \(true/false\), got str 'no'"),
    ({"chunks": [{"params": ["a"], "numel": 2, "placement": 0}], "world_size": 1},
     r"chunk 0 of the plan: chunk field 'placement' must be one of \('device', 'cpu', 'nvme'\), got int 0"),
    ({"chunks": [{"params": ["a"]}], "world_size": 1}, r"chunk 0 of the plan: .*numel.*needs at least 'params' and 'numel'"),
]


@pytest.mark.parametrize("data, message", BAD_FIELDS)
def test_wrongly_typed_plan_fields_name_field_type_and_value(data, message):
    with pytest.raises(PlanError, match=message):
        ElixirPlan.from_dict(data)
    with pytest.raises(PlanError, match=message):
        ElixirPlan.from_json(json.dumps(data))
    with pytest.raises(PlanError, match=message):
        ElixirStrategy(plan=data)


def test_wrongly_typed_fields_in_python_too():
    with pytest.raises(PlanError, match=r"plan field 'chunks' must hold ChunkSpecs \(JSON: objects\), got dict"):
        ElixirPlan(chunks=[{"params": ["a"], "numel": 2}], world_size=1)
    with pytest.raises(PlanError, match=r"chunk field 'params' must be a list of parameter names \(strings\), got str"):
        ChunkSpec("a", 2)
    with pytest.raises(PlanError, match=r"chunk field 'params' must be a list .*got set"):
        ChunkSpec({"a", "b"}, 2)  # no order to pack in
    with pytest.raises(PlanError, match="a plan must be a dict"):
        ElixirPlan.from_dict([("chunk_numel", 4)])


def test_valid_plans_round_trip_through_json():
    plan = ElixirPlan(chunk_numel=128, cache_blocks=2, prefetch_depth=0, world_size=2, reduce_in_fp32=False,
                      chunks=[ChunkSpec(["a", "b"], 128), ChunkSpec(("c",), 8, private=True)], name="mine")
    assert isinstance(plan.chunks, tuple) and isinstance(plan.chunks[0].params, tuple)
    assert ElixirPlan.from_json(plan.to_json()) == plan
    assert ElixirPlan.from_dict(json.loads(json.dumps(plan.to_dict()))) == plan
    assert dataclasses.replace(plan, cache_blocks="min").cache_blocks == "min"
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.cache_blocks = 3  # type: ignore[misc]


# ---- 5. planning inputs and private_params ---------------------------------------------------------


@pytest.mark.parametrize("limit", [2**30, 0.8, 1.0, "40GiB", "512MB", "80%", "0.5", "40 G"])
def test_valid_memory_limits_are_accepted_with_auto(limit):
    check_memory_limit(limit)
    assert ElixirStrategy(plan="auto", device_memory_limit=limit).device_memory_limit == limit
    parse_memory_limit(limit, 1 << 40)  # and the device-time parser agrees


@pytest.mark.parametrize("limit, message", [
    ("40 Gigs", "cannot read device_memory_limit '40 Gigs'"),
    ("-1GiB", "cannot read device_memory_limit"),
    (0, "device_memory_limit must be positive"),
    (-5, "device_memory_limit must be positive"),
    ("0GiB", "device_memory_limit must be positive"),
    (1.5, r"fraction of device memory in \(0, 1\]"),
    (0.0, r"fraction of device memory in \(0, 1\]"),
    ("150%", r"fraction of device memory in \(0, 1\]"),
    (True, "device_memory_limit must be bytes as an int"),
    ([1], "device_memory_limit must be bytes as an int"),
])
def test_malformed_memory_limit_fails_at_construction(limit, message):
    with pytest.raises(ValueError, match=message):
        ElixirStrategy(plan="auto", device_memory_limit=limit)


@pytest.mark.parametrize("plan, shown", [("zero2", "plan='zero2'"), ("zero3", "plan='zero3'"),
                                         (ElixirPlan(cache_blocks=2), "a fixed plan"),
                                         ({"cache_blocks": 2}, "a fixed plan")])
def test_planning_inputs_with_a_fixed_plan_are_refused(plan, shown, tmp_path):
    with pytest.raises(ValueError, match=f"device_memory_limit='40GiB' is used by plan='auto' to choose a plan and "
                                         rf"has no effect on {shown}: remove it, or use plan='auto'"):
        ElixirStrategy(plan=plan, device_memory_limit="40GiB")
    with pytest.raises(ValueError, match=f"hardware_profile is used by plan='auto' to choose a plan and has no "
                                         rf"effect on {shown}: remove it, or use plan='auto'"):
        ElixirStrategy(plan=plan, hardware_profile=hardware())


def test_malformed_limit_is_reported_before_the_fixed_plan():
    with pytest.raises(ValueError, match="cannot read device_memory_limit"):
        ElixirStrategy(plan="zero2", device_memory_limit="lots")


def test_hardware_profile_is_loaded_at_construction(tmp_path):
    hw = hardware()
    path = tmp_path / "hw.json"
    path.write_text(hw.to_json())
    assert ElixirStrategy(plan="auto", hardware_profile=str(path)).hardware_profile == hw
    assert ElixirStrategy(plan="auto", hardware_profile=hw).hardware_profile is hw
    with pytest.raises(ProfileError, match="does not exist"):
        ElixirStrategy(plan="auto", hardware_profile=str(tmp_path / "missing.json"))
    with pytest.raises(TypeError, match="hardware_profile must be a HardwareProfile or the path of its JSON file, got dict"):
        ElixirStrategy(plan="auto", hardware_profile={"device_name": "cpu"})


def test_private_params_must_be_names_not_one_string():
    with pytest.raises(TypeError, match=r"got the string 'emb.weight'; write private_params=\['emb.weight'\]"):
        ElixirStrategy(plan="zero2", private_params="emb.weight")
    with pytest.raises(TypeError, match=r"private_params must be a list of parameter names \(strings\), got int 1"):
        ElixirStrategy(plan="zero2", private_params=["emb.weight", 1])
    with pytest.raises(TypeError, match="private_params must be a list of parameter names, got NoneType"):
        ElixirStrategy(plan="zero2", private_params=None)
    assert ElixirStrategy(plan="zero2", private_params=["a", "b"]).private_params == ("a", "b")
    assert check_private_params(iter(["a"]), "auto") == ("a",)


def test_private_params_in_a_public_chunk_of_the_layout_are_refused():
    plan = ElixirPlan(chunks=(ChunkSpec(("a", "b"), 128), ChunkSpec(("c",), 8, private=True)), world_size=1)
    with pytest.raises(PlanError, match=r"private_params \['b'\] sit in public chunks of the plan's layout; give each "
                                        r"its own private chunk"):
        ElixirStrategy(plan=plan, private_params=["b", "c"])
    assert ElixirStrategy(plan=plan, private_params=["c"]).private_params == ("c",)


# ---- 6. the other constructor inputs -----------------------------------------------------------------


def test_other_constructor_inputs():
    with pytest.raises(ValueError, match=r"start_method='threads': use 'popen' \(a script run once per rank; "
                                         r"torchrun, SLURM\), 'fork' \(a notebook\), 'spawn' or 'forkserver'"):
        ElixirStrategy(start_method="threads")
    with pytest.raises(ValueError, match="start_method=None: use 'popen'"):
        ElixirStrategy(start_method=None)
    with pytest.raises(ValueError, match="process_group_backend=3: use a torch.distributed backend name"):
        ElixirStrategy(process_group_backend=3)
    with pytest.raises(ValueError, match="process_group_backend='': use a torch.distributed backend name"):
        ElixirStrategy(process_group_backend="")
    with pytest.raises(ValueError, match=r"timeout=60: use a positive datetime.timedelta"):
        ElixirStrategy(timeout=60)
    with pytest.raises(ValueError, match=r"use a positive datetime.timedelta"):
        ElixirStrategy(timeout=timedelta(0))
    strategy = ElixirStrategy(process_group_backend="gloo", timeout=timedelta(minutes=5), start_method="spawn")
    assert strategy._timeout == timedelta(minutes=5)


def test_a_bad_host_memory_limit_is_named_in_its_error():
    with pytest.raises(ValueError, match="cannot read host_memory_limit '40 Gigs'"):
        ElixirStrategy(host_memory_limit="40 Gigs")
    with pytest.raises(ValueError, match="host_memory_limit must be positive"):
        ElixirStrategy(host_memory_limit=0)


# ---- 7. parameters given to the optimizer later; callbacks refused at setup ---------------------------------------


class Backbone(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Linear(8, 8)
        self.head = nn.Linear(8, 2)

    def training_step(self, batch, batch_idx):
        return self.head(self.backbone(batch[0])).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.head.parameters(), lr=0.1)

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.randn(8, 8)), batch_size=2)


def test_callbacks_that_read_weights_at_epoch_ends_are_refused_before_training():
    from lightning.pytorch.callbacks import ModelPruning

    trainer = L.Trainer(accelerator="cpu", devices=1, strategy="elixir", max_epochs=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[ModelPruning("l1_unstructured", amount=0.5)])
    model = Backbone()
    with pytest.raises(ValueError, match=r"ModelPruning does not work .*gathered_params"):
        trainer.fit(model)
    assert trainer.global_step == 0


def test_graph_logging_is_refused_before_training(tmp_path):
    from lightning.pytorch.loggers import TensorBoardLogger

    trainer = L.Trainer(accelerator="cpu", devices=1, strategy="elixir", max_epochs=1, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        logger=TensorBoardLogger(tmp_path, name="tb", log_graph=True))
    model = Backbone()
    model.example_input_array = torch.randn(2, 8)
    with pytest.raises(ValueError, match=r"TensorBoardLogger\(log_graph=True\) traces the model on rank 0 alone"):
        trainer.fit(model)
    assert trainer.global_step == 0


def test_lazy_modules_must_be_initialized_first():
    class Lazy(Backbone):
        def __init__(self) -> None:
            super().__init__()
            self.backbone = nn.LazyLinear(8)

    trainer = L.Trainer(accelerator="cpu", devices=1, strategy="elixir", max_steps=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(ValueError, match=r"parameters \['backbone.weight', 'backbone.bias'\] of lazy modules .* "
                                         r"run one forward pass on a sample batch"):
        trainer.fit(Lazy())
    with pytest.raises(ValueError, match="lazy modules"):
        ElixirRuntime(nn.Sequential(nn.LazyLinear(4)), ElixirPlan())


def _trained_after_adding_a_group(plan: ElixirPlan) -> dict:
    """Two steps of momentum SGD over the head (the first layer frozen), then the first layer unfrozen and added
    as a group of its own, two more."""
    from lightning_elixir.runtime.optim import optimizer_step
    from lightning_elixir.runtime.state_dict import full_state_dict

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    model[0].requires_grad_(False)
    runtime = ElixirRuntime(model, plan)
    opt = shard_optimizer(runtime, torch.optim.SGD(model[1].parameters(), lr=0.1, momentum=0.9))
    for step in range(4):
        if step == 2:
            model[0].requires_grad_(True)
            opt.add_param_group({"params": model[0].parameters(), "lr": 0.5})
            assert opt.param_groups[1]["lr"] == 0.5
            assert [p.numel() for p in opt.param_groups[1]["params"]] == [16, 4]
        model(torch.full((2, 4), 1.0 + step)).sum().backward()
        optimizer_step(runtime, opt)
        opt.zero_grad()
    return full_state_dict(runtime)


def test_add_param_group_takes_module_parameters_also_of_offloaded_chunks():
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    ref[0].requires_grad_(False)
    opt = torch.optim.SGD(ref[1].parameters(), lr=0.1, momentum=0.9)
    for step in range(4):
        if step == 2:
            ref[0].requires_grad_(True)
            opt.add_param_group({"params": ref[0].parameters(), "lr": 0.5})
        ref(torch.full((2, 4), 1.0 + step)).sum().backward()
        opt.step()
        opt.zero_grad()
    names = ("0.weight", "0.bias", "1.weight", "1.bias")
    for placement in ("device", "cpu"):
        plan = ElixirPlan(chunks=[ChunkSpec(params=names, numel=256, placement=placement)], world_size=1)
        state = _trained_after_adding_a_group(plan)
        for key, value in ref.state_dict().items():
            torch.testing.assert_close(state[key], value, msg=f"{placement}: {key}")
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    opt = shard_optimizer(ElixirRuntime(model, ElixirPlan()), torch.optim.SGD(model[1].parameters(), lr=0.1))
    with pytest.raises(ValueError, match="not a parameter of the model"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(3))]})
