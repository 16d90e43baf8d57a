"""From a module and a plan to materialised, sharded chunks.

[Note: materialisation]
Chunks are filled one at a time in a staging buffer of the master dtype: real parameters are
copied in; parameters on the meta device are pointed at the staging buffer and initialised by
their module's ``reset_parameters()``. The staging buffer is broadcast from rank 0 (so every rank
starts from rank 0's weights, as DDP does), each rank keeps its shard, and the buffer is dropped
before the next chunk: no rank ever holds more than a few chunks of the model at once.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

import torch
import torch.nn as nn

from lightning_elixir.plan import (
    ChunkSpec,
    ElixirPlan,
    PlanError,
    chunk_used_numel,
    default_chunk_numel,
    pack_chunks,
    slot_offsets,
)
from lightning_elixir.runtime import collectives
from lightning_elixir.runtime.chunk import Chunk, Slot
from lightning_elixir.runtime.collectives import Group

def param_owners(module: nn.Module) -> dict[int, list[tuple[str, nn.Module]]]:
    """For each parameter (by id), every (module name, module) that holds it directly."""
    owners: dict[int, list[tuple[str, nn.Module]]] = defaultdict(list)
    for mod_name, mod in module.named_modules(remove_duplicate=False):
        for p in mod._parameters.values():
            if p is not None:
                owners[id(p)].append((mod_name, mod))
    return owners


def shared_param_names(module: nn.Module) -> set[str]:
    """Parameters held by more than one module (tied weights, shared modules)."""
    owners = param_owners(module)
    return {name for name, p in module.named_parameters() if len(owners[id(p)]) > 1}


def resolve_specs(module: nn.Module, plan: ElixirPlan, world_size: int, private: Iterable[str] = ()) -> tuple[ChunkSpec, ...]:
    """The chunk layout for ``module``: the plan's own, validated, or packed in registration order."""
    named = list(module.named_parameters())
    shared = shared_param_names(module) | set(private)
    if not plan.chunks:
        chunk_numel = plan.chunk_numel or default_chunk_numel([p.numel() for n, p in named if n not in shared])
        return pack_chunks([(n, p.numel()) for n, p in named], chunk_numel, world_size, shared)
    _check_plan_matches(plan, named, world_size, shared)
    return plan.chunks


def _check_plan_matches(plan: ElixirPlan, named: list[tuple[str, nn.Parameter]], world_size: int, shared: set[str]) -> None:
    if plan.world_size != world_size:
        raise PlanError(f"the plan's layout was built for world_size={plan.world_size}, but {world_size} ranks "
                        "are running; re-plan (plan='auto') or build the layout for this world size")
    model_names = {n for n, _ in named}
    plan_names = {n for spec in plan.chunks for n in spec.params}
    missing, unknown = sorted(model_names - plan_names), sorted(plan_names - model_names)
    if missing or unknown:
        raise PlanError(f"the plan does not match the model: parameters missing from the plan {missing[:5]}, "
                        f"names in the plan that the model lacks {unknown[:5]}; was it made for another model?")
    numels = dict((n, p.numel()) for n, p in named)
    for spec in plan.chunks:
        if chunk_used_numel([numels[n] for n in spec.params]) > spec.numel:
            raise PlanError(f"chunk {spec.params[:3]}... holds more elements than its numel {spec.numel}")
        bad = [n for n in spec.params if n in shared and not spec.private]
        if bad:
            raise PlanError(f"parameters {bad} are shared between modules but sit in a public chunk; "
                            "give each its own private chunk")


def build_chunks(module: nn.Module, specs: tuple[ChunkSpec, ...], group: Group, device: torch.device,
                 compute_dtype: torch.dtype, master_dtype: torch.dtype, reduce_dtype: torch.dtype) -> list[Chunk]:
    """Create every chunk, materialise and shard its parameters, and leave it released."""
    _replace_meta_params(module, device, compute_dtype)
    params = dict(module.named_parameters())
    chunks = []
    for index, spec in enumerate(specs):
        members = [params[name] for name in spec.params]
        offsets = slot_offsets([p.numel() for p in members])
        slots = [Slot(n, p, off, p.numel(), p.shape) for n, p, off in zip(spec.params, members, offsets)]
        chunks.append(Chunk(index, spec, slots, group, device, compute_dtype, master_dtype, reduce_dtype))
    _materialize(module, chunks, group, master_dtype)
    for chunk in chunks:
        chunk.release()
    return chunks


