"""Offloaded optimizer state: how fast the host updates it, how much of that a step shows, NVMe.

    python examples/benchmarks/offload.py             # the CPU tables, ~3-4 minutes on 2 cores, < 3 GB
    python examples/benchmarks/offload.py --quick     # smaller sizes, under a minute
    python examples/benchmarks/offload.py --gpu-only  # the GPU table alone (needs CUDA)
    python examples/benchmarks/offload.py --host-only # table 1 and the launching thread beside the worker

1. CPU optimizer update, in this process: AdamW over one flat fp32 shard split into parameter views
   (as a chunk's parameters are views of its shard) with torch's implementations and with the
   runtime's own ``Shadow`` (what the offload worker runs on machines with an accelerator), against
   the memory-bandwidth bound: the copy bandwidth measured here / 28 bytes per element (AdamW reads
   param, grad, exp_avg, exp_avg_sq and writes param, exp_avg, exp_avg_sq: 7 x 4 bytes). Then the
   thread that launches a step's work beside the worker, with the worker's threads at every core and
   at every core but one.
2. Exposed optimizer time, on 2 spawned gloo ranks (one CPU thread each) training the example GPT
   under plans with one chunk layout and different placements, all alive at once. A sample is two
   steps: the second is timed end to end (forward, backward, ``optimizer_step``, ``zero_grad``), so
   it holds the wait in its forward for the update the first launched; then its own update is
   waited for with nothing else running (the update alone). Samples of all plans alternate, so
   that load drifting on the machine shifts the plans alike, and differences are paired per round.
3. NVMe throughput during those steps (the plan with the last chunks on "nvme"): the store's own
   counters against ``dd`` with direct I/O on the same directory, measured after the ranks finish.
4. On a GPU only: the example GPT under an emulated memory budget, plan="auto" with offload,
   every chunk on "cpu", and FSDP2 with ``CPUOffloadPolicy``, in tokens/s.

Medians of a few steps; nothing is asserted about timings (they vary with the machine and its load).
"""

from __future__ import annotations

import argparse
import copy
import gc
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Optional

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from lightning_elixir.demos.gpt import GPT, GPTConfig  # noqa: E402
from lightning_elixir.plan import CACHE_ALL, ElixirPlan  # noqa: E402
from lightning_elixir.profile import bench, optimizer_bench  # noqa: E402
from lightning_elixir.runtime.layout import resolve_specs  # noqa: E402
from lightning_elixir.runtime.optim import optimizer_step, shard_optimizer  # noqa: E402
from lightning_elixir.runtime.policy import PrecisionPolicy  # noqa: E402
from lightning_elixir.runtime.runtime import ElixirRuntime  # noqa: E402
from lightning_elixir.runtime.shadow import Shadow  # noqa: E402
from tests.distributed import free_port, run_distributed  # noqa: E402

MB = 1e6
MiB = 1 << 20
GiB = 1 << 30
WORLD_SIZE = 2
LR = 1e-4
ADAMW_BYTES_PER_NUMEL = 7 * 4
"""AdamW reads param, grad, exp_avg, exp_avg_sq and writes param, exp_avg, exp_avg_sq (fp32)."""
DD_BLOCK_BYTES = 4 * MiB
# Defaults of the options left unset, per --quick. Table 2's GPT takes few tokens per step for its size
# (a step of ~0.4-0.6 s on 2 cores): its offloaded update is then ~5% of a step rather than ~1%, which
# the step-time noise of a shared machine would bury.
SIZES = {
    False: dict(numel=100_000_000, rounds=2, n_layer=4, n_embd=512, vocab_size=4096, batch_size=2, samples=20,
                dd_mib=1024),
    True: dict(numel=10_000_000, rounds=1, n_layer=2, n_embd=256, vocab_size=2048, batch_size=1, samples=3,
               dd_mib=256),
}


def _parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smaller sizes and fewer steps")
    p.add_argument("--numel", type=int, help="elements of the shard of table 1 (100M; quick 10M)")
    p.add_argument("--views", type=int, default=8, help="parameter views the shard is split into")
    p.add_argument("--repeats", type=int, default=3, help="timed optimizer steps per variant (after one warm-up)")
    p.add_argument("--rounds", type=int, help="passes over the variants of table 1, order reversed each pass; "
                   "the fastest counts")
    p.add_argument("--n-layer", type=int)
    p.add_argument("--n-embd", type=int)
    p.add_argument("--n-head", type=int, default=8)
    p.add_argument("--vocab-size", type=int)
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--batch-size", type=int, help="sequences per rank")
    p.add_argument("--chunks", type=int, default=12, help="public chunks the layout aims for")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per plan")
    p.add_argument("--samples", type=int, help="rounds of one sample (two steps) per plan")
    p.add_argument("--nvme-path", help="directory for NVMe records and dd (default: a temp dir under /tmp)")
    p.add_argument("--dd-mib", type=int, help="MiB dd moves per measurement")
    p.add_argument("--gpu-only", action="store_true", help="only the GPU table")
    p.add_argument("--host-only", action="store_true",
                   help="only the tables of this process: the host update and the launching thread beside it")
    p.add_argument("--gpu-n-layer", type=int, default=12)
    p.add_argument("--gpu-n-embd", type=int, default=2048)
    p.add_argument("--gpu-n-head", type=int, default=16)
    p.add_argument("--gpu-vocab-size", type=int, default=50304)
    p.add_argument("--gpu-block-size", type=int, default=1024)
    p.add_argument("--gpu-batch-size", type=int, default=2)
    p.add_argument("--gpu-budget-gib", type=float, default=10.0, help="emulated device memory")
    p.add_argument("--gpu-warmup", type=int, default=2)
    p.add_argument("--gpu-steps", type=int, default=5)
    args = p.parse_args(argv)
    for key, value in SIZES[args.quick].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def print_table(header: tuple, rows: list[tuple]) -> None:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    for row in [header, tuple("-" * w for w in widths), *rows]:
        print("  ".join(str(cell).rjust(w) for cell, w in zip(row, widths)))


