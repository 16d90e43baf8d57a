"""The runtime's host cost where it shows: a launch-bound GPT, DDP against Elixir and FSDP2, in one run.

    python examples/benchmarks/host_overhead.py                        # world sizes 1 and 2, both tables
    python examples/benchmarks/host_overhead.py --world-sizes 2 --rounds 3
    python examples/benchmarks/host_overhead.py --checkpointing on     # recomputation per block only
    python examples/benchmarks/host_overhead.py --model moe --checkpointing off   # another launch-bound shape

On a GPU a step of a realistic model is often launch-bound: every Python call on the hot path is
paid as GPU idle time. On a 2-core CPU kernels of realistic widths are so slow that the same
overhead hides in them (3% of a step). This benchmark makes the host cost visible on a CPU: a
GPT of many layers and tiny width (24 x 64, vocabulary 256, sequence 32, batch 2) whose step is
mostly per-call overhead, so the ratio of a system's step time to DDP's is its host overhead. Its
ratios matched those measured on an H200 for GPT-2 medium.

Every system trains the same model from the same seed with AdamW on its own spawned gloo
processes (one thread each), driving the runtime directly (no Trainer): "ddp" (torch's
DistributedDataParallel), "elixir_zero2" and "elixir_zero3" (fixed plans; this small model packs into two
public chunks, for which the ZeRO-3 preset's cache ("min+1") has a block each, so it keeps them gathered), "elixir_zero3_block" (ZeRO-3
with a chunk per block, gathered and released per use, as FSDP2 runs here; at world size 1, as every
plan that keeps its state on the device, it keeps its chunks gathered), "elixir" (plan="auto",
profiled and searched for the model) and "fsdp2" (``fully_shard`` per block and at the root). A
round runs every system once, the order reversed every other round; a system's step time is the
median over timed steps of the slowest rank, best round counts. A second, profiled pass gives the
host time per step of each kind of hook (torch.profiler's ``Elixir::*`` and ``FSDP::*`` labels,
inclusive CPU time, rank 0), which the profiler itself inflates: compare them with each other.
``--checkpointing`` also runs every system with non-reentrant activation checkpointing per block.

``--model`` picks other launch-bound shapes of the same depth, width, vocabulary and sequence, to
check that the host cost does not depend on the GPT's: "llama" (lightning_elixir/demos/llama.py: RMSNorm,
SwiGLU, rotary, no biases), "moe" (--experts expert MLPs per block, top-2 routing, a Python loop
over the experts), "tiny_params" (many small parameters per block: four LayerNorms, biases
everywhere, a depthwise convolution, per-channel scales), "hf_gpt2" (transformers' GPT2LMHeadModel
from a config), "hf_llama_lora" (transformers' LlamaForCausalLM with PEFT's LoRA on q/v: 3% of
the parameters train). Blocks are the model's first ModuleList (FSDP2's ``fully_shard`` units and
the chunk-per-block plan's size); the HF models take ``--checkpointing off`` only.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from collections import defaultdict
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from lightning_elixir import per_parameter_optimizer  # noqa: E402
from tests.distributed import run_distributed  # noqa: E402

MODELS = ("gpt", "llama", "moe", "tiny_params", "hf_gpt2", "hf_llama_lora")
SYSTEMS = ("ddp", "elixir_zero2", "elixir_zero3", "elixir_zero3_block", "elixir", "fsdp2")
HOOK_PREFIXES = ("Elixir::", "FSDP::")


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=MODELS, default="gpt")
    p.add_argument("--experts", type=int, default=16, help="experts per block of --model moe")
    p.add_argument("--optimizer", choices=("adamw", "adafactor", "lamb"), default="adamw",
                   help="adamw: the model's own (configure_optimizers); adafactor: torch's, over every parameter; "
                        "lamb: LAMB, declared per-parameter (its step on whole parameters gathered chunk by chunk)")
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--world-sizes", default="1,2")
    p.add_argument("--checkpointing", choices=("off", "on", "both"), default="both")
    p.add_argument("--n-layer", type=int, default=24)
    p.add_argument("--n-embd", type=int, default=64)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--vocab-size", type=int, default=256)
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--profile-steps", type=int, default=5)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args(argv)
    args.system_list = args.systems.split(",")
    unknown = set(args.system_list) - set(SYSTEMS)
    if unknown:
        p.error(f"unknown systems {sorted(unknown)}; choose from {', '.join(SYSTEMS)}")
    args.world_size_list = [int(w) for w in args.world_sizes.split(",")]
    args.checkpointing_list = {"off": [False], "on": [True], "both": [False, True]}[args.checkpointing]
    return args


def build(args: argparse.Namespace, checkpointing: bool) -> torch.nn.Module:
    """A LightningModule with ``.model``, ``_loss(batch)`` and ``configure_optimizers()``."""
    torch.manual_seed(0)
    if args.model == "gpt":
        from lightning_elixir.demos.gpt import GPTLightningModule

        return GPTLightningModule(vocab_size=args.vocab_size, block_size=args.block_size, n_layer=args.n_layer,
                                  n_head=args.n_head, n_embd=args.n_embd, activation_checkpointing=checkpointing)
    if args.model == "llama":
        from lightning_elixir.demos.llama import LlamaLightningModule

        return LlamaLightningModule(vocab_size=args.vocab_size, block_size=args.block_size, n_layer=args.n_layer,
                                    n_head=args.n_head, n_embd=args.n_embd, activation_checkpointing=checkpointing)
    from examples.benchmarks.shapes import build_shape

    return build_shape(args.model, args, checkpointing)


def blocks(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The model's repeated blocks: its first ModuleList in module order."""
    return next(m for m in model.modules() if isinstance(m, torch.nn.ModuleList))


