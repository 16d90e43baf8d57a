"""Per-parameter optimizers on shards: the optimizer's own step on whole parameters, one chunk at a time.

[Note: per-parameter optimizers]
Many optimizers read whole parameters but nothing beyond one parameter: LARS and LAMB scale each
update by the ratio of the parameter's norm to the update's, Shampoo and SOAP keep preconditioners
per matrix, 8-bit optimizers quantise their state in blocks of the flattened parameter. None is
element-wise, so none can run on flat shard views ([Note: shard views] in optim.py), and unlike
Adafactor ([Note: Adafactor on shards] in factored.py) their whole-parameter quantities are not sums
that split over shards. A class declared with ``per_parameter_optimizer`` (its update of each
parameter reads only that parameter, its gradient, its own state and the group's hyperparameters)
runs its own ``step`` on whole parameters instead:

1. the ranks agree on the parameters to update (those with a gradient on some rank: one all-reduce
   of a flag per parameter), as for Muon ([Note: Muon on shards] in whole.py);
2. for each chunk that holds such parameters, in the same order on every rank, the fp32 masters,
   the reduced gradients and each per-element state tensor (one of the parameter's shape: LAMB's
   moments) are gathered whole;
3. the class's ``step`` runs on whole parameters made from the gathered chunk (the optimizer object
   itself, its param groups holding those parameters and its ``state`` their whole state for the
   call), on every rank alike, as every DDP replica runs it;
4. each rank keeps its own slice of the updated masters and of the per-element state; state of any
   other shape (a preconditioner, a block's scale) and scalars are kept whole by every rank, as the
   factored moments of Adafactor are (``state_dict.note_replicated``: recorded when made, since on a
   shard a 1-D one may have the view's shape by chance).

Every element then gets what one process computes, bit for bit, and every checkpoint format, a resume
at another world size and a plan switch carry the state (per-element state is sharded like Adam's, the
rest is saved whole, as torch saves it). The step runs once per chunk, so values a step keeps in the
param groups (timm's LAMB counts steps there, in a tensor advanced in place) are set back before each
chunk's call, tensors by value, and kept from the last; a step over no chunk at all still runs once,
with empty groups, so such counts advance as one process's do. State kept under no parameter
(MADGRAD's ``state["k"]``, a count shared by all of them) would be made afresh in each call and never
count, so the step raises instead: such a class is not per-parameter as written. A key may be
per-element for one parameter and whole for another in the same chunk (Shampoo's first preconditioner
is a square matrix's shape and not a vector's): each parameter's own keys are gathered.
Optimizers that draw random numbers in their step (Kron/PSGD) draw them per chunk here, in another
order than one process does, so they train as well but not to the same bits.

What it costs: each step gathers (2 + the per-element state tensors) x the trained parameters' fp32
bytes, and every rank computes every update, where an element-wise optimizer's step gathers nothing
and computes only this rank's shard. On the host: the reduced gradient shard is gathered as it is
(the members' gradients are its slices, unless code assigned others) and this rank's master shard goes
back in one copy; the per-element state is copied per parameter, into the gathered buffers and back.
It is the general fallback, not the fast path. Offloaded chunks update here too (their gathered values
are on the device; the kept slices go back to the host), and their compute shards are refreshed after;
chunks on NVMe are refused. An optimizer that mixes parameters within its step (LBFGS flattens them
all; timm's LAMB with ``max_grad_norm`` clips by the norm over every parameter; D-Adaptation and
Prodigy sum over all of them) is not per-parameter: run on one chunk at a time it would see part of
the model, so it must not be declared.
"""

from __future__ import annotations

import inspect
from collections import defaultdict
from typing import Any

import torch
import torch.nn as nn
from torch.optim import Optimizer

from lightning_elixir.runtime import collectives
from lightning_elixir.runtime.state_dict import hold_replicated, is_per_element, note_replicated, replicated_keys
from lightning_elixir.runtime.whole import install_step, refuse_nvme, unhooked_step

_declared: set[type] = set()
"""Classes declared with ``per_parameter_optimizer``."""


def per_parameter_optimizer(cls: type) -> type:
    """Declare an optimizer class per-parameter, so that it runs on whole parameters gathered from the
    shards; returns ``cls``.

    Use it as a class decorator on an optimizer whose update of each parameter reads only that
    parameter, its gradient, its own state and the group's hyperparameters: LARS, LAMB without a clip
    by the global gradient norm, Shampoo, SOAP. Its state may have any shapes. Each step gathers whole
    parameters chunk by chunk ([Note: per-parameter optimizers] in runtime/per_parameter.py), so an
    element-wise optimizer is better declared with ``elementwise_optimizer``, which runs on shards
    without gathering.
    """
    if not (isinstance(cls, type) and issubclass(cls, Optimizer)):
        raise TypeError(f"per_parameter_optimizer expects a torch.optim.Optimizer subclass, got {cls!r}")
    if issubclass(cls, torch.optim.LBFGS):
        raise TypeError(f"{cls.__name__} is an LBFGS: its step flattens every parameter into one vector and "
                        "re-evaluates the closure, so it is not per-parameter and cannot run on shards")
    _declared.add(cls)
    return cls


