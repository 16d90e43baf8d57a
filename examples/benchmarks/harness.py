"""Elixir against DDP, FSDP2, FSDP and DeepSpeed: step time, tokens/s, memory, on the example GPT and Llama.

    python examples/benchmarks/harness.py                          # CPU: ~20M-parameter models, 2 gloo ranks
    python examples/benchmarks/harness.py --reduced                # tiny models, 3 systems, ~1 minute
    python examples/benchmarks/harness.py --systems ddp,elixir,fsdp2 --workloads llama --rounds 3
    python examples/benchmarks/harness.py --profile elixir_zero3   # torch.profiler tables of one system
    python examples/benchmarks/harness.py --accelerator gpu --size large --budgets 16GB,24GB,40GB,80GB
    python examples/benchmarks/harness.py --accelerator gpu --sizes medium,large,xl --budgets 16GB,40GB,80GB

Systems: "ddp" (Lightning's DDP); "elixir" (plan="auto", given the budget as device_memory_limit);
"elixir_zero2" and "elixir_zero3" (fixed plans); "elixir_offload" (the default chunk layout with every
chunk's sharded state on the host); "fsdp2" and "fsdp2_offload" (Lightning's ModelParallelStrategy,
``fully_shard`` per transformer block and at the root, the second with ``CPUOffloadPolicy``). On a GPU
also "fsdp" and "fsdp_offload" (Lightning's FSDP, FULL_SHARD per block, the second with CPUOffload)
and "deepspeed_zero2", "deepspeed_zero3", "deepspeed_zero3_offload" (optimizer and parameters on the
host, with DeepSpeed's host AdamW); a system whose package does not import is a "not installable" row.

Both workloads train on lightning_elixir/demos/llama.py's generated tokens, with fp32 AdamW state (bf16-mixed
compute on a GPU). Every run of a system is a fresh set of processes this script launches itself (one
per rank, all at once, as torchrun would); each rank writes its results as JSON. Every system runs
``--rounds`` times, the order reversed every other round so that drifting load hits all alike; the
fastest round counts. The step time is the median of the timed steps (after ``--warmup``) of the
slowest rank, from the start of a training batch to its end (forward, backward, optimizer step). Peak
memory: the CUDA allocator's peak and each process's peak RSS (host), both the maximum over ranks,
taken when training ends. On a GPU a budget is emulated with ``torch.cuda.set_per_process_memory_fraction`` in
every rank (and given to plan="auto"); TFLOP/s count 6 N + 12 L d T FLOPs per token (see
``flops_per_token`` in harness_systems.py) and MFU divides them by the GPUs' dense bf16 peak. A run
that fails is a row "OOM" or "failed: <reason>", never dropped. The tables are markdown, one per
workload, with ratios of tokens/s to DDP and to the best peer (the fastest non-Elixir system) of the
same workload and budget; all results also go to ``--json``, and on a GPU a plot of tokens/s against
budget to ``--png`` (when matplotlib imports). ``--sizes`` runs the grid at several model sizes, smallest
first; a system that runs out of memory at a size under a budget is not run at the larger ones, and the
report ends with the largest size each system trained under each budget.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from typing import Optional

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

# This file is the entry point and the parent process; beside it, harness_systems.py holds what each system and
# workload is, harness_rank.py what runs inside one rank (``--worker``), harness_report.py the tables and the plot.
from examples.benchmarks.harness_rank import run_worker  # noqa: E402
from examples.benchmarks.harness_report import report, status_cell  # noqa: E402
from examples.benchmarks.harness_systems import (  # noqa: E402
    CHECKPOINTED, COMPILED, ELIXIR_SYSTEMS, WORKLOADS, base_system, flops_per_token)

CPU_SYSTEMS = ("ddp", *ELIXIR_SYSTEMS, "fsdp2", "fsdp2_offload")
GPU_SYSTEMS = (*CPU_SYSTEMS, "fsdp", "fsdp_offload", "deepspeed_zero2", "deepspeed_zero3", "deepspeed_zero3_offload")
REDUCED_SYSTEMS = ("ddp", "elixir_zero2", "fsdp2")
FAILURE_RANK = {"not installable": 0, "OOM": 1, "failed": 2}
"""Which rank's failure names a run: an import or memory error beats the collective errors it causes."""
GRACE_S = 20.0
"""How long the other ranks may run on after one rank failed (they are usually stuck in a collective)."""
PEAK_BF16_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12}
"""Dense bf16 tensor-core peak per GPU (NVIDIA datasheets, SXM parts), for MFU; override with --peak-tflops."""
GPT2_SIZES = {"small": (12, 768, 12), "medium": (24, 1024, 16), "large": (36, 1280, 20), "xl": (48, 1600, 25)}
"""(n_layer, n_embd, n_head) of the GPT-2 family; the Llama workload takes the same shapes."""