def _times_s(fn: Callable[[], object], repeats: int, warmup: int = 1) -> list[float]:
    """Seconds of each of ``repeats`` calls of ``fn`` after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def _median_s(fn: Callable[[], object], repeats: int, warmup: int = 1) -> float:
    """Median seconds of ``repeats`` calls of ``fn`` after ``warmup`` calls."""
    return statistics.median(_times_s(fn, repeats, warmup))


# ---- 1. CPU optimizer update --------------------------------------------------------------------


def copy_bytes_per_s(numel: int, repeats: int) -> tuple[float, float]:
    """(copy, add) bandwidth, the fastest call (a bound): ``dst.copy_(src)`` moves 2 x 4 bytes per
    element, ``add(out=)`` 3 x 4."""
    a, b, out = torch.rand(numel), torch.rand(numel), torch.empty(numel)
    copy_s = min(_times_s(lambda: out.copy_(a), repeats + 2))
    add_s = min(_times_s(lambda: torch.add(a, b, out=out), repeats + 2))
    return 8 * numel / copy_s, 12 * numel / add_s


def _parameters(master: torch.Tensor, grad: torch.Tensor, views: int) -> list[nn.Parameter]:
    """Views of ``master`` as parameters, their gradients views of ``grad``."""
    params = [nn.Parameter(v) for v in master.tensor_split(views)]
    for p, g in zip(params, grad.tensor_split(views)):
        p.grad = g
    return params


def torch_step_s(master: torch.Tensor, grad: torch.Tensor, args: argparse.Namespace, **impl) -> float:
    """Median step of ``torch.optim.AdamW(**impl)`` over the views (its state freed on return)."""
    optimizer = torch.optim.AdamW(_parameters(master, grad, args.views), lr=LR, **impl)
    return _median_s(optimizer.step, args.repeats)


def shadow_step_s(master: torch.Tensor, grad: torch.Tensor, args: argparse.Namespace, on_worker: bool) -> float:
    """Median step of the runtime's ``Shadow`` (fused where unset), on this thread or on one worker thread."""
    user = [nn.Parameter(v) for v in master.tensor_split(args.views)]
    members = [(0, u, nn.Parameter(v)) for u, v in zip(user, master.tensor_split(args.views))]
    shadow = Shadow(torch.optim.AdamW(user, lr=LR), members, fused_when_unset=True)
    grads = list(grad.tensor_split(args.views))

    def step() -> None:
        shadow.step(shadow.snapshot(), grads)

    if not on_worker:
        return _median_s(step, args.repeats)
    with ThreadPoolExecutor(1, thread_name_prefix="bench-offload") as worker:
        return _median_s(lambda: worker.submit(step).result(), args.repeats)


def update_table(args: argparse.Namespace) -> None:
    load = os.getloadavg()[0]
    master, grad = torch.randn(args.numel) * 0.02, torch.randn(args.numel) * 1e-3
    variants = [
        ("AdamW foreach=True", lambda: torch_step_s(master, grad, args, foreach=True)),
        ("AdamW fused=True", lambda: torch_step_s(master, grad, args, fused=True)),
        ("AdamW default (CPU: per-tensor loop)", lambda: torch_step_s(master, grad, args)),
        ("Shadow, fused_when_unset (this thread)", lambda: shadow_step_s(master, grad, args, on_worker=False)),
        ("Shadow, fused_when_unset (worker thread)", lambda: shadow_step_s(master, grad, args, on_worker=True)),
    ]
    seconds: dict[str, float] = {}
    copy_bps = add_bps = 0.0
    for r in range(args.rounds):  # the order reversed every other round, so that drifting load hits all alike
        bandwidth = copy_bytes_per_s(args.numel, args.repeats)
        copy_bps, add_bps = max(copy_bps, bandwidth[0]), max(add_bps, bandwidth[1])
        gc.collect()
        for name, run in variants if r % 2 == 0 else variants[::-1]:
            seconds[name] = min(run(), seconds.get(name, math.inf))
            gc.collect()
    seconds = {name: seconds[name] for name, _ in variants}
    bound = max(copy_bps, add_bps) / ADAMW_BYTES_PER_NUMEL
    fused = args.numel / seconds["AdamW fused=True"]
    print(f"## 1. CPU optimizer update: AdamW on a {args.numel / 1e6:.0f}M-element fp32 shard in {args.views} "
          f"views, {torch.get_num_threads()} threads (torch.get_num_threads()), {os.cpu_count()} CPUs; "
          f"1-minute load average before: {load:.2f}\n")
    print(f"copy bandwidth {copy_bps / 1e9:.1f} GB/s (copy_: 2 x 4 B/element), {add_bps / 1e9:.1f} GB/s "
          f"(add out=: 3 x 4 B/element), fastest call of all rounds; bound = the larger / "
          f"{ADAMW_BYTES_PER_NUMEL} B/element = "
          f"{bound / 1e6:.0f} M elements/s. One warm-up step, median of {args.repeats}, fastest of "
          f"{args.rounds} rounds. The worker-thread row runs the Shadow as the offload engine does (on one "
          f"worker thread; with an accelerator this is the offloaded chunks' update). copy_ and add count the "
          f"bytes the code names; the caches also read each line before it is written (write-allocate: 1.5x "
          f"and 1.33x those bytes), which an in-place update avoids, so a one-pass kernel can exceed 100%.\n")
    rows = [(name, f"{s * 1e3:.0f}", f"{args.numel / s / 1e6:.0f}", f"{args.numel / s / fused:.2f}",
             f"{100 * args.numel / s / bound:.0f}%") for name, s in seconds.items()]
    print_table(("implementation", "ms/step", "M elements/s", "vs fused", "of bound"), rows)
    print()


