"""The calibrated compute model: per-operator overhead and size-dependent matmul, attention and
elementwise rates (see [Note: roofline] in profile/cost.py)."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch

from lightning_elixir.profile import bench
from lightning_elixir.profile.bench import BenchSizes
from lightning_elixir.profile.cost import OpCost, flops_kind, op_cost, roofline_s
from lightning_elixir.profile.model import profile_model
from lightning_elixir.profile.types import HardwareProfile, ProfileError
from tests.profile.models import mlp_case, mse_step

_aten = torch.ops.aten

NEW_FIELDS = ("op_overhead_s", "matmul_points", "attention_points", "attention_backward_points", "elementwise_points")

# 2 MFLOP at 1e9 FLOP/s, 2 GFLOP at 1e11 FLOP/s: a factor 1000 in flops, 100 in rate.
POINTS = ((2e9, 1e11), (2e6, 1e9))


@pytest.fixture
def calibrated(hardware_factory):
    return hardware_factory(matmul_flops_per_s=1e11, op_overhead_s=1e-5, matmul_points=POINTS,
                            attention_points=((1e6, 2e8), (1e9, 2e9)), attention_backward_points=((1e6, 1e8),),
                            elementwise_points=((1e3, 1e8), (1e6, 1e9)))


def test_points_are_sorted_and_the_peak_is_kept(calibrated):
    assert calibrated.matmul_points == ((2e6, 1e9), (2e9, 1e11))
    assert calibrated.matmul_flops_per_s == 1e11


@pytest.mark.parametrize("flops, rate", [
    (2e6, 1e9),  # at a point
    (2e9, 1e11),
    (2e7, 1e9 + (1e11 - 1e9) / 3),  # a third of the way in log space of the flops
    (math.sqrt(2e6 * 2e9), (1e9 + 1e11) / 2),  # the geometric middle
    (1.0, 1e9),  # below the smallest: flat
    (1e15, 1e11),  # above the largest: flat
])
def test_rate_is_interpolated_in_log_space_and_flat_beyond_the_ends(calibrated, flops, rate):
    assert calibrated.matmul_flops_per_s_at(flops) == pytest.approx(rate)


def test_without_points_every_size_runs_at_the_peak(hardware_factory):
    hardware = hardware_factory(matmul_flops_per_s=3e10, device_memory_bytes_per_s=4e9)
    assert hardware.matmul_points == () and hardware.op_overhead_s == 0.0
    assert hardware.matmul_flops_per_s_at(1.0) == hardware.matmul_flops_per_s_at(1e18) == 3e10
    assert hardware.attention_flops_per_s_at(1.0) == hardware.attention_flops_per_s_at(1e9, backward=True) == 3e10
    assert hardware.elementwise_bytes_per_s_at(1.0) == hardware.elementwise_bytes_per_s_at(1e12) == 4e9


def test_attention_without_its_points_runs_at_the_matmul_rate_of_its_size(hardware_factory):
    hardware = hardware_factory(matmul_points=POINTS)
    assert hardware.attention_flops_per_s_at(2e6) == hardware.attention_flops_per_s_at(2e6, backward=True) == 1e9


def test_attention_and_elementwise_rates_come_from_their_own_points(calibrated):
    assert calibrated.attention_flops_per_s_at(1e6) == 2e8
    assert calibrated.attention_flops_per_s_at(math.sqrt(1e6 * 1e9)) == pytest.approx(1.1e9)
    assert calibrated.attention_flops_per_s_at(1e12) == 2e9
    assert calibrated.attention_flops_per_s_at(1e6, backward=True) == calibrated.attention_flops_per_s_at(
        1e12, backward=True) == 1e8
    assert calibrated.elementwise_bytes_per_s_at(10.0) == 1e8
    assert calibrated.elementwise_bytes_per_s_at(math.sqrt(1e3 * 1e6)) == pytest.approx(5.5e8)
    assert calibrated.elementwise_bytes_per_s_at(1e9) == 1e9


def test_one_point_is_flat(hardware_factory):
    hardware = hardware_factory(matmul_points=((1e6, 2e9),))
    assert hardware.matmul_flops_per_s_at(1.0) == hardware.matmul_flops_per_s_at(1e12) == 2e9


@pytest.mark.parametrize("changes, match", [
    ({"op_overhead_s": -1e-6}, "op_overhead_s"),
    ({"op_overhead_s": float("nan")}, "op_overhead_s"),
    ({"op_overhead_s": float("inf")}, "op_overhead_s"),
    ({"matmul_points": ((1e6, 0.0),)}, "matmul_points"),
    ({"matmul_points": ((0.0, 1e9),)}, "matmul_points"),
    ({"matmul_points": ((1e6, -1e9),)}, "matmul_points"),
    ({"matmul_points": ((1e6, float("nan")),)}, "matmul_points"),
    ({"matmul_points": ((1e6, 1e9), (1e6, 2e9))}, "same work"),
    ({"matmul_points": ((1e6,),)}, "matmul_points"),
    ({"attention_points": ((1e6, 0.0),)}, "attention_points"),
    ({"attention_backward_points": ((-1.0, 1e9),)}, "attention_backward_points"),
    ({"elementwise_points": ((1e3, float("inf")),)}, "elementwise_points"),
])
def test_invalid_calibrations_are_rejected(hardware_factory, changes, match):
    with pytest.raises(ProfileError, match=match):
        hardware_factory(**changes)


def test_json_round_trip_with_and_without_the_calibration(calibrated, hardware_factory, tmp_path):
    data = json.loads(calibrated.to_json())
    assert data["op_overhead_s"] == 1e-5 and data["matmul_points"] == [[2e6, 1e9], [2e9, 1e11]]
    assert data["attention_backward_points"] == [[1e6, 1e8]]
    assert HardwareProfile.from_json(calibrated.to_json()) == calibrated
    calibrated.to_json(tmp_path / "hw.json")
    assert HardwareProfile.from_json(tmp_path / "hw.json") == calibrated
    plain = hardware_factory()
    assert HardwareProfile.from_json(plain.to_json()) == plain
    assert json.loads(plain.to_json())["matmul_points"] == []


def test_a_profile_written_before_the_calibration_loads_with_the_peak_model(calibrated):
    old = {k: v for k, v in json.loads(calibrated.to_json()).items() if k not in NEW_FIELDS}
    loaded = HardwareProfile.from_json(json.dumps(old))
    assert loaded == dataclasses.replace(calibrated, op_overhead_s=0.0, matmul_points=(), attention_points=(),
                                         attention_backward_points=(), elementwise_points=())


def test_the_hand_written_hardware_profiles_still_load():
    configs = sorted((Path(__file__).parents[2] / "configs" / "hardware").glob("*.json"))
    written = [HardwareProfile.from_json(path) for path in configs]
    estimates = [profile for profile in written if profile.torch_version == "estimate"]
    assert estimates and len(estimates) < len(written)  # the GPU estimates, and local-cpu-x2.json (measured)
    for profile in estimates:  # written without the calibration: the peak model
        assert profile.op_overhead_s == 0.0 and profile.matmul_points == ()
        assert profile.matmul_flops_per_s_at(1e6) == profile.matmul_flops_per_s
        assert profile.host_update_overhead_s == 0.0 and profile.upload_bytes_per_s == 0.0
    for profile in written:
        if profile.torch_version != "estimate":
            assert profile.op_overhead_s > 0 and profile.matmul_points and profile.upload_bytes_per_s > 0


def _cost(func, *args, hardware):
    out = func(*args)
    tensors = [a for a in args if isinstance(a, torch.Tensor)] + [out]
    return op_cost(func, args, {}, out, tensors, hardware)


def test_a_view_is_free(calibrated):
    a = torch.ones(64, 64)
    cost = _cost(_aten.view.default, a, [4096], hardware=calibrated)
    assert cost == OpCost(0.0, 0, 0.0)


def test_an_operator_without_flops_pays_the_overhead_and_its_bytes(calibrated):
    a = torch.ones(1000)
    cost = _cost(_aten.add.Tensor, a, a, hardware=calibrated)
    assert cost.flops == 0.0 and cost.moved_bytes == 3 * 4000
    assert cost.time_s == pytest.approx(1e-5 + 12000 / calibrated.elementwise_bytes_per_s_at(12000))
    # Bytes at the copy bandwidth without elementwise points.
    plain = dataclasses.replace(calibrated, elementwise_points=())
    assert _cost(_aten.add.Tensor, a, a, hardware=plain).time_s == pytest.approx(
        1e-5 + 12000 / plain.device_memory_bytes_per_s)


def test_a_small_matmul_is_charged_at_the_small_size_rate(calibrated):
    n = 100  # 2 MFLOP: the smallest point, 100x below the peak
    a = torch.ones(n, n)
    cost = _cost(_aten.mm.default, a, a, hardware=calibrated)
    assert cost.flops == 2 * n**3
    assert cost.time_s == pytest.approx(1e-5 + 2e6 / 1e9)
    big = _cost(_aten.mm.default, torch.ones(1000, 1000), torch.ones(1000, 1000), hardware=calibrated)
    assert big.time_s == pytest.approx(1e-5 + 2e9 / 1e11)


def test_attention_is_charged_at_the_attention_rates(calibrated):
    q = torch.ones(1, 2, 16, 8)
    forward = _aten._scaled_dot_product_flash_attention_for_cpu.default
    backward = _aten._scaled_dot_product_flash_attention_for_cpu_backward.default
    assert (flops_kind(forward), flops_kind(backward), flops_kind(_aten.mm.default)) == (
        "attention", "attention_backward", "matmul")
    out = forward(q, q, q)
    cost = op_cost(forward, (q, q, q), {}, out, [q, q, q, *out], calibrated)
    assert cost.flops == 4 * 2 * 16 * 16 * 8  # PyTorch's formula: two matmuls per head
    assert cost.time_s == pytest.approx(1e-5 + cost.flops / 2e8)  # below the smallest point: flat
    args = (out[0], q, q, q, out[0], out[1], 0.0, False)
    grads = backward(*args)
    back = op_cost(backward, args, {}, grads, [q, *grads], calibrated)
    assert back.flops > cost.flops and back.time_s == pytest.approx(1e-5 + back.flops / 1e8)


def test_memory_bound_operators_with_flops_take_the_larger_term(hardware_factory):
    hardware = hardware_factory(matmul_flops_per_s=1e12, device_memory_bytes_per_s=1e3, op_overhead_s=1e-6,
                                matmul_points=((1.0, 1e12),))
    assert roofline_s(1e6, 1e6, hardware) == pytest.approx(1e-6 + 1e3)
    assert roofline_s(0.0, 0.0, hardware) == pytest.approx(1e-6)
    assert roofline_s(1e6, 1e6, None) == 0.0


def test_every_traced_operator_but_views_pays_the_overhead(hardware_factory):
    module, batch = mlp_case()
    fast = hardware_factory(matmul_flops_per_s=1e30, device_memory_bytes_per_s=1e30)
    base = profile_model(module, batch, step_fn=mse_step, hardware=fast)
    overhead = profile_model(module, batch, step_fn=mse_step,
                             hardware=dataclasses.replace(fast, op_overhead_s=1.0))
    assert base.compute_s == pytest.approx(0.0, abs=1e-12)
    ops = overhead.compute_s  # one second per non-view operator
    assert ops == pytest.approx(round(ops)) and 0 < ops < 200
    per_access = sum(a.compute_s for a in overhead.accesses)
    assert per_access == pytest.approx(round(per_access)) and per_access <= ops


def test_overhead_benchmark_times_a_tiny_training_step_per_operator():
    sizes = BenchSizes(128, 1, 8, (4,), 1, 2, overhead_steps=2)
    overhead = bench.op_overhead_s(torch.device("cpu"), sizes)
    assert 0.0 < overhead < 1e-2
    counter = bench._OpCounter()
    block = bench._TinyBlock(16, torch.device("cpu"))
    x = torch.ones(4, 16, requires_grad=True)
    with counter:
        y = block(x)
    assert counter.ops == 4  # layer_norm, addmm, gelu, add; the linear's transpose is a view
    with counter:
        y.sum().backward()
    assert counter.ops > 8


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_overhead_benchmark_counts_operators_as_the_profile_charges_them(hardware_factory, dtype):
    model = torch.nn.Sequential(*(bench._TinyBlock(16, torch.device("cpu")) for _ in range(4)))
    x = torch.ones(4, 16)

    def loss(m, b):
        return m(b).float().square().mean()

    with bench._OpCounter() as counter:
        with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            out = loss(model, x)
        out.backward()
    model.zero_grad(set_to_none=True)
    one_second_each = hardware_factory(matmul_flops_per_s=1e30, device_memory_bytes_per_s=1e30, op_overhead_s=1.0)
    profile = profile_model(model, x, step_fn=loss, compute_dtype=dtype, hardware=one_second_each)
    assert profile.compute_s == pytest.approx(counter.ops)
    assert bench.op_overhead_s(torch.device("cpu"), BenchSizes(128, 1, 8, (4,), 1, 2, overhead_steps=2), dtype) > 0


def test_the_fastest_block_counts_and_the_blocks_take_turns(monkeypatch):
    calls = []
    # Blocks in turn: a (2 calls) 3 s, b (1 call) 2 s, a 1 s, b 3 s, a 5 s, b 1 s.
    clock = iter([0.0, 3.0, 3.0, 5.0, 5.0, 6.0, 6.0, 9.0, 9.0, 14.0, 14.0, 15.0])
    monkeypatch.setattr(bench.time, "perf_counter", lambda: next(clock))
    seconds = bench.fastest_s([(lambda: calls.append("a"), 6), (lambda: calls.append("b"), 2)], torch.device("cpu"))
    assert seconds == [0.5, 1.0]
    assert calls == ["a", "b"] + ["a", "a", "b"] * 3  # a warm-up call each, then the blocks in turn


def test_bench_sizes_span_small_matmuls_up_to_the_peak_size():
    cpu = BenchSizes.for_device(torch.device("cpu"))
    assert cpu.matmul_sides() == (128, 256, 512, 1024)
    assert cpu.matmul_iters(1024) == cpu.iters and cpu.matmul_iters(128) == cpu.iters * 512
    gpu = BenchSizes.for_device(torch.device("cuda"))
    assert gpu.matmul_sides()[-1] == gpu.matmul_dim and len(gpu.matmul_sides()) == 4
    derived = BenchSizes(matmul_dim=128, copy_bytes=1, optimizer_numel=8, collective_bytes=(4,), nvme_bytes=1,
                         iters=2)
    assert derived.matmul_sides() == (16, 32, 64, 128)
    assert derived.matmul_iters(16) == 1024
    assert BenchSizes(8192, 1, 8, (4,), 1, 2, matmul_dims=(8, 16384)).matmul_iters(8) == 10_000
    assert BenchSizes(8192, 1, 8, (4,), 1, 2, matmul_dims=(8, 16384)).matmul_sides() == (8, 8192)
    for sizes in (cpu, gpu):
        assert sizes.attention_iters(sizes.attention_shapes[-1]) == sizes.iters
        assert sizes.attention_iters(sizes.attention_shapes[0]) > sizes.iters
        assert sizes.elementwise_iters(sizes.elementwise_bytes[-1]) == sizes.iters
        assert list(sizes.elementwise_bytes) == sorted(sizes.elementwise_bytes)
