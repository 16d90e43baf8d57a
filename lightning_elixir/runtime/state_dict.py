"""Full (unsharded) state dicts: the model's with its original names, the optimizer's per parameter.

Every rank takes part in the gathers; rank 0 of the group keeps the gathered tensors, on the CPU
(gathered point to point, so no other rank holds more than its shards), or every rank does with
``everywhere=True`` (gathered with all-gathers). Checkpoints take the deferred forms
(``deferred_state_dict``, ``deferred_optimizer_state_dict``, ``deferred_records``), which gather
while the file is written ([Note: streamed full checkpoints] in full_file.py).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Set as AbstractSet
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch.optim import Optimizer

from lightning_elixir.runtime import collectives
from lightning_elixir.runtime.chunk import Chunk, Slot
from lightning_elixir.runtime.full_file import DeferredTensor, Gathered, Records, deferred_in


def full_state_dict(runtime, everywhere: bool = False) -> dict[str, Any]:
    """The module's ``state_dict()`` with every parameter gathered from its master shard, on rank 0
    (an empty dict elsewhere) or, ``everywhere``, on every rank."""
    keep = everywhere or runtime.group.rank == 0
    values = {pid: value.cpu().clone() for pid, value in param_records(runtime, everywhere) if keep}
    if not keep:
        return {}
    return {key: values.get(id(value), value) for key, value in _module_state(runtime).items()}


def _module_state(runtime) -> dict[str, Any]:
    """The module's state dict: chunked parameters as themselves, other tensors as CPU copies, a module's
    extra state (``get_extra_state``, any object) as it gave it."""
    chunked = runtime.param_ids()
    return {key: value if id(value) in chunked or not isinstance(value, torch.Tensor) else value.detach().cpu().clone()
            for key, value in runtime.module.state_dict(keep_vars=True).items()}


def extra_state_modules(module: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The state-dict keys of the modules' extra state (``get_extra_state``, any object, a tensor included),
    with the module that ``set_extra_state`` gives each back to, as ``nn.Module.state_dict`` names them.

    [Note: extra state]
    A module that overrides ``get_extra_state`` puts what it returns into the state dict under
    ``<prefix>_extra_state``, and ``load_state_dict`` hands the entry to its ``set_extra_state``. It is
    no parameter or buffer: a tensor there is a new object each time, so copying a checkpoint's value
    into it (as into a buffer) loads nothing. Loading gives it to ``set_extra_state``, full and sharded."""
    suffix = torch.nn.modules.module._EXTRA_STATE_KEY_SUFFIX
    return {(f"{name}." if name else "") + suffix: sub for name, sub in module.named_modules(remove_duplicate=False)
            if getattr(type(sub), "get_extra_state", torch.nn.Module.get_extra_state)
            is not torch.nn.Module.get_extra_state}


def param_records(runtime, everywhere: bool,
                  shards: Optional[list[torch.Tensor]] = None) -> Iterator[tuple[int, Optional[torch.Tensor]]]:
    """(id(parameter), its full value) for every chunked parameter, gathered one chunk at a time on
    every rank; values (views of the gathered chunk, valid until the next chunk) on rank 0 or ``everywhere``.
    From the masters, or from ``shards`` of the same layout (a companion: [Note: companion shards])."""
    for chunk in runtime.chunks:
        with _holding(runtime, chunk, shards):
            full = _gather(chunk, chunk.master if shards is None else shards[chunk.index], everywhere)
        for slot in chunk.slots:
            yield id(slot.param), None if full is None else full[slot.offset:slot.end].view(slot.shape)
        del full  # before the next chunk's gather: one gathered chunk at a time


def _holding(runtime, chunk: Chunk, shards: Optional[list[torch.Tensor]]) -> Any:
    """Around a read of ``chunk``'s master (paged in from NVMe), or of a companion's shard (always in memory)."""
    return runtime.offload.resident(chunk) if shards is None else contextlib.nullcontext()


