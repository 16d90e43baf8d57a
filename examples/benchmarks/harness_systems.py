"""What each benchmarked system and workload is: the workloads' modules and their FLOP count, the FSDP2 and
DeepSpeed mixins, and the Lightning strategy of every system (see harness.py for the systems' names)."""

from __future__ import annotations

import argparse
import importlib
from dataclasses import replace
from typing import Any, Optional

ELIXIR_SYSTEMS = ("elixir", "elixir_zero2", "elixir_zero3", "elixir_offload")
"""The Elixir systems: the tables' best peer is the fastest system not among them."""
COMPILED = "+compile"
"""A system's name with this suffix runs the same system with every transformer block compiled in place
(``block.compile()``, as torchtitan does), e.g. "ddp+compile"."""
CHECKPOINTED = "+ac"
"""A system's name with this suffix runs the same system with the workload's own activation
checkpointing per block switched on by hand (``activation_checkpointing=True``), e.g. "fsdp2+ac"."""


def base_system(system: str) -> str:
    """The system without its ``COMPILED`` and ``CHECKPOINTED`` suffixes (in either order)."""
    for _ in range(2):
        system = system.removesuffix(COMPILED).removesuffix(CHECKPOINTED)
    return system
WORKLOADS = {"gpt": "lightning_elixir.demos.gpt:GPTLightningModule", "llama": "lightning_elixir.demos.llama:LlamaLightningModule"}
"""Each workload's LightningModule ("module:class"), taking vocab_size, block_size, n_layer, n_head, n_embd."""


def flops_per_token(n_params: int, n_layer: int, n_embd: int, seq_len: int) -> int:
    """Training FLOPs per token: 6 N for the matrix multiplies of forward and backward (every parameter,
    embeddings included) plus 12 L d T for attention's scores and weighted sums, as in PaLM (Chowdhery
    et al. 2022, appendix B) and nanoGPT's ``estimate_mfu``. Causal masking is not discounted."""
    return 6 * n_params + 12 * n_layer * n_embd * seq_len


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


class CompiledBlocks:
    """``configure_model``: whatever the system does there, then ``compile()`` every transformer block."""

    def configure_model(self) -> None:
        super().configure_model()
        for block in transformer_blocks(self.model):
            block.compile()


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
    system = base_system(system)
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


def build_module(args: argparse.Namespace) -> Any:
    """The workload's LightningModule, with the system's mixin when it has one."""
    path, _, name = WORKLOADS[args.workload].partition(":")
    base = getattr(importlib.import_module(path), name)
    suffixes = args.worker[len(base_system(args.worker)):]
    mixins = [CompiledBlocks] if COMPILED in suffixes else []
    if base_system(args.worker) in MIXINS:
        mixins.append(MIXINS[base_system(args.worker)])
    cls = type("".join(m.__name__ for m in mixins) + base.__name__, (*mixins, base), {}) if mixins else base
    extra = {"n_kv_head": args.n_kv_head} if args.workload == "llama" and args.n_kv_head else {}
    if CHECKPOINTED in suffixes:
        extra["activation_checkpointing"] = True
    return cls(vocab_size=args.vocab_size, block_size=args.block_size, n_layer=args.n_layer, n_head=args.n_head,
               n_embd=args.n_embd, **extra)
