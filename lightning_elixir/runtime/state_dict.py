"""Full (unsharded) state dicts: the model's with its original names, the optimizer's per parameter.

Every rank takes part in the gathers; only ranks that ask (``keep=True``, by default rank 0 of
the group) keep the gathered tensors, on the CPU.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional

import torch
from torch.optim import Optimizer

from lightning_elixir.runtime.chunk import Chunk, Slot


def full_state_dict(runtime, keep: Optional[bool] = None) -> dict[str, Any]:
    """The module's ``state_dict()`` with every parameter gathered from its master shard."""
    keep = runtime.group.rank == 0 if keep is None else keep
    values: dict[int, torch.Tensor] = {}
    for chunk in runtime.chunks:
        with runtime.offload.resident(chunk):
            full = chunk.gather_full(chunk.master)
        if keep:
            for slot in chunk.slots:
                values[id(slot.param)] = full[slot.offset:slot.end].view(slot.shape).cpu().clone()
        del full  # before the next chunk's gather: one gathered chunk at a time
    if not keep:
        return {}
    out = {}
    for key, value in runtime.module.state_dict(keep_vars=True).items():
        out[key] = values[id(value)] if id(value) in values else value.detach().cpu().clone()
    return out


def load_full_state_dict(runtime, state_dict: Mapping[str, Any], strict: bool = True) -> None:
    """Load a plain (unsharded) state dict into the master shards and the buffers."""
    own = runtime.module.state_dict(keep_vars=True)
    missing, unexpected = sorted(set(own) - set(state_dict)), sorted(set(state_dict) - set(own))
    if strict and (missing or unexpected):
        raise KeyError(f"state dict does not match the model: missing keys {missing[:5]}, unexpected keys {unexpected[:5]}")
    source = {id(v): state_dict[k] for k, v in own.items() if k in state_dict}
    wrong = [f"{k}: checkpoint {tuple(state_dict[k].shape)}, model {tuple(v.shape)}" for k, v in own.items()
             if k in state_dict and tuple(getattr(state_dict[k], "shape", ())) != tuple(v.shape)]
    if wrong:  # before anything is loaded: a partial load would leave a model that is neither
        raise ValueError(f"the checkpoint's shapes do not match the model ({len(wrong)} tensors), e.g. "
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


def _load_chunk(chunk: Chunk, source: dict[int, torch.Tensor]) -> None:
    lo, hi = chunk.shard_begin, chunk.shard_begin + chunk.shard_numel
    for slot in chunk.slots:
        tensor = source.get(id(slot.param))
        if tensor is None:
            continue
        begin, end = max(slot.offset, lo), min(slot.end, hi)
        if begin < end:
            flat = tensor.reshape(-1)[begin - slot.offset:end - slot.offset]
            chunk.master[begin - lo:end - lo].copy_(flat)
    chunk.refresh_shard()


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


def is_per_element(key: str, value: Any, shape: torch.Size) -> bool:
    """Whether an optimizer state entry has one value per parameter element (``exp_avg``, not ``step``)."""
    return key != "step" and isinstance(value, torch.Tensor) and value.shape == shape


def per_element_nbytes(values: Mapping[str, Any], shape: torch.Size) -> int:
    """Bytes of one parameter's per-element optimizer state."""
    return sum(v.nbytes for k, v in values.items() if is_per_element(k, v, shape))


def full_optimizer_state_dict(runtime, optimizer: Optimizer, keep: Optional[bool] = None) -> dict[str, Any]:
    """A normal torch optimizer state dict: one entry per original parameter, full-shaped tensors."""
    keep = runtime.group.rank == 0 if keep is None else keep
    runtime.offload.settle()
    sharded = optimizer.state_dict()  # its per-parameter dicts are the optimizer's own (NVMe chunks bind into them)
    entries = optimizer_views(runtime, optimizer)
    state: dict[int, dict[str, Any]] = {}
    for chunk in runtime.chunks:
        members = [(i, slot, view) for i, (c, slot, view) in enumerate(entries) if c is chunk and i in sharded["state"]]
        if members:
            with runtime.offload.resident(chunk):
                _gather_chunk_state(chunk, members, sharded["state"], state, keep)
    if not keep:
        return {}
    return {"state": state, "param_groups": sharded["param_groups"]}


def _gather_chunk_state(chunk: Chunk, members: list, sharded: dict, state: dict, keep: bool) -> None:
    """Full-shaped optimizer state of one chunk's parameters (every rank gathers, ``keep`` ranks keep)."""
    first_i, _, first_view = members[0]
    keys = sorted(k for k, v in sharded[first_i].items() if is_per_element(k, v, first_view.shape))
    for i, slot, view in members:
        state[i] = {k: _detached(v) for k, v in sharded[i].items() if k not in keys}
    for key in keys:
        flat = _shard_buffer(chunk, members, sharded, key)
        full = chunk.gather_full(flat)
        for i, slot, _ in members:
            state[i][key] = full[slot.offset:slot.end].view(slot.shape).cpu().clone() if keep else None
        del flat, full  # before the next key's gather: one gathered chunk at a time


def _detached(value: Any) -> Any:
    """A CPU copy of a tensor (the optimizer's own 'step' must not be shared with the checkpoint)."""
    return value.detach().cpu().clone() if isinstance(value, torch.Tensor) else value


def _shard_buffer(chunk: Chunk, members: list, state: dict, key: str) -> torch.Tensor:
    sample = state[members[0][0]][key]
    flat = torch.zeros(chunk.shard_numel, dtype=sample.dtype, device=chunk.master.device)
    for i, slot, _ in members:
        begin, end = chunk.shard_range(slot)
        flat[begin:end].copy_(state[i][key])
    return flat


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
    runtime.offload.settle()
    optimizer.load_state_dict({"state": state, "param_groups": full["param_groups"]})
    for chunk in runtime.offload.nvme:  # the loaded state goes into the chunks' NVMe records
        with runtime.offload.resident(chunk, write=True, bind_state=False):
            pass
