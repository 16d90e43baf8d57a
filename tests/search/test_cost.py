"""Cost model: small plans whose step time is worked out by hand, line by line."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_elixir.plan import ElixirPlan
from lightning_elixir.search import SearchOptions, build_layout, evaluate_plan, search, step_time_s
from tests.search.profiles import chain_profile, chain_profiles, flat_hardware, hardwares

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
    # With room for everything: both blocks, prefetch 1 -> 12 s (prefetch 2 ties; the deeper wins).
    best, report = search(MODEL, HARDWARE, 10_000, OPTIONS)
    assert (best.cache_blocks, best.prefetch_depth, best.offloads) == ("all", 2, False)
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


# [Note: overlap], contention: a collective the schedule hides behind compute still costs the
# compute (1 - comm_overlap) of its time. The schedules are the ones worked out above.


@pytest.mark.parametrize("overlap, forward_backward_s", [(1.0, 11.0), (0.5, 12.5), (0.0, 14.0)])
def test_contention_with_prefetch(overlap, forward_backward_s):
    # The schedule of test_prefetch_hides_the_second_gather ends at 11. Hidden behind compute: the
    # prefetch of chunk 1 while m0 computes (2 -> 3, 1 s) and the reduce of chunk 1 while m0's
    # backward computes (7 -> 9, 2 s): 3 s, i.e. compute 6 + collectives 8 - 11.
    # Overlap 0.5: 11 + 0.5 * 3 = 12.5. Overlap 0: 11 + 3 = 14 = compute + collectives.
    cost = evaluate_plan(plan("all", 1), MODEL, dataclasses.replace(HARDWARE, comm_overlap=overlap), OPTIONS).cost
    assert cost.contention_s == pytest.approx(forward_backward_s - 11.0)
    assert cost.forward_backward_s == pytest.approx(forward_backward_s)
    assert cost.step_s == pytest.approx(forward_backward_s + 1.0)


@pytest.mark.parametrize("overlap, step_s", [(1.0, 13.0), (0.5, 14.0), (0.0, 15.0)])
def test_contention_without_prefetch(overlap, step_s):
    # The schedule of test_every_chunk_gathered_without_prefetch ends at 12; only the reduce of
    # chunk 1 (8 -> 10) runs beside compute (m0's backward): 2 s hidden. Overlap 0.5: 12 + 1 + 1 = 14.
    hardware = dataclasses.replace(HARDWARE, comm_overlap=overlap)
    assert evaluate_plan(plan("all", 0), MODEL, hardware, OPTIONS).cost.step_s == pytest.approx(step_s)


def test_a_schedule_that_hides_nothing_loses_nothing_to_contention():
    # test_one_block_regathers_in_backward: compute 6 + gathers 6 + reduces 4 = 16 = the schedule's
    # end (the reduce of chunk 1, 8 -> 10, runs while m0 waits for its gather). Step 17 at any overlap.
    cost = evaluate_plan(plan(1, 0), MODEL, dataclasses.replace(HARDWARE, comm_overlap=0.0), OPTIONS).cost
    assert cost.contention_s == 0.0
    assert cost.step_s == pytest.approx(17.0)


def test_contention_delays_the_optimizer_but_not_the_gradient_copies():
    # test_offloading_one_chunk_to_the_cpu at overlap 0.5: forward/backward 12.5 (as with prefetch),
    # device optimizer done at 13. The copy of chunk 1's gradient keeps the schedule's clock (done at
    # 11). Host pipeline 2 s: step max(13, 11) + 2 = 15 s.
    hardware = dataclasses.replace(HARDWARE, comm_overlap=0.5)
    cost = evaluate_plan(plan("all", 1, ("device", "cpu")), MODEL, hardware, OPTIONS).cost
    assert cost.copy_done_s == pytest.approx(11.0)
    assert cost.step_s == pytest.approx(15.0)


def test_without_overlap_prefetch_saves_nothing_and_the_bound_adds_up():
    # Overlap 0: every plan costs compute + collectives + optimizer. Both blocks with or without
    # prefetch: 6 + 8 + 1 = 15 s (a tie: the deeper prefetch wins); one block: 17 s.
    # Lower bound: the least traffic (8 s) cannot hide behind compute (6 s): 14 s.
    best, report = search(MODEL, dataclasses.replace(HARDWARE, comm_overlap=0.0), 10_000, OPTIONS)
    assert (best.cache_blocks, best.prefetch_depth) == ("all", 2)
    assert report.winner.step_s == pytest.approx(15.0)
    no_prefetch = evaluate_plan(dataclasses.replace(best, prefetch_depth=0), MODEL,
                                dataclasses.replace(HARDWARE, comm_overlap=0.0), OPTIONS)
    assert no_prefetch.cost.step_s == pytest.approx(15.0)
    assert (report.lower_bound_reason, report.lower_bound_s) == ("network", pytest.approx(14.0))
    # Overlap 0.5: prefetch saves again (13.5 s against 14 s); the bound is 8 + 0.5 * 6 = 11 s.
    best, report = search(MODEL, dataclasses.replace(HARDWARE, comm_overlap=0.5), 10_000, OPTIONS)
    assert (best.cache_blocks, best.prefetch_depth, report.winner.step_s) == ("all", 2, pytest.approx(13.5))
    assert report.lower_bound_s == pytest.approx(11.0)


@settings(max_examples=40, deadline=None)
@given(chain_profiles(), hardwares(), st.integers(1, 4), st.floats(0.0, 1.0), st.floats(0.0, 1.0))
def test_less_overlap_is_never_predicted_faster(model, hw, world_size, a, b):
    options = SearchOptions(world_size=world_size, min_chunk_numel=1, shard_align_numel=1, chunk_size_steps=2)
    less, more = (dataclasses.replace(hw, comm_overlap=x) for x in sorted((a, b)))
    plan_, report = search(model, more, 1 << 60, options)
    slow, fast = (evaluate_plan(plan_, model, h, options).cost for h in (less, more))
    assert slow.step_s >= fast.step_s - 1e-12
    assert search(model, less, 1 << 60, options)[1].winner.step_s >= report.winner.step_s - 1e-12
    # Between the bounds: overlap 1 hides everything the schedule can, overlap 0 nothing.
    collectives_s = slow.all_gather_s + slow.reduce_scatter_s
    assert slow.forward_backward_s <= slow.compute_s + collectives_s + 1e-12
    nothing_hides = evaluate_plan(plan_, model, dataclasses.replace(hw, comm_overlap=0.0), options).cost
    assert nothing_hides.forward_backward_s == pytest.approx(nothing_hides.compute_s + collectives_s)