def is_per_parameter(cls: type) -> bool:
    """Whether ``cls`` was declared per-parameter, or inherits ``step`` unchanged from a class that was."""
    return any(base in _declared and inspect.unwrap(cls.step) is inspect.unwrap(base.step) for base in cls.__mro__)


def install_per_parameter_step(runtime: Any, optimizer: Optimizer) -> None:
    """Give ``optimizer`` (a per-parameter optimizer over shard views) the step of the note."""
    refuse_nvme(runtime, optimizer, type(optimizer).__name__)
    hold_replicated(optimizer)
    install_step(optimizer, _PerParameterStep(runtime, optimizer))


class _PerParameterStep:
    """The class's own ``step`` over whole parameters, chunk by chunk ([Note: per-parameter optimizers])."""

    def __init__(self, runtime: Any, optimizer: Optimizer) -> None:
        self.runtime, self.optimizer = runtime, optimizer
        self.step = unhooked_step(type(optimizer))  # the hooks run once per step, around all chunks' calls
        self._wholes: dict[int, nn.Parameter] = {}
        """One whole parameter per shard view (by id), made once: it holds the gathered chunk's values and
        gradient during its chunk's call only, so what a step caches per parameter object (Kron's einsum
        expressions) stays one entry per parameter, and no gathered chunk outlives the step."""

    @torch.no_grad()
    def __call__(self) -> None:
        runtime, optimizer = self.runtime, self.optimizer
        index = runtime.view_index()
        views = [(group, view) for group in optimizer.param_groups for view in group["params"]]
        entries = [(group, i, view) for i, (group, view) in enumerate(views)]  # i: the view's state-dict index
        mine = [float(view.numel() > 0 and view.grad is not None) for _, _, view in entries]
        flags = torch.tensor(mine or [0.0], dtype=torch.float32, device=runtime.device)
        trains = collectives.all_reduce_max(flags, runtime.group)[:len(entries)].tolist()
        by_chunk: dict[int, list[tuple[dict, int, nn.Parameter]]] = {}
        for entry, flag in zip(entries, trains):
            if flag:
                by_chunk.setdefault(index[id(entry[2])][0].index, []).append(entry)
        # tensors a step keeps in the groups may be counted in place (timm's LAMB: group["step"].add_(1)):
        # their values are kept too, to be written back into them before each chunk's call
        before = [{k: (v, v.clone() if isinstance(v, torch.Tensor) else None) for k, v in group.items() if k != "params"}
                  for group in optimizer.param_groups]
        for i in sorted(by_chunk):  # the same chunks in the same order on every rank
            for group, values in zip(optimizer.param_groups, before):  # as before the step: made keys go too
                for key in [k for k in group if k != "params" and k not in values]:
                    del group[key]
                for key, (value, kept) in values.items():
                    if kept is not None:
                        value.copy_(kept)
                    group[key] = value
            self._chunk_step(index[id(by_chunk[i][0][2])][0], by_chunk[i], index)
        if not by_chunk:
            self._run([], [])

    def _chunk_step(self, chunk: Any, members: list[tuple[dict, int, nn.Parameter]], index: dict) -> None:
        state = self.optimizer.state
        slots = [index[id(view)][1] for _, _, view in members]
        whole = [replicated_keys(self.optimizer, i) for _, i, _ in members]
        keys = sorted({k for (_, _, view), held in zip(members, whole)
                       for k, v in state.get(view, {}).items() if is_per_element(k, v, view.shape, held)})
        masters = chunk.gather_full(chunk.master)
        full = {key: self._gathered(chunk, members, slots, key) for key in keys}
        grads = chunk.gather_full(chunk.grad_shard) if self._grads_in_shard(chunk, members, slots) else \
            self._gathered(chunk, members, slots, None)
        params, states = [], []
        for (_, _, view), slot, held in zip(members, slots, whole):
            param = self._wholes.get(id(view))
            if param is None:
                param = self._wholes[id(view)] = nn.Parameter(masters.new_empty(0), requires_grad=True)
            param.data = masters[slot.offset:slot.end].view(slot.shape)
            param.grad = grads[slot.offset:slot.end].view(slot.shape)
            own = state.get(view, {})
            states.append({k: (full[k][slot.offset:slot.end].view(slot.shape)
                               if k in full and is_per_element(k, v, view.shape, held) else v) for k, v in own.items()})
            params.append(param)
        updated = self._run([(group, param) for (group, _, _), param in zip(members, params)], states)
        in_place = all(_lies_at(param, masters, slot.offset) for param, slot in zip(params, slots))
        if in_place:  # the step updated the parameters where they lie: this rank's shard goes back in one copy
            chunk.master.copy_(masters[chunk.shard_begin:chunk.shard_begin + chunk.shard_numel])
        for (_, i, view), slot, param, values in zip(members, slots, params, updated):
            begin, end = chunk.shard_range(slot)
            first = chunk.shard_begin + begin - slot.offset  # this view's first element within the parameter
            if not in_place:  # a step that rebinds ``p.data``
                view.copy_(param.reshape(-1)[first:first + end - begin])
            note_replicated(self.optimizer, i, values, slot.shape)
            held, kept = replicated_keys(self.optimizer, i), state[view]
            for key, value in values.items():
                if is_per_element(key, value, slot.shape, held):  # not "step", a 0-d tensor of a 0-d parameter too
                    own = value.reshape(-1)[first:first + end - begin]
                    current = kept.get(key)
                    if isinstance(current, torch.Tensor) and current.shape == own.shape and current.dtype == own.dtype:
                        current.copy_(own)
                    else:
                        kept[key] = own.to(view.device, copy=True)
                else:
                    kept[key] = value.to(view.device) if isinstance(value, torch.Tensor) else value
        for param in params:  # the gathered chunk goes with the step
            param.grad = None
            param.data = masters.new_empty(0)
        if chunk.offloaded:  # no worker updated it: its compute shard is refreshed here ([Note: offloaded updates])
            chunk.refresh_shard()

    @staticmethod
    def _grads_in_shard(chunk: Any, members: list, slots: list) -> bool:
        """Whether the members' gradients are their slices of the chunk's reduced gradient shard (as after a
        backward on the device), so that the shard is gathered as it is."""
        for (_, _, view), slot in zip(members, slots):
            begin, end = chunk.shard_range(slot)
            if begin < end and (view.grad is None or not _lies_at(view.grad, chunk.grad_shard, begin)):
                return False
        return True

    def _gathered(self, chunk: Any, members: list, slots: list, key: Any) -> torch.Tensor:
        """The whole chunk of the members' gradients (``key`` None) or of their per-element state ``key``."""
        state, shard = self.optimizer.state, None
        for (_, i, view), slot in zip(members, slots):
            value = view.grad if key is None else state.get(view, {}).get(key)
            if value is None or value.numel() == 0:
                continue
            if key is not None and not is_per_element(key, value, view.shape, replicated_keys(self.optimizer, i)):
                continue  # held whole for this member (Shampoo's preconditioner of a vector beside a matrix's)
            if shard is None:
                shard = torch.zeros(chunk.shard_numel, dtype=value.dtype, device=chunk.master.device)
            begin, end = chunk.shard_range(slot)
            shard[begin:end].copy_(value.reshape(-1))
        if shard is None:  # this rank holds none of them: the dtype is the others'
            dtype = chunk.master.dtype if key is None else self._dtype(members, key)
            shard = torch.zeros(chunk.shard_numel, dtype=dtype, device=chunk.master.device)
        return chunk.gather_full(shard)

    def _dtype(self, members: list, key: str) -> torch.dtype:
        state = self.optimizer.state
        return next(state[view][key].dtype for _, i, view in members if key in state.get(view, {})
                    and is_per_element(key, state[view][key], view.shape, replicated_keys(self.optimizer, i)))

    def _run(self, pairs: list[tuple[dict, nn.Parameter]], states: list[dict]) -> list[dict]:
        """Run the class's step with ``pairs`` (group, whole parameter) as the only parameters and ``states``
        as their state; return their state after it. The optimizer's own groups and state are put back."""
        optimizer = self.optimizer
        held = [group["params"] for group in optimizer.param_groups]
        own_state = optimizer.state
        try:
            for group in optimizer.param_groups:
                group["params"] = []
            for group, param in pairs:
                group["params"].append(param)
            optimizer.state = defaultdict(dict, {param: values for (_, param), values in zip(pairs, states)})
            self.step(optimizer)
            made = {id(param) for _, param in pairs}
            other = [key for key in optimizer.state if id(key) not in made]
            if other:  # MADGRAD's state["k"]: made afresh in each call, it would be lost, not counted
                raise TypeError(f"{type(optimizer).__name__}'s step keeps state under {other[0]!r}, not a parameter's "
                                "entry: state shared by all parameters is not per-parameter, so the class cannot be "
                                "declared with per_parameter_optimizer (keep such counts in the param groups)")
            return [optimizer.state.get(param, {}) for _, param in pairs]
        finally:
            for group, params in zip(optimizer.param_groups, held):
                group["params"] = params
            optimizer.state = own_state


def _lies_at(tensor: torch.Tensor, buffer: torch.Tensor, offset: int) -> bool:
    """Whether ``tensor`` starts ``offset`` elements into ``buffer``, in its dtype and on its device."""
    return (tensor.dtype == buffer.dtype and tensor.device == buffer.device
            and tensor.data_ptr() == buffer.data_ptr() + offset * buffer.element_size())