def batches(args: argparse.Namespace, rank: int, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1 + rank)
    out = []
    for _ in range(count):
        tokens = torch.randint(0, args.vocab_size, (args.batch_size, args.block_size + 1), generator=gen)
        out.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))
    return out


def _plain_step(model: torch.nn.Module, optimizer: Any) -> Callable[[Any], None]:
    def step(batch: Any) -> None:
        inputs, targets = batch
        logits = model(inputs)
        loss = torch.nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return step


def optimizer_of(args: argparse.Namespace, module: Any) -> Any:
    """The optimizer ``--optimizer`` names for ``module``."""
    if args.optimizer == "adafactor":
        return torch.optim.Adafactor(module.parameters(), lr=1e-2)
    if args.optimizer == "lamb":
        return Lamb(module.parameters(), lr=1e-3)
    return module.configure_optimizers()


@per_parameter_optimizer
class Lamb(torch.optim.Optimizer):
    """LAMB: Adam's update with weight decay, scaled per parameter by ||parameter|| / ||update||."""

    def __init__(self, params: Any, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6,
                 weight_decay: float = 0.01) -> None:
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"], state["exp_avg_sq"] = torch.zeros_like(p), torch.zeros_like(p)
                state["step"] += 1
                state["exp_avg"].lerp_(p.grad, 1 - beta1)
                state["exp_avg_sq"].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                update = (state["exp_avg"] / (1 - beta1 ** state["step"])) / (
                    (state["exp_avg_sq"] / (1 - beta2 ** state["step"])).sqrt() + group["eps"])
                update.add_(p, alpha=group["weight_decay"])
                w, u = p.norm(), update.norm()
                trust = torch.where((w > 0) & (u > 0), w / u, torch.ones_like(w))
                p.sub_(update * (trust * group["lr"]))
        return None


def make_step(args: argparse.Namespace, system: str, checkpointing: bool, world_size: int) -> Callable[[Any], None]:
    """One training step of ``system`` on a fresh model: forward, loss, backward, optimizer step."""
    module = build(args, checkpointing)
    if system == "ddp":
        # experts no token chose get no gradient: DDP must look for unused parameters
        model = torch.nn.parallel.DistributedDataParallel(module.model, find_unused_parameters=args.model == "moe")
        return _plain_step(model, optimizer_of(args, module))
    if system == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for block in blocks(module.model):
            fully_shard(block)
        fully_shard(module.model)
        return _plain_step(module.model, optimizer_of(args, module))
    return _elixir_step(args, module, system, world_size)


def _elixir_step(args: argparse.Namespace, module: Any, system: str, world_size: int) -> Callable[[Any], None]:
    from lightning_elixir.plan import PRESETS
    from lightning_elixir.runtime.collectives import Group
    from lightning_elixir.runtime.optim import optimizer_step, shard_optimizer
    from lightning_elixir.runtime.runtime import ElixirRuntime

    group = Group.default()
    if system == "elixir":
        plan = _auto_plan(args, module, group)
    elif system == "elixir_zero3_block":  # ZeRO-3 as FSDP2 runs it here: a chunk per block, gathered per use
        block_numel = sum(p.numel() for p in blocks(module.model)[0].parameters())
        plan = dataclasses.replace(PRESETS["zero3"], chunk_numel=block_numel, name="zero3_block")
    else:
        plan = PRESETS[system.removeprefix("elixir_")]
    runtime = ElixirRuntime(module, plan, group=group, grow_cache=system == "elixir")
    optimizer = shard_optimizer(runtime, optimizer_of(args, module))

    def step(batch: Any) -> None:
        with runtime.step_region():
            runtime.begin_iteration()
            loss = module._loss(batch)
        loss.backward()
        optimizer_step(runtime, optimizer)
        optimizer.zero_grad()
    return step


