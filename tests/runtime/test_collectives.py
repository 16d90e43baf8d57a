"""The collectives on gloo CPU tensors: the point-to-point reduce-scatter against a plain sum, with
several in flight and waited for out of order, at an odd world size, with the peers' parts received
into new buffers and into reused ones that hold other numbers."""

from __future__ import annotations

import torch

from lightning_elixir.runtime import collectives
from lightning_elixir.runtime.collectives import Group
from tests.distributed import run_distributed

WORLD_SIZE = 3
NUMEL = 3 * 1000


def _full(rank: int, index: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(NUMEL, generator=torch.Generator().manual_seed(100 * index + rank)).to(dtype)


def _reduce(rank: int, world_size: int) -> dict:
    group = Group.default()
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        fulls = [_full(rank, i, dtype) for i in range(4)]
        shards = [torch.empty(NUMEL // world_size, dtype=dtype) for _ in range(3)]
        n = NUMEL // world_size
        shards.append(fulls[3][rank * n:(rank + 1) * n])  # the last one read in place
        reused = torch.full(((world_size - 1) * n,), float("nan"), dtype=dtype)
        received = [None, reused, None, reused.clone()]
        pending = [collectives.reduce_scatter(shards[i], fulls[i], group, async_op=True, chunk=i, received=received[i])
                   for i in range(4)]
        gathered = torch.empty(NUMEL, dtype=dtype)
        mine = torch.full((NUMEL // world_size,), float(rank + 1), dtype=dtype)
        collectives.all_gather(gathered, mine, group)  # a collective while the reductions are in flight
        for work in reversed(pending):
            work.wait()
        out[str(dtype)] = {"shards": [s.clone() for s in shards], "gathered": gathered}
    out["issued"] = group.issued[0]
    return out


def test_reduce_scatter_sums_each_rank_part_whatever_the_order_of_waits():
    results = run_distributed(_reduce, WORLD_SIZE)
    n = NUMEL // WORLD_SIZE
    for dtype in (torch.float32, torch.bfloat16):
        for i in range(4):
            fulls = [_full(r, i, dtype) for r in range(WORLD_SIZE)]
            for rank, result in enumerate(results):
                got = result[str(dtype)]["shards"][i]
                # Each rank adds the others' parts to its own in rank order; bf16 sums round per addition.
                expected = fulls[rank][rank * n:(rank + 1) * n].clone()
                for r in range(WORLD_SIZE):
                    if r != rank:
                        expected += fulls[r][rank * n:(rank + 1) * n]
                torch.testing.assert_close(got, expected, rtol=0, atol=0)
                exact = sum(f[rank * n:(rank + 1) * n].double() for f in fulls)
                torch.testing.assert_close(got.double(), exact, rtol=1e-2 if dtype == torch.bfloat16 else 1e-6,
                                           atol=1e-2 if dtype == torch.bfloat16 else 1e-6)
        ranks = torch.arange(1, WORLD_SIZE + 1, dtype=dtype).repeat_interleave(n)
        for result in results:
            torch.testing.assert_close(result[str(dtype)]["gathered"], ranks, rtol=0, atol=0)
    assert len({r["issued"] for r in results}) == 1, "every rank counted the same collectives"


def _gather(rank: int, world_size: int, collective: bool) -> dict:
    group = Group.default()
    n = 5
    shard = torch.arange(n, dtype=torch.float32) + 10 * rank
    out = torch.full((world_size * n,), float("nan")) if rank == 0 else None
    if rank == 0 and not collective:
        out[:n].copy_(shard)
        shard = out[:n]  # the caller's own part already in place
    collectives.gather_to_first(out, shard, group, collective=collective)
    return {"out": out}


def test_gather_to_first_by_collective_and_point_to_point_give_rank_0_every_shard():
    expected = torch.cat([torch.arange(5, dtype=torch.float32) + 10 * r for r in range(WORLD_SIZE)])
    for collective in (True, False):
        results = run_distributed(_gather, WORLD_SIZE, collective)
        torch.testing.assert_close(results[0]["out"], expected, rtol=0, atol=0)
        assert all(r["out"] is None for r in results[1:])


class _SyncOnStream:
    """A process group that runs synchronous collectives in order on the current stream and returns no
    work handle, as NCCL does since torch 2.7; here rank 0 of two, whose peer holds the same values."""

    def allreduce(self, tensors, opts):
        if opts.reduceOp == torch.distributed.ReduceOp.SUM:
            tensors[0].mul_(2)
        return None  # a maximum of equal values is each of them

    def broadcast(self, tensors, opts):
        return None  # rank 0 is the source: its tensor is the result


def _gather_same(pg, out, shard, opts):
    out.copy_(shard.repeat(2))
    return None


def test_a_synchronous_collective_that_returns_no_work_handle_is_done(monkeypatch):
    group = Group(_SyncOnStream(), 0, 2)
    monkeypatch.setattr(collectives, "_ALL_GATHER", _gather_same)
    assert collectives.all_reduce_sum(torch.ones(3), group).tolist() == [2.0, 2.0, 2.0]
    assert collectives.broadcast(torch.full((2,), 5.0), group).tolist() == [5.0, 5.0]
    out = torch.zeros(4)
    assert collectives.all_gather(out, torch.tensor([1.0, 2.0]), group) is None
    assert out.tolist() == [1.0, 2.0, 1.0, 2.0]
    assert collectives.Agreement.start(torch.tensor([1.0, 7.0]), group).values() == [1.0, 7.0]
