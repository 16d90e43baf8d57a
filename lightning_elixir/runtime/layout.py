"""From a module and a plan to materialised, sharded chunks.

[Note: materialisation]
Chunks are filled one at a time in a staging buffer of the master dtype: real parameters are
copied in; parameters on the meta device get the values a real build would have given them,
replayed from the build's recording ([Note: deferred initialisation] in deferred.py), or, when
they were made outside one, are pointed at the staging buffer and initialised by their module's
``reset_parameters()``. The staging buffer is broadcast from rank 0 (so every rank
starts from rank 0's weights, as DDP does), each rank keeps its shard, and the buffer is dropped
before the next chunk: no rank ever holds more than a few chunks of the model at once.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any, Optional

import torch
import torch.nn as nn

from lightning_elixir.plan import (
    ChunkSpec,
    ElixirPlan,
    PlanError,
    chunk_used_numel,
    default_chunk_numel,
    pack_chunks,
    shard_aligned,
    slot_offsets,
)
from lightning_elixir.runtime import collectives
from lightning_elixir.runtime.chunk import Chunk, Slot, host_requests
from lightning_elixir.runtime.deferred import InitRecord, recording_of
from lightning_elixir.runtime.collectives import Group
from lightning_elixir.runtime.hostmem import HostArena
from lightning_elixir.runtime.policy import PrecisionPolicy, own_dtype_params

def param_owners(module: nn.Module) -> dict[int, list[tuple[str, nn.Module]]]:
    """For each parameter (by id), every (module name, module) that holds it directly."""
    owners: dict[int, list[tuple[str, nn.Module]]] = defaultdict(list)
    for mod_name, mod in module.named_modules(remove_duplicate=False):
        for p in mod._parameters.values():
            if p is not None:
                owners[id(p)].append((mod_name, mod))
    return owners


def shared_param_names(module: nn.Module) -> set[str]:
    """Parameters held by more than one module object (tied weights). One module registered under two
    names is not sharing: its hooks run once per call, as for a module called twice."""
    owners = param_owners(module)
    return {name for name, p in module.named_parameters() if len({id(m) for _, m in owners[id(p)]}) > 1}


def check_initialized(module: nn.Module) -> None:
    """Refuse lazy modules whose parameters have no shape yet: chunks are laid out from the shapes."""
    lazy = [n for n, p in module.named_parameters() if nn.parameter.is_lazy(p)]
    if lazy:
        raise ValueError(f"parameters {lazy[:3]} of lazy modules (nn.LazyLinear, ...) are not initialized yet, and "
                         "chunks are laid out from parameter shapes; run one forward pass on a sample batch before "
                         "training (e.g. at the end of __init__ or in configure_model), or give the layers their "
                         "input sizes")


def resolve_specs(module: nn.Module, plan: ElixirPlan, world_size: int, private: Iterable[str] = (),
                  full_precision: Iterable[str] = (), own_dtypes: Optional[dict[str, torch.dtype]] = None
                  ) -> tuple[ChunkSpec, ...]:
    """The chunk layout for ``module``: the plan's own, validated, or packed in registration order.

    Without an explicit layout, parameters that compute in full precision (see
    ``PrecisionPolicy.keeps_full_precision``) share one private chunk of that dtype, so that the
    public chunks keep the compute dtype, and parameters of other dtypes (``own_dtypes``, [Note:
    parameters of other dtypes] in policy.py) one private chunk per dtype. An explicit layout is run
    as given: a chunk that holds a full-precision parameter computes in full precision as a whole, and
    one that holds a parameter of another dtype must hold only parameters of that dtype.
    """
    check_initialized(module)
    named = list(module.named_parameters())
    unknown = sorted(set(private) - {n for n, _ in named})
    if unknown:
        raise PlanError(f"private_params names {unknown[:5]} are not parameters of the model; use names from "
                        "model.named_parameters(), e.g. {}".format([n for n, _ in named][:3]))
    if own_dtypes is None:  # as under a policy that converts nothing but fp32 (32-true)
        own_dtypes = own_dtype_params(module, ())
    shared = shared_param_names(module) | set(private)
    if plan.chunks:
        _check_plan_matches(plan, named, world_size, shared)
        _check_one_dtype(plan.chunks, own_dtypes)
        return plan.chunks
    full_precision = set(full_precision) - shared - set(own_dtypes)
    groups = [[(n, p.numel()) for n, p in named if n in full_precision]]
    for dtype in dict.fromkeys(own_dtypes.values()):
        groups.append([(n, p.numel()) for n, p in named if own_dtypes.get(n) == dtype])
    apart = {n for group in groups for n, _ in group}
    shared -= apart
    chunk_numel = plan.chunk_numel or default_chunk_numel([p.numel() for n, p in named if n not in shared | apart],
                                                         world_size)
    specs = pack_chunks([(n, p.numel()) for n, p in named if n not in apart], shard_aligned(chunk_numel, world_size),
                        world_size, shared)  # [Note: shards on the vector grid], as the search's sizes
    for group in groups:
        if group:
            numel = shard_aligned(chunk_used_numel([n for _, n in group]), world_size)
            specs += (ChunkSpec(tuple(n for n, _ in group), numel, private=True),)
    return specs


def _check_one_dtype(specs: tuple[ChunkSpec, ...], own_dtypes: dict[str, torch.dtype]) -> None:
    """A chunk that holds a parameter of a dtype of its own ([Note: parameters of other dtypes]) holds only that dtype."""
    for spec in specs:
        kinds = {own_dtypes.get(n) for n in spec.params}
        if len(kinds) > 1:
            kept = {str(k).removeprefix("torch.") for k in kinds if k is not None}
            raise PlanError(f"chunk {spec.params[:3]}... mixes parameters that keep their own dtype ({sorted(kept)}) "
                            "with others: a chunk has one dtype, so give the parameters of each such dtype chunks of "
                            "their own")


def _check_plan_matches(plan: ElixirPlan, named: list[tuple[str, nn.Parameter]], world_size: int, shared: set[str]) -> None:
    if plan.world_size != world_size:
        raise PlanError(f"the plan's layout was built for world_size={plan.world_size}, but {world_size} ranks "
                        f"are running; re-plan (plan='auto', or `lightning-elixir plan ... --devices {world_size}` for a "
                        "plan file), or use plan='zero2'/'zero3', which carry no layout")
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
                 policy: PrecisionPolicy, full_precision: Iterable[str] = (), values: bool = True,
                 aliased: bool = False, deferred: Sequence[InitRecord] = (),
                 own_dtypes: Optional[dict[str, torch.dtype]] = None) -> list[Chunk]:
    """Create every chunk, materialise and shard its parameters, and leave it released.

    ``aliased``: the chunks' shards are their gathered blocks ([Note: a world of one] in chunk.py).
    ``deferred``: the recordings of the builds that made meta parameters ([Note: materialisation]).

    A chunk holding a parameter named in ``full_precision`` computes in the master dtype, and one holding
    parameters of a dtype of their own (``own_dtypes``) computes, trains and reduces in that dtype. With
    ``values=False`` the parameters' values are neither read nor initialised: the chunks start at
    zero and the caller fills the master shards (re-chunking, runtime/replan.py).
    """
    full_precision = set(full_precision)
    _replace_meta_params(module, device)
    params = dict(module.named_parameters())
    own_dtypes = policy.own_dtype_params(module) if own_dtypes is None else own_dtypes
    fulls = [bool(full_precision.intersection(spec.params)) for spec in specs]
    owns = [own_dtypes.get(spec.params[0]) if spec.params else None for spec in specs]
    computes = [own or (policy.master_dtype if full else policy.compute_dtype) for full, own in zip(fulls, owns)]
    masters = [own or policy.master_dtype for own in owns]
    # What offloaded chunks keep in host memory, asked for at once ([Note: pinned memory in slabs]).
    host = HostArena([request for spec, compute, master in zip(specs, computes, masters) for request in host_requests(
        spec, spec.numel // group.world_size, compute, master).values()], pin=device.type == "cuda")
    chunks = []
    for index, (spec, full, own, compute, master) in enumerate(zip(specs, fulls, owns, computes, masters)):
        members = [params[name] for name in spec.params]
        offsets = slot_offsets([p.numel() for p in members])
        slots = [Slot(n, p, off, p.numel(), p.shape, p.dtype, stride=dense_stride(p))
                 for n, p, off in zip(spec.params, members, offsets)]
        reduce = own or (torch.float32 if full and policy.master_dtype == torch.float32 else policy.reduce_dtype)
        state_device = device if spec.placement == "device" else torch.device("cpu")
        chunks.append(Chunk(index, spec, slots, group, device, compute, master, reduce,
                            state_device=state_device, host=host, aliased=aliased))
    if values:
        _materialize(module, chunks, group, deferred)
    else:
        for chunk in chunks:
            chunk.release()
    return chunks


def dense_stride(p: torch.Tensor) -> Optional[tuple[int, ...]]:
    """``p``'s strides when it is dense but not contiguous (channels_last, transposed); else None.

    A parameter the runtime had before (re-chunked after ``detach_module``, whose placeholders are
    expanded) keeps the strides it was first chunked with."""
    kept = getattr(p, "_elixir_stride", None)
    if kept is not None:
        return kept
    if p.is_meta or p.is_contiguous():
        return None
    expected = 1  # dense and not overlapping: the strides, smallest first, step through every element once
    for stride, size in sorted((stride, size) for stride, size in zip(p.stride(), p.shape) if size > 1):
        if stride != expected:
            return None
        expected *= size
    return tuple(p.stride())


def _replace_meta_params(module: nn.Module, device: torch.device) -> None:
    """Swap meta parameters for real (empty) ones in every module that holds them."""
    owners = param_owners(module)
    for _, p in list(module.named_parameters()):
        if not p.is_meta:
            continue
        # One element expanded to the right shape: numel/shape stay true until the chunk view is bound.
        stub = torch.empty(1, dtype=p.dtype, device=device).expand(p.shape) if p.dim() else torch.empty((), dtype=p.dtype, device=device)
        real = nn.Parameter(stub, requires_grad=p.requires_grad)
        real._elixir_meta_source = p  # type: ignore[attr-defined]  # uninitialised; what a recording knows it by
        for _, mod in owners[id(p)]:
            for key, value in mod._parameters.items():
                if value is p:
                    mod._parameters[key] = real


def _materialize(module: nn.Module, chunks: list[Chunk], group: Group, deferred: Sequence[InitRecord]) -> None:
    where = {id(s.param): (chunk, s) for chunk in chunks for s in chunk.slots}
    staging: dict[int, torch.Tensor] = {}
    initialised: set[int] = set()
    owners = param_owners(module)
    for chunk in chunks:
        stage = staging.setdefault(chunk.index, _new_stage(chunk))
        for slot in chunk.slots:
            source = getattr(slot.param, "_elixir_meta_source", None)
            record = None if source is None else recording_of(source, deferred)
            if record is not None:
                stage[slot.offset:slot.end].copy_(record.materialize(source).reshape(-1))
                del slot.param._elixir_meta_source
            elif source is not None:
                for _, mod in owners[id(slot.param)]:
                    _init_meta_module(mod, where, staging, initialised)
            else:
                stage[slot.offset:slot.end].copy_(slot.param.detach().reshape(-1))
        _finalize_chunk(chunk, staging.pop(chunk.index), group)
        chunk.release()  # before the next chunk's block is allocated


def _new_stage(chunk: Chunk) -> torch.Tensor:
    """The whole chunk's values in its master dtype, while they are being put together."""
    return torch.zeros(chunk.numel, dtype=chunk.master.dtype, device=chunk.full.device)