def _auto_plan(args: argparse.Namespace, module: Any, group: Any) -> Any:
    from lightning_elixir.planner import plan_automatically

    batch = batches(args, 0, 1)[0]
    result = plan_automatically(module, batch, device=torch.device("cpu"), group=group, compute_dtype=torch.float32,
                                autocast_dtype=None, micro_batches=1, step_fn=lambda m, b: m._loss(b))
    return result.plan


def _median_step_s(step: Callable[[Any], None], data: list, warmup: int) -> list[float]:
    times = []
    for i, batch in enumerate(data):
        start = time.perf_counter()
        step(batch)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return times


def _hook_ms(step: Callable[[Any], None], data: list) -> dict[str, float]:
    """Inclusive host ms per step of every hook label, from torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for batch in data:
            step(batch)
    out: dict[str, float] = defaultdict(float)
    for e in prof.key_averages():
        if e.key.startswith(HOOK_PREFIXES):  # FSDP's labels name their module: "FSDP::post_backward_reduce (h.3)"
            out[e.key.split(" (", 1)[0]] += e.cpu_time_total / 1e3 / len(data)
    return dict(out)


def run_rank(rank: int, world_size: int, args: argparse.Namespace, system: str, checkpointing: bool) -> dict:
    step = make_step(args, system, checkpointing, world_size)
    data = batches(args, rank, args.warmup + args.steps)
    times = _median_step_s(step, data, args.warmup)
    per_step = torch.tensor(times)
    if world_size > 1:  # the slowest rank sets each step
        dist.all_reduce(per_step, op=dist.ReduceOp.MAX)
    hooks = _hook_ms(step, data[:args.profile_steps])
    return {"step_s": statistics.median(per_step.tolist()), "hooks": hooks}


def measure(args: argparse.Namespace) -> dict:
    """{(world_size, checkpointing): {system: (best step s, hook ms of that round)}}."""
    results: dict = {}
    for world_size in args.world_size_list:
        for checkpointing in args.checkpointing_list:
            best: dict[str, tuple[float, dict]] = {}
            for round_ in range(args.rounds):
                order = args.system_list if round_ % 2 == 0 else args.system_list[::-1]
                for system in order:
                    out = run_distributed(run_rank, world_size, args, system, checkpointing)[0]
                    print(f"  ws={world_size} ckpt={checkpointing} {system}: {out['step_s'] * 1e3:.1f} ms",
                          file=sys.stderr, flush=True)
                    if system not in best or out["step_s"] < best[system][0]:
                        best[system] = (out["step_s"], out["hooks"])
            results[(world_size, checkpointing)] = best
    return results


def report(args: argparse.Namespace, results: dict) -> None:
    name = {"gpt": "GPT"}.get(args.model, f"--model {args.model}")
    print(f"{name} {args.n_layer} layers x width {args.n_embd}, vocabulary {args.vocab_size}, sequence "
          f"{args.block_size}, batch {args.batch_size}, AdamW, gloo, 1 thread per rank; median of {args.steps} "
          f"steps of the slowest rank, best of {args.rounds} rounds\n")
    print("| world size | checkpointing | system | step ms | vs DDP | hook host ms/step (profiled) |")
    print("|---|---|---|---|---|---|")
    for (world_size, checkpointing), best in results.items():
        ddp = best.get("ddp", (None,))[0]
        for system in args.system_list:
            step_s, hooks = best[system]
            ratio = f"{step_s / ddp:.2f}x" if ddp else "-"
            top = sorted(hooks.items(), key=lambda kv: -kv[1])
            cell = ", ".join(f"{k.split('::', 1)[1]} {v:.1f}" for k, v in top[:4]) or "-"
            print(f"| {world_size} | {'per block' if checkpointing else 'off'} | {system} | {step_s * 1e3:.1f} | "
                  f"{ratio} | {cell} |")


def main(argv: Optional[list[str]] = None) -> None:
    args = parse_args(argv)
    report(args, measure(args))


if __name__ == "__main__":
    main()
