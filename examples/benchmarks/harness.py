"""Elixir against DDP, FSDP2, FSDP and DeepSpeed: step time, tokens/s, memory, on the example GPT and Llama.

    python examples/benchmarks/harness.py                          # CPU: ~20M-parameter models, 2 gloo ranks
    python examples/benchmarks/harness.py --reduced                # tiny models, 3 systems, ~1 minute
    python examples/benchmarks/harness.py --systems ddp,elixir,fsdp2 --workloads llama --rounds 3
    python examples/benchmarks/harness.py --profile elixir_zero3   # torch.profiler tables of one system
    python examples/benchmarks/harness.py --accelerator gpu --size large --budgets 16GB,24GB,40GB,80GB

Systems: "ddp" (Lightning's DDP); "elixir" (plan="auto", given the budget as device_memory_limit);
"elixir_zero2" and "elixir_zero3" (fixed plans); "elixir_offload" (the default chunk layout with every
chunk's sharded state on the host); "fsdp2" and "fsdp2_offload" (Lightning's ModelParallelStrategy,
``fully_shard`` per transformer block and at the root, the second with ``CPUOffloadPolicy``). On a GPU
also "fsdp" and "fsdp_offload" (Lightning's FSDP, FULL_SHARD per block, the second with CPUOffload)
and "deepspeed_zero2", "deepspeed_zero3", "deepspeed_zero3_offload" (optimizer and parameters on the
host, with DeepSpeed's host AdamW); a system whose package does not import is a "not installable" row.

Both workloads train on examples/llama.py's generated tokens, with fp32 AdamW state (bf16-mixed
compute on a GPU). Every run of a system is a fresh set of processes this script launches itself (one
per rank, all at once, as torchrun would); each rank writes its results as JSON. Every system runs
``--rounds`` times, the order reversed every other round so that drifting load hits all alike; the
fastest round counts. The step time is the median of the timed steps (after ``--warmup``) of the
slowest rank, from the start of a training batch to its end (forward, backward, optimizer step). Peak
memory: the CUDA allocator's peak and each process's peak RSS (host), both the maximum over ranks,
taken when training ends. On a GPU a budget is emulated with ``torch.cuda.set_per_process_memory_fraction`` in
every rank (and given to plan="auto"); TFLOP/s count 6 N + 12 L d T FLOPs per token (see
``flops_per_token``) and MFU divides them by the GPUs' dense bf16 peak. A run that fails is a row
"OOM" or "failed: <reason>", never dropped. The tables are markdown, one per workload, with ratios of
tokens/s to DDP and to the best peer (the fastest non-Elixir system) of the same workload and budget;
all results also go to ``--json``, and on a GPU a plot of tokens/s against budget to ``--png`` (when
matplotlib imports).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import resource
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from typing import Any, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

ELIXIR_SYSTEMS = ("elixir", "elixir_zero2", "elixir_zero3", "elixir_offload")
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


WORKLOADS = {"gpt": "examples.gpt:GPTLightningModule", "llama": "examples.llama:LlamaLightningModule"}
"""Each workload's LightningModule ("module:class"), taking vocab_size, block_size, n_layer, n_head, n_embd."""


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
    for name in ("n_layer", "n_embd", "n_head", "vocab_size", "block_size", "batch_size", "warmup", "steps"):
        p.add_argument("--" + name.replace("_", "-"), type=int)
    p.add_argument("--n-kv-head", type=int, help="Llama's key/value heads (grouped-query attention); default n_head")
    p.add_argument("--rounds", type=int, help="runs of every system (default 2; --reduced 1)")
    p.add_argument("--run-timeout", type=float, default=1800.0, help="seconds one run of one system may take")
    p.add_argument("--peak-tflops", type=float, help="dense bf16 peak of one GPU, for MFU")
    p.add_argument("--profile", metavar="SYSTEM", help="run torch.profiler on this system instead of the tables")
    p.add_argument("--profile-steps", type=int, default=3)
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
    unknown = [s for s in [*args.system_list, args.profile] if s and s not in GPU_SYSTEMS]
    if unknown:
        p.error(f"unknown system(s) {unknown}; choose from {', '.join(GPU_SYSTEMS)}")
    if [w for w in args.workload_list if w not in WORKLOADS]:
        p.error(f"--workloads takes {', '.join(WORKLOADS)}, got {args.workloads!r}")
    if args.budgets and not gpu:
        p.error("--budgets emulates GPU memory; use it with --accelerator gpu")


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count()