def deferred_state_dict(runtime) -> dict[str, Any]:
    """The full state dict with each chunked parameter as a DeferredTensor ([Note: streamed full checkpoints])."""
    chunked, made = runtime.param_ids(), {}  # tied parameters share one DeferredTensor, as they share a tensor
    out = {}
    for key, value in _module_state(runtime).items():
        if id(value) in chunked:
            if id(value) not in made:
                chunk, slot = runtime.where(value)
                made[id(value)] = DeferredTensor(("param", id(value)), slot.shape, chunk.master.dtype)
            value = made[id(value)]
        out[key] = value
    return out


class StateDictMismatchError(RuntimeError, ValueError):
    """A state dict that does not fit the model: a RuntimeError, as ``nn.Module.load_state_dict`` raises."""


def check_keys(model_keys: Iterable[str], keys: Iterable[str]) -> None:
    """Strict loading: the state dict's ``keys`` are exactly the model's, as ``load_state_dict`` requires."""
    model_keys, keys = set(model_keys), set(keys)
    missing, unexpected = sorted(model_keys - keys), sorted(keys - model_keys)
    if missing or unexpected:
        raise StateDictMismatchError(f"state dict does not match the model: missing keys {missing[:5]}, unexpected keys "
                                     f"{unexpected[:5]} (load with strict=False to load what matches)")


def load_full_state_dict(runtime, state_dict: Mapping[str, Any], strict: bool = True) -> None:
    """Load a plain (unsharded) state dict into the master shards and the buffers."""
    extra = extra_state_modules(runtime.module)
    whole = runtime.module.state_dict(keep_vars=True)
    if strict:
        check_keys(whole, state_dict)
    own = {k: v for k, v in whole.items() if k not in extra}
    source = {id(v): state_dict[k] for k, v in own.items() if k in state_dict}
    wrong = [f"{k}: checkpoint {tuple(state_dict[k].shape)}, model {tuple(v.shape)}" for k, v in own.items()
             if k in state_dict and tuple(getattr(state_dict[k], "shape", ())) != tuple(v.shape)]
    if wrong:  # before anything is loaded: a partial load would leave a model that is neither
        raise StateDictMismatchError(f"the checkpoint's shapes do not match the model ({len(wrong)} tensors), e.g. "
                                     f"{'; '.join(wrong[:3])}; was it saved from another model configuration?")
    runtime.release_all()
    chunked = runtime.param_ids()
    with torch.no_grad():
        for chunk in runtime.chunks:
            with runtime.offload.resident(chunk, write=True):
                _load_chunk(chunk, source)
        for key, value in own.items():
            if key in state_dict and id(value) not in chunked:
                value.copy_(state_dict[key])
    for key, sub in extra.items():  # [Note: extra state]
        if key in state_dict:
            sub.set_extra_state(state_dict[key])


def _load_chunk(chunk: Chunk, source: dict[int, torch.Tensor]) -> None:
    load_own_pieces(chunk, chunk.master, source)
    chunk.refresh_shard()


def load_own_pieces(chunk: Chunk, shard: torch.Tensor, source: Mapping[int, torch.Tensor]) -> None:
    """Copy this rank's piece of each full tensor in ``source`` (by id of the parameter) into ``shard``,
    a tensor of ``chunk``'s shard layout (its master, a companion)."""
    lo, hi = chunk.shard_begin, chunk.shard_begin + chunk.shard_numel
    for slot in chunk.slots:
        tensor = source.get(id(slot.param))
        if tensor is None:
            continue
        begin, end = max(slot.offset, lo), min(slot.end, hi)
        if begin < end:
            flat = tensor.reshape(-1)[begin - slot.offset:end - slot.offset]
            shard[begin - lo:end - lo].copy_(flat)


def optimizer_views(runtime, optimizer: Optimizer) -> list[tuple[Chunk, Slot, torch.Tensor]]:
    """(chunk, slot, view) for each optimizer parameter, in state-dict index order."""
    by_view = runtime.view_index()
    out = []
    for group in optimizer.param_groups:
        for view in group["params"]:
            if id(view) not in by_view:
                raise ValueError("the optimizer holds a parameter that is not a shard view; was it set up by the strategy?")
            out.append((*by_view[id(view)], view))
    return out


