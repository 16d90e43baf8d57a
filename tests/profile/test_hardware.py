"""profile_hardware: JSON round trip, cache reuse and rejection, and two ranks over gloo."""

from __future__ import annotations

import dataclasses
import json
import logging
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_elixir.profile import bench, hardware
from lightning_elixir.profile.bench import BenchSizes
from lightning_elixir.profile.hardware import MachineKey, profile_hardware
from lightning_elixir.profile.types import HardwareProfile, ProfileError

TINY = BenchSizes(matmul_dim=128, copy_bytes=1 << 20, optimizer_numel=1 << 14,
                  collective_bytes=(1 << 12, 1 << 16), nvme_bytes=1 << 23, iters=2,
                  attention_shapes=((1, 2, 16, 16), (1, 2, 32, 16)), elementwise_bytes=(1 << 14, 1 << 16),
                  overhead_steps=2)


@pytest.fixture
def measured(tmp_path):
    """One real measurement, cached under tmp_path."""
    return profile_hardware("cpu", cache_dir=tmp_path, sizes=TINY)


@pytest.fixture
def no_measuring(monkeypatch):
    """Make any measurement fail the test: the profile must come from the cache."""

    def refuse(*args, **kwargs):
        raise AssertionError("measured although a valid cache exists")

    monkeypatch.setattr(hardware, "measure_hardware", refuse)


def test_measurement_is_plausible_and_says_what_it_measured(measured):
    assert measured.device_name == "cpu" and measured.world_size == 1
    assert measured.matmul_flops_per_s > 1e8 and measured.device_memory_bytes_per_s > 1e8
    assert [b for b, _ in measured.all_gather_bytes_per_s] == list(TINY.collective_bytes)
    assert measured.nvme_read_bytes_per_s == measured.nvme_write_bytes_per_s == 0.0
    assert any("host memory copy" in note for note in measured.notes)
    assert measured.all_gather_s(1 << 14) > measured.collective_latency_s
    assert 0.0 <= measured.comm_overlap <= 1.0
    assert measured.host_update_overhead_s >= 0.0 and measured.upload_bytes_per_s > 0


def test_measurement_calibrates_the_compute_model(measured):
    assert 0.0 < measured.op_overhead_s < 1e-2
    flops = [f for f, _ in measured.matmul_points]
    assert flops == [2.0 * n**3 for n in TINY.matmul_sides()] == sorted(flops) and len(flops) == 4
    assert measured.matmul_flops_per_s == measured.matmul_points[-1][1]  # the peak: the largest size
    assert measured.matmul_flops_per_s_at(flops[0]) == measured.matmul_points[0][1]
    forward = [f for f, _ in measured.attention_points]
    backward = [f for f, _ in measured.attention_backward_points]
    assert len(forward) == len(backward) == len(TINY.attention_shapes)
    assert forward == sorted(forward) and backward == sorted(backward) and backward[0] > forward[0]
    moved = [b for b, _ in measured.elementwise_points]
    assert len(moved) == len(TINY.elementwise_bytes) and moved == sorted(moved)
    for name in ("matmul_points", "attention_points", "attention_backward_points", "elementwise_points"):
        assert all(rate > 0 for _, rate in getattr(measured, name)), name


def test_json_round_trip(measured, tmp_path):
    path = tmp_path / "hw.json"
    measured.to_json(path)
    assert HardwareProfile.from_json(path) == measured
    assert HardwareProfile.from_json(measured.to_json()) == measured
    partial = dataclasses.replace(measured, comm_overlap=0.25)
    assert json.loads(partial.to_json())["comm_overlap"] == 0.25
    assert HardwareProfile.from_json(partial.to_json()) == partial


@pytest.mark.parametrize("window_s, computed_s, overlap", [
    (25.0, 25.0, 1.0),  # the compute lost nothing while 10 s of collectives ran: fully hidden
    (25.0, 15.0, 0.0),  # it lost all 10 s: nothing hidden
    (25.0, 20.0, 0.5),
    (25.0, 10.0, 0.0),  # lost more than the collectives took alone (noise): clamped
    (25.0, 26.0, 1.0),  # computed more than the window (noise): clamped
])
def test_hidden_fraction(window_s, computed_s, overlap):
    assert bench.hidden_fraction(10.0, window_s, computed_s) == pytest.approx(overlap)


