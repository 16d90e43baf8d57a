"""profile_model against real runs of the same step on the CPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from lightning_elixir.profile.model import profile_model
from lightning_elixir.profile.stand_ins import quiet_logging
from lightning_elixir.profile.types import ModelProfile, ProfileError
from tests.profile.models import (
    MLP,
    TiedLM,
    checkpoint_case,
    ctc_case,
    ctc_step,
    gpt_case,
    lm_step,
    mlp_case,
    mse_step,
    tied_case,
)
from tests.profile.real_step import allocator_peaks, run_real_step


def _gpt_step(module, batch):
    with quiet_logging(module):
        return module.training_step(batch, 0)


CASES = {
    "gpt": (gpt_case, _gpt_step, None),
    "gpt-checkpointed": (lambda: gpt_case(activation_checkpointing=True), _gpt_step, None),
    "mlp": (mlp_case, mse_step, mse_step),
    "tied": (tied_case, lm_step, lm_step),
    "checkpointed": (checkpoint_case, mse_step, mse_step),
    "ctc": (ctc_case, ctc_step, ctc_step),
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _profile_and_run(case: str, dtype: torch.dtype):
    make, real_step_fn, step_fn = CASES[case]
    module, batch = make()
    profile = profile_model(module, batch, step_fn=step_fn, compute_dtype=dtype)
    return module, batch, profile, run_real_step(module, batch, real_step_fn, dtype)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("case", CASES)
def test_access_sequence_matches_real_hooks(case, dtype):
    _, _, profile, real = _profile_and_run(case, dtype)
    hooked = [(a.phase, a.module) for a in profile.accesses if not a.op]
    assert hooked == real.sequence
    assert {"forward", "backward"} <= {phase for phase, _ in hooked}


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("case", CASES)
def test_activation_peaks_within_10_percent_of_real_run(case, dtype):
    _, _, profile, real = _profile_and_run(case, dtype)
    assert profile.forward_peak_bytes == pytest.approx(real.forward_peak_bytes, rel=0.10)
    assert profile.backward_peak_bytes == pytest.approx(real.backward_peak_bytes, rel=0.10)


@pytest.mark.parametrize("case", ["gpt", "gpt-checkpointed", "tied"])
def test_activation_peaks_within_10_percent_of_allocator(case):
    make, real_step_fn, step_fn = CASES[case]
    module, batch = make()
    profile = profile_model(module, batch, step_fn=step_fn)
    forward, backward = allocator_peaks(module, batch, real_step_fn)
    assert profile.forward_peak_bytes == pytest.approx(forward, rel=0.10)
    assert profile.backward_peak_bytes == pytest.approx(backward, rel=0.10)


def test_checkpointing_recomputes_in_backward_and_saves_memory():
    module, batch = gpt_case()
    plain = profile_model(module, batch)
    module.config.activation_checkpointing = True
    checkpointed = profile_model(module, batch)
    recomputed = [a.module for a in checkpointed.accesses if a.phase == "recompute"]
    block_forwards = [a.module for a in checkpointed.accesses if a.phase == "forward" and ".h." in a.module]
    assert sorted(recomputed) == sorted(block_forwards)
    assert not any(a.phase == "recompute" for a in plain.accesses)
    assert checkpointed.forward_peak_bytes < plain.forward_peak_bytes


def test_tied_and_foreign_uses_are_shared_and_attributed():
    module, batch = tied_case()
    profile = profile_model(module, batch, step_fn=lm_step)
    assert profile.shared_params == ("emb.weight",)
    op_level = [a for a in profile.accesses if a.op]
    assert [(a.phase, a.params) for a in op_level] == [("forward", ("emb.weight",)), ("backward", ("emb.weight",))]
    assert all(a.module == f":{a.op}" for a in op_level)
    head = [a for a in profile.accesses if a.module == "head"]
    assert all(a.params == ("emb.weight",) for a in head)


def test_a_unit_owns_its_submodules_parameters_and_reads_them_anywhere_in_its_forward():
    class Parent(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.ones(8))
            self.child = nn.Linear(8, 8)

        def forward(self, x):
            return self.child(x) * self.scale + x @ self.child.weight

    profile = profile_model(Parent(), torch.randn(4, 8))
    # No block inside: the module holding parameters is one unit with its child, hooked once.
    assert [(a.phase, a.module) for a in profile.accesses] == [("forward", ""), ("backward", "")]
    assert all(a.params == ("child.weight", "child.bias", "scale") for a in profile.accesses)  # first-read order
    assert profile.shared_params == ()


def test_a_parameter_read_outside_its_unit_joins_the_running_units_access():
    class Stack(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
            self.scale = nn.Parameter(torch.ones(8))

        def forward(self, x):
            for block in self.blocks:
                x = block(x) * self.scale
            return x

    profile = profile_model(Stack(), torch.randn(4, 8))
    assert [(a.phase, a.module) for a in profile.accesses if a.phase == "forward"] == [
        ("forward", ""), ("forward", "blocks.0"), ("forward", "blocks.1")]
    assert profile.shared_params == ()  # the root unit owns scale and reads it while it runs


def test_root_parameters_read_in_the_step_outside_forward_are_shared():
    """The root unit and the step outside modules are both named "": a read of the root's own parameters
    outside its forward is still one no hook holds (torch.vmap reads them unseen by the runtime), so they are
    shared and get private chunks."""

    class Ensemble(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(3, 8, 4))

    def step(module, batch):
        x, y = batch
        out = torch.vmap(lambda w: x @ w)(module.weight).mean(0)  # never calls the root's forward
        return ((out - y) ** 2).mean()

    profile = profile_model(Ensemble(), (torch.randn(4, 8), torch.randn(4, 4)), step_fn=step)
    assert profile.shared_params == ("weight",)


def test_params_in_first_use_order_with_unused_last():
    class Reordered(nn.Module):
        def __init__(self):
            super().__init__()
            self.unused = nn.Linear(4, 4)
            self.second = nn.Linear(4, 4)
            self.first = nn.Linear(4, 4)

        def forward(self, x):
            return self.second(self.first(x))

    profile = profile_model(Reordered(), torch.randn(2, 4))
    assert [p.name for p in profile.params] == [
        "first.weight", "first.bias", "second.weight", "second.bias", "unused.weight", "unused.bias"]


def test_gpt_parameters_are_recorded_once_with_the_tied_weight_shared():
    module, batch = gpt_case()
    profile = profile_model(module, batch)
    expected = dict(module.named_parameters())
    assert {p.name for p in profile.params} == set(expected)
    assert profile.total_numel == sum(p.numel() for p in expected.values())
    info = {p.name: p for p in profile.params}["model.wte.weight"]
    assert (info.shape, info.dtype, info.requires_grad, info.owner) == ((256, 64), "float32", True, "model.wte")
    assert profile.shared_params == ("model.wte.weight",)
    assert profile.params[0].name == "model.wte.weight"


def test_profiling_leaves_the_module_as_it_was():
    module, batch = gpt_case()
    module.eval()
    before = {name: p.detach().clone() for name, p in module.named_parameters()}
    objects = {name: p for name, p in module.named_parameters()}
    profile_model(module, batch)
    assert all(objects[name] is p for name, p in module.named_parameters())
    assert all(torch.equal(before[name], p) for name, p in module.named_parameters())
    assert all(p.grad is None for p in module.parameters())
    assert not any(m.training for m in module.modules())
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in module.modules())
    assert "log" not in module.__dict__ and "log_dict" not in module.__dict__


def test_self_log_is_a_no_op_with_a_trainer_attached():
    import lightning as L

    module, batch = gpt_case()
    module.trainer = L.Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False)
    with pytest.raises(Exception):
        module.log("x", 1.0)  # outside the fit loop Lightning refuses: profiling must not call it
    assert profile_model(module, batch).total_numel > 0


def test_meta_module_profiles_like_the_real_one():
    real, batch = gpt_case()
    with torch.device("meta"):
        meta, _ = gpt_case()
    assert all(p.is_meta for p in meta.parameters())
    assert profile_model(meta, batch) == profile_model(real, batch)


def test_plain_module_default_step_and_frozen_params():
    model = MLP(16)
    model.fc1.requires_grad_(False)
    profile = profile_model(model, torch.randn(4, 16))
    assert {p.name: p.requires_grad for p in profile.params}["fc1.weight"] is False
    backward = [a.module for a in profile.accesses if a.phase == "backward"]
    assert backward == ["fc3", "fc2"]  # fc1's output needs no gradient: no pre-backward hook fires


def test_flops_follow_the_matmul_shapes():
    batch, width = 8, 16
    model = nn.Sequential(nn.Linear(width, 2 * width, bias=False), nn.Linear(2 * width, width, bias=False))
    profile = profile_model(model, torch.randn(batch, width))
    flops = {(a.phase, a.module): a.flops for a in profile.accesses}
    one_matmul = 2 * batch * width * 2 * width
    assert flops[("forward", "0")] == flops[("forward", "1")] == one_matmul
    assert flops[("backward", "1")] == 2 * one_matmul  # gradient of the input and of the weight
    assert flops[("backward", "0")] == one_matmul  # the batch needs no gradient


@pytest.mark.parametrize("bound", ["compute", "memory"])
def test_compute_time_is_a_roofline_of_flops_and_bytes(bound, hardware_factory):
    fast = 1e30
    hardware = hardware_factory(matmul_flops_per_s=1e9 if bound == "compute" else fast,
                                device_memory_bytes_per_s=1e9 if bound == "memory" else fast)
    module, batch = mlp_case()
    profile = profile_model(module, batch, step_fn=mse_step, hardware=hardware)
    for access in profile.accesses:
        work = access.flops if bound == "compute" else access.moved_bytes
        assert access.compute_s == pytest.approx(work / 1e9, rel=1e-6, abs=1e-15)
    total = sum(a.compute_s for a in profile.accesses)
    assert profile.compute_s == pytest.approx(total, rel=0.05)
    assert profile.compute_s > 0 and profile.backward_compute_s > profile.forward_compute_s


def test_compute_dtype_sets_autocast_and_param_dtype_drops_weight_casts():
    module, batch = gpt_case()
    fp32 = profile_model(module, batch)
    bf16 = profile_model(module, batch, compute_dtype=torch.bfloat16)
    bf16_params = profile_model(module, batch, compute_dtype=torch.bfloat16, param_dtype=torch.bfloat16)
    assert (fp32.compute_dtype, bf16.compute_dtype) == ("float32", "bfloat16")
    assert bf16_params.forward_peak_bytes < bf16.forward_peak_bytes
    assert {p.dtype for p in bf16_params.params} == {"float32"}  # as stored in the module
    with pytest.raises(ProfileError, match="compute_dtype"):
        profile_model(module, batch, compute_dtype=torch.int32)  # float64 is allowed: "64-true"


def test_json_round_trip(tmp_path):
    module, batch = tied_case()
    profile = profile_model(module, batch, step_fn=lm_step)
    path = tmp_path / "profile.json"
    profile.to_json(path)
    assert ModelProfile.from_json(path) == profile
    assert ModelProfile.from_json(profile.to_json()) == profile


def test_manual_optimization_is_traced_and_a_step_fn_still_works():
    module, batch = gpt_case()
    module.automatic_optimization = False  # its training_step returns the loss without manual_backward
    traced = profile_model(module, batch)
    assert {a.phase for a in traced.accesses} >= {"forward", "backward"}
    assert profile_model(module, batch, step_fn=_gpt_step).total_numel > 0


@torch.library.custom_op("elixir_test::positives", mutates_args=())
def _positives(x: torch.Tensor) -> torch.Tensor:
    return x[x > 0].clone()


@_positives.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty(torch.library.get_ctx().new_dynamic_size())  # how a library declares a value-dependent shape


def test_steps_with_value_dependent_shapes_beyond_the_known_ones_fail_with_a_clear_error():
    def step(module, batch):
        out = module(batch)
        return (out * _positives(batch[:, 0]).sum()).sum()  # a library's operator: not one the trace bounds

    with pytest.raises(ProfileError, match="cannot bound"):
        profile_model(MLP(8), torch.randn(2, 8), step_fn=step)


def test_step_without_loss_fails():
    with pytest.raises(ProfileError, match="loss"):
        profile_model(TiedLM(), torch.zeros(2, 3, dtype=torch.long), step_fn=lambda m, b: None)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_a_device_this_machine_lacks_is_refused_before_tracing():
    module, batch = mlp_case()
    with pytest.raises(ProfileError, match="device='cpu'"):
        profile_model(module, batch, step_fn=mse_step, device="cuda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_profile_matches_cpu_access_order():
    module, batch = mlp_case()
    profile = profile_model(module, batch, step_fn=mse_step, device="cuda")
    cpu = profile_model(module, batch, step_fn=mse_step)
    assert [(a.phase, a.module) for a in profile.accesses] == [(a.phase, a.module) for a in cpu.accesses]
    assert torch.cuda.memory_allocated() == 0


def test_pytorch_tools_we_rely_on():
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils.flop_counter import flop_registry

    aten = torch.ops.aten
    assert {aten.mm, aten.addmm, aten.bmm, aten._scaled_dot_product_flash_attention} <= set(flop_registry)
    assert hasattr(aten, "_scaled_dot_product_flash_attention_for_cpu_backward")
    with FakeTensorMode() as mode:
        w = nn.Parameter(torch.empty(1 << 20, 1 << 20))
        assert w.untyped_storage().nbytes() == 4 << 40 and isinstance(w, nn.Parameter)
    assert mode is not None and aten.t.default.is_view and not aten.mm.default.is_view
    linear = nn.Linear(2, 2, bias=False)
    tied = {"weight": torch.zeros(2, 2)}
    assert torch.func.functional_call(linear, tied, (torch.ones(1, 2),)).sum() == 0


class _Router(nn.Module):
    """Converts its own classifier inside forward, as Switch Transformers' router does."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.classifier = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.classifier = self.classifier.to(torch.float32)
        return self.classifier(torch.relu(self.inp(x))).sum()


def test_a_module_that_converts_itself_in_forward_profiles_and_stays_as_it_was():
    model = _Router()
    weight = model.classifier.weight
    profile = profile_model(model, torch.randn(2, 8), step_fn=lambda m, b: m(b))
    assert {"inp", "classifier"} <= {a.module for a in profile.accesses}
    assert model.classifier.weight is weight and not weight.is_meta