REPLICATED_STATE = frozenset({"row_var", "col_var", "exp_avg_sq_row", "exp_avg_sq_col"})
"""Optimizer state that every rank holds whole and alike, whatever its shape: the factored second
moments of torch's and Hugging Face's Adafactor ([Note: Adafactor on shards] in factored.py). Saved
and moved as ``step`` is."""


def is_per_element(key: str, value: Any, shape: torch.Size, replicated: AbstractSet[str] = REPLICATED_STATE) -> bool:
    """Whether an optimizer state entry has one value per parameter element (``exp_avg``, not ``step``);
    ``replicated``: the keys held whole whatever their shape (``replicated_keys``)."""
    return (key != "step" and key not in replicated and isinstance(value, torch.Tensor)
            and value.shape == shape)


_replicated: "weakref.WeakKeyDictionary[Optimizer, dict[int, set[str]]]" = weakref.WeakKeyDictionary()
"""For each optimizer that runs a per-parameter step ([Note: per-parameter optimizers] in per_parameter.py),
the state keys of each parameter (by state-dict index) that every rank holds whole: tensors not of the
parameter's shape. Recorded where they are made or loaded from whole shapes; on a shard a 1-D one could
have the shard view's shape by chance, so shape alone cannot tell later."""


def hold_replicated(optimizer: Optimizer) -> None:
    """Record ``optimizer``'s whole tensor state from now on (kept across plan switches)."""
    _replicated.setdefault(optimizer, {})


def replicated_keys(optimizer: Optimizer, index: int) -> AbstractSet[str]:
    """The state keys of ``optimizer``'s ``index``-th parameter held whole by every rank."""
    own = _replicated.get(optimizer)
    keys = own.get(index) if own else None
    return REPLICATED_STATE | keys if keys else REPLICATED_STATE


def note_replicated(optimizer: Optimizer, index: int, values: Mapping[str, Any],
                    shape: Optional[torch.Size] = None) -> None:
    """Record the whole tensors among ``values``, the ``index``-th parameter's state (those not of ``shape``,
    the parameter's; all of them without one), for an optimizer that ``hold_replicated``."""
    own = _replicated.get(optimizer)
    if own is not None:
        keys = {k for k, v in values.items() if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape != shape}
        if keys:
            own.setdefault(index, set()).update(keys)


def per_element_nbytes(values: Mapping[str, Any], shape: torch.Size) -> int:
    """Bytes of one parameter's per-element optimizer state."""
    return sum(v.nbytes for k, v in values.items() if is_per_element(k, v, shape))


@dataclass
class ChunkOptimizerState:
    """One chunk's share of an optimizer's state: its parameters' entries and per-element keys."""

    chunk: Chunk
    members: list[tuple[int, Slot, torch.Tensor]]
    """(state-dict index, slot, shard view) of the chunk's parameters that have state."""
    keys: list[str]
    """Per-element state keys (``exp_avg``, ...) of any member, gathered; the rest (``step``) is copied."""
    flat: dict[int, set[str]] = field(default_factory=dict)
    """Per member (by state-dict index), its own per-element keys: a key per-element for one member may be
    held whole for another (Shampoo's preconditioner of a square matrix and of a vector beside it)."""

    def having(self, state: Mapping[int, Mapping[str, Any]], key: str) -> list[tuple[int, Slot, torch.Tensor]]:
        """The members whose ``state`` holds ``key`` per element."""
        return [member for member in self.members if key in state[member[0]] and self.is_flat(member[0], key)]

    def is_flat(self, index: int, key: str) -> bool:
        """Whether member ``index``'s ``key`` is per-element (gathered) rather than held whole."""
        return key in self.flat[index] if index in self.flat else key in self.keys