def _init_meta_module(mod: nn.Module, where: dict, staging: dict, initialised: set[int]) -> None:
    """Point ``mod``'s direct parameters at staging views and run its ``reset_parameters``."""
    if id(mod) in initialised:
        return
    initialised.add(id(mod))
    if not hasattr(mod, "reset_parameters"):
        raise TypeError(f"{type(mod).__name__} was created on the meta device but has no reset_parameters(); build "
                        "it in configure_model() (or under trainer.init_module(empty_init=True)), where the strategy "
                        "records the build and gives every tensor the values a real build would, or create it "
                        "on a real device, or add a reset_parameters() that initialises its own parameters")
    for p in mod._parameters.values():
        if p is None:
            continue
        chunk, slot = where[id(p)]
        stage = staging.setdefault(chunk.index, _new_stage(chunk))
        p.data = stage[slot.offset:slot.end].view(slot.shape)
    for key, buf in mod._buffers.items():
        if buf is not None and buf.is_meta:
            mod._buffers[key] = torch.empty_like(buf, device=next(iter(staging.values())).device)
    with torch.no_grad():
        mod.reset_parameters()
    for p in mod._parameters.values():
        if p is not None and hasattr(p, "_elixir_meta_source"):
            del p._elixir_meta_source


def _finalize_chunk(chunk: Chunk, stage: torch.Tensor, group: Group) -> None:
    """Broadcast rank 0's values, keep this rank's shard, fill the gathered block."""
    collectives.broadcast(stage, group, src=0)
    shard = stage[chunk.shard_begin:chunk.shard_begin + chunk.shard_numel]
    chunk.master.copy_(shard)
    chunk.refresh_shard()
    chunk.fill(stage)