def _replace_meta_params(module: nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    """Swap meta parameters for real (empty) ones in every module that holds them."""
    owners = param_owners(module)
    for _, p in list(module.named_parameters()):
        if not p.is_meta:
            continue
        # One element expanded to the right shape: numel/shape stay true until the chunk view is bound.
        stub = torch.empty(1, dtype=dtype, device=device).expand(p.shape) if p.dim() else torch.empty((), dtype=dtype, device=device)
        real = nn.Parameter(stub, requires_grad=p.requires_grad)
        real._elixir_meta_shape = p.shape  # type: ignore[attr-defined]
        for _, mod in owners[id(p)]:
            for key, value in mod._parameters.items():
                if value is p:
                    mod._parameters[key] = real


def _materialize(module: nn.Module, chunks: list[Chunk], group: Group, master_dtype: torch.dtype) -> None:
    where = {id(s.param): (chunk, s) for chunk in chunks for s in chunk.slots}
    staging: dict[int, torch.Tensor] = {}
    initialised: set[int] = set()
    owners = param_owners(module)
    for chunk in chunks:
        stage = staging.setdefault(chunk.index, _new_stage(chunk, master_dtype))
        for slot in chunk.slots:
            if hasattr(slot.param, "_elixir_meta_shape"):
                for _, mod in owners[id(slot.param)]:
                    _init_meta_module(mod, where, staging, initialised, master_dtype)
            else:
                stage[slot.offset:slot.end].copy_(slot.param.detach().reshape(-1))
        _finalize_chunk(chunk, staging.pop(chunk.index), group)


def _new_stage(chunk: Chunk, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(chunk.numel, dtype=dtype, device=chunk.full.device)


def _init_meta_module(mod: nn.Module, where: dict, staging: dict, initialised: set[int], dtype: torch.dtype) -> None:
    """Point ``mod``'s direct parameters at staging views and run its ``reset_parameters``."""
    if id(mod) in initialised:
        return
    initialised.add(id(mod))
    if not hasattr(mod, "reset_parameters"):
        raise TypeError(f"{type(mod).__name__} was created on the meta device but has no reset_parameters(); "
                        "add one that initialises its own parameters, or create the model without empty_init")
    for p in mod._parameters.values():
        if p is None:
            continue
        chunk, slot = where[id(p)]
        stage = staging.setdefault(chunk.index, _new_stage(chunk, dtype))
        p.data = stage[slot.offset:slot.end].view(slot.shape)
    for key, buf in mod._buffers.items():
        if buf is not None and buf.is_meta:
            mod._buffers[key] = torch.empty_like(buf, device=next(iter(staging.values())).device)
    with torch.no_grad():
        mod.reset_parameters()
    for p in mod._parameters.values():
        if p is not None and hasattr(p, "_elixir_meta_shape"):
            del p._elixir_meta_shape


def _finalize_chunk(chunk: Chunk, stage: torch.Tensor, group: Group) -> None:
    """Broadcast rank 0's values, keep this rank's shard, fill the gathered block."""
    collectives.broadcast(stage, group, src=0)
    shard = stage[chunk.shard_begin:chunk.shard_begin + chunk.shard_numel]
    chunk.master.copy_(shard)
    chunk.refresh_shard()
    chunk.full.copy_(stage)
    chunk.bind_views()


def materialize_buffers(module: nn.Module, device: torch.device) -> None:
    """Move buffers to ``device``; initialise meta buffers of parameter-free modules."""
    for mod in module.modules():
        has_meta = False
        for key, buf in mod._buffers.items():
            if buf is None:
                continue
            has_meta |= buf.is_meta
            mod._buffers[key] = torch.empty_like(buf, device=device) if buf.is_meta else buf.to(device)
        if has_meta and not any(p is not None for p in mod._parameters.values()):
            if not hasattr(mod, "reset_parameters"):
                raise TypeError(f"{type(mod).__name__} has meta buffers but no reset_parameters() to initialise them")
            mod.reset_parameters()


def broadcast_buffers(module: nn.Module, group: Group) -> None:
    """Make every rank start from rank 0's buffers, as DDP does."""
    for buf in module.buffers():
        collectives.broadcast(buf, group, src=0)
