"""Offloaded chunks' host tensors are cut from a few slabs ([Note: pinned memory in slabs] in runtime/hostmem.py)."""

from __future__ import annotations

import random

import pytest
import torch

from lightning_elixir.plan import ChunkSpec
from lightning_elixir.runtime.chunk import host_requests
from lightning_elixir.runtime.hostmem import ALIGN, HostArena, slab_plan

MB = 1 << 20


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _check(sizes: list[int], slabs: list[tuple[int, list[int]]]) -> int:
    """Every tensor in exactly one slab that holds it; the slack."""
    placed = sorted(i for _, members in slabs for i in members)
    assert placed == [i for i, size in enumerate(sizes) if size > 0]
    for nbytes, members in slabs:
        assert _pow2(nbytes)
        assert sum(-(-sizes[i] // ALIGN) * ALIGN for i in members) <= nbytes
    return sum(nbytes for nbytes, _ in slabs) - sum(sizes)


def test_equal_shards_take_a_few_power_of_two_slabs_with_little_slack():
    shard = 8_400_000 * 4  # 33.6 MB: a block of its own would hold 64 MiB
    sizes = [shard] * 23
    slabs = slab_plan(sizes, rounds=True)
    slack = _check(sizes, slabs)
    assert len(slabs) <= 4
    assert slack < 0.15 * sum(sizes)  # a block per shard: 0.9 x the shards' bytes
    assert slack < len(slabs) * shard


@pytest.mark.parametrize("seed", range(20))
def test_any_sizes_fit_with_under_one_tensor_of_slack_per_slab(seed):
    rng = random.Random(seed)
    sizes = [rng.choice([0, rng.randrange(1, 4 * MB), rng.randrange(4 * MB, 64 * MB)]) for _ in range(rng.randrange(1, 40))]
    slabs = slab_plan(sizes, rounds=True)
    slack = _check(sizes, slabs)
    largest = max(sizes)
    assert slack < len(slabs) * (largest + ALIGN) + ALIGN * len(sizes)


def test_without_rounding_one_slab_holds_everything_aligned():
    sizes = [100, 0, 4096, 12]
    (nbytes, members), = slab_plan(sizes, rounds=False)
    assert sorted(members) == [0, 2, 3] and nbytes == 128 + 4096 + 64
    assert slab_plan([0, 0], rounds=False) == slab_plan([], rounds=True) == []


def test_the_arena_hands_out_zeroed_disjoint_views_in_the_order_asked():
    requests = [(1000, torch.float32), (17, torch.bfloat16), (0, torch.float32), (333, torch.float64)]
    arena = HostArena(requests, pin=False)
    views = [arena.zeros(numel, dtype) for numel, dtype in requests]
    for view, (numel, dtype) in zip(views, requests):
        assert view.numel() == numel and view.dtype == dtype and view.is_contiguous()
        assert not view.any() and view.data_ptr() % ALIGN == 0 or numel == 0
        view.fill_(1)
    for view in views:  # writing one touched no other
        assert bool((view == 1).all())
    assert arena.slack_bytes == sum(s.numel() for s in arena.slabs) - (4000 + 34 + 333 * 8)
    with pytest.raises(AssertionError, match="asked as"):
        arena.zeros(1, torch.float32)


def test_a_chunk_keeps_in_host_memory_its_gradient_shard_and_a_master_it_updates_there():
    def spec(placement):
        return ChunkSpec(params=("w",), numel=64, placement=placement)

    f32, bf16 = torch.float32, torch.bfloat16
    assert host_requests(spec("device"), 32, f32, f32) == {}
    assert host_requests(spec("cpu"), 32, f32, f32) == {"master": (32, f32), "grad_shard": (32, f32)}
    assert host_requests(spec("cpu"), 32, bf16, f32) == {"grad_shard": (32, f32)}  # goes up through staging
    assert host_requests(spec("nvme"), 32, f32, f32) == {"grad_shard": (32, f32)}  # the master is paged out
