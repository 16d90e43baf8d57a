"""Memory model: every component of the predicted peak, worked out by hand."""

from __future__ import annotations

import dataclasses

import pytest

from lightning_elixir.search import SearchOptions, build_layout, memory_breakdown
from tests.search.profiles import chain_profile

# Two parameters of 100 elements, one chunk each (100 elements, world size 2 -> shards of 50).
OPTIONS = SearchOptions(world_size=2, margin_fraction=0.05, margin_bytes=0, reduce_buffers=2)


def test_all_on_device_in_bf16():
    model = chain_profile([[100], [100]], activation_bytes=1000)
    layout = build_layout(model, 100, 2)
    m = memory_breakdown(layout, model, 2, ("device", "device"), OPTIONS)
    assert m.param_shard_bytes == 2 * 50 * 2  # bf16 shards
    assert m.device_state_bytes == 2 * 50 * (4 + 8 + 4)  # fp32 master + AdamW + fp32 grad
    assert m.cache_bytes == 2 * 100 * 2  # two blocks of a full bf16 chunk
    assert m.private_bytes == 0
    assert m.reduce_buffer_bytes == 2 * 100 * 4  # two fp32 full-chunk gradient buffers
    assert m.activation_bytes == 1000
    subtotal = 200 + 1600 + 400 + 800 + 1000
    assert m.margin_bytes == subtotal * 5 // 100
    assert m.peak_bytes == 4200
    assert m.host_bytes == m.nvme_bytes == 0


def test_state_held_whole_counts_every_trained_element_and_the_steps_gathers_follow_the_activations():
    # A per-parameter optimizer: Adam's moments sharded (8 B), a preconditioner of 4 B per element held
    # whole by both ranks wherever the chunk is, and a step that gathers 16 B per element of a chunk.
    model = chain_profile([[100], [100]], activation_bytes=1000)
    layout = build_layout(model, 100, 2)
    options = dataclasses.replace(OPTIONS, whole_state_bytes_per_numel=4, step_gather_bytes_per_numel=16)
    base = memory_breakdown(layout, model, 2, ("device", "cpu"), OPTIONS)
    m = memory_breakdown(layout, model, 2, ("device", "cpu"), options)
    assert m.whole_state_bytes == 200 * 4  # both parameters whole, not a shard's 100 elements
    assert m.step_gather_bytes == 100 * 16  # the largest chunk
    assert m.device_state_bytes == base.device_state_bytes and m.host_bytes == base.host_bytes
    assert m.fixed_bytes == base.fixed_bytes + 800 + (1600 - 1000)  # the step's gathers replace the activations
    assert m.peak_bytes == (m.fixed_bytes + m.device_state_bytes) * 105 // 100
    smaller = memory_breakdown(layout, model, 2, ("device", "cpu"),
                               dataclasses.replace(options, step_gather_bytes_per_numel=4))
    assert smaller.fixed_bytes == base.fixed_bytes + 800  # 400 B gathered while 1000 B of activations were freed


def test_offloading_moves_state_off_the_device():
    model = chain_profile([[100], [100]], activation_bytes=1000)
    layout = build_layout(model, 100, 2)
    cpu = memory_breakdown(layout, model, 2, ("device", "cpu"), OPTIONS)
    assert cpu.device_state_bytes == 50 * 16
    assert cpu.host_bytes == 50 * 16
    assert cpu.peak_bytes == (4000 - 800) * 105 // 100
    nvme = memory_breakdown(layout, model, 2, ("device", "nvme"), OPTIONS)
    # The gradient shard is staged on the host; the record (master and optimizer states, 600 B) is
    # paged through 3 page buffers, each a 4096 B header block and the record padded to 4096 B.
    assert nvme.host_bytes == 50 * 4 + 3 * (4096 + 4096)
    assert nvme.nvme_bytes == 4096 + 4096  # the file: a header block and the padded record
    assert nvme.peak_bytes == cpu.peak_bytes


