"""Cost model: small plans whose step time is worked out by hand, line by line."""

from __future__ import annotations

import dataclasses

import pytest

from lightning_elixir.plan import ElixirPlan
from lightning_elixir.search import SearchOptions, build_layout, evaluate_plan, search, step_time_s
from tests.search.profiles import chain_profile, flat_hardware

# Two modules with one 100-element parameter each, one chunk each, world size 2 (shards of 50), bf16.
# Forward takes 1 s per module, backward 2 s. Accesses: fwd m0, fwd m1, bwd m1, bwd m0.
MODEL = chain_profile([[100], [100]], forward_s=[1.0, 1.0], backward_s=[2.0, 2.0], activation_bytes=1000)
# A bf16 chunk is 200 B: gathered at 100 B/s in 2 s. Its fp32 gradient is 400 B: reduced at 200 B/s in 2 s.
# Optimizer: 100 elements/s on the device, 25 on the CPU. Host link: 100 B/s each way.
# NVMe: master + AdamW of a shard is 50 * 12 = 600 B: read at 300 B/s (2 s), written at 200 B/s (3 s).
HARDWARE = flat_hardware(100.0, 200.0, optimizer_device_numel_per_s=100.0, optimizer_cpu_numel_per_s=25.0,
                         d2h_bytes_per_s=100.0, h2d_bytes_per_s=100.0,
                         nvme_read_bytes_per_s=300.0, nvme_write_bytes_per_s=200.0)
OPTIONS = SearchOptions(world_size=2, margin_fraction=0.05, margin_bytes=0, nvme_available=True,
                        chunk_size_steps=1, min_chunk_numel=1, shard_align_numel=1)
LAYOUT = build_layout(MODEL, 100, 2)


def plan(blocks, depth, placements=("device", "device")):
    chunks = tuple(dataclasses.replace(c, placement=p) for c, p in zip(LAYOUT.chunks, placements))
    return ElixirPlan(chunks=chunks, world_size=2, cache_blocks=blocks, prefetch_depth=depth)


def test_every_chunk_gathered_without_prefetch():
    # p0 fwd m0: gather 0 on demand, 0 -> 2; compute 2 -> 3.
    # p1 fwd m1: gather 1 on demand, 3 -> 5; compute 5 -> 6.
    # p2 bwd m1: cached; compute 6 -> 8; chunk 1's gradient is complete: reduce 8 -> 10.
    # p3 bwd m0: cached; compute 8 -> 10; reduce chunk 0: 10 -> 12.
    # Device optimizer: 100 elements at 100/s = 1 s. Step: 12 + 1 = 13 s.
    cost = evaluate_plan(plan("all", 0), MODEL, HARDWARE, OPTIONS).cost
    assert cost.forward_backward_s == pytest.approx(12.0)
    assert cost.step_s == pytest.approx(13.0)
    assert cost.compute_s == pytest.approx(6.0)
    assert cost.all_gather_s == pytest.approx(4.0)
    assert cost.reduce_scatter_s == pytest.approx(4.0)


def test_prefetch_hides_the_second_gather():
    # p0: gather 0, 0 -> 2; compute 2 -> 3; prefetch 1 when compute starts: 2 -> 4.
    # p1: waits for chunk 1 until 4; compute 4 -> 5.
    # p2: compute 5 -> 7; reduce 1: 7 -> 9.   p3: compute 7 -> 9; reduce 0: 9 -> 11.
    # Step: 11 + 1 = 12 s.
    assert evaluate_plan(plan("all", 1), MODEL, HARDWARE, OPTIONS).cost.step_s == pytest.approx(12.0)


def test_one_block_regathers_in_backward():
    # p0: gather 0, 0 -> 2; compute 2 -> 3.   p1: evict 0, gather 1, 3 -> 5; compute 5 -> 6.
    # p2: cached; compute 6 -> 8; reduce 1: 8 -> 10.
    # p3: evict 1, gather 0: issued at 8, the link is busy until 10: 10 -> 12; compute 12 -> 14;
    #     reduce 0: 14 -> 16.   Step: 16 + 1 = 17 s.
    prediction = evaluate_plan(plan(1, 0), MODEL, HARDWARE, OPTIONS)
    assert prediction.sim.gathers == 3
    assert prediction.cost.step_s == pytest.approx(17.0)