def agree_scalar_state(runtime, optimizer: Optimizer) -> None:
    """Give each shard view held elsewhere its owner's scalar optimizer state (``step``); every rank
    calls it, before the state is read across ranks ([Note: shard views held elsewhere] in optim.py)."""
    if runtime.group.world_size == 1:
        return
    entries = optimizer_views(runtime, optimizer)
    rank, state = runtime.group.rank, optimizer.state
    own = {}
    for i, (chunk, slot, view) in enumerate(entries):
        if state.get(view) and not chunk.elsewhere(slot) and chunk.owner(slot) == rank:
            whole = replicated_keys(optimizer, i)
            own[i] = {k: detached(v) for k, v in state[view].items()
                      if not is_per_element(k, v, view.shape, whole) and k not in whole}
    owned: dict[int, dict[str, Any]] = {}
    for part in collectives.all_gather_objects(own, runtime.group):
        owned.update(part)
    for i, (chunk, slot, view) in enumerate(entries):
        values = state.get(view)
        if not values or i not in owned or not chunk.elsewhere(slot):
            continue
        for key, value in owned[i].items():
            current = values.get(key)
            if isinstance(current, torch.Tensor) and isinstance(value, torch.Tensor) and current.shape == value.shape:
                current.copy_(value)
            else:
                values[key] = value


def optimizer_layout(runtime, optimizer: Optimizer) -> tuple[dict[str, Any], list[ChunkOptimizerState]]:
    """The optimizer's sharded state dict and, per chunk, what of it is gathered."""
    runtime.offload.settle()
    agree_scalar_state(runtime, optimizer)
    sharded = optimizer.state_dict()  # its per-parameter dicts are the optimizer's own (NVMe chunks bind into them)
    entries = optimizer_views(runtime, optimizer)
    layout = []
    for chunk in runtime.chunks:
        members = [(i, slot, view) for i, (c, slot, view) in enumerate(entries) if c is chunk and i in sharded["state"]]
        if members:  # the keys of every member: they differ (amsgrad in one group only)
            flat = {i: {k for k, v in sharded["state"][i].items()
                        if is_per_element(k, v, view.shape, replicated_keys(optimizer, i))} for i, _, view in members}
            layout.append(ChunkOptimizerState(chunk, members, sorted(set().union(*flat.values())), flat))
    return sharded, layout


def _optimizer_skeleton(sharded: dict[str, Any], layout: list[ChunkOptimizerState],
                        value: Callable[[int, str, Slot, torch.Tensor], Any]) -> dict[str, Any]:
    """The full optimizer state dict with ``value(index, key, slot, shard state)`` for each per-element entry."""
    state: dict[int, dict[str, Any]] = {}
    for part in layout:
        for i, slot, _ in part.members:
            own = sharded["state"][i]
            state[i] = {k: (value(i, k, slot, v) if part.is_flat(i, k) else detached(v)) for k, v in own.items()}
    return {"state": state, "param_groups": sharded["param_groups"]}


def optimizer_records(runtime, sharded: dict[str, Any], layout: list[ChunkOptimizerState],
                       everywhere: bool) -> Iterator[tuple[int, str, Optional[torch.Tensor]]]:
    """(index, key, full value) of every per-element entry, gathered one chunk and key at a time on
    every rank; values (views of the gathered chunk, valid until the next item) on rank 0 or ``everywhere``."""
    for part in layout:
        with runtime.offload.resident(part.chunk):
            for key in part.keys:
                members = part.having(sharded["state"], key)
                flat = _shard_buffer(part.chunk, members, sharded["state"], key)
                full = _gather(part.chunk, flat, everywhere)
                del flat
                for i, slot, _ in members:
                    yield i, key, None if full is None else full[slot.offset:slot.end].view(slot.shape)
                del full  # before the next key's gather: one gathered chunk at a time


def _gather(chunk: Chunk, shard: torch.Tensor, everywhere: bool) -> Optional[torch.Tensor]:
    return chunk.gather_full(shard) if everywhere else chunk.gather_to_first(shard)


