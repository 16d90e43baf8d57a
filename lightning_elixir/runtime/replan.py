"""Switching a running model to another plan in place: new chunks, same values, same optimizer state.

[Note: switching plans]
Between two optimizer steps, ``switch_plan`` moves a module from one runtime to a new one built for
another plan (another chunk size, cache, prefetch or placement) without a checkpoint and without
holding the model anywhere in full:

1. For each old chunk, one at a time, its master shard is all-gathered, and every rank copies out
   the part of each parameter it owns under the new layout (``new_ranges``); the same for each
   per-element optimizer state (``exp_avg``, ...), through the same chunk-by-chunk records as full
   checkpoints (state_dict.py), and for each companion shard ([Note: companion shards] in
   runtime.py). Scalar state (``step``) is copied as it is.
2. The old runtime lets go of the module (``ElixirRuntime.detach_module``): parameters become
   one-element placeholders, hooks and NVMe files go, the optimizers get their original parameters
   back with empty state.
3. A runtime for the new plan is built with ``values=False`` (nothing initialised, nothing
   broadcast), its master shards are filled from what step 1 kept, and each optimizer is sharded
   again and loaded with its state. Optimizer objects keep their identity, so Lightning's wrappers
   and LR schedulers see nothing change.

What is kept in between is this rank's shard of everything, on the host: memory peaks at the old
shards plus that copy plus one gathered chunk (the new runtime's shards replace the old ones).
Values are copied, never recomputed, so the next step computes what the old plan would have,
up to the summation order of the new chunks' reductions.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.optim import Optimizer

from lightning_elixir.plan import ChunkSpec, ElixirPlan, slot_offsets
from lightning_elixir.runtime.layout import resolve_specs
from lightning_elixir.runtime.optim import shard_optimizer
from lightning_elixir.runtime.runtime import ElixirRuntime
from lightning_elixir.runtime.state_dict import (detached, optimizer_layout, optimizer_records, param_records,
                                                 load_own_optimizer_state, optimizer_views)


def new_ranges(specs: Sequence[ChunkSpec], numels: Mapping[str, int], rank: int,
               world_size: int) -> dict[str, tuple[int, int]]:
    """Per parameter name, the [begin, end) of its flattened elements this rank owns under ``specs``."""
    out = {}
    for spec in specs:
        shard = spec.numel // world_size
        lo, hi = rank * shard, (rank + 1) * shard
        for name, offset in zip(spec.params, slot_offsets([numels[n] for n in spec.params])):
            stop = offset + numels[name]
            begin = min(max(offset, lo), stop)
            out[name] = (begin - offset, max(begin, min(stop, hi)) - offset)
    return out


def switch_plan(runtime: ElixirRuntime, plan: ElixirPlan, grads: bool = False, **settings: Any) -> ElixirRuntime:
    """Re-chunk ``runtime``'s module under ``plan`` between optimizer steps ([Note: switching plans]).

    Call it on every rank, outside a step. ``settings`` are the ElixirRuntime arguments of the new
    runtime (device, policy, group, private parameters, ... default: the old runtime's). ``grads``:
    carry the gradients accumulated so far (a switch between the micro-batches of one optimizer step),
    as a companion is carried; without it the new runtime starts with none, as after ``zero_grad``.

    Returns:
        The new runtime, holding the module and the old runtime's optimizers; the old one is empty.
    """
    module, group = runtime.module, runtime.group
    settings = {"device": runtime.device, "policy": runtime.policy, "group": group,
                "private_params": runtime.private_params, "broadcast_buffers": runtime.broadcast_buffers,
                "nvme_path": runtime.offload.nvme_path, **settings}
    runtime.release_all()
    runtime.offload.settle()
    specs = resolve_specs(module, plan, group.world_size, settings["private_params"],
                          runtime.policy.full_precision_params(module), runtime.policy.own_dtype_params(module))
    names = {id(slot.param): slot.name for chunk in runtime.chunks for slot in chunk.slots}
    numels = {slot.name: slot.numel for chunk in runtime.chunks for slot in chunk.slots}
    ranges = new_ranges(specs, numels, group.rank, group.world_size)

    def own(pid: int, full: torch.Tensor) -> torch.Tensor:
        begin, end = ranges[names[pid]]
        return full.reshape(-1)[begin:end].to("cpu", copy=True)

    with torch.no_grad():
        values = {pid: own(pid, full) for pid, full in param_records(runtime, everywhere=True)}
        optimizers = [_take_optimizer(runtime, optimizer, own) for optimizer in runtime.optimizers]
        companions = {name: (shards[0].device if shards else None,
                             {pid: own(pid, full) for pid, full in param_records(runtime, True, shards)})
                      for name, shards in runtime.companions.items()}
        accumulated = _take_grads(runtime, own) if grads else None
    carried = {name: getattr(runtime, name) for name in ("scaler", "steps", "micro_batches", "skipped_steps")}

    runtime.detach_module()
    for optimizer, params, _ in optimizers:
        for group_, group_params in zip(optimizer.param_groups, params):
            group_["params"] = group_params
        optimizer.state.clear()

    new = ElixirRuntime(module, plan, values=False, **settings)
    for name, value in carried.items():
        setattr(new, name, value)
    with torch.no_grad():
        for chunk in new.chunks:
            with new.offload.resident(chunk, write=True):
                _fill_own(chunk, chunk.master, values)
                chunk.refresh_shard()  # inside: an NVMe chunk's master is paged out after the block
        for name, (device, pieces) in companions.items():
            for chunk, shard in zip(new.chunks, new.add_companion(name, device)):
                _fill_own(chunk, shard, pieces)
    for optimizer, _, state in optimizers:
        param_groups = optimizer.state_dict()["param_groups"]
        shard_optimizer(new, optimizer)
        load_own_optimizer_state(new, optimizer, state, param_groups)
    if accumulated is not None:
        _put_grads(new, *accumulated)
    return new


def _take_grads(runtime: ElixirRuntime, own: Any) -> tuple[dict[int, torch.Tensor], set[int]]:
    """This rank's pieces, under the new layout, of the gradients accumulated so far (parameters whose
    chunk holds none are left out), and the parameters that got one ([Note: unused parameters])."""
    reductions = runtime.grads.reductions
    shards = [c.grad_shard if reductions.valid[c.index] else torch.zeros_like(c.grad_shard) for c in runtime.chunks]
    held = {id(s.param) for c in runtime.chunks if reductions.valid[c.index] for s in c.slots}
    pieces = {pid: own(pid, full) for pid, full in param_records(runtime, True, shards) if pid in held}
    return pieces, set(reductions.seen)


def _put_grads(runtime: ElixirRuntime, pieces: dict[int, torch.Tensor], seen: set[int]) -> None:
    """Fill the new chunks' gradient shards with what ``_take_grads`` kept: a chunk holding any of it
    takes the next backward's gradients by adding, as the old one would have."""
    reductions = runtime.grads.reductions
    with torch.no_grad():
        for chunk in runtime.chunks:
            if not any(id(s.param) in pieces for s in chunk.slots):
                continue
            chunk.grad_shard.zero_()
            for slot in chunk.slots:
                piece = pieces.get(id(slot.param))
                if piece is not None:
                    begin, end = chunk.shard_range(slot)
                    chunk.grad_shard[begin:end].copy_(piece)
            reductions.hold(chunk)
    reductions.seen.update(seen)


