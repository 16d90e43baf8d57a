"""What runs inside one rank: the budget, the timed fit of one system on one workload, the profiler's tables,
and the rank's results (or its classified failure) as JSON."""

from __future__ import annotations

import argparse
import json
import os
import resource
import time
from typing import Any, Optional

from examples.benchmarks.harness_systems import NotInstallable, build_module, make_strategy


def _timed_callback(args: argparse.Namespace) -> Any:
    """A Callback timing every training batch, keeping losses, peaks and an optional profile."""
    import torch
    from lightning.pytorch.callbacks import Callback

    def sync(trainer: Any) -> None:
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.synchronize(trainer.strategy.root_device)

    class StepTimer(Callback):
        def __init__(self) -> None:
            self.times_s, self.cpu_s, self.losses, self.peaks, self.note, self.profiler = [], [], [], {}, "", None
            self.device_peak: Optional[int] = None

        def note_device_peak(self, trainer) -> None:
            """Keep the largest allocator peak seen. Elixir's monitor resets the peak at the start of each
            step it reads (every step while the self-correction measures, and the logged ones), so the peak
            read once at the end could be the last step's only (under DDP, the run's): it is read after setup
            (planning, profiling) and after every step, before the next reset."""
            peak = _device_peak(trainer.strategy.root_device)
            if peak is not None:
                self.device_peak = max(self.device_peak or 0, peak)

        def on_train_start(self, trainer, pl_module) -> None:
            self.note_device_peak(trainer)

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            if args.profile and batch_idx == args.warmup:
                self.profiler = _start_profiler(trainer.strategy.root_device)
            sync(trainer)
            self.start, self.start_cpu = time.perf_counter(), time.process_time()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            sync(trainer)
            self.times_s.append(time.perf_counter() - self.start)
            self.cpu_s.append(time.process_time() - self.start_cpu)
            self.losses.append(float(outputs["loss"]))
            self.note_device_peak(trainer)
            if self.profiler is not None and batch_idx == args.warmup + args.profile_steps - 1:
                self.profiler.stop()

        def on_train_end(self, trainer, pl_module) -> None:
            self.note_device_peak(trainer)
            self.peaks = {"peak_device_bytes": self.device_peak,
                          "peak_host_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}  # Linux: KiB
            runtime = getattr(trainer.strategy, "runtime", None)
            self.note = _plan_note(runtime.plan) if runtime is not None else ""

    return StepTimer()


def _start_profiler(device: Any) -> Any:
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    profiler = profile(activities=activities)
    profiler.start()
    return profiler


def _device_peak(device: Any) -> Optional[int]:
    """The CUDA allocator's peak since its last reset (None off a GPU)."""
    import torch

    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def _plan_note(plan: Any) -> str:
    placed = ", ".join(f"{n} {p}" for p in ("device", "cpu", "nvme")
                       if (n := sum(c.placement == p for c in plan.chunks)))
    return f"plan {plan.name!r}, cache {plan.cache_blocks}" + (f", chunks: {placed}" if placed else "")


def _apply_budget(args: argparse.Namespace) -> Optional[int]:
    """Cap this rank's CUDA allocator at the budget; the budget in bytes (None: no budget)."""
    if not args.budget:
        return None
    import torch

    from lightning_elixir.search.budget import parse_memory_limit

    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    total = torch.cuda.get_device_properties(device).total_memory
    budget = parse_memory_limit(args.budget, total)
    torch.cuda.set_per_process_memory_fraction(budget / total, device)
    return budget


def train(args: argparse.Namespace) -> dict:
    """Fit the workload under the system for warmup + steps batches; this rank's results."""
    import lightning as L
    import torch

    from lightning_elixir.demos.llama import RepeatDataModule

    L.seed_everything(0)
    module = build_module(args)
    n_params = sum(p.numel() for p in module.parameters())
    steps = args.warmup + max(args.steps, args.profile_steps if args.profile else 0)
    # Every workload trains on the Llama example's generated data: cheap at any vocabulary, where the GPT
    # example's bigram table takes vocab_size**2 floats (10 GB per rank at GPT-2's vocabulary).
    data = RepeatDataModule(vocab_size=args.vocab_size, block_size=args.block_size, batch_size=args.batch_size,
                            num_samples=args.batch_size * args.devices * (steps + 1))
    strategy = make_strategy(args.worker, module, args.devices, _apply_budget(args))
    timer = _timed_callback(args)
    # default_root_dir: whatever a strategy or callback writes (plans, reports) stays in the run's temporary directory
    trainer = L.Trainer(accelerator=args.accelerator, devices=args.devices, strategy=strategy,
                        precision=args.precision, max_steps=steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        num_sanity_val_steps=0, default_root_dir=args.out, callbacks=[timer])
    trainer.fit(module, data)
    if args.profile and trainer.global_rank == 0 and timer.profiler is not None:
        with open(os.path.join(args.out, "profile.txt"), "w") as f:
            f.write(profile_tables(timer.profiler, trainer.strategy.root_device.type == "cuda"))
    name = torch.cuda.get_device_name(trainer.strategy.root_device) if args.accelerator == "gpu" else "cpu"
    return {"times_s": timer.times_s[args.warmup:], "cpu_s": timer.cpu_s[args.warmup:], "losses": timer.losses,
            "n_params": n_params, "note": timer.note, "device_name": name, **timer.peaks}


def profile_tables(profiler: Any, on_gpu: bool, rows: int = 15) -> str:
    """Top record_function labels (inclusive host time) and operators (self time on the device, else host)."""
    events = profiler.key_averages()
    labels = sorted((e for e in events if e.is_user_annotation), key=lambda e: e.cpu_time_total, reverse=True)
    self_of = (lambda e: e.self_device_time_total) if on_gpu else (lambda e: e.self_cpu_time_total)
    ops = sorted((e for e in events if not e.is_user_annotation), key=self_of, reverse=True)
    device = (lambda e: f"{e.device_time_total / 1e3:10.1f}") if on_gpu else (lambda e: "")
    lines = ["record_function labels: host ms (inclusive)" + (", device ms" if on_gpu else "") + ", calls"]
    lines += [f"  {e.cpu_time_total / 1e3:10.1f}{device(e)}  x{e.count:<5} {e.key}" for e in labels[:rows]]
    lines += [] if labels else ["  (none recorded)"]
    lines.append(f"operators: self {'device' if on_gpu else 'host'} ms, calls")
    lines += [f"  {self_of(e) / 1e3:10.1f}  x{e.count:<5} {e.key}" for e in ops[:rows]]
    return "\n".join(lines) + "\n"


def classify(err: BaseException) -> dict:
    """A failure as the table shows it: "not installable", "OOM" or "failed", with a short reason."""
    text = (str(err).strip().splitlines() or [""])[0][:160]
    if isinstance(err, NotInstallable):
        return {"status": "not installable", "reason": text}
    if "out of memory" in str(err).lower() or type(err).__name__ in ("OutOfMemoryError", "NoPlanFitsError"):
        return {"status": "OOM", "reason": f"{type(err).__name__}: {text}"}
    return {"status": "failed", "reason": f"{type(err).__name__}: {text}"}


def run_worker(args: argparse.Namespace) -> None:
    import torch

    import lightning_elixir  # noqa: F401  (registers the strategy names)

    rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // args.devices))
    try:
        result = train(args)
    except Exception as err:
        write_json(os.path.join(args.out, f"rank{rank}.json"), {"error": classify(err)})
        raise
    write_json(os.path.join(args.out, f"rank{rank}.json"), result)
    # Lightning's DDP and ModelParallel strategies leave a gloo group to the interpreter's finalization,
    # which aborts the process now and then. (Not after a failure: a rank may be stuck mid-collective.)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def write_json(path: str, data: Any) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