def full_optimizer_state_dict(runtime, optimizer: Optimizer, everywhere: bool = False) -> dict[str, Any]:
    """A normal torch optimizer state dict: one entry per original parameter, full-shaped tensors; on
    rank 0 (an empty dict elsewhere) or, ``everywhere``, on every rank."""
    keep = everywhere or runtime.group.rank == 0
    sharded, layout = optimizer_layout(runtime, optimizer)
    out = _optimizer_skeleton(sharded, layout, lambda *_: None)
    for i, key, value in optimizer_records(runtime, sharded, layout, everywhere):
        out["state"][i][key] = value.cpu().clone() if keep else None
    return out if keep else {}


def deferred_optimizer_state_dict(runtime, optimizer: Optimizer, index: int) -> dict[str, Any]:
    """The full optimizer state dict of the strategy's ``index``-th optimizer, per-element state as
    DeferredTensors ([Note: streamed full checkpoints])."""
    sharded, layout = optimizer_layout(runtime, optimizer)
    return _optimizer_skeleton(sharded, layout,
                               lambda i, key, slot, v: DeferredTensor(("optimizer", index, i, key), slot.shape, v.dtype))


def deferred_records(runtime, optimizers: list[Optimizer], checkpoint: Any) -> Records:
    """Gather what the DeferredTensors in ``checkpoint`` stand for, chunk by chunk, to rank 0.

    Each rank's ``checkpoint`` must have the same structure (the strategy made it on every rank); a
    rank gathers the model if it holds deferred parameters, an optimizer's state if it holds that
    optimizer's. Values on rank 0; the other ranks get None for them."""
    wanted = {d.source: d for d in deferred_in(checkpoint)}
    buffers = _GatherBuffers(runtime)
    laid_out = [(("param",), None)] if any(source[0] == "param" for source in wanted) else []
    laid_out += [(("companion", name), runtime.companions[name])  # [Note: companion shards]
                 for name in sorted({source[1] for source in wanted if source[0] == "companion"})]
    for prefix, shards in laid_out:
        for chunk in runtime.chunks:
            with _holding(runtime, chunk, shards):
                shard = chunk.master if shards is None else shards[chunk.index]
                full = chunk.gather_to_first(shard, buffers.out(chunk, shard.dtype))
            yield _gathered(full, [(wanted.get((*prefix, id(slot.param))), slot) for slot in chunk.slots])
            del full  # its buffer is the next gather's: the values are consumed before that
    for index, optimizer in enumerate(optimizers):
        if not any(source[:2] == ("optimizer", index) for source in wanted):
            continue
        sharded, layout = optimizer_layout(runtime, optimizer)
        for part in layout:
            with runtime.offload.resident(part.chunk):
                for key in part.keys:
                    members = part.having(sharded["state"], key)
                    dtype = sharded["state"][members[0][0]][key].dtype
                    out = buffers.out(part.chunk, dtype)
                    shard = out[:part.chunk.shard_numel] if out is not None else buffers.shard(part.chunk, dtype)
                    shard.zero_()  # rank 0's shard is the start of its result
                    _fill_shard(shard, part.chunk, members, sharded["state"], key)
                    full = part.chunk.gather_to_first(shard, out)
                    del shard, out
                    yield _gathered(full, [(wanted.get(("optimizer", index, i, key)), slot) for i, slot, _ in members])
                    del full