def flops_per_token(n_params: int, n_layer: int, n_embd: int, seq_len: int) -> int:
    """Training FLOPs per token: 6 N for the matrix multiplies of forward and backward (every parameter,
    embeddings included) plus 12 L d T for attention's scores and weighted sums, as in PaLM (Chowdhery
    et al. 2022, appendix B) and nanoGPT's ``estimate_mfu``. Causal masking is not discounted."""
    return 6 * n_params + 12 * n_layer * n_embd * seq_len


# ---- inside a rank: the module, the strategy, the timed fit ----------------------------------------


def transformer_blocks(model: Any) -> Any:
    """The ModuleList of transformer blocks of the example GPT ("h") or Llama ("layers")."""
    return model.h if hasattr(model, "h") else model.layers


class FSDP2Blocks:
    """``configure_model`` for ModelParallelStrategy: ``fully_shard`` each block, then the root.

    A mixin for the FSDP2 systems only: Elixir and DDP take the module as it is.
    """

    def fsdp2_settings(self) -> dict:
        import torch
        from torch.distributed.fsdp import MixedPrecisionPolicy

        settings: dict = {"mesh": self.device_mesh["data_parallel"]}
        if self.trainer.precision == "bf16-mixed":  # bf16 gathers and compute, fp32 gradient reduction
            settings["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        return settings

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        super().configure_model()
        settings = self.fsdp2_settings()
        for block in transformer_blocks(self.model):
            fully_shard(block, **settings)
        fully_shard(self.model, **settings)


class FSDP2BlocksOffload(FSDP2Blocks):
    """FSDP2 with ``CPUOffloadPolicy``: sharded parameters, gradients and AdamW step on the host."""

    def fsdp2_settings(self) -> dict:
        import torch
        from torch.distributed.fsdp import CPUOffloadPolicy

        return {**super().fsdp2_settings(), "offload_policy": CPUOffloadPolicy(pin_memory=torch.cuda.is_available())}


class HostAdamForDeepSpeed:
    """``configure_optimizers`` with DeepSpeed's host AdamW, which ZeRO-Offload expects (torch's is far slower)."""

    def configure_optimizers(self) -> Any:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        torch_adamw = super().configure_optimizers()
        groups = [{"params": g["params"], "weight_decay": g["weight_decay"]} for g in torch_adamw.param_groups]
        return DeepSpeedCPUAdam(groups, lr=torch_adamw.defaults["lr"], betas=torch_adamw.defaults["betas"],
                                adamw_mode=True)


MIXINS = {"fsdp2": FSDP2Blocks, "fsdp2_offload": FSDP2BlocksOffload, "deepspeed_zero3_offload": HostAdamForDeepSpeed}


class NotInstallable(RuntimeError):
    """The system's package does not import on this machine."""


def host_offload_plan(module: Any, world_size: int) -> Any:
    """Elixir's default chunk layout with every chunk's sharded state (master, gradient, AdamW) on the host."""
    from lightning_elixir.plan import CACHE_ALL, ElixirPlan
    from lightning_elixir.runtime.layout import resolve_specs

    specs = resolve_specs(module, ElixirPlan(), world_size)
    return ElixirPlan(chunks=tuple(replace(s, placement="cpu") for s in specs), world_size=world_size,
                      cache_blocks=CACHE_ALL, name="host offload")


def make_strategy(system: str, module: Any, devices: int, budget_bytes: Optional[int]) -> Any:
    """The Lightning strategy (object or registered name) that runs ``system``."""
    from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

    from lightning_elixir import ElixirStrategy

    elixir = dict(unshard_on_teardown=False)  # gathering the whole model at the end is no part of a step
    match system:
        case "ddp":
            return "ddp"
        case "elixir":
            return ElixirStrategy(plan="auto", device_memory_limit=budget_bytes, **elixir)
        case "elixir_zero2" | "elixir_zero3":
            return ElixirStrategy(plan=system.removeprefix("elixir_"), **elixir)
        case "elixir_offload":
            return ElixirStrategy(plan=host_offload_plan(module, devices), **elixir)
        case "fsdp2":
            return ModelParallelStrategy(data_parallel_size=devices, tensor_parallel_size=1)
        case "fsdp2_offload":
            return host_offload_model_parallel(devices)
        case "fsdp" | "fsdp_offload":
            block = type(transformer_blocks(module.model)[0])
            return FSDPStrategy(sharding_strategy="FULL_SHARD", auto_wrap_policy={block},
                                cpu_offload=system == "fsdp_offload")
    return deepspeed_strategy(system)


def host_offload_model_parallel(devices: int) -> Any:
    """ModelParallelStrategy that leaves the module's shards where ``CPUOffloadPolicy`` put them.

    Its ``setup`` moves the module to the device after ``configure_model``, and FSDP2 refuses to run
    CPU offload with parameters on the GPU; the blocks and the root are all sharded, so nothing is
    left that needs moving.
    """
    from lightning.pytorch.strategies import ModelParallelStrategy

    class HostOffloadModelParallel(ModelParallelStrategy):
        def model_to_device(self) -> None:
            pass

    return HostOffloadModelParallel(data_parallel_size=devices, tensor_parallel_size=1)


def deepspeed_strategy(system: str) -> Any:
    """DeepSpeed ZeRO-2, ZeRO-3, or ZeRO-3 with optimizer state and parameters on the host."""
    try:
        import deepspeed  # noqa: F401
    except Exception as err:  # noqa: BLE001 (any import failure: missing, or its extensions fail to build)
        raise NotInstallable(f"import deepspeed: {type(err).__name__}: {err}") from err
    from lightning.pytorch.strategies import DeepSpeedStrategy

    offload = system.endswith("_offload")
    return DeepSpeedStrategy(stage=3 if "zero3" in system else 2, offload_optimizer=offload, offload_parameters=offload)


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
            if self.profiler is not None and batch_idx == args.warmup + args.profile_steps - 1:
                self.profiler.stop()

        def on_train_end(self, trainer, pl_module) -> None:
            self.peaks = _peaks(trainer.strategy.root_device)
            runtime = getattr(trainer.strategy, "runtime", None)
            self.note = _plan_note(runtime.plan) if runtime is not None else ""

    return StepTimer()


def _start_profiler(device: Any) -> Any:
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    profiler = profile(activities=activities)
    profiler.start()
    return profiler


def _peaks(device: Any) -> dict:
    import torch

    device_bytes = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return {"peak_device_bytes": device_bytes,
            "peak_host_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}  # Linux: KiB


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


def build_module(args: argparse.Namespace) -> Any:
    """The workload's LightningModule, with the system's mixin when it has one."""
    path, _, name = WORKLOADS[args.workload].partition(":")
    base = getattr(importlib.import_module(path), name)
    mixin = MIXINS.get(args.worker)
    cls = type(mixin.__name__ + base.__name__, (mixin, base), {}) if mixin else base
    extra = {"n_kv_head": args.n_kv_head} if args.workload == "llama" and args.n_kv_head else {}
    return cls(vocab_size=args.vocab_size, block_size=args.block_size, n_layer=args.n_layer, n_head=args.n_head,
               n_embd=args.n_embd, **extra)


def train(args: argparse.Namespace) -> dict:
    """Fit the workload under the system for warmup + steps batches; this rank's results."""
    import lightning as L
    import torch

    from examples.llama import RepeatDataModule

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
        _write_json(os.path.join(args.out, f"rank{rank}.json"), {"error": classify(err)})
        raise
    _write_json(os.path.join(args.out, f"rank{rank}.json"), result)
    # Lightning's DDP and ModelParallel strategies leave a gloo group to the interpreter's finalization,
    # which aborts the process now and then. (Not after a failure: a rank may be stuck mid-collective.)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def _write_json(path: str, data: Any) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=1)


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
    """Wait for every rank; kill the rest once one failed and GRACE_S passed, or at the timeout."""
    deadline, reason = time.monotonic() + timeout_s, f"timed out after {timeout_s:.0f} s"
    while any(p.poll() is None for p in procs):
        if any(p.poll() not in (None, 0) for p in procs) and deadline > time.monotonic() + GRACE_S:
            deadline, reason = time.monotonic() + GRACE_S, "another rank failed; this one did not finish"
        if time.monotonic() > deadline:
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)  # its own session: the rank and anything it started
                    p.wait()
            return reason
        time.sleep(0.2)
    return None


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
        cmd = [sys.executable, os.path.abspath(__file__), *argv, "--worker", system, "--workload", workload,
               "--budget", budget or "", "--out", out]
        killed = wait(launch(cmd, args.devices, out), args.run_timeout)
        profile = os.path.join(out, "profile.txt")
        text = open(profile).read() if os.path.exists(profile) else ""
        return summarise(args, collect(out, args.devices, killed)), text


def run_grid(args: argparse.Namespace, argv: list[str]) -> list[dict]:
    """Every workload x budget x system, ``rounds`` times in alternating order; each one's fastest round."""
    results = []
    for workload in args.workload_list:
        for budget in args.budget_list:
            best: dict[str, dict] = {}
            for round_ in range(args.rounds):
                for system in args.system_list if round_ % 2 == 0 else args.system_list[::-1]:
                    if system in best and best[system]["status"] != "ok":
                        continue  # a failure repeats; running it again only costs time
                    row, _ = run_system(args, argv, system, workload, budget)
                    _progress(workload, budget, system, round_, row)
                    kept = best.get(system)
                    rounds = (kept["rounds"] if kept else []) + [row.get("step_s", row["status"])]
                    if kept is None or (row["status"] == "ok" and row["step_s"] < kept["step_s"]):
                        kept = {"workload": workload, "budget": budget, "system": system, **row}
                    best[system] = {**kept, "rounds": rounds}
            results += [best[s] for s in args.system_list]
    return results


def _progress(workload: str, budget: Optional[str], system: str, round_: int, row: dict) -> None:
    what = f"{row['step_s'] * 1e3:.0f} ms/step" if row["status"] == "ok" else _status(row)
    print(f"[{workload}{' @ ' + budget if budget else ''}] round {round_ + 1}: {system}: {what}",
          file=sys.stderr, flush=True)


# ---- the report ------------------------------------------------------------------------------------


def _status(row: dict, width: int = 90) -> str:
    """A failure as a table cell: "OOM", or the status and the start of its reason."""
    if row["status"] == "OOM":
        return "OOM"
    text = f"{row['status']}: {row['reason']}"
    return text if len(text) <= width else text[:width - 3] + "..."


def _ratio(row: dict, base: Optional[dict]) -> str:
    return f"{row['tokens_per_s'] / base['tokens_per_s']:.2f}" if base and row["status"] == "ok" else "-"


def paired_ratio(row: dict, base: Optional[dict]) -> Optional[float]:
    """The median over rounds of ``base``'s step time over ``row``'s in the same round: on a noisy
    machine, steadier than the ratio of the best rounds (each round runs both within minutes)."""
    if not base or row["status"] != "ok" or base["status"] != "ok":
        return None
    pairs = [(b, r) for b, r in zip(base.get("rounds", ()), row.get("rounds", ()))
             if isinstance(b, float) and isinstance(r, float)]
    return statistics.median(b / r for b, r in pairs) if pairs else None


def _cells(row: dict, ddp: Optional[dict], peer: Optional[dict], gpu: bool) -> list[str]:
    """A row's measured cells, from "step ms" to the last number."""
    if row["status"] != "ok":
        return [_status(row)]
    paired = paired_ratio(row, ddp)
    cells = [f"{row['step_s'] * 1e3:.0f}", f"{row['cpu_s'] * 1e3:.0f}", f"{row['tokens_per_s']:.0f}", _ratio(row, ddp),
             "-" if paired is None else f"{paired:.2f}", _ratio(row, peer),
             f"{row['peak_host_bytes'] / 2**20:.0f}"]
    if gpu:
        mfu = f"{row['mfu']:.1%}" if row["mfu"] is not None else "-"
        cells += [f"{row['peak_device_bytes'] / 2**30:.1f}", f"{row['tflops']:.1f}", mfu]
    return cells


def markdown_table(args: argparse.Namespace, rows: list[dict]) -> str:
    """One workload's rows, with ratios to DDP and to the best peer of the same budget."""
    gpu = args.accelerator == "gpu"
    lead = ["budget", "system"] if gpu else ["system"]
    numbers = ["step ms", "CPU ms", "tokens/s", "vs ddp", "vs ddp, paired", "vs best peer", "peak host MiB"]
    numbers += ["peak device GiB", "TFLOP/s", "MFU"] if gpu else []
    header = [*lead, *numbers, "notes"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    best_peers = []
    for budget in args.budget_list:
        ok = [r for r in rows if r["budget"] == budget and r["status"] == "ok"]
        ddp = next((r for r in ok if r["system"] == "ddp"), None)
        peer = max((r for r in ok if r["system"] not in ELIXIR_SYSTEMS), key=lambda r: r["tokens_per_s"], default=None)
        best_peers.append(f"{budget + ': ' if budget else ''}{peer['system'] if peer else 'none ran'}")
        for r in (r for r in rows if r["budget"] == budget):
            measured = _cells(r, ddp, peer, gpu)
            cells = [*([budget or "all"] if gpu else []), r["system"], *measured,
                     *["-"] * (len(numbers) - len(measured)), r.get("note", "")]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + f"\n\nbest peer: {'; '.join(best_peers)}\n"


def report(args: argparse.Namespace, results: list[dict], load: float, elapsed_s: float) -> None:
    print(f"{args.devices} x {args.accelerator}, {args.precision}, batch {args.batch_size}/rank x seq "
          f"{args.block_size}; {args.warmup} warm-up + median of {args.steps} steps (slowest rank), fastest of "
          f"{args.rounds} round(s); 1-minute load average before: {load:.2f}; {elapsed_s:.0f} s in all\n")
    print("CPU ms: host CPU time of one step, all of a process's threads, the mean over ranks. vs ddp: "
          "tokens/s over DDP's, best rounds; paired: the median over rounds of the same ratio within a round.\n")
    for workload in args.workload_list:
        rows = [r for r in results if r["workload"] == workload]
        params = next((r["n_params"] for r in rows if r["status"] == "ok"), None)
        size = f"{params / 1e6:.1f}M parameters, " if params else ""
        print(f"## {workload}: {size}n_layer {args.n_layer}, n_embd {args.n_embd}, n_head {args.n_head}, "
              f"vocab {args.vocab_size}\n")
        print(markdown_table(args, rows))
    if args.accelerator == "gpu":
        print("TFLOP/s: (6 N + 12 L d T) FLOPs per token x tokens per step / step time, all ranks together; "
              "MFU: over the GPUs' dense bf16 peak.\n")
    config = {k: v for k, v in vars(args).items() if k not in ("worker", "workload", "budget", "out")}
    _write_json(args.json, {"config": config, "results": results})
    print(f"results: {args.json}")
    if args.accelerator == "gpu" and plot(args, results):
        print(f"plot: {args.png}")


def plot(args: argparse.Namespace, results: list[dict]) -> bool:
    """Tokens/s against budget, one line per system and one panel per workload; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, len(args.workload_list), figsize=(6 * len(args.workload_list), 4), squeeze=False)
    for ax, workload in zip(axes[0], args.workload_list):
        for system in args.system_list:
            ran = {r["budget"]: r["tokens_per_s"] for r in results
                   if (r["workload"], r["system"], r["status"]) == (workload, system, "ok")}
            points = [(i, ran[b]) for i, b in enumerate(args.budget_list) if b in ran]
            if points:
                ax.plot(*zip(*points), marker="o", label=system)
        ax.set_xticks(range(len(args.budget_list)), [b or "all" for b in args.budget_list])
        ax.set(title=workload, xlabel="device memory budget per rank", ylabel="tokens/s")
        ax.legend(fontsize=7)
    os.makedirs(os.path.dirname(args.png) or ".", exist_ok=True)
    fig.tight_layout()
    fig.savefig(args.png, dpi=120)
    return True


def run_profile(args: argparse.Namespace, argv: list[str]) -> None:
    for workload in args.workload_list:
        row, text = run_system(args, argv, args.profile, workload, args.budget_list[0])
        print(f"## {workload}: {args.profile}, torch.profiler over {args.profile_steps} steps after "
              f"{args.warmup} warm-up, rank 0\n")
        print(text if row["status"] == "ok" else _status(row))


def main(argv: Optional[list[str]] = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.worker:
        return run_worker(args)
    if args.profile:
        return run_profile(args, argv)
    load, start = os.getloadavg()[0], time.perf_counter()
    results = run_grid(args, argv)
    report(args, results, load, time.perf_counter() - start)


if __name__ == "__main__":
    main()