def test_offloading_one_chunk_to_the_cpu():
    # As with prefetch (backward ends at 11), but chunk 1 (reduced first, at 9) lives on the CPU:
    # its gradient shard (50 * 4 B) is copied down 9 -> 11. Device optimizer: chunk 0 only, 0.5 s,
    # done at 11.5. Host: CPU AdamW 50 / 25 = 2 s, upload 50 * 2 B / 100 = 1 s; pipelined -> 2 s.
    # Step: max(11.5, 11) + 2 = 13.5 s.
    cost = evaluate_plan(plan("all", 1, ("device", "cpu")), MODEL, HARDWARE, OPTIONS).cost
    assert cost.copy_done_s == pytest.approx(11.0)
    assert cost.device_optimizer_s == pytest.approx(0.5)
    assert cost.step_s == pytest.approx(13.5)


def test_offloading_one_chunk_to_nvme():
    # Same, but the host pipeline's slowest stage is NVMe: 2 s read + 3 s write = 5 s. Step: 11.5 + 5.
    cost = evaluate_plan(plan("all", 1, ("device", "nvme")), MODEL, HARDWARE, OPTIONS).cost
    assert cost.nvme_s == pytest.approx(5.0)
    assert cost.step_s == pytest.approx(16.5)


def test_gradient_accumulation_keeps_the_cache_and_reduces_every_micro_batch():
    # Micro-batch 1 as with prefetch: compute ends at 9, reduces at 9 and 11.
    # Micro-batch 2: everything cached. p4: 9 -> 10. p5: 10 -> 11. p6: 11 -> 13; reduce 1: 13 -> 15.
    # p7: 13 -> 15; reduce 0: 15 -> 17.   Step: 17 + 1 = 18 s.
    options = dataclasses.replace(OPTIONS, micro_batches=2)
    prediction = evaluate_plan(plan("all", 1), MODEL, HARDWARE, options)
    assert prediction.sim.gathers == 2
    assert prediction.cost.step_s == pytest.approx(18.0)


def test_the_overlap_rule_for_the_optimizer():
    assert step_time_s(10.0, 0.0, 1.0, 0.0) == 11.0  # no offload: device optimizer after backward
    assert step_time_s(10.0, 12.0, 1.0, 2.0) == 14.0  # host waits for the last gradient copy
    assert step_time_s(10.0, 10.5, 1.0, 2.0) == 13.0  # ... and for the device optimizer


def test_search_finds_the_hand_optimum():
    # With room for everything: both blocks, prefetch 1 -> 12 s (prefetch 2 ties; the smaller wins).
    best, report = search(MODEL, HARDWARE, 10_000, OPTIONS)
    assert (best.cache_blocks, best.prefetch_depth, best.offloads) == ("all", 1, False)
    assert report.winner.step_s == pytest.approx(12.0)
    # Lower bound: compute is 6 s; the network must at least gather both chunks once (2 * 200 B at
    # 100 B/s = 4 s) and reduce both gradients (2 * 400 B at 200 B/s = 4 s): 8 s. 12 / 8 = 1.5.
    assert report.lower_bound_reason == "network"
    assert report.lower_bound_s == pytest.approx(8.0)
    assert report.lower_bound_ratio == pytest.approx(1.5)
    # Peaks: 2 blocks on device 4200 B; 1 block 3990 B; 2 blocks with chunk 1 offloaded 3360 B.
    # At 4000 B: one block costs 17 s, offloading chunk 1 costs 13.5 s: this hardware says offload.
    best, report = search(MODEL, HARDWARE, 4000, OPTIONS)
    assert report.winner.step_s == pytest.approx(13.5)
    assert best.cache_blocks == "all" and [c.placement for c in best.chunks] == ["device", "cpu"]
    # With a CPU optimizer of 5 elements/s the offload costs 11.5 + 10 = 21.5 s > 17 s: shard instead.
    slow_cpu = dataclasses.replace(HARDWARE, optimizer_cpu_numel_per_s=5.0)
    best, report = search(MODEL, slow_cpu, 4000, OPTIONS)
    assert report.winner.step_s == pytest.approx(17.0)
    assert best.cache_blocks == "min" and not best.offloads