@dataclass(frozen=True)
class Scale:
    """Default sizes of one mode; every field can be set on the command line."""

    n_layer: int
    n_embd: int
    n_head: int
    vocab_size: int
    block_size: int
    batch_size: int
    """Sequences per rank and step."""
    warmup: int
    """Untimed steps first (allocator, caches, Elixir's grown cache blocks)."""
    steps: int
    """Timed steps."""


SCALES = {
    # ~20M parameters (GPT 21M, Llama 24M with its untied head): a step of a few seconds on 2 cores.
    "cpu": Scale(n_layer=6, n_embd=512, n_head=8, vocab_size=4096, block_size=256, batch_size=4, warmup=2, steps=5),
    "reduced": Scale(n_layer=2, n_embd=64, n_head=4, vocab_size=256, block_size=32, batch_size=2, warmup=1, steps=2),
    "gpu": Scale(*GPT2_SIZES["large"], vocab_size=50304, block_size=1024, batch_size=8, warmup=3, steps=10),
}


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--systems", help=f"comma-separated; default {','.join(CPU_SYSTEMS)} (GPU: also the rest of "
                   f"{','.join(GPU_SYSTEMS[len(CPU_SYSTEMS):])})")
    p.add_argument("--workloads", default="gpt,llama")
    p.add_argument("--accelerator", choices=("cpu", "gpu"), default="cpu")
    p.add_argument("--devices", type=int, help="ranks (default: 2 on the CPU, every GPU)")
    p.add_argument("--precision", help="default 32-true on the CPU, bf16-mixed on a GPU")
    p.add_argument("--budgets", help="GPU only: comma-separated device memory per rank, e.g. 16GB,24GB,40GB")
    p.add_argument("--reduced", action="store_true", help="tiny models, 2 timed steps, 1 round, 3 systems")
    p.add_argument("--size", choices=tuple(GPT2_SIZES), help="a GPT-2 shape for n_layer, n_embd, n_head")
    p.add_argument("--sizes", help="a grid over model size, smallest first: GPT-2 names or LxDxH shapes (layers x "
                   "width x heads), e.g. medium,large,xl; the report adds the largest size each system trains per budget")
    for name in ("n_layer", "n_embd", "n_head", "vocab_size", "block_size", "batch_size", "warmup", "steps"):
        p.add_argument("--" + name.replace("_", "-"), type=int)
    p.add_argument("--n-kv-head", type=int, help="Llama's key/value heads (grouped-query attention); default n_head")
    p.add_argument("--rounds", type=int, help="runs of every system (default 2; --reduced 1)")
    p.add_argument("--run-timeout", type=float, default=1800.0, help="seconds one run of one system may take")
    p.add_argument("--peak-tflops", type=float, help="dense bf16 peak of one GPU, for MFU")
    p.add_argument("--profile", metavar="SYSTEM", help="run torch.profiler on this system instead of the tables")
    p.add_argument("--profile-steps", type=int, default=3)
    p.add_argument("--logs", metavar="DIR", help="keep every run's rank logs here (<workload>_<budget>_<system>.rank<r>.txt)")
    p.add_argument("--json", default=os.path.join("runs", "benchmarks", "harness.json"))
    p.add_argument("--png", default=os.path.join("runs", "benchmarks", "harness.png"))
    for hidden in ("--worker", "--workload", "--budget", "--out"):  # what the parent passes to each rank
        p.add_argument(hidden, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    _fill_defaults(p, args)
    return args


def _fill_defaults(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Mode defaults for what the command line left unset; reject what does not fit together."""
    gpu = args.accelerator == "gpu"
    scale = SCALES["reduced" if args.reduced else "gpu" if gpu else "cpu"]
    if args.size:
        scale = replace(scale, **dict(zip(("n_layer", "n_embd", "n_head"), GPT2_SIZES[args.size])))
    for key, value in vars(scale).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.precision = args.precision or ("bf16-mixed" if gpu else "32-true")
    args.rounds = args.rounds or (1 if args.reduced else 2)
    args.devices = args.devices or (_gpu_count() if gpu else 2)
    default = REDUCED_SYSTEMS if args.reduced else GPU_SYSTEMS if gpu else CPU_SYSTEMS
    args.system_list = args.systems.split(",") if args.systems else list(default)
    args.workload_list = args.workloads.split(",")
    args.budget_list = args.budgets.split(",") if args.budgets else [None]
    if args.sizes and args.size:
        p.error("--size and --sizes do not go together: give the one size as --sizes")
    args.size_list = [_parse_size(p, s) for s in args.sizes.split(",")] if args.sizes else [None]
    unknown = [s for s in [*args.system_list, args.profile] if s and base_system(s) not in GPU_SYSTEMS]
    if unknown:
        p.error(f"unknown system(s) {unknown}; choose from {', '.join(GPU_SYSTEMS)}, each also with the suffix "
                f"{COMPILED!r} (its transformer blocks compiled) and {CHECKPOINTED!r} (activation checkpointing per "
                "block, by hand)")
    if [w for w in args.workload_list if w not in WORKLOADS]:
        p.error(f"--workloads takes {', '.join(WORKLOADS)}, got {args.workloads!r}")
    if args.budgets and not gpu:
        p.error("--budgets emulates GPU memory; use it with --accelerator gpu")


def _parse_size(p: argparse.ArgumentParser, text: str) -> tuple[str, tuple[int, int, int]]:
    """(name, (n_layer, n_embd, n_head)) of a GPT-2 size name or an LxDxH shape."""
    if text in GPT2_SIZES:
        return text, GPT2_SIZES[text]
    try:
        n_layer, n_embd, n_head = (int(v) for v in text.split("x"))
    except ValueError:
        p.error(f"--sizes takes {', '.join(GPT2_SIZES)} or LxDxH shapes such as 2x64x4, got {text!r}")
    return text, (n_layer, n_embd, n_head)


def sized(args: argparse.Namespace, size: Optional[tuple[str, tuple[int, int, int]]]) -> argparse.Namespace:
    """``args`` with one size of the grid's shape (unchanged for None: no size grid)."""
    if size is None:
        return args
    n_layer, n_embd, n_head = size[1]
    return argparse.Namespace(**{**vars(args), "n_layer": n_layer, "n_embd": n_embd, "n_head": n_head})


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count()


# ---- the parent: launch, collect, keep the best round --------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(cmd: list[str], devices: int, out: str) -> list[subprocess.Popen]:
    """One process per rank, with the variables Lightning reads when processes are launched for it."""
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(devices),
           "NODE_RANK": "0", "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
    procs = []
    for rank in range(devices):
        log = open(os.path.join(out, f"log.rank{rank}.txt"), "w")
        procs.append(subprocess.Popen(cmd, env={**env, "LOCAL_RANK": str(rank), "RANK": str(rank)}, cwd=ROOT,
                                      stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
        log.close()
    return procs


def wait(procs: list[subprocess.Popen], timeout_s: float) -> Optional[str]:
    """Wait for every rank; kill the rest once one failed and GRACE_S passed, or at the timeout, or when
    this process is stopped while waiting (``timeout``, Ctrl-C): ranks in sessions of their own would
    otherwise outlive it and hold their devices into the next run."""
    deadline, reason = time.monotonic() + timeout_s, f"timed out after {timeout_s:.0f} s"
    try:
        while any(p.poll() is None for p in procs):
            if any(p.poll() not in (None, 0) for p in procs) and deadline > time.monotonic() + GRACE_S:
                deadline, reason = time.monotonic() + GRACE_S, "another rank failed; this one did not finish"
            if time.monotonic() > deadline:
                return reason
            time.sleep(0.2)
        return None
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)  # its own session: the rank and anything it started
                p.wait()


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds through wait(), which stops the ranks


def collect(out: str, devices: int, killed: Optional[str]) -> list[dict]:
    """Every rank's results, or a failure made from its log when it wrote none."""
    ranks = []
    for rank in range(devices):
        path = os.path.join(out, f"rank{rank}.json")
        if os.path.exists(path):
            with open(path) as f:
                ranks.append(json.load(f))
            continue
        with open(os.path.join(out, f"log.rank{rank}.txt"), errors="replace") as f:
            lines = [ln.strip() for ln in f if ln.strip()]
        error = next((ln for ln in reversed(lines) if "Error" in ln or "Exception" in ln), None)
        status = "OOM" if error and "out of memory" in error.lower() else "failed"
        ranks.append({"error": {"status": status, "reason": (error or killed or "exited without results")[:160]}})
    return ranks


def summarise(args: argparse.Namespace, ranks: list[dict]) -> dict:
    """One run's row: the slowest rank's median step, or the most telling failure."""
    errors = sorted((r["error"] for r in ranks if "error" in r), key=lambda e: FAILURE_RANK[e["status"]])
    if errors:
        return dict(errors[0])
    step_s = max(statistics.median(r["times_s"]) for r in ranks)
    tokens = args.batch_size * args.block_size * args.devices
    cpu_s = statistics.mean(statistics.median(r["cpu_s"]) for r in ranks)
    row = {"status": "ok", "step_s": step_s, "cpu_s": cpu_s, "tokens_per_s": tokens / step_s,
           "n_params": ranks[0]["n_params"], "peak_host_bytes": max(r["peak_host_bytes"] for r in ranks),
           "note": ranks[0]["note"], "loss_first": ranks[0]["losses"][0], "loss_last": ranks[0]["losses"][-1]}
    if args.accelerator == "gpu":
        flops = flops_per_token(row["n_params"], args.n_layer, args.n_embd, args.block_size) * tokens
        peak = args.peak_tflops * 1e12 if args.peak_tflops else next(
            (v for k, v in PEAK_BF16_FLOPS.items() if k in ranks[0]["device_name"]), None)
        row.update(peak_device_bytes=max(r["peak_device_bytes"] for r in ranks), tflops=flops / step_s / 1e12,
                   mfu=flops / step_s / (peak * args.devices) if peak else None, device_name=ranks[0]["device_name"])
    return row


def run_system(args: argparse.Namespace, argv: list[str], system: str, workload: str,
               budget: Optional[str]) -> tuple[dict, str]:
    """Run one system once in fresh processes: its row, and rank 0's profile text (if profiling)."""
    with tempfile.TemporaryDirectory(prefix="elixir-harness-") as out:
        # the shape last: in a size grid it overrides the defaults (the worker ignores --sizes)
        shape = ["--n-layer", str(args.n_layer), "--n-embd", str(args.n_embd), "--n-head", str(args.n_head)]
        cmd = [sys.executable, os.path.abspath(__file__), *argv, *shape, "--worker", system, "--workload", workload,
               "--budget", budget or "", "--out", out]
        killed = wait(launch(cmd, args.devices, out), args.run_timeout)
        if args.logs:
            os.makedirs(args.logs, exist_ok=True)
            for rank in range(args.devices):
                shutil.copy(os.path.join(out, f"log.rank{rank}.txt"),
                            os.path.join(args.logs, f"{workload}_{budget or 'none'}_{system}.rank{rank}.txt"))
        profile = os.path.join(out, "profile.txt")
        text = open(profile).read() if os.path.exists(profile) else ""
        return summarise(args, collect(out, args.devices, killed)), text


def run_grid(args: argparse.Namespace, argv: list[str]) -> list[dict]:
    """Every workload x size x budget x system, ``rounds`` times in alternating order; each one's fastest
    round. In a size grid a system that ran out of memory at a size under a budget is not run at the
    larger sizes under that budget: its row says so."""
    results = []
    for workload in args.workload_list:
        out_of_memory: dict[tuple, str] = {}  # (budget, system) -> the size that ran out of memory
        for size in args.size_list:
            shaped, name = sized(args, size), size[0] if size else None
            for budget in args.budget_list:
                best: dict[str, dict] = {}
                for system in args.system_list:
                    if (budget, system) in out_of_memory:
                        best[system] = {"status": "OOM", "reason": f"not run: OOM at {out_of_memory[budget, system]}"}
                for round_ in range(args.rounds):
                    for system in args.system_list if round_ % 2 == 0 else args.system_list[::-1]:
                        if system in best and best[system]["status"] != "ok":
                            continue  # a failure repeats; running it again only costs time
                        row, _ = run_system(shaped, argv, system, workload, budget)
                        _progress(workload, name, budget, system, round_, row)
                        kept = best.get(system)
                        rounds = (kept["rounds"] if kept else []) + [row.get("step_s", row["status"])]
                        if kept is None or (row["status"] == "ok" and row["step_s"] < kept["step_s"]):
                            kept = row
                        best[system] = {**kept, "rounds": rounds}
                for system in args.system_list:
                    if best[system]["status"] == "OOM":
                        out_of_memory.setdefault((budget, system), name)
                results += [{"workload": workload, "size": name, "n_layer": shaped.n_layer, "n_embd": shaped.n_embd,
                             "n_head": shaped.n_head, "budget": budget, "system": s, **best[s]} for s in args.system_list]
    return results


def _progress(workload: str, size: Optional[str], budget: Optional[str], system: str, round_: int, row: dict) -> None:
    what = f"{row['step_s'] * 1e3:.0f} ms/step" if row["status"] == "ok" else status_cell(row)
    print(f"[{workload}{' ' + size if size else ''}{' @ ' + budget if budget else ''}] round {round_ + 1}: "
          f"{system}: {what}", file=sys.stderr, flush=True)


def run_profile(args: argparse.Namespace, argv: list[str]) -> None:
    for workload in args.workload_list:
        row, text = run_system(args, argv, args.profile, workload, args.budget_list[0])
        print(f"## {workload}: {args.profile}, torch.profiler over {args.profile_steps} steps after "
              f"{args.warmup} warm-up, rank 0\n")
        print(text if row["status"] == "ok" else status_cell(row))


def main(argv: Optional[list[str]] = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.worker:
        return run_worker(args)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)  # the launcher only, not its ranks
    if args.profile:
        return run_profile(args, argv)
    load, start = os.getloadavg()[0], time.perf_counter()
    results = run_grid(args, argv)
    report(args, results, load, time.perf_counter() - start)


if __name__ == "__main__":
    main()
