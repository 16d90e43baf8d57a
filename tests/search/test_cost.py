"""Cost model: small plans whose step time is worked out by hand, line by line."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_elixir.plan import ElixirPlan
from lightning_elixir.search import SearchOptions, build_layout, evaluate_plan, search, step_time_s
from lightning_elixir.search.cost import _best_landed_first, chunk_times, host_floor_s, placement_cost
from tests.search.profiles import chain_profile, chain_profiles, flat_hardware, hardware, hardwares

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
# The same machine where the host is the device: host work beside compute hides nothing.
CPU_HARDWARE = dataclasses.replace(HARDWARE, device_name="cpu")


def plan(blocks, depth, placements=("device", "device")):
    chunks = tuple(dataclasses.replace(c, placement=p) for c, p in zip(LAYOUT.chunks, placements))
    return ElixirPlan(chunks=chunks, world_size=2, cache_blocks=blocks, prefetch_depth=depth)


def test_a_resident_plan_gathers_every_chunk_at_the_start():
    # Every chunk has a block: both gathers are issued when the step starts, whatever the prefetch depth.
    # p0 fwd m0: waits for chunk 0, 0 -> 2; compute 2 -> 3; chunk 1 follows on the link, 2 -> 4.
    # p1 fwd m1: waits for chunk 1 until 4; compute 4 -> 5.
    # p2 bwd m1: compute 5 -> 7; chunk 1's gradient is complete: reduce 7 -> 9.
    # p3 bwd m0: compute 7 -> 9; reduce chunk 0: 9 -> 11.
    # Device optimizer: 100 elements at 100/s = 1 s. Step: 11 + 1 = 12 s.
    for depth in (0, 1):
        prediction = evaluate_plan(plan("all", depth), MODEL, HARDWARE, OPTIONS)
        cost = prediction.cost
        assert prediction.sim.demand[0] == (0,) and prediction.sim.prefetched[0] == (1,)
        assert cost.forward_backward_s == pytest.approx(11.0)
        assert cost.step_s == pytest.approx(12.0)
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
    # As with prefetch (backward ends at 11; chunk 1 first used by p1 at 4), but chunk 1 (reduced
    # first, at 9) lives on the CPU: its gradient shard (50 * 4 B) is copied down 9 -> 11. Device
    # optimizer: chunk 0 only, 0.5 s: the next step can start at 11.5. The worker starts at 11:
    # CPU AdamW 50 / 25 = 2 s, then upload 50 * 2 B / 100 = 1 s: done at 14. The next step gathers
    # chunk 1 (2 s) to start p1 at 11.5 + 4, so the update must be done by 11.5 + 4 - 2 = 13.5:
    # 0.5 s exposed. Step: 11.5 + 0.5 = 12 s.
    cost = evaluate_plan(plan("all", 1, ("device", "cpu")), MODEL, HARDWARE, OPTIONS).cost
    assert cost.copy_done_s == pytest.approx(11.0)
    assert cost.device_optimizer_s == pytest.approx(0.5)
    assert cost.host_work_s == pytest.approx(3.0)
    assert cost.exposed_host_s == pytest.approx(0.5)
    assert cost.step_s == pytest.approx(12.0)


def test_offloading_one_chunk_to_nvme():
    # Same, but NVMe paging (2 s read + 3 s write = 5 s) outlasts update and upload (3 s): the
    # worker's period is 5 s, done at 16, 2.5 s past the deadline. Step: 11.5 + 2.5 = 14 s.
    cost = evaluate_plan(plan("all", 1, ("device", "nvme")), MODEL, HARDWARE, OPTIONS).cost
    assert cost.nvme_s == pytest.approx(5.0)
    assert cost.exposed_host_s == pytest.approx(2.5)
    assert cost.step_s == pytest.approx(14.0)


def test_an_update_done_before_its_gather_is_hidden():
    # A CPU optimizer of 50 elements/s: update 1 s + upload 1 s, done at 13 <= 13.5. Step: 11.5 s,
    # faster than keeping chunk 1 on the device (12 s): its device optimizer no longer runs.
    fast_cpu = dataclasses.replace(HARDWARE, optimizer_cpu_numel_per_s=50.0)
    cost = evaluate_plan(plan("all", 1, ("device", "cpu")), MODEL, fast_cpu, OPTIONS).cost
    assert cost.exposed_host_s == 0.0
    assert cost.step_s == pytest.approx(11.5)


@pytest.mark.parametrize("placement, step_s", [("cpu", 14.5), ("nvme", 16.5)])
def test_where_the_host_is_the_device_host_work_runs_in_sequence(placement, step_s):
    # The step of test_offloading_one_chunk_*: 11.5 s, then the worker's whole time (3 s; 5 s).
    cost = evaluate_plan(plan("all", 1, ("device", placement)), MODEL, CPU_HARDWARE, OPTIONS).cost
    assert cost.exposed_host_s == cost.host_work_s
    assert cost.step_s == pytest.approx(step_s)


def test_a_host_update_pays_its_fixed_cost_and_the_measured_upload():
    # test_offloading_one_chunk_to_the_cpu with the host update measured as the worker runs it: a fixed
    # 0.5 s per chunk, and the upload at 50 B/s (conversion included) rather than the link's 100 B/s.
    # Worker: 0.5 + 2 s AdamW + 50 * 2 B / 50 = 2 s upload = 4.5 s, done at 15.5: 2 s past 13.5.
    measured = dataclasses.replace(HARDWARE, host_update_overhead_s=0.5, upload_bytes_per_s=50.0)
    cost = evaluate_plan(plan("all", 1, ("device", "cpu")), MODEL, measured, OPTIONS).cost
    assert cost.cpu_optimizer_s == pytest.approx(2.5) and cost.h2d_s == pytest.approx(2.0)
    assert cost.host_work_s == pytest.approx(4.5)
    assert cost.exposed_host_s == pytest.approx(2.0)
    assert cost.step_s == pytest.approx(13.5)


def test_both_chunks_offloaded_update_in_forward_order():
    # Both on the CPU: copies 9 -> 11 (chunk 1) and 11 -> 13 (chunk 0); no device optimizer, so the
    # next step can start at 13. Worker: chunk 0 first (used first), done 16, deadline 13 + 2 - 2 =
    # 13; then chunk 1, done 19, deadline 13 + 4 - 2 = 15. Worst: chunk 1, 4 s. Step: 17 s.
    cost = evaluate_plan(plan("all", 1, ("cpu", "cpu")), MODEL, HARDWARE, OPTIONS).cost
    assert cost.copy_done_s == pytest.approx(13.0)
    assert cost.exposed_host_s == pytest.approx(4.0)
    assert cost.step_s == pytest.approx(17.0)


def test_host_floor():
    # Chunk 1 on the CPU: copies D = 2 s, worker W = 3 s (see above). Where host work hides, the
    # copy stream and the worker each need their time every step: max(D, W); else D + W.
    times = chunk_times(LAYOUT, MODEL, HARDWARE, OPTIONS)
    cost = placement_cost(times, ("device", "cpu"), 1)
    assert host_floor_s(cost, host_hides=True) == pytest.approx(3.0)
    assert host_floor_s(cost, host_hides=False) == pytest.approx(5.0)
    assert host_floor_s(placement_cost(times, ("device", "device"), 1), host_hides=True) == 0.0


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
    assert step_time_s(10.0, 12.0, 1.0, 2.0) == 14.0  # exposed host time after the last gradient copy
    assert step_time_s(10.0, 10.5, 1.0, 2.0) == 13.0  # ... and after the device optimizer


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
    # Offloading chunk 1 also takes 12 s (test_offloading_one_chunk_to_the_cpu): the tie goes to
    # fewer chunks offloaded.
    assert report.winner.offloaded == 0
    # Peaks: 2 blocks on device 4200 B; 1 block 3990 B; 2 blocks with chunk 1 offloaded 3360 B.
    # At 4000 B: one block costs 17 s, offloading chunk 1 costs 12 s: this hardware says offload.
    best, report = search(MODEL, HARDWARE, 4000, OPTIONS)
    assert report.winner.step_s == pytest.approx(12.0)
    assert best.cache_blocks == "all" and [c.placement for c in best.chunks] == ["device", "cpu"]
    assert report.cost.exposed_host_s == pytest.approx(0.5)
    # With a CPU optimizer of 5 elements/s the update takes 10 s + 1 s upload, done at 22, 8.5 s
    # past its deadline: 20 s > 17 s. Shard instead.
    slow_cpu = dataclasses.replace(HARDWARE, optimizer_cpu_numel_per_s=5.0)
    best, report = search(MODEL, slow_cpu, 4000, OPTIONS)
    assert report.winner.step_s == pytest.approx(17.0)
    assert best.cache_blocks == "min" and not best.offloads
    # Where the host is the device, offloading chunk 1 costs 11.5 + 3 = 14.5 s: still under 17 s.
    best, report = search(MODEL, CPU_HARDWARE, 4000, OPTIONS)
    assert report.winner.step_s == pytest.approx(14.5) and best.offloads


def test_the_report_says_where_chunks_went_and_why():
    _, report = search(MODEL, HARDWARE, 4000, OPTIONS)
    assert ("placement: 1 device, 1 cpu, 0 nvme: all-device state with 2 cache blocks needs 4.10 KiB (over the "
            "budget by 200 B); offloading frees 800 B for 1 more cache block(s); host work 3000.00ms, "
            "exposed 500.00ms") in report.summary()
    assert report.placement_reason.startswith("all-device state with 2 cache blocks")
    _, report = search(MODEL, HARDWARE, 10_000, OPTIONS)
    assert "placement: 2 device, 0 cpu, 0 nvme: all state on the device" in report.summary()
    _, report = search(MODEL, HARDWARE, 4000, dataclasses.replace(OPTIONS, updates_in_backward=True))
    assert "host work 3000.00ms (started in backward), exposed" in report.summary()


# A GPU-like machine (profiles.hardware(): PCIe 4 host link, CPU AdamW at 1e9 elements/s). Four
# modules of 16M parameters, 10 ms forward and 20 ms backward each, at world size 8: shards of 2M
# elements; a CPU update takes 2.1 ms, its upload 0.17 ms, a gather 0.4 ms. The last two chunks are
# offloaded: the next forward needs them 20 and 30 ms in.
GPU_MODEL = chain_profile([[1 << 24]] * 4, forward_s=[0.01] * 4, backward_s=[0.02] * 4)
GPU_OPTIONS = SearchOptions(world_size=8)


def gpu_plan(placements):
    layout = build_layout(GPU_MODEL, 1 << 24, 8)
    chunks = tuple(dataclasses.replace(c, placement=p) for c, p in zip(layout.chunks, placements))
    return ElixirPlan(chunks=chunks, world_size=8, cache_blocks="all", prefetch_depth=1)


def test_updates_done_before_their_first_use_are_hidden():
    offloaded = evaluate_plan(gpu_plan(("device", "device", "cpu", "cpu")), GPU_MODEL, hardware(), GPU_OPTIONS).cost
    assert offloaded.host_work_s > 0.004 and offloaded.exposed_host_s == 0.0
    assert offloaded.step_s == pytest.approx(offloaded.forward_backward_s + offloaded.device_optimizer_s
                                             + offloaded.exposed_copy_s)
    on_device = evaluate_plan(gpu_plan(("device",) * 4), GPU_MODEL, hardware(), GPU_OPTIONS).cost
    assert offloaded.step_s < on_device.step_s  # the device optimizer skips the offloaded shards
    # A CPU optimizer 100x slower: chunk 2's update takes 210 ms, far past its first use.
    slow = hardware(optimizer_cpu_numel_per_s=1e7)
    late = evaluate_plan(gpu_plan(("device", "device", "cpu", "cpu")), GPU_MODEL, slow, GPU_OPTIONS).cost
    assert late.exposed_host_s > 0.3
    assert late.step_s == pytest.approx(late.forward_backward_s + late.device_optimizer_s + late.exposed_copy_s
                                        + late.exposed_host_s)


def test_where_the_host_is_the_device_all_host_work_is_exposed():
    plan_ = gpu_plan(("device", "device", "cpu", "cpu"))
    cost = evaluate_plan(plan_, GPU_MODEL, hardware(device_name="cpu"), GPU_OPTIONS).cost
    assert cost.host_work_s > 0.004 and cost.exposed_host_s == cost.host_work_s
    ready_s = max(cost.forward_backward_s + cost.device_optimizer_s, cost.copy_done_s)
    assert cost.step_s == pytest.approx(ready_s + cost.host_work_s)


@settings(max_examples=40, deadline=None)
@given(chain_profiles(), hardwares(), st.integers(1, 4), st.data())
def test_hiding_is_never_slower_and_every_step_pays_its_host_floor(model, hw, world_size, data):
    options = SearchOptions(world_size=world_size, min_chunk_numel=1, shard_align_numel=1, nvme_available=True)
    layout = build_layout(model, max(p.numel for p in model.params), world_size)
    placements = tuple(data.draw(st.sampled_from(["device", "cpu", "nvme"])) for _ in layout.chunks)
    chunks = tuple(dataclasses.replace(c, placement=p) for c, p in zip(layout.chunks, placements))
    plan_ = ElixirPlan(chunks=chunks, world_size=world_size, prefetch_depth=data.draw(st.integers(0, 2)))
    hides, not_hides = (evaluate_plan(plan_, model, h, options).cost
                        for h in (hw, dataclasses.replace(hw, device_name="cpu")))
    assert hides.step_s <= not_hides.step_s + 1e-12
    times = chunk_times(layout, model, hw, options)
    cost = placement_cost(times, placements, 1)
    assert hides.step_s >= host_floor_s(cost, host_hides=True) * (1 - 1e-12)
    assert not_hides.step_s >= host_floor_s(cost, host_hides=False) * (1 - 1e-12)
    assert 0.0 <= hides.exposed_host_s <= hides.host_work_s * (1 + 1e-12)


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


@pytest.mark.parametrize("overlap, step_s", [(1.0, 12.0), (0.5, 13.5), (0.0, 15.0)])
def test_contention_of_a_resident_plan(overlap, step_s):
    # The schedule of test_a_resident_plan_gathers_every_chunk_at_the_start ends at 11; chunk 1's
    # gather runs beside p0's compute (2 -> 3: 1 s) and the reduce of chunk 1 beside m0's backward
    # (7 -> 9: 2 s): 3 s hidden. Overlap 0.5: 11 + 1 + 1.5 = 13.5.
    hardware = dataclasses.replace(HARDWARE, comm_overlap=overlap)
    assert evaluate_plan(plan("all", 0), MODEL, hardware, OPTIONS).cost.step_s == pytest.approx(step_s)


def test_a_schedule_that_hides_nothing_loses_nothing_to_contention():
    # test_one_block_regathers_in_backward: compute 6 + gathers 6 + reduces 4 = 16 = the schedule's
    # end (the reduce of chunk 1, 8 -> 10, runs while m0 waits for its gather). Step 17 at any overlap.
    cost = evaluate_plan(plan(1, 0), MODEL, dataclasses.replace(HARDWARE, comm_overlap=0.0), OPTIONS).cost
    assert cost.contention_s == 0.0
    assert cost.step_s == pytest.approx(17.0)


def test_contention_delays_the_optimizer_but_not_the_gradient_copies_or_first_uses():
    # test_offloading_one_chunk_to_the_cpu at overlap 0.5: forward/backward 12.5 (as with prefetch),
    # device optimizer done at 13. The copy of chunk 1's gradient keeps the schedule's clock (done at
    # 11), so does chunk 1's first use (4). Worker from 12.5: done 15.5; deadline 13 + 4 - 2 = 15.
    # Step: 13 + 0.5 = 13.5 s.
    hardware = dataclasses.replace(HARDWARE, comm_overlap=0.5)
    cost = evaluate_plan(plan("all", 1, ("device", "cpu")), MODEL, hardware, OPTIONS).cost
    assert cost.copy_done_s == pytest.approx(11.0)
    assert cost.step_s == pytest.approx(13.5)


def test_without_overlap_prefetch_saves_nothing_and_the_bound_adds_up():
    # State on the device. Overlap 0: every plan costs compute + collectives + optimizer. Both blocks
    # with or without prefetch: 6 + 8 + 1 = 15 s (a tie: the deeper prefetch wins); one block: 17 s.
    # Lower bound: the least traffic (8 s) cannot hide behind compute (6 s): 14 s.
    device_only = dataclasses.replace(OPTIONS, allow_cpu=False, nvme_available=False)
    best, report = search(MODEL, dataclasses.replace(HARDWARE, comm_overlap=0.0), 10_000, device_only)
    assert (best.cache_blocks, best.prefetch_depth) == ("all", 2)
    assert report.winner.step_s == pytest.approx(15.0)
    no_prefetch = evaluate_plan(dataclasses.replace(best, prefetch_depth=0), MODEL,
                                dataclasses.replace(HARDWARE, comm_overlap=0.0), OPTIONS)
    assert no_prefetch.cost.step_s == pytest.approx(15.0)
    assert (report.lower_bound_reason, report.lower_bound_s) == ("network", pytest.approx(14.0))
    # Overlap 0.5: prefetch saves again (13.5 s against 14 s); the bound is 8 + 0.5 * 6 = 11 s.
    best, report = search(MODEL, dataclasses.replace(HARDWARE, comm_overlap=0.5), 10_000, device_only)
    assert (best.cache_blocks, best.prefetch_depth, report.winner.step_s) == ("all", 2, pytest.approx(13.5))
    assert report.lower_bound_s == pytest.approx(11.0)


def test_offload_the_search_is_not_forced_to_take():
    # Overlap 0 with room for everything, offload allowed. All on the device the plan is resident:
    # 11 + 3 s contention + 1 s optimizer = 15 s (test_contention_of_a_resident_plan). Offloading
    # chunk 1 makes it gather at first use; without prefetch the schedule ends at 12 (p0 gathers 0 -> 2,
    # computes 2 -> 3; p1 gathers chunk 1 3 -> 5, computes 5 -> 6; backward as before) + 2 s
    # contention: 14. The next step can start at 14.5 (device optimizer 0.5 s), the
    # worker runs 14 -> 17, the deadline is 14.5 + 5 - 2 = 17.5: hidden. 14.5 s < 15 s on the
    # device. Prefetching chunk 1 (ready at 4) moves its deadline to 16.5: 15 s, so depth 0 wins.
    # Predicted 3.3% faster: offloaded when any gain counts, kept on the device under the default
    # 10% ([Note: offloading for speed] in search.py).
    hardware = dataclasses.replace(HARDWARE, comm_overlap=0.0)
    best, report = search(MODEL, hardware, 10_000, dataclasses.replace(OPTIONS, min_offload_gain=0.0))
    assert (best.cache_blocks, best.prefetch_depth, report.winner.step_s) == ("all", 0, pytest.approx(14.5))
    assert [c.placement for c in best.chunks] == ["device", "cpu"] and report.cost.exposed_host_s == 0.0
    assert "all-device state fits too" in report.summary()
    best, report = search(MODEL, hardware, 10_000, OPTIONS)
    assert [c.placement for c in best.chunks] == ["device", "device"] and report.winner.step_s == pytest.approx(15.0)
    assert "offloading 1 chunk(s) is predicted only 3.3% faster, under the 10% it must gain" in report.summary()


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


def test_updates_started_in_backward_start_as_their_gradients_land():
    # test_offloading_one_chunk_to_the_cpu with a 10x faster copy down: chunk 1's gradient shard
    # (reduced at 9) lands at 9.2. Started at the step (11), its update (2 s AdamW + 1 s upload) ends
    # at 14, 0.5 s past its deadline of 13.5; started as it lands, at 12.2: hidden. Step 12 -> 11.5 s.
    fast_copy = dataclasses.replace(HARDWARE, d2h_bytes_per_s=1000.0)
    early = dataclasses.replace(OPTIONS, updates_in_backward=True)
    at_step = evaluate_plan(plan("all", 1, ("device", "cpu")), MODEL, fast_copy, OPTIONS).cost
    started = evaluate_plan(plan("all", 1, ("device", "cpu")), MODEL, fast_copy, early).cost
    assert at_step.copy_done_s == pytest.approx(9.2) and at_step.exposed_host_s == pytest.approx(0.5)
    assert started.exposed_host_s == 0.0 and started.step_s == pytest.approx(11.5)
    # NVMe chunks keep the step's launch; where the host is the device, nothing changes.
    for placements, hardware in ((("device", "nvme"), fast_copy), (("device", "cpu"), dataclasses.replace(
            fast_copy, device_name="cpu"))):
        at_step = evaluate_plan(plan("all", 1, placements), MODEL, hardware, OPTIONS).cost
        started = evaluate_plan(plan("all", 1, placements), MODEL, hardware, early).cost
        assert started == at_step



def test_the_worker_takes_the_landed_chunk_needed_first():
    # Chunks 2, 1, 0 land at 0, 1 and 1.5 s (the reverse of the forward's order), 2 s of work each. The
    # worker takes chunk 2 at once; free at 2, it finds 1 and 0 landed and takes 0, needed first.
    landed = [(0.0, 2, 2), (1.0, 1, 1), (1.5, 0, 0)]  # (time, place in the update order, chunk)
    assert _best_landed_first(landed, (2.0, 2.0, 2.0)) == [(2.0, 2), (4.0, 0), (6.0, 1)]
    # Idle between landings: each starts as it lands.
    assert _best_landed_first([(0.0, 1, 1), (5.0, 0, 0)], (1.0, 1.0)) == [(1.0, 1), (6.0, 0)]