def test_overlap_benchmark_runs_the_collectives_it_is_given():
    calls = []

    def all_gather(out, inp):
        calls.append("all_gather")
        bench.local_copy(out, inp)

    def reduce_scatter(out, inp):
        calls.append("reduce_scatter")
        bench.local_copy(out, inp)

    overlap = bench.comm_overlap(all_gather, reduce_scatter, 1, torch.device("cpu"), torch.float32, TINY)
    assert 0.0 <= overlap <= 1.0
    # Per round, the collectives alone and beside the matmuls (half of each kind); a tiny all-gather
    # starts each of the 3 phases; plus the warm-up and the calibration.
    phases = 1 + 3 * TINY.overlap_rounds
    rounds = TINY.overlap_rounds * 2 + 2
    assert calls.count("reduce_scatter") == rounds * TINY.overlap_collectives // 2
    assert calls.count("all_gather") == rounds * TINY.overlap_collectives // 2 + phases


def test_second_call_reuses_the_cache(measured, tmp_path, no_measuring):
    assert profile_hardware("cpu", cache_dir=tmp_path, sizes=TINY) == measured


def test_cache_is_per_compute_dtype(measured, tmp_path, no_measuring):
    with pytest.raises(AssertionError, match="measured although"):
        profile_hardware("cpu", cache_dir=tmp_path, sizes=TINY, compute_dtype=torch.bfloat16)


def _corrupt_json(text: str) -> str:
    return text[: len(text) // 2]


def _unknown_key(text: str) -> str:
    return json.dumps({**json.loads(text), "surprise": 1})


def _invalid_value(text: str) -> str:
    return json.dumps({**json.loads(text), "matmul_flops_per_s": -1.0})


def _other_machine(text: str) -> str:
    return json.dumps({**json.loads(text), "torch_version": "0.0.1"})


def _missing_key(text: str) -> str:
    data = json.loads(text)
    del data["h2d_bytes_per_s"]
    return json.dumps(data)


@pytest.mark.parametrize("corrupt", [_corrupt_json, _unknown_key, _invalid_value, _other_machine, _missing_key])
def test_corrupted_cache_is_detected_and_measured_again(measured, tmp_path, caplog, corrupt):
    path = tmp_path / MachineKey.current(torch.device("cpu"), 1, torch.float32).file_name()
    path.write_text(corrupt(path.read_text()))
    with caplog.at_level(logging.WARNING, logger=hardware.__name__):
        again = profile_hardware("cpu", cache_dir=tmp_path, sizes=TINY)
    assert "measuring again" in caplog.text
    assert again.torch_version == torch.__version__ and again.matmul_flops_per_s > 0
    assert HardwareProfile.from_json(path) == again  # the cache is repaired


def test_nvme_bandwidth_is_measured_at_a_path(tmp_path):
    profile = profile_hardware("cpu", cache_dir=tmp_path / "cache", nvme_path=tmp_path, sizes=TINY, refresh=True)
    assert profile.nvme_read_bytes_per_s > 0 and profile.nvme_write_bytes_per_s > 0
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("elixir-bench-")]


def test_arguments_that_would_fail_mid_way_are_refused_up_front(tmp_path):
    with pytest.raises(ValueError, match="all_gather"):
        profile_hardware("cpu", world_size=2, cache_dir=tmp_path)
    with pytest.raises(ValueError, match="nvme_path"):
        profile_hardware("cpu", nvme_path=tmp_path / "missing", cache_dir=tmp_path)