def materialize_buffers(module: nn.Module, device: torch.device, deferred: Sequence[InitRecord] = ()) -> None:
    """Move buffers to ``device``; give meta buffers the values their build's recording replays, else
    initialise those of parameter-free modules with ``reset_parameters()``."""
    for mod in module.modules():
        has_meta = False
        for key, buf in mod._buffers.items():
            if buf is None:
                continue
            record = recording_of(buf, deferred) if buf.is_meta else None
            if record is not None:
                mod._buffers[key] = record.materialize(buf).to(device)
                continue
            has_meta |= buf.is_meta
            mod._buffers[key] = torch.empty_like(buf, device=device) if buf.is_meta else buf.to(device)
        if has_meta and not any(p is not None for p in mod._parameters.values()):
            if not hasattr(mod, "reset_parameters"):
                raise TypeError(f"{type(mod).__name__} has meta buffers but no reset_parameters() to initialise them; "
                                "build it in configure_model() (or under trainer.init_module(empty_init=True)), "
                                "where the strategy records the build and replays it, or create it on a real device")
            mod.reset_parameters()
        if deferred:
            _materialize_attributes(mod, device, deferred)


def _materialize_attributes(mod: nn.Module, device: torch.device, deferred: Sequence[InitRecord]) -> None:
    """Tensors a deferred build left in plain attributes (a torchmetrics metric's states and their defaults,
    ``example_input_array``, a mask kept as an attribute), directly or in a list, tuple or dict: the values
    the recording replays, on ``device``, as a real build (moved to the device) would have them."""
    def meta(value: Any) -> bool:
        return isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter) and value.device.type == "meta"

    def real(value: Any) -> Any:
        record = recording_of(value, deferred) if meta(value) else None
        return record.materialize(value).to(device) if record is not None else value

    for name, value in list(vars(mod).items()):
        if name in ("_parameters", "_buffers", "_modules"):
            continue
        if meta(value):
            mod.__dict__[name] = real(value)
        elif type(value) is tuple and any(meta(v) for v in value):
            mod.__dict__[name] = tuple(real(v) for v in value)
        elif isinstance(value, list) and any(meta(v) for v in value):  # in place: others may hold the same list
            value[:] = [real(v) for v in value]
        elif isinstance(value, dict) and any(meta(v) for v in value.values()):
            for key, v in list(value.items()):
                value[key] = real(v)


def broadcast_buffers(buffers: list[torch.Tensor], group: Group) -> None:
    """Overwrite every rank's buffers with rank 0's, as DDP does: one broadcast per dtype and device."""
    if group.world_size == 1:
        return
    by_kind: dict[tuple, list[torch.Tensor]] = defaultdict(list)
    for buf in buffers:
        by_kind[(buf.dtype, buf.device)].append(buf)
    for same in by_kind.values():
        flat = torch.cat([b.detach().reshape(-1) for b in same])
        collectives.broadcast(flat, group, src=0)
        offset = 0
        with torch.no_grad():
            for b in same:
                b.copy_(flat[offset:offset + b.numel()].view_as(b))
                offset += b.numel()