def test_nvme_page_buffers_are_sized_by_the_largest_nvme_record():
    # Public chunks of 6000 elements (m1, m2) and a private chunk of 10000 (m0, tied) at world size 2,
    # bf16, AdamW: shards of 3000, 3000 and 5056 (the private chunk padded to 10112, so that its shards are
    # multiples of 64 elements); a record (fp32 master + AdamW) is 12 B per element.
    model = chain_profile([[10_000], [6_000], [6_000]], shared=(0,))
    layout = build_layout(model, 6_000, 2)
    assert [(c.numel, c.private) for c in layout.chunks] == [(6_000, False), (6_000, False), (10_112, True)]
    options = dataclasses.replace(OPTIONS, nvme_buffers=2)
    # Chunk 1 on the CPU, chunks 0 and 2 on NVMe: the private chunk's record is the largest.
    m = memory_breakdown(layout, model, 2, ("nvme", "cpu", "nvme"), options)
    cpu_state = 3000 * (4 + 8 + 4)  # 48000
    staged_grads = (3000 + 5056) * 4  # 32224
    pages = 2 * (4096 + 61440)  # a header block + 5056 * 12 = 60672 B padded to 15 blocks of 4096 B, twice
    assert m.host_bytes == cpu_state + staged_grads + pages == 211296
    # Files: header block + 3000 * 12 = 36000 B padded to 36864; header block + 61440.
    assert m.nvme_bytes == (4096 + 36864) + (4096 + 61440) == 106496
    # The private chunk on the CPU instead: the largest NVMe record is 36000 B, 9 blocks.
    m = memory_breakdown(layout, model, 2, ("nvme", "nvme", "cpu"), options)
    assert m.host_bytes == 5056 * 16 + 2 * 3000 * 4 + 2 * (4096 + 36864) == 186816
    assert memory_breakdown(layout, model, 2, ("cpu", "cpu", "device"), options).nvme_bytes == 0


def test_nvme_needs_a_page_buffer():
    with pytest.raises(ValueError, match="nvme_buffers"):
        SearchOptions(nvme_buffers=0)


def test_fewer_blocks_and_a_private_chunk():
    model = chain_profile([[100], [100], [40]], activation_bytes=0, shared=(2,))
    layout = build_layout(model, 100, 2)
    m = memory_breakdown(layout, model, 1, ("device",) * 3, dataclasses.replace(OPTIONS, margin_fraction=0.0))
    private = 128  # 40 elements, padded so that each of the 2 shards is a multiple of 64 elements
    assert m.cache_bytes == 1 * 100 * 2
    assert m.private_bytes == private * 2  # gathered all step
    assert m.param_shard_bytes == (200 + private) // 2 * 2
    # + compute copies of the public chunks' shards, fp32 master and AdamW state, one cache block, the
    # private chunk gathered, two fp32 reduce buffers of the largest chunk (the private one)
    assert m.peak_bytes == (200 + private) + (200 + private) // 2 * 16 + 200 + private * 2 + 2 * private * 4


def test_fp32_keeps_one_copy_and_reduces_in_fp32():
    model = chain_profile([[100], [100]], activation_bytes=1000, compute_dtype="float32")
    layout = build_layout(model, 100, 2)
    m = memory_breakdown(layout, model, 2, ("device", "device"), OPTIONS)
    assert m.param_shard_bytes == 2 * 50 * 4  # the fp32 shard is the master
    assert m.device_state_bytes == 2 * 50 * (8 + 4)
    assert m.cache_bytes == 2 * 100 * 4
    assert m.peak_bytes == (400 + 1200 + 800 + 800 + 1000) * 105 // 100
    off = memory_breakdown(layout, model, 2, ("device", "cpu"), OPTIONS)
    assert off.host_bytes == 50 * (4 + 8 + 4)  # the host updates its own fp32 copy


def test_half_precision_reduce_halves_the_buffers():
    model = chain_profile([[100], [100]])
    layout = build_layout(model, 100, 2)
    options = dataclasses.replace(OPTIONS, reduce_in_fp32=False)
    assert memory_breakdown(layout, model, 2, ("device",) * 2, options).reduce_buffer_bytes == 2 * 100 * 2
