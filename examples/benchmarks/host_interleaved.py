"""host_overhead.py's systems and models, measured interleaved: robust to a machine shared with other jobs.

    python examples/benchmarks/host_interleaved.py --model llama --world-size 2
    python examples/benchmarks/host_interleaved.py --model moe --systems ddp,elixir_zero2 --steps 60

host_overhead.py runs each system in its own processes one after the other, so load from another job
that comes and goes lands on some systems and not others (on a shared 2-core machine its ratios moved
by 10-40% between runs). Here every rank builds every system once and runs their steps round-robin
(the order reversed every other step, a barrier before each), so each system sees the same load;
a system's step time is the median over steps of the slowest rank. No profiled pass.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from examples.benchmarks import host_overhead  # noqa: E402
from tests.distributed import run_distributed  # noqa: E402


def run_rank(rank: int, world_size: int, args: argparse.Namespace) -> dict[str, float]:
    steps = {s: host_overhead.make_step(args, s, False, world_size) for s in args.system_list}
    times: dict[str, list[float]] = {s: [] for s in args.system_list}
    for i, batch in enumerate(host_overhead.batches(args, rank, args.warmup + args.steps)):
        for system in args.system_list if i % 2 == 0 else args.system_list[::-1]:
            dist.barrier()
            start = time.perf_counter()
            steps[system](batch)
            if i >= args.warmup:
                times[system].append(time.perf_counter() - start)
    out = {}
    for system, ts in times.items():
        per_step = torch.tensor(ts)
        dist.all_reduce(per_step, op=dist.ReduceOp.MAX)  # the slowest rank sets each step
        out[system] = statistics.median(per_step.tolist())
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-size", type=int, default=1)
    argv, rest = p.parse_known_args()
    args = host_overhead.parse_args(["--checkpointing", "off", "--systems", "ddp,elixir_zero2,elixir_zero3,elixir",
                                     "--steps", "40", *rest])
    best = run_distributed(run_rank, argv.world_size, args)[0]
    print(f"| model | world size | " + " | ".join(args.system_list) + " |")
    print("|---|---|" + "---|" * len(args.system_list))
    print(f"| {args.model} | {argv.world_size} | " + " | ".join(
        f"{best[s] * 1e3:.1f} ms ({best[s] / best['ddp']:.2f}x)" for s in args.system_list) + " |")


if __name__ == "__main__":
    main()