def feeding_table(args: argparse.Namespace) -> None:
    """The thread that launches the device's work, beside the offload worker, with the worker's intra-op
    threads at every core and at every core but one ([Note: a core for the thread that feeds the device])."""
    numel = args.numel // 4
    params = [nn.Parameter(torch.zeros(numel)) for _ in range(4)]
    for p in params:
        p.grad = torch.full_like(p, 1e-3)
    optimizers = [torch.optim.AdamW([p]) for p in params]  # torch's CPU default, as the shadows on a CPU
    x = torch.zeros(16)

    def launches_per_s(until: Callable[[], bool]) -> float:
        count, start = 0, time.perf_counter()
        while not until():
            for _ in range(64):
                x.add_(1.0)
            count += 64
        return count / (time.perf_counter() - start)

    def updates() -> float:
        start = time.perf_counter()
        for _ in range(args.repeats):
            for optimizer in optimizers:
                optimizer.step()
        return (time.perf_counter() - start) / (args.repeats * len(optimizers))

    threads = torch.get_num_threads()
    rows = []
    for count in sorted({threads, max(1, threads - 1)}, reverse=True):
        deadline = time.perf_counter() + 1.0
        alone = launches_per_s(lambda: time.perf_counter() > deadline)
        with ThreadPoolExecutor(1, initializer=torch.set_num_threads, initargs=(count,)) as worker:
            worker.submit(updates).result()  # warm-up: the state is created
            timed = worker.submit(updates)
            beside = launches_per_s(timed.done)
            rows.append((str(count), f"{timed.result() * 1e3:.1f}", f"{alone / 1e3:.0f}", f"{beside / 1e3:.0f}",
                         f"{beside / alone:.2f}"))
    print(f"### The launching thread beside the worker: AdamW on 4 shards of {numel / 1e6:.1f}M elements in a worker "
          f"thread, while this thread runs tiny operators (x.add_ on 16 elements) as a step's Python launches "
          f"kernels; {threads} threads in this process\n")
    print_table(("worker threads", "update ms/shard", "launches/s alone (k)", "beside the worker (k)", "ratio"),
                rows)
    print()


# ---- 2 and 3. offloaded steps, inside the ranks ---------------------------------------------------


def _config(args: argparse.Namespace) -> GPTConfig:
    return GPTConfig(vocab_size=args.vocab_size, block_size=args.block_size, n_layer=args.n_layer,
                     n_head=args.n_head, n_embd=args.n_embd)


def _loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    logits = model(batch[0])
    return F.cross_entropy(logits.float().flatten(0, 1), batch[1].flatten())