class _GatherBuffers:
    """The buffers of one save, reused by every gather: rank 0's results (one per dtype, as large as the
    largest chunk) and the other ranks' optimizer-state shards. One allocation each, so that the save
    adds one chunk to rank 0's resident set even under glibc's default allocator, which keeps
    chunk-sized blocks resident once freed (its mmap threshold rises to the size of a freed block)
    and did not reuse them from one gather to the next."""

    def __init__(self, runtime) -> None:
        self.rank0 = runtime.group.rank == 0
        self.numel = max((c.numel for c in runtime.chunks), default=0)
        self.shard_numel = max((c.shard_numel for c in runtime.chunks), default=0)
        self.buffers: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = {}

    def out(self, chunk: Chunk, dtype: torch.dtype) -> Optional[torch.Tensor]:
        """A chunk-sized result for ``gather_to_first`` on rank 0; None elsewhere."""
        return self._buffer("out", self.numel, dtype, chunk.full.device)[:chunk.numel] if self.rank0 else None

    def shard(self, chunk: Chunk, dtype: torch.dtype) -> torch.Tensor:
        """A shard-sized buffer where the chunk's sharded state lives (the other ranks' optimizer state)."""
        return self._buffer("shard", self.shard_numel, dtype, chunk.master.device)[:chunk.shard_numel]

    def _buffer(self, kind: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        key = (kind, dtype, device)
        if key not in self.buffers:
            self.buffers[key] = torch.empty(numel, dtype=dtype, device=device)
        return self.buffers[key]


def _gathered(full: Optional[torch.Tensor], slots: list[tuple[Optional[DeferredTensor], Slot]]) -> Gathered:
    """The region of ``full`` that the wanted slots cover, and their views."""
    slots = [(d, slot) for d, slot in slots if d is not None]
    if full is None or not slots:
        return Gathered(None, [(d, None) for d, _ in slots])
    lo, hi = min(slot.offset for _, slot in slots), max(slot.end for _, slot in slots)
    return Gathered(full[lo:hi], [(d, full[slot.offset:slot.end].view(slot.shape)) for d, slot in slots])


def detached(value: Any) -> Any:
    """A CPU copy of a tensor (the optimizer's own 'step' must not be shared with the checkpoint)."""
    return value.detach().cpu().clone() if isinstance(value, torch.Tensor) else value


def _shard_buffer(chunk: Chunk, members: list, state: dict, key: str) -> torch.Tensor:
    sample = state[members[0][0]][key]
    flat = torch.zeros(chunk.shard_numel, dtype=sample.dtype, device=chunk.master.device)
    _fill_shard(flat, chunk, members, state, key)
    return flat


def _fill_shard(flat: torch.Tensor, chunk: Chunk, members: list, state: dict, key: str) -> None:
    """This rank's shard of a per-element optimizer state ``key``, from the members' entries, into ``flat``."""
    for i, slot, _ in members:
        begin, end = chunk.shard_range(slot)
        flat[begin:end].copy_(state[i][key])


def load_full_optimizer_state_dict(runtime, optimizer: Optimizer, full: Mapping[str, Any]) -> None:
    """Load a normal (full) optimizer state dict into the sharded optimizer."""
    entries = optimizer_views(runtime, optimizer)
    if len(full["param_groups"]) != len(optimizer.param_groups):
        raise ValueError(f"optimizer state has {len(full['param_groups'])} param groups, "
                         f"the optimizer has {len(optimizer.param_groups)}")
    state = {}
    for i, param_state in full["state"].items():
        chunk, slot, view = entries[int(i)]
        begin, end = chunk.shard_range(slot)
        lo = chunk.shard_begin + begin - slot.offset
        state[int(i)] = {k: (v.reshape(-1)[lo:lo + end - begin].clone() if is_per_element(k, v, slot.shape) else v)
                         for k, v in param_state.items()}
        note_replicated(optimizer, int(i), param_state, slot.shape)
    load_own_optimizer_state(runtime, optimizer, state, full["param_groups"])


def load_own_optimizer_state(runtime, optimizer: Optimizer, state: Mapping[int, Mapping[str, Any]],
                             param_groups: list[dict[str, Any]]) -> None:
    """Load this rank's optimizer state (per-element entries shaped as its shard views) into ``optimizer``."""
    runtime.offload.settle()
    optimizer.load_state_dict({"state": dict(state), "param_groups": param_groups})
    for chunk in runtime.offload.nvme:  # the loaded state goes into the chunks' NVMe records
        with runtime.offload.resident(chunk, write=True, bind_state=False):
            pass
