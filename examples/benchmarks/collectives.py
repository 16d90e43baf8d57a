"""What a gradient reduction costs on gloo CPU processes, and why the runtime exchanges parts point to point.

    python examples/benchmarks/collectives.py                    # 2 ranks, 1-16 MiB buffers
    python examples/benchmarks/collectives.py --sizes-mib 4 --calls 10

1. One buffer at a time, torch.distributed directly: reduce_scatter_tensor, all_reduce (what
   DDP's buckets do), all_gather_into_tensor (a ZeRO forward's parameter gather, for scale) and the
   runtime's point-to-point exchange of parts followed by the additions. Median of ``--calls``.
2. Four buffers in flight at once, through the runtime's own collectives as a backward issues
   them: the exchange receiving into new buffers and into reused ones ([Note: reused gradient
   buffers] in runtime/chunk.py), an in-place all-reduce, and the all-gather. Wall and CPU time
   (all of a process's threads) per group of four, median of ``--calls``, per rank.

Every rank runs one thread, as the harness gives each of 2 ranks on 2 cores.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

# Imported here, before the ranks create their process group: lightning_elixir imports
# torch.distributed.checkpoint, and importing that after init_process_group makes gloo abort at exit now and then.
from lightning_elixir.runtime import collectives  # noqa: E402
from lightning_elixir.runtime.collectives import Group  # noqa: E402

IN_FLIGHT = 4


def _parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--sizes-mib", default="1,4,16", help="comma-separated buffer sizes (fp32)")
    p.add_argument("--calls", type=int, default=20, help="timed calls per measurement (after 3 untimed)")
    return p.parse_args(argv)


def _median_s(fn: Callable[[], None], calls: int) -> tuple[float, float]:
    """Median wall and CPU seconds of ``fn`` over ``calls`` calls, after 3 untimed ones."""
    for _ in range(3):
        fn()
    wall, cpu = [], []
    for _ in range(calls):
        start, start_cpu = time.perf_counter(), time.process_time()
        fn()
        wall.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    return statistics.median(wall), statistics.median(cpu)


def _single(rank: int, world_size: int, numel: int, calls: int) -> dict[str, float]:
    """Part 1: each collective on one buffer of ``numel`` fp32 elements, torch.distributed directly."""
    import torch
    import torch.distributed as dist

    n = numel // world_size
    full, out = torch.randn(numel), torch.empty(n)
    gathered, received = torch.empty(numel), torch.empty(world_size - 1, n)
    peers = [r for r in range(world_size) if r != rank]

    def exchange() -> None:
        works = [dist.isend(full[r * n:(r + 1) * n], r) for r in peers]
        works += [dist.irecv(received[i], r) for i, r in enumerate(peers)]
        for work in works:
            work.wait()
        mine = full[rank * n:(rank + 1) * n]
        for part in received:
            mine.add_(part)

    ops = {"reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(out, full),
           "all_reduce": lambda: dist.all_reduce(full),
           "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(gathered, out),
           "exchange + add": exchange}
    return {name: _median_s(fn, calls)[0] for name, fn in ops.items()}


def _in_flight(rank: int, world_size: int, numel: int, calls: int) -> dict[str, tuple[float, float]]:
    """Part 2: IN_FLIGHT buffers issued at once through the runtime's collectives, then waited for."""
    import torch
    import torch.distributed as dist

    group, n = Group.default(), numel // world_size
    fulls = [torch.randn(numel) for _ in range(IN_FLIGHT)]
    shards = [f[rank * n:(rank + 1) * n] for f in fulls]  # read in place, as a chunk does on the CPU
    reused = [torch.empty((world_size - 1) * n) for _ in range(IN_FLIGHT)]
    gathered = [torch.empty(numel) for _ in range(IN_FLIGHT)]

    def reduce(receive_into: list) -> Callable[[], None]:
        def run() -> None:
            works = [collectives.reduce_scatter(s, f, group, async_op=True, received=r)
                     for s, f, r in zip(shards, fulls, receive_into)]
            for work in works:
                work.wait()
        return run

    def all_reduce() -> None:
        for work in [dist.all_reduce(f, async_op=True) for f in fulls]:
            work.wait()

    def all_gather() -> None:
        for work in [collectives.all_gather(g, s, group, async_op=True) for g, s in zip(gathered, shards)]:
            work.wait()

    ops = {"exchange, new buffers": reduce([None] * IN_FLIGHT), "exchange, reused buffers": reduce(reused),
           "all-reduce": all_reduce, "all-gather": all_gather}
    return {name: _median_s(fn, calls) for name, fn in ops.items()}


def _rank(rank: int, world_size: int, sizes: list[int], calls: int) -> dict:
    import warnings

    import torch

    warnings.filterwarnings("ignore", category=FutureWarning)  # the *_tensor names, deprecated in torch 2.13
    torch.set_num_threads(1)
    return {numel: (_single(rank, world_size, numel, calls), _in_flight(rank, world_size, numel, calls))
            for numel in sizes}


def main(argv=None) -> None:
    args = _parse(argv)
    from tests.distributed import run_distributed

    sizes_mib = [float(s) for s in args.sizes_mib.split(",")]
    sizes = [max(args.ranks, round(mib * 2**20 / 4) // args.ranks * args.ranks) for mib in sizes_mib]
    start = time.perf_counter()
    ranks = run_distributed(_rank, args.ranks, sizes, args.calls)
    print(f"{args.ranks} gloo ranks, 1 thread each, fp32; medians of {args.calls} calls; "
          f"{time.perf_counter() - start:.0f} s in all\n")
    names = list(ranks[0][sizes[0]][0])
    print("## 1. One buffer, torch.distributed (ms, the slowest rank)\n")
    print("| buffer | " + " | ".join(names) + " |\n|---|" + "---|" * len(names))
    for mib, numel in zip(sizes_mib, sizes):
        cells = [f"{max(r[numel][0][name] for r in ranks) * 1e3:.1f}" for name in names]
        print(f"| {mib:g} MiB | " + " | ".join(cells) + " |")
    names = list(ranks[0][sizes[0]][1])
    print(f"\n## 2. {IN_FLIGHT} buffers in flight, the runtime's collectives (ms per group: wall, CPU; per rank)\n")
    print(f"| {IN_FLIGHT} buffers of | " + " | ".join(names) + " |\n|---|" + "---|" * len(names))
    for mib, numel in zip(sizes_mib, sizes):
        cells = [", ".join(f"{r[numel][1][name][0] * 1e3:.1f} / {r[numel][1][name][1] * 1e3:.1f}" for r in ranks)
                 for name in names]
        print(f"| {mib:g} MiB | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
