"""What the runtime itself costs, without communication: one process, plain module against Elixir.

    python examples/benchmarks/overhead.py                      # the harness's CPU GPT, 1 thread
    python examples/benchmarks/overhead.py --model llama --rounds 3

The same model and batches train with the module's own AdamW ("plain") and under ElixirRuntime at
world size 1 with the zero2 and zero3 presets. At world size 1 every collective is a local copy,
so the difference is the runtime's own work: module and gradient hooks, gradient copies into the
chunks, gathers into cache blocks. torch.profiler records ``--steps`` steps after 2 warm-up steps
per system and round (systems alternate their order every round); the tables give the host CPU
time per step (self time of every operator and label, summed), the operators whose time differs
most from plain, and what a sharded optimizer saves: AdamW over the whole model against AdamW over
half of it (each of 2 ranks' share), on flat fp32 tensors.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from typing import Callable

import torch
from torch.profiler import ProfilerActivity, profile

from lightning_elixir.plan import PRESETS
from lightning_elixir.runtime.optim import optimizer_step, shard_optimizer
from lightning_elixir.runtime.runtime import ElixirRuntime

SYSTEMS = ("plain", "zero2", "zero3")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=("gpt", "llama"), default="gpt")
    p.add_argument("--n-layer", type=int, default=6)
    p.add_argument("--n-embd", type=int, default=512)
    p.add_argument("--n-head", type=int, default=8)
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--block-size", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--steps", type=int, default=3, help="profiled steps per system and round")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="torch threads (the harness gives each of 2 ranks 1)")
    p.add_argument("--top", type=int, default=12, help="operators listed")
    return p.parse_args(argv)


def build(args: argparse.Namespace) -> torch.nn.Module:
    torch.manual_seed(0)
    if args.model == "gpt":
        from lightning_elixir.demos.gpt import GPTLightningModule as Module
    else:
        from lightning_elixir.demos.llama import LlamaLightningModule as Module
    return Module(vocab_size=args.vocab_size, block_size=args.block_size, n_layer=args.n_layer,
                  n_head=args.n_head, n_embd=args.n_embd)


def trainer_step(args: argparse.Namespace, system: str) -> Callable[[], None]:
    """One training step of ``system`` on a fresh model (forward, loss, backward, AdamW step)."""
    module = build(args)
    optimizer = module.configure_optimizers()
    if system == "plain":
        def step_optimizer() -> None:
            optimizer.step()
            optimizer.zero_grad()
    else:
        runtime = ElixirRuntime(module, PRESETS[system])
        optimizer = shard_optimizer(runtime, optimizer)

        def step_optimizer() -> None:
            optimizer_step(runtime, optimizer)
    tokens = torch.randint(0, args.vocab_size, (args.batch_size, args.block_size + 1),
                           generator=torch.Generator().manual_seed(1))
    batch = (tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())

    def step() -> None:
        module._loss(batch).backward()
        step_optimizer()
    return step


def measure(args: argparse.Namespace, system: str) -> tuple[float, float, dict[str, float]]:
    """Wall and CPU seconds per step, and self CPU seconds per step by operator or label."""
    step = trainer_step(args, system)
    for _ in range(2):
        step()
    wall, cpu = time.perf_counter(), time.process_time()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            step()
    wall, cpu = (time.perf_counter() - wall) / args.steps, (time.process_time() - cpu) / args.steps
    ops = {e.key: e.self_cpu_time_total / 1e6 / args.steps for e in prof.key_averages()}
    return wall, cpu, ops


def adamw_s(numel: int, repeats: int = 5) -> float:
    """Median CPU seconds of one AdamW step over a flat fp32 tensor of ``numel`` elements."""
    param = torch.nn.Parameter(torch.randn(numel))
    param.grad = torch.randn(numel)
    optimizer = torch.optim.AdamW([param], lr=1e-4)
    times = []
    for _ in range(repeats + 1):
        start = time.process_time()
        optimizer.step()
        times.append(time.process_time() - start)
    return statistics.median(times[1:])


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    walls, cpus, ops = defaultdict(list), defaultdict(list), defaultdict(lambda: defaultdict(list))
    for round_ in range(args.rounds):
        for system in SYSTEMS if round_ % 2 == 0 else SYSTEMS[::-1]:
            wall, cpu, by_op = measure(args, system)
            walls[system].append(wall)
            cpus[system].append(cpu)
            for key, seconds in by_op.items():
                ops[system][key].append(seconds)
    numel = sum(p.numel() for p in build(args).parameters())
    print(f"{args.model}: {numel / 1e6:.1f}M parameters, batch {args.batch_size} x {args.block_size}, "
          f"{args.threads} thread(s), {args.steps} profiled steps x {args.rounds} rounds, world size 1\n")
    print("| system | CPU ms/step | wall ms/step | CPU vs plain | profiled self CPU ms/step |")
    print("|---|---|---|---|---|")
    total = {s: statistics.mean(sum(v[i] for v in ops[s].values() if i < len(v)) for i in range(args.rounds))
             for s in SYSTEMS}
    for system in SYSTEMS:
        cpu = statistics.median(cpus[system])
        print(f"| {system} | {cpu * 1e3:.0f} | {statistics.median(walls[system]) * 1e3:.0f} | "
              f"{cpu / statistics.median(cpus['plain']):.3f} | {total[system] * 1e3:.0f} |")

    def mean(system: str, key: str) -> float:
        values = ops[system].get(key, [])
        return sum(values) / args.rounds
    keys = set(ops["plain"]) | set(ops["zero2"]) | set(ops["zero3"])
    top = sorted(keys, key=lambda k: -max(abs(mean(s, k) - mean("plain", k)) for s in ("zero2", "zero3")))
    print("\nOperators and labels that differ most from plain (self CPU ms per step, mean of rounds):\n")
    print("| operator | plain | zero2 | zero3 |")
    print("|---|---|---|---|")
    for key in top[:args.top]:
        print(f"| {key[:70]} | {mean('plain', key) * 1e3:.1f} | {mean('zero2', key) * 1e3:.1f} | "
              f"{mean('zero3', key) * 1e3:.1f} |")
    full, half = adamw_s(numel), adamw_s(numel // 2)
    print(f"\nAdamW step, flat fp32, CPU ms: whole model {full * 1e3:.1f}; half of it {half * 1e3:.1f} "
          f"(a sharded optimizer on 2 ranks saves {(full - half) * 1e3:.1f} ms per step)")


if __name__ == "__main__":
    main()
