"""The placement ladder: earliest-reduced chunks leave first, to the CPU while it has room, then NVMe."""

from __future__ import annotations

from lightning_elixir.search import SearchOptions, build_layout
from lightning_elixir.search.placement import placement_ladder
from tests.search.profiles import chain_profile

# Three 100-element chunks at world size 1, fp32 compute: 16 B of state per element (4 master copy
# for the host, 8 AdamW, 4 gradient), so 1600 B per chunk; an NVMe chunk keeps 400 B (its gradient)
# in host memory. Backward reaches chunk 2 first, so it is reduced first and leaves first.
MODEL = chain_profile([[100], [100], [100]], compute_dtype="float32")
LAYOUT = build_layout(MODEL, 100, 1)


def ladder(**kw):
    return placement_ladder(LAYOUT, MODEL, SearchOptions(world_size=1, **kw), nvme_ok=kw.get("nvme_available", False))


def test_unlimited_host_memory_offloads_everything_to_the_cpu_in_reduce_order():
    rungs = ladder()
    assert [r.placements for r in rungs] == [
        ("device", "device", "device"), ("device", "device", "cpu"), ("device", "cpu", "cpu"), ("cpu", "cpu", "cpu")]
    assert [r.device_state_bytes for r in rungs] == [3 * 1200, 2 * 1200, 1200, 0]  # fp32: no separate master
    assert [r.host_bytes for r in rungs] == [0, 1600, 3200, 4800]


def test_the_cpu_fills_first_then_nvme_until_host_memory_runs_out():
    rungs = ladder(host_memory_bytes=2000, nvme_available=True)
    assert [r.placements for r in rungs] == [
        ("device", "device", "device"), ("device", "device", "cpu"), ("device", "nvme", "cpu")]
    assert rungs[-1].host_bytes == 2000


def test_without_nvme_the_ladder_stops_where_host_memory_does():
    assert len(ladder(host_memory_bytes=2000)) == 2
    assert len(ladder(allow_cpu=False)) == 1
