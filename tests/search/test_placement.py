"""The placement ladder: earliest-reduced chunks leave first, to the CPU while host memory lasts, then NVMe."""

from __future__ import annotations

from lightning_elixir.search import SearchOptions, build_layout, memory_breakdown
from lightning_elixir.search.placement import placement_ladder
from tests.search.profiles import chain_profile

# Three 1024-element chunks at world size 1, fp32 compute: 16 B of state per element (4 master copy
# for the host, 8 AdamW, 4 gradient), so 16 KiB per chunk on the CPU. An NVMe chunk keeps 4 KiB (its
# gradient) in host memory; its record (master copy and AdamW) is 12 KiB, three 4096 B blocks, and
# every page buffer holds one record behind a 4096 B header block: 16 KiB. Backward reaches chunk 2
# first, so it is reduced first and leaves first.
MODEL = chain_profile([[1024], [1024], [1024]], compute_dtype="float32")
LAYOUT = build_layout(MODEL, 1024, 1)
KiB = 1024


def ladder(**kw):
    return placement_ladder(LAYOUT, MODEL, SearchOptions(world_size=1, **kw), nvme_ok=kw.get("nvme_available", False))


def test_unlimited_host_memory_offloads_everything_to_the_cpu_in_reduce_order():
    rungs = ladder()
    assert [r.placements for r in rungs] == [
        ("device", "device", "device"), ("device", "device", "cpu"), ("device", "cpu", "cpu"), ("cpu", "cpu", "cpu")]
    assert [r.device_state_bytes for r in rungs] == [36 * KiB, 24 * KiB, 12 * KiB, 0]  # fp32: no separate master
    assert [r.host_bytes for r in rungs] == [0, 16 * KiB, 32 * KiB, 48 * KiB]


def test_the_cpu_fills_first_then_the_first_chunks_move_to_nvme():
    # One page buffer (16 KiB). Rung 3 cannot keep all three on the CPU (48 KiB > 40 KiB), nor move
    # only chunk 2 (4 + 32 + 16 = 52 KiB); moving chunks 2 and 1 fits: 8 + 16 + 16 = 40 KiB.
    rungs = ladder(host_memory_bytes=40 * KiB, nvme_available=True, nvme_buffers=1)
    assert [r.placements for r in rungs] == [
        ("device", "device", "device"), ("device", "device", "cpu"), ("device", "cpu", "cpu"),
        ("cpu", "nvme", "nvme")]
    assert [r.host_bytes for r in rungs] == [0, 16 * KiB, 32 * KiB, 40 * KiB]


def test_nvme_needs_host_memory_for_its_page_buffers():
    # Three page buffers (48 KiB): the best split of rung 3 is all on NVMe, 12 + 48 = 60 KiB > 44 KiB.
    rungs = ladder(host_memory_bytes=44 * KiB, nvme_available=True)
    assert [r.placements for r in rungs][-1] == ("device", "cpu", "cpu")
    assert not any(r.nvme_chunks for r in rungs)
    # NVMe alone: one chunk needs its gradient and the pages, 4 + 48 = 52 KiB; a byte less refuses it.
    assert len(ladder(host_memory_bytes=52 * KiB - 1, nvme_available=True, allow_cpu=False)) == 1
    rungs = ladder(host_memory_bytes=52 * KiB, nvme_available=True, allow_cpu=False)
    assert [r.placements for r in rungs] == [("device", "device", "device"), ("device", "device", "nvme")]


def test_the_pages_are_paid_once():
    rungs = ladder(nvme_available=True, allow_cpu=False)
    assert [r.host_bytes for r in rungs] == [0, 52 * KiB, 56 * KiB, 60 * KiB]


def test_without_nvme_the_ladder_stops_where_host_memory_does():
    assert len(ladder(host_memory_bytes=40 * KiB)) == 3
    assert len(ladder(allow_cpu=False)) == 1


def test_every_rung_holds_what_the_memory_model_counts():
    for buffers in (1, 3):
        options = SearchOptions(world_size=1, host_memory_bytes=40 * KiB, nvme_available=True, nvme_buffers=buffers)
        for rung in placement_ladder(LAYOUT, MODEL, options, nvme_ok=True):
            memory = memory_breakdown(LAYOUT, MODEL, 3, rung.placements, options)
            assert rung.host_bytes == memory.host_bytes <= 40 * KiB
            assert rung.device_state_bytes == memory.device_state_bytes