def _batch(seed: int, config: GPTConfig, batch_size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(config.vocab_size, (batch_size, config.block_size), generator=g)
    return x.to(device), torch.roll(x, -1, dims=1).to(device)


IN_BACKWARD = ", started in backward"
"""The name suffix of a plan whose offloaded updates start in backward."""


def chunk_numel_for(model: GPT, chunks: int) -> int:
    """A capacity that packs the public parameters (all but the tied embedding) into about ``chunks``."""
    public = [p for p in model.parameters() if p is not model.wte.weight]
    return max(max(p.numel() for p in public), math.ceil(sum(p.numel() for p in public) / chunks))


def placed_plans(model: GPT, chunks: int) -> dict[str, ElixirPlan]:
    """One layout, four placements; "last half" = the last public chunks by index (the last layers)."""
    specs = resolve_specs(model, ElixirPlan(chunk_numel=chunk_numel_for(model, chunks)), WORLD_SIZE)
    public = [i for i, s in enumerate(specs) if not s.private]
    last_half = set(public[len(public) // 2:])

    def plan(name: str, where: Callable[[int], str]) -> ElixirPlan:
        placed = tuple(replace(s, placement=where(i)) for i, s in enumerate(specs))
        return ElixirPlan(chunks=placed, world_size=WORLD_SIZE, cache_blocks=CACHE_ALL, name=name)

    return {"device": plan("device", lambda i: "device"),
            "cpu, last half": plan("cpu, last half", lambda i: "cpu" if i in last_half else "device"),
            "cpu, all": plan("cpu, all", lambda i: "cpu"),
            "nvme, last half": plan("nvme, last half", lambda i: "nvme" if i in last_half else "device")}


def _io(runtime: ElixirRuntime) -> dict[str, float]:
    store = runtime.offload.store
    if store is None:
        return {}
    s = store.stats
    return {"bytes_read": s.bytes_read, "bytes_written": s.bytes_written, "read_s": s.read_s,
            "write_s": s.write_s, "reads": s.reads, "writes": s.writes}


@dataclass
class PlanRun:
    """One plan on this rank: its own copy of the model, runtime and optimizer, kept for the whole run."""

    model: nn.Module
    runtime: ElixirRuntime
    optimizer: torch.optim.Optimizer
    batch: tuple[torch.Tensor, torch.Tensor]
    in_backward: bool = False
    """Offloaded updates start in backward ([Note: updates started in backward]), as the strategy allows
    for a step with nothing between backward and the optimizer step."""

    @classmethod
    def open(cls, plan: ElixirPlan, base: GPT, batch: tuple, nvme_path: str, in_backward: bool = False) -> "PlanRun":
        model = copy.deepcopy(base)
        runtime = ElixirRuntime(model, plan, nvme_path=nvme_path)
        optimizer = shard_optimizer(runtime, torch.optim.AdamW(model.parameters(), lr=LR))
        return cls(model, runtime, optimizer, batch, in_backward)

    def step(self) -> tuple[float, float, float]:
        """One step: (its seconds, the seconds in ``optimizer_step``, ``update_s`` once backward is done).

        The forward gathers every chunk, so by the end of backward the previous step's update is done.
        """
        start = time.perf_counter()
        self.runtime.offload.early = self.in_backward
        try:
            _loss(self.model, self.batch).backward()
        finally:
            self.runtime.offload.early = False
        updated_s, stepping = self.runtime.offload.update_s, time.perf_counter()
        optimizer_step(self.runtime, self.optimizer)
        optimizer_s = time.perf_counter() - stepping
        self.optimizer.zero_grad()
        return time.perf_counter() - start, optimizer_s, updated_s

    def sample(self) -> dict:
        """Two steps: the first's update overlaps the second, which is timed; the second's update is then
        waited for, alone. Starts and ends with no update in flight, so the plans of a round do not overlap.
        """
        offload, io = self.runtime.offload, _io(self.runtime)
        before_s = offload.update_s
        self.step()
        step_s, optimizer_s, updated_s = self.step()
        offload.settle()  # the main thread waits: the update runs alone
        if offload.store is not None:
            offload.store.flush()  # its records written back: counted in this sample
        io_after = _io(self.runtime)
        return {"step_s": step_s, "optimizer_s": optimizer_s, "in_run_s": updated_s - before_s,
                "alone_s": offload.update_s - updated_s, "io": {k: io_after[k] - io[k] for k in io}}

    def close(self) -> dict:
        """What the summary needs besides the samples; gives the module back, removes the NVMe files."""
        store = self.runtime.offload.store
        out = {"offloaded": sum(c.offloaded for c in self.runtime.chunks), "chunks": len(self.runtime.chunks),
               "direct_io": getattr(store, "_direct", None)}  # no public flag says whether O_DIRECT held
        self.runtime.restore_module()
        return out


def bench_rank(rank: int, world_size: int, args: argparse.Namespace, nvme_path: str) -> dict[str, dict]:
    """Every plan warmed up, then ``samples`` rounds of one sample per plan (order reversed every other
    round): drifting load then shifts the plans of one round alike, and the tables compare them per round."""
    torch.manual_seed(0)
    base = GPT(_config(args))
    batch = _batch(rank, _config(args), args.batch_size, torch.device("cpu"))
    plans = placed_plans(base, args.chunks)
    runs = {name: PlanRun.open(plan, base, batch, nvme_path) for name, plan in plans.items()}
    for name in ("cpu, last half", "cpu, all"):
        runs[name + IN_BACKWARD] = PlanRun.open(plans[name], base, batch, nvme_path, in_backward=True)
    for run in runs.values():
        for _ in range(args.warmup):
            run.step()
        run.runtime.offload.settle()
    dist.barrier()
    samples: dict[str, list[dict]] = {name: [] for name in runs}
    names = list(runs)
    for r in range(args.samples):
        for name in names if r % 2 == 0 else names[::-1]:
            samples[name].append(runs[name].sample())
    predicted = predicted_updates_s(runs)
    return {name: {**predicted[name], **run.close(), "samples": samples[name]} for name, run in runs.items()}


def predicted_updates_s(runs: dict[str, "PlanRun"]) -> dict[str, dict[str, float]]:
    """Per plan, the worker's seconds per step the cost model predicts for this rank's chunks in host
    memory (NVMe paging left out), from the hardware profile's host update numbers as measured before
    (one fused AdamW on cached state, on the main thread; the upload at the copy bandwidth) and now
    ([Note: measuring host updates]), both measured here, in this rank's threads."""
    cpu, sizes = torch.device("cpu"), bench.BenchSizes.for_device(torch.device("cpu"))
    old_rate = optimizer_bench.optimizer_numel_per_s(cpu, sizes.optimizer_numel, sizes.iters)
    old_upload = bench.host_transfer_bytes_per_s(cpu, sizes)[0]
    now = optimizer_bench.host_update_costs(cpu, torch.float32, sizes)
    out = {}
    for name, run in runs.items():
        shards = [c.shard_numel for c in run.runtime.chunks if c.placement == "cpu"]
        out[name] = {"predicted_old_s": sum(n / old_rate + 4 * n / old_upload for n in shards),
                     "predicted_new_s": sum(now.overhead_s + n / now.optimizer_numel_per_s
                                            + 4 * n / now.upload_bytes_per_s for n in shards)}
    return out


# ---- 2 and 3. in this process -----------------------------------------------------------------


def _median_error(values: list[float]) -> float:
    """Standard error of the median of ``values`` (normal approximation: 1.25 x that of the mean)."""
    return 1.2533 * statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else math.nan


def combine_ranks(per_rank: list[dict[str, dict]]) -> dict[str, dict]:
    """Per plan: per round the slowest rank's step (a step ends when every rank's does), the ranks' mean
    of the rest; medians over rounds; the step difference to "device" paired by round; I/O summed."""
    rows = {}
    rounds = range(len(per_rank[0]["device"]["samples"]))
    device_s = [max(rank["device"]["samples"][k]["step_s"] for rank in per_rank) for k in rounds]
    for name, first in per_rank[0].items():
        samples = [[rank[name]["samples"][k] for rank in per_rank] for k in rounds]
        step_s = [max(x["step_s"] for x in ranks) for ranks in samples]
        delta = [s - d for s, d in zip(step_s, device_s)]

        def median_mean(key: str) -> float:
            return statistics.median(statistics.fmean(x[key] for x in ranks) for ranks in samples)

        rows[name] = {"step_s": statistics.median(step_s), "delta_s": statistics.median(delta),
                      "delta_error_s": _median_error(delta), "optimizer_s": median_mean("optimizer_s"),
                      "in_run_s": median_mean("in_run_s"), "alone_s": median_mean("alone_s"),
                      "io": {k: sum(x["io"][k] for ranks in samples for x in ranks) for k in first["samples"][0]["io"]},
                      **{k: first[k] for k in ("offloaded", "chunks", "direct_io")},
                      **{k: statistics.fmean(rank[name][k] for rank in per_rank)
                         for k in ("predicted_old_s", "predicted_new_s")}}
    return rows


def exposed_table(args: argparse.Namespace, rows: dict[str, dict], params: int, seconds: float) -> None:
    dev = rows["device"]
    print(f"## 2. Exposed optimizer time: example GPT {params / 1e6:.2f}M parameters (L{args.n_layer} "
          f"d{args.n_embd} V{args.vocab_size} T{args.block_size}, batch {args.batch_size}/rank), fp32, "
          f"{WORLD_SIZE} gloo ranks x 1 CPU thread, AdamW (torch's CPU default, in the shadows too), "
          f"cache_blocks='all', {rows['device']['chunks']} chunks; {args.warmup} warm-up steps per plan, then "
          f"{args.samples} rounds of one sample per plan ({seconds:.0f} s)\n")
    print("On a CPU-only machine the host IS the device: the worker's update competes with forward and "
          "backward for the same cores, and the all-device step already spends the same CPU work on the same "
          "chunks inside optimizer_step, so little can hide. The goal (exposed <= 25%) is for machines with an "
          "accelerator, where the device step of those chunks is nearly free.")
    print("  a sample: one step whose update then overlaps the next step, the next step timed end to end (its "
          "forward waits for that update), then its own update waited for with nothing else running (alone)")
    print("  step = median over rounds of the slowest rank; update in run / alone = the worker's seconds per "
          "step (update_s), overlapped with the next step / alone")
    print("  exposed = (step - step[device]) / update alone, the step difference paired by round (the "
          "definition; on this machine ~0 when the update is fully exposed, negative when hidden, since the "
          "device plan pays it too)")
    print("  exposed, net = (step - step[device] + optim[device] - optim) / update alone: against the device "
          "step without the offloaded chunks' update (1 = fully exposed, 0 = fully hidden)")
    print("  +- = the standard error of the paired difference's median over update alone: when it is as large as "
          "the share, the share is noise\n")
    table = []
    print("  rows '...started in backward': the same plan, its offloaded updates started as each chunk's "
          "reduction retires; 'update alone' is the at-step row's (what is left after backward is less)\n")
    print("  predicted = the cost model's worker seconds per step for the chunks in host memory, from the host "
          "update as the profile measured it before (one fused AdamW on cached state, main thread) / now (as "
          "the worker runs it: [Note: measuring host updates]), both measured in the ranks\n")
    for name, r in rows.items():
        alone = rows[name.removesuffix(IN_BACKWARD)]["alone_s"]
        cells = ["", "", "", "", "", ""]
        if r["offloaded"]:
            net = r["delta_s"] + dev["optimizer_s"] - r["optimizer_s"]
            predicted = (f"{r['predicted_old_s'] * 1e3:.1f} / {r['predicted_new_s'] * 1e3:.1f}"
                         if r["predicted_new_s"] else "")
            cells = [f"{alone * 1e3:.1f}", predicted, f"{r['in_run_s'] * 1e3:.1f}",
                     f"{100 * r['delta_s'] / alone:.0f}%", f"{100 * net / alone:.0f}%",
                     f"{100 * r['delta_error_s'] / alone:.0f}%"]
        table.append((name, f"{r['offloaded']}/{r['chunks']}", f"{r['step_s'] * 1e3:.0f}",
                      f"{r['optimizer_s'] * 1e3:.1f}", *cells))
    print_table(("placement", "offloaded", "step ms", "optim ms (main)", "update alone ms",
                 "predicted ms (before / now)", "update in run ms", "exposed", "exposed, net", "+-"), table)
    print()


def _dd_bytes_per_s(operands: list[str]) -> tuple[float | None, str]:
    """``dd`` with ``operands``: (bytes/s from its report, "") or (None, its error line)."""
    proc = subprocess.run(["dd", *operands], capture_output=True, text=True, env={**os.environ, "LC_ALL": "C"})
    match = re.search(r"(\d+) bytes.*copied, ([0-9.e+-]+) s", proc.stderr)
    if proc.returncode or match is None:
        return None, (proc.stderr.strip().splitlines() or ["dd failed"])[-1]
    return int(match[1]) / max(float(match[2]), 1e-9), ""


def _dd_pair(source: str, target: str, block: int, count: int) -> tuple[float, float, str]:
    """(write, read) bytes/s of ``count`` blocks, direct I/O, or buffered (cache dropped) if that is refused."""
    write, err = _dd_bytes_per_s([f"if={source}", f"of={target}", f"bs={block}", f"count={count}", "oflag=direct",
                                  "conv=fdatasync"])
    if write is None:
        write, _ = _dd_bytes_per_s([f"if={source}", f"of={target}", f"bs={block}", f"count={count}",
                                    "conv=fdatasync"])
        note = f"buffered (direct I/O refused: {err})"
    else:
        note = "direct"
    read, err = _dd_bytes_per_s([f"if={target}", "of=/dev/null", f"bs={block}", "iflag=direct"])
    if read is None:
        fd = os.open(target, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
        read, _ = _dd_bytes_per_s([f"if={target}", "of=/dev/null", f"bs={block}"])
        note += f", read buffered (direct I/O refused: {err})"
    os.unlink(target)
    return write or float("nan"), read or float("nan"), note


def dd_speeds(directory: str, total_bytes: int, record_block: int) -> dict[str, tuple[float, float, str]]:
    """dd throughput (best of 2) from zeros and from random bytes, at 4 MiB blocks and at the record size."""
    with tempfile.NamedTemporaryFile(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as rnd:
        for _ in range(total_bytes // DD_BLOCK_BYTES):
            rnd.write(torch.randint(0, 256, (DD_BLOCK_BYTES,), dtype=torch.uint8).numpy().tobytes())
        rnd.flush()
        target = os.path.join(directory, "dd-probe.bin")
        runs = {"zeros, 4 MiB": ("/dev/zero", DD_BLOCK_BYTES), "random, 4 MiB": (rnd.name, DD_BLOCK_BYTES),
                "random, record": (rnd.name, record_block)}
        out = {}
        for label, (source, block) in runs.items():
            tries = [_dd_pair(source, target, block, total_bytes // block) for _ in range(2)]
            out[label] = (max(t[0] for t in tries), max(t[1] for t in tries), tries[0][2])
        return out


def nvme_table(row: dict, dd: dict[str, tuple[float, float, str]], steps: int, record_block: int) -> None:
    io = row["io"]
    per_step = {"read": io["bytes_read"] / steps, "write": io["bytes_written"] / steps}
    in_calls = {"read": io["bytes_read"] / max(io["read_s"], 1e-9),
                "write": io["bytes_written"] / max(io["write_s"], 1e-9)}
    wall = {k: v / row["step_s"] for k, v in per_step.items()}
    print(f"## 3. NVMe throughput during the step ('nvme, last half': {row['offloaded']}/{row['chunks']} chunks, "
          f"both ranks on one drive; store I/O {'O_DIRECT' if row['direct_io'] else 'buffered'})\n")
    print(f"record: {io['bytes_read'] / max(io['reads'], 1) / MB:.2f} MB payload (master, exp_avg, exp_avg_sq of a "
          f"chunk's shard), one pread/pwrite each; per step (both ranks): {per_step['read'] / MB:.1f} MB read in "
          f"{io['reads'] / steps:.0f} records, {per_step['write'] / MB:.1f} MB written; step "
          f"{row['step_s'] * 1e3:.0f} ms. 'in I/O calls' = bytes / seconds inside the calls (summed over the "
          f"store's threads and both ranks: per-call speed); 'wall' = bytes per step / step time.")
    print(f"dd: {'; '.join(f'{k}: {v[2]}' for k, v in dd.items())}; record-size dd blocks are {record_block / MiB:.2f} "
          "MiB. A virtual disk may serve zeros faster than data, so the random-data 4 MiB row is the reference.\n")
    ref = {"read": dd["random, 4 MiB"][1], "write": dd["random, 4 MiB"][0]}
    table = []
    for i, kind in ((1, "read"), (0, "write")):
        table.append((kind, f"{in_calls[kind] / MB:.0f}", f"{wall[kind] / MB:.0f}",
                      *(f"{dd[k][i] / MB:.0f}" for k in dd),
                      f"{100 * in_calls[kind] / ref[kind]:.0f}%", f"{100 * wall[kind] / ref[kind]:.0f}%"))
    print_table(("", "in I/O calls MB/s", "wall MB/s", *(f"dd {k} MB/s" for k in dd), "in calls / dd",
                 "wall / dd"), table)
    print()


def offload_tables(args: argparse.Namespace) -> None:
    nvme_path = tempfile.mkdtemp(prefix="elixir-offload-bench-", dir=args.nvme_path or "/tmp")
    try:
        load, start = os.getloadavg()[0], time.perf_counter()
        rows = combine_ranks(run_distributed(bench_rank, WORLD_SIZE, args, nvme_path))
        params = sum(p.numel() for p in GPT(_config(args)).parameters())
        print(f"(1-minute load average before the ranks: {load:.2f})")
        exposed_table(args, rows, params, time.perf_counter() - start)
        io = rows["nvme, last half"]["io"]
        record_block = math.ceil((io["bytes_read"] / max(io["reads"], 1) + 4096) / 4096) * 4096
        dd = dd_speeds(nvme_path, args.dd_mib * MiB, record_block)
        nvme_table(rows["nvme, last half"], dd, 2 * args.samples, record_block)
    finally:
        shutil.rmtree(nvme_path, ignore_errors=True)


# ---- 4. GPU -----------------------------------------------------------------------------------------


def _device_steps(step: Callable[[], None], device: torch.device, warmup: int, steps: int) -> list[float]:
    """Seconds of each timed ``step`` (the device synchronised around each)."""
    times = []
    for _ in range(warmup + steps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return times[warmup:]


def _autocast_loss(model: nn.Module, batch: tuple, device: torch.device) -> torch.Tensor:
    with torch.autocast(device.type, dtype=torch.bfloat16):
        return _loss(model, batch)


def elixir_steps(model: GPT, plan: ElixirPlan, batch: tuple, device: torch.device, args) -> list[float]:
    """bf16-mixed steps of the runtime under ``plan`` (AdamW left to torch's choice: shadows fused)."""
    runtime = ElixirRuntime(model, plan, device=device, policy=PrecisionPolicy.from_flag("bf16-mixed"),
                            grow_cache=True)
    optimizer = shard_optimizer(runtime, torch.optim.AdamW(model.parameters(), lr=LR))

    def step() -> None:
        _autocast_loss(model, batch, device).backward()
        optimizer_step(runtime, optimizer)
        optimizer.zero_grad()

    try:
        return _device_steps(step, device, args.gpu_warmup, args.gpu_steps)
    finally:
        runtime.release_all()
        runtime.remove_hooks()
        runtime.offload.close()


def auto_plan(model: GPT, batch: tuple, device: torch.device, budget_bytes: int) -> ElixirPlan:
    """plan="auto" with host offload allowed, for a device of ``budget_bytes``."""
    from lightning_elixir.planner import OffloadSettings, plan_automatically
    from lightning_elixir.runtime.collectives import Group

    result = plan_automatically(model, batch, device=device, group=Group.default(), compute_dtype=torch.bfloat16,
                                autocast_dtype=torch.bfloat16, micro_batches=1, memory_limit=budget_bytes,
                                step_fn=_loss, offload=OffloadSettings(allow_cpu=True))
    return result.plan


def all_cpu_plan(model: GPT) -> ElixirPlan:
    """The default packing with every chunk's sharded state on "cpu"."""
    specs = resolve_specs(model, ElixirPlan(), 1)
    return ElixirPlan(chunks=tuple(replace(s, placement="cpu") for s in specs), world_size=1,
                      cache_blocks=CACHE_ALL, name="all cpu")


def fsdp2_steps(model: GPT, batch: tuple, device: torch.device, args) -> list[float]:
    """FSDP2 per block and at the root, bf16 params, CPUOffloadPolicy, AdamW fused (the shadows' kernel)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device.type, (1,))
    settings = dict(mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
                    offload_policy=CPUOffloadPolicy(pin_memory=device.type == "cuda"))
    for block in model.h:
        fully_shard(block, **settings)
    fully_shard(model, **settings)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, fused=True)

    def step() -> None:
        _autocast_loss(model, batch, device).backward()
        optimizer.step()
        optimizer.zero_grad()

    return _device_steps(step, device, args.gpu_warmup, args.gpu_steps)


def _placed(plan: ElixirPlan) -> str:
    counts = {p: sum(c.placement == p for c in plan.chunks) for p in ("device", "cpu", "nvme")}
    placed = ", ".join(f"{n} {p}" for p, n in counts.items() if n)
    return f"{len(plan.chunks)} chunks ({placed}), cache_blocks {plan.cache_blocks}, prefetch {plan.prefetch_depth}"


Variant = Callable[[], tuple[Optional[list[float]], str]]
"""Runs one GPU variant: (its step seconds, or None when skipped; a note for the table)."""


def measure_variant(run: Variant, device: torch.device) -> dict:
    """Median step, peak device memory and note of one variant; a failure becomes its note."""
    torch.cuda.reset_peak_memory_stats(device)
    try:
        times, note = run()
    except Exception as err:  # noqa: BLE001 (one variant failing must not lose the others' rows)
        traceback.print_exc()
        times, note = None, f"failed: {type(err).__name__}: {(str(err).splitlines() or [''])[0][:160]}"
    finally:
        gc.collect()
        torch.cuda.empty_cache()
    return {"step_s": statistics.median(times) if times else None, "note": note,
            "peak_bytes": torch.cuda.max_memory_allocated(device)}


def gpu_variants(args: argparse.Namespace, device: torch.device, budget_bytes: int) -> dict[str, Variant]:
    """The three variants, each on its own copy of one model (built on the host in fp32)."""
    config = GPTConfig(vocab_size=args.gpu_vocab_size, block_size=args.gpu_block_size, n_layer=args.gpu_n_layer,
                       n_head=args.gpu_n_head, n_embd=args.gpu_n_embd)
    torch.manual_seed(0)
    base = GPT(config)
    batch = _batch(0, config, args.gpu_batch_size, device)

    def auto() -> tuple[Optional[list[float]], str]:
        try:
            plan = auto_plan(base, batch, device, budget_bytes)
        except ImportError as err:
            return None, f"skipped: plan_automatically(offload=OffloadSettings(...)) is not importable yet ({err})"
        return elixir_steps(copy.deepcopy(base), plan, batch, device, args), _placed(plan)

    def all_cpu() -> tuple[Optional[list[float]], str]:
        plan = all_cpu_plan(base)
        return elixir_steps(copy.deepcopy(base), plan, batch, device, args), _placed(plan)

    def fsdp2() -> tuple[Optional[list[float]], str]:
        return fsdp2_steps(copy.deepcopy(base), batch, device, args), "per block + root, AdamW fused on the host"

    return {"elixir auto": auto, "elixir all cpu": all_cpu, "fsdp2 CPUOffloadPolicy": fsdp2}


def gpu_table(args: argparse.Namespace) -> None:
    if not torch.cuda.is_available():
        print("## 4. GPU: skipped (no CUDA device); run with --gpu-only on a machine with one\n")
        return
    device = torch.device("cuda", torch.cuda.current_device())
    if not dist.is_initialized():
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        dist.init_process_group("nccl", rank=0, world_size=1, device_id=device)
    budget = int(args.gpu_budget_gib * GiB)
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, budget / total), device)
    start = time.perf_counter()
    results = {name: measure_variant(run, device) for name, run in gpu_variants(args, device, budget).items()}
    params = (12 * args.gpu_n_layer * args.gpu_n_embd ** 2 + args.gpu_vocab_size * args.gpu_n_embd) / 1e9
    print(f"## 4. GPU: {torch.cuda.get_device_name(device)}, budget {args.gpu_budget_gib:g} GiB of "
          f"{total / GiB:.0f} (set_per_process_memory_fraction), example GPT ~{params:.2f}B parameters "
          f"(L{args.gpu_n_layer} d{args.gpu_n_embd} V{args.gpu_vocab_size} T{args.gpu_block_size}, batch "
          f"{args.gpu_batch_size}), bf16 compute, fp32 master and AdamW state, 1 process; {args.gpu_warmup} "
          f"warm-up + median of {args.gpu_steps} steps ({time.perf_counter() - start:.0f} s)\n")
    tokens = args.gpu_batch_size * args.gpu_block_size
    fsdp2_s = results["fsdp2 CPUOffloadPolicy"]["step_s"]
    rows = []
    for name, r in results.items():
        step_s = r["step_s"]
        timed = (f"{step_s * 1e3:.0f}", f"{tokens / step_s:.0f}", f"{fsdp2_s / step_s:.2f}" if fsdp2_s else "-") \
            if step_s else ("-", "-", "-")
        rows.append((name, *timed, f"{r['peak_bytes'] / GiB:.1f}", r["note"]))
    print_table(("variant", "step ms", "tokens/s", "vs fsdp2", "peak GiB", "plan / notes"), rows)
    print()
    dist.destroy_process_group()


def main(argv=None) -> None:
    args = _parse(argv)
    start = time.perf_counter()
    if not args.gpu_only:
        update_table(args)
        feeding_table(args)
        if not args.host_only:
            offload_tables(args)
    if not args.host_only:
        gpu_table(args)
    print(f"total {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