def _fill_own(chunk: Any, shard: torch.Tensor, pieces: dict[int, torch.Tensor]) -> None:
    """Copy each of ``chunk``'s parameters' pieces (this rank's, under the new layout) into ``shard``."""
    for slot in chunk.slots:
        begin, end = chunk.shard_range(slot)
        shard[begin:end].copy_(pieces.pop(id(slot.param)))


def _take_optimizer(runtime: ElixirRuntime, optimizer: Optimizer,
                    own: Any) -> tuple[Optimizer, list[list[torch.nn.Parameter]], dict[int, dict[str, Any]]]:
    """(optimizer, its original parameters per group, this rank's state under the new layout)."""
    entries = optimizer_views(runtime, optimizer)
    params, i = [], 0
    for group in optimizer.param_groups:
        params.append([entries[i + k][1].param for k in range(len(group["params"]))])
        i += len(group["params"])
    sharded, layout = optimizer_layout(runtime, optimizer)
    gathered = {i: {k for k in part.keys if part.is_flat(i, k)} for part in layout for i, _, _ in part.members}
    state = {i: {k: detached(v) for k, v in values.items() if k not in gathered.get(i, ())}
             for i, values in sharded["state"].items()}
    for i, key, full in optimizer_records(runtime, sharded, layout, everywhere=True):
        state[i][key] = own(id(entries[i][1].param), full)
    return optimizer, params, state