def test_an_unwritable_cache_warns_and_still_returns(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with caplog.at_level(logging.WARNING, logger=hardware.__name__):
        profile = profile_hardware("cpu", cache_dir=blocker, sizes=TINY)
    assert profile.matmul_flops_per_s > 0 and "could not cache" in caplog.text


def test_invalid_profiles_are_rejected(measured):
    with pytest.raises(ProfileError):
        HardwareProfile.from_json(json.dumps({**json.loads(measured.to_json()), "all_gather_bytes_per_s": []}))
    for overlap in (-0.1, 1.5, float("nan")):
        with pytest.raises(ProfileError, match="comm_overlap"):
            dataclasses.replace(measured, comm_overlap=overlap)


def test_a_cache_from_before_comm_overlap_is_measured_again(measured, tmp_path):
    # Written by the version before comm_overlap: no such key, and the file name had no format.
    old = {k: v for k, v in json.loads(measured.to_json()).items() if k != "comm_overlap"}
    old["matmul_flops_per_s"] = 1.0  # a marker: it must not come back
    key = MachineKey.current(torch.device("cpu"), 1, torch.float32)
    old_name = key.file_name().replace(f"hardware-v{hardware.CACHE_FORMAT}-", "hardware-")
    (tmp_path / old_name).write_text(json.dumps(old))
    (tmp_path / key.file_name()).unlink()
    assert HardwareProfile.from_json(json.dumps(old)).comm_overlap == 1.0  # why the file name changed
    again = profile_hardware("cpu", cache_dir=tmp_path, sizes=TINY)
    assert again.matmul_flops_per_s > 1.0 and 0.0 <= again.comm_overlap <= 1.0
    assert HardwareProfile.from_json(tmp_path / key.file_name()) == again


def _two_ranks(fn, mine, other):
    """``fn(mine, all_gather, 2, cpu)`` as rank 0 with ``other`` on rank 1 (running the same ``fn``)."""
    sent = []

    def record(out, inp):
        sent.append(inp.clone())
        out.copy_(torch.cat([inp, inp]))

    fn(other, record, 2, torch.device("cpu"))

    def all_gather(out, inp):  # rank 1 sends what `other` sent
        assert inp.numel() == sent[0].numel(), "the ranks' vectors differ in length"
        out.copy_(torch.cat([inp, sent[0]]))

    return fn(mine, all_gather, 2, torch.device("cpu"))


def test_ranks_agree_on_the_worst_numbers(hardware_factory):
    mine = hardware_factory(world_size=2, comm_overlap=0.7, collective_latency_s=1e-4, op_overhead_s=2e-6,
                            host_update_overhead_s=1e-4, upload_bytes_per_s=2e9,
                            matmul_points=((1e6, 1e9), (1e9, 4e10), (1e12, 9e10)),
                            attention_points=((1e6, 1e9), (1e9, 1e10)), attention_backward_points=((3e6, 5e8),),
                            elementwise_points=((1e3, 1e9), (1e6, 2e10)))
    other = dataclasses.replace(mine, comm_overlap=0.2, collective_latency_s=3e-4, matmul_flops_per_s=5e10,
                                op_overhead_s=5e-6, host_update_overhead_s=3e-5, upload_bytes_per_s=1e9,
                                matmul_points=((1e6, 2e9), (1e9, 3e10), (1e12, 5e10)),
                                attention_points=((1e6, 2e9), (1e9, 5e9)), attention_backward_points=((3e6, 4e8),),
                                elementwise_points=((1e3, 2e9), (1e6, 1e10)))
    agreed = _two_ranks(hardware._slowest_rank, mine, other)
    assert agreed == dataclasses.replace(mine, comm_overlap=0.2, collective_latency_s=3e-4, matmul_flops_per_s=5e10,
                                         op_overhead_s=5e-6, upload_bytes_per_s=1e9,
                                         matmul_points=((1e6, 1e9), (1e9, 3e10), (1e12, 5e10)),
                                         attention_points=((1e6, 1e9), (1e9, 5e9)),
                                         attention_backward_points=((3e6, 4e8),),
                                         elementwise_points=((1e3, 1e9), (1e6, 1e10)))
    # The other way round, the same profile.
    assert _two_ranks(hardware._slowest_rank, other, mine) == agreed


def test_ranks_without_the_calibration_still_agree(hardware_factory):
    mine = hardware_factory(world_size=2, collective_latency_s=1e-4)
    other = dataclasses.replace(mine, collective_latency_s=2e-4, matmul_flops_per_s=5e10)
    assert _two_ranks(hardware._slowest_rank, mine, other) == other


def test_a_cache_is_used_only_if_every_rank_has_one_with_the_same_points(hardware_factory):
    usable = hardware._usable_on_every_rank
    mine = hardware_factory(world_size=2, matmul_points=((1e6, 1e9), (1e9, 4e10)))
    assert _two_ranks(usable, mine, dataclasses.replace(mine, op_overhead_s=1e-6))
    assert not _two_ranks(usable, mine, None)
    assert not _two_ranks(usable, None, mine)
    assert not _two_ranks(usable, mine, dataclasses.replace(mine, matmul_points=((1e6, 1e9),)))
    assert not _two_ranks(usable, mine, dataclasses.replace(mine, elementwise_points=((1e6, 1e9),)))
    more_collective_points = ((1 << 10, 1e8), (1 << 20, 1e9))
    assert not _two_ranks(usable, mine, dataclasses.replace(mine, all_gather_bytes_per_s=more_collective_points))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world_size: int, port: int, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    calls = []

    def all_gather(out, inp):
        calls.append(("all_gather", out.numel()))
        dist.all_gather_into_tensor(out, inp)

    def reduce_scatter(out, inp):
        calls.append(("reduce_scatter", inp.numel()))
        dist.reduce_scatter_tensor(out, inp)

    try:
        results = []
        for attempt in range(3):  # 2nd: from the cache on both ranks; 3rd: rank 1 lost its cache
            if attempt == 2 and rank == 1:
                for path in Path(f"{out_dir}/cache{rank}").iterdir():
                    path.unlink()
            dist.barrier()
            calls.clear()
            profile = profile_hardware("cpu", world_size, all_gather, reduce_scatter,
                                       cache_dir=f"{out_dir}/cache{rank}", sizes=TINY)
            results.append({"profile": profile.to_json(), "calls": list(calls)})
        with open(f"{out_dir}/rank{rank}.json", "w") as f:
            json.dump(results, f)
    finally:
        dist.destroy_process_group()


def test_two_ranks_run_the_same_collectives_and_agree(tmp_path):
    world_size = 2
    mp.spawn(_rank_main, args=(world_size, _free_port(), str(tmp_path)), nprocs=world_size)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world_size)]
    measured, cached, _ = ([HardwareProfile.from_json(rank[i]["profile"]) for rank in ranks] for i in range(3))
    assert measured[0] == measured[1] and measured[0].world_size == world_size
    assert [b for b, _ in measured[0].reduce_scatter_bytes_per_s] == list(TINY.collective_bytes)
    assert ranks[0][0]["calls"] == ranks[1][0]["calls"]
    assert {name for name, _ in ranks[0][0]["calls"]} == {"all_gather", "reduce_scatter"}
    # From the cache: only the two agreement all-gathers (every rank cached? slowest rank's numbers?).
    assert ranks[0][1]["calls"] == ranks[1][1]["calls"]
    assert [name for name, _ in ranks[0][1]["calls"]] == ["all_gather", "all_gather"]
    assert cached == measured
    assert 0.0 <= measured[0].comm_overlap <= 1.0  # agreed: the same on both ranks (asserted above)
    # One rank without a cache: every rank measures again, with the same collectives.
    assert ranks[0][2]["calls"] == ranks[1][2]["calls"] == ranks[0][0]["calls"]


def test_ranks_spread_over_machines_do_not_share_a_profile_with_ranks_on_one(measured, tmp_path):
    # a cache in a shared home directory: 2 ranks on one node and 2 on two nodes measure other collectives
    one = MachineKey.current(torch.device("cpu"), 2, torch.float32)
    two = MachineKey.current(torch.device("cpu"), 2, torch.float32, nodes=2)
    assert one.file_name() != two.file_name() and "nodes" not in one.file_name()
    assert two.matches(dataclasses.replace(measured, world_size=2))  # the profile's fields are the same
