"""Muon on shard views: per-element state, the whole-matrix step of its update on the gathered update.

[Note: Muon on shards]
``torch.optim.Muon`` keeps one per-element state tensor (the momentum buffer) and does element-wise
work around one step that reads a whole matrix: it orthogonalises each parameter's update with a
Newton-Schulz iteration, and scales the learning rate by the parameter's shape. So its state is
sharded like any element-wise optimizer's ([Note: shard views] in optim.py: the checkpoint formats,
resuming at other world sizes and plan switches carry it unchanged), and its step runs here instead
of on the flat views, which it could not orthogonalise:

1. the ranks agree on the parameters to update (those with a gradient on some rank: the one small
   all-reduce of a flag per parameter), since each of the following collectives needs every rank;
2. each rank updates the momentum of its views and writes the update into a shard-sized buffer of
   each chunk that holds such parameters, at the views' places; the chunks' buffers are gathered,
   one chunk at a time (a chunk-sized buffer is the most this holds);
3. each rank orthogonalises the whole update of every matrix it holds a part of, with torch's own
   iteration, and applies its own slice with torch's weight decay and learning-rate scaling.

Each element then gets exactly what one process computes (the gathered update is the same on every
rank and the iteration is deterministic for it). A matrix split over two ranks' shards is
orthogonalised on both; one within a single shard only there, so the work is divided among the
ranks about as the matrices are, where DDP repeats all of it on every replica. A shard view whose
parameter lies wholly on other ranks gets its (empty) state on the step where its parameter first
trains, as torch's optimizers give theirs. Offloaded chunks update here too, in host memory, and
their compute shards are refreshed after; chunks on NVMe are refused, and so is a subclass of Muon
that overrides ``step`` (it may no longer be this algorithm).
"""

from __future__ import annotations

import functools
import inspect
import types
import weakref
from typing import Any, Callable, Optional

import torch
import torch.nn as nn
from torch.optim import Optimizer
from torch.optim.optimizer import _global_optimizer_post_hooks as _GLOBAL_POST_HOOKS
from torch.optim.optimizer import _global_optimizer_pre_hooks as _GLOBAL_PRE_HOOKS

from lightning_elixir.runtime import collectives

try:
    from torch.optim import Muon
    from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz
except ImportError:  # torch before 2.9
    Muon = None


def is_muon(cls: type) -> bool:
    """Whether ``cls`` is torch's Muon or a subclass that keeps its ``step`` (compared unwrapped: torch wraps
    ``step`` in a profiling hook on the class of the first instance made)."""
    return Muon is not None and issubclass(cls, Muon) and inspect.unwrap(cls.step) is inspect.unwrap(Muon.step)


def install_muon_step(runtime: Any, optimizer: Optimizer) -> None:
    """Give ``optimizer`` (a Muon over shard views) the sharded step of the note."""
    refuse_nvme(runtime, optimizer, "Muon")
    install_step(optimizer, _MuonStep(runtime, optimizer))


_own_steps: "weakref.WeakKeyDictionary[Optimizer, Callable[..., Any]]" = weakref.WeakKeyDictionary()


def install_step(optimizer: Optimizer, step: Callable[[], None]) -> None:
    """Make ``step`` (after the closure, if one is given) ``optimizer.step``, as a method bound to it.

    torch's LR schedulers wrap ``optimizer.step`` when they are made, to learn that it ran before
    them: a scheduler made later (by the user, or again after a plan switch) rebinds the function of
    the step it finds, so the step must be a method; one made before (in ``configure_optimizers``)
    wrapped the class's step, so this step is wrapped as it would have been, or the scheduler would
    warn that the step was replaced after it was made."""
    _own_steps[optimizer] = step
    if hasattr(optimizer.step, "_wrapped_by_lr_sched"):
        owner = weakref.ref(optimizer)

        @functools.wraps(_run_own_step)
        def tracked(*args: Any, **kwargs: Any) -> Any:
            opt = owner()
            opt._opt_called = True  # type: ignore[union-attr]
            return _run_own_step(opt, *args, **kwargs)

        tracked._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
        optimizer.step = tracked  # type: ignore[method-assign]
    else:
        optimizer.step = types.MethodType(_run_own_step, optimizer)  # type: ignore[method-assign]


def unhooked_step(cls: type) -> Callable[..., Any]:
    """``cls.step`` without torch's profiling wrapper (added to the class when its first instance is made),
    which runs the optimizer's step hooks: for calls that are not the user's step."""
    step = cls.step
    return step.__wrapped__ if getattr(step, "hooked", False) else step


def _run_own_step(optimizer: Optimizer, *args: Any, **kwargs: Any) -> Any:
    """The own step, between the optimizer's step hooks (global ones too), as torch's profiling wrapper of
    a class's ``step`` runs them: they see ``(optimizer, args, kwargs)``, ``args`` starting with it."""
    args = (optimizer, *args)
    for hook in (*_GLOBAL_PRE_HOOKS.values(), *optimizer._optimizer_step_pre_hooks.values()):
        result = hook(optimizer, args, kwargs)
        if result is not None:
            if not (isinstance(result, tuple) and len(result) == 2):
                raise RuntimeError(f"an optimizer step pre-hook must return None or (args, kwargs), got {result!r}")
            args, kwargs = result
    closure: Optional[Callable[[], Any]] = args[1] if len(args) > 1 else kwargs.get("closure")
    loss = None
    if closure is not None:  # as torch's optimizers run it: with gradients, before the update
        with torch.enable_grad():
            loss = closure()
    _own_steps[optimizer]()
    for hook in (*optimizer._optimizer_step_post_hooks.values(), *_GLOBAL_POST_HOOKS.values()):
        hook(optimizer, args, kwargs)
    return loss


def refuse_nvme(runtime: Any, optimizer: Optimizer, name: str) -> None:
    """Raise if a chunk of ``optimizer``'s parameters is placed on NVMe, where a step of the runtime's own
    cannot update it."""
    for chunk in chunks_of(runtime, optimizer):
        if chunk.spec.placement == "nvme":
            raise ValueError(f"chunk {chunk.index} holds parameters of a {name} optimizer and is placed on NVMe, "
                             f"where {name} cannot update it: plan without NVMe (leave nvme_path unset)")


def chunks_of(runtime: Any, optimizer: Optimizer) -> list:
    """The chunks that hold ``optimizer``'s parameters, in order."""
    index = runtime.view_index()
    seen = {index[id(v)][0].index: index[id(v)][0] for g in optimizer.param_groups for v in g["params"]}
    return [seen[i] for i in sorted(seen)]


class _MuonStep:
    """``Muon.step`` over shard views ([Note: Muon on shards])."""

    def __init__(self, runtime: Any, optimizer: Optimizer) -> None:
        self.runtime, self.optimizer = runtime, optimizer

    @torch.no_grad()
    def __call__(self) -> None:
        runtime, optimizer = self.runtime, self.optimizer
        index = runtime.view_index()
        entries = [(group, view) for group in optimizer.param_groups for view in group["params"]]
        mine = [float(view.numel() > 0 and view.grad is not None) for _, view in entries]
        flags = torch.tensor(mine or [0.0], dtype=torch.float32, device=runtime.device)
        trains = collectives.all_reduce_max(flags, runtime.group)[:len(entries)].tolist()
        by_chunk: dict[int, list[tuple[dict, nn.Parameter]]] = {}
        for (group, view), flag in zip(entries, trains):
            if flag:
                by_chunk.setdefault(index[id(view)][0].index, []).append((group, view))
        for i in sorted(by_chunk):  # the same chunks in the same order on every rank
            members = by_chunk[i]
            self._chunk_step(index[id(members[0][1])][0], members, index)

    def _chunk_step(self, chunk: Any, members: list[tuple[dict, nn.Parameter]], index: dict) -> None:
        updates = torch.zeros(chunk.shard_numel, dtype=chunk.master.dtype, device=chunk.master.device)
        for group, view in members:
            state = self.optimizer.state[view]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(view)
            if view.numel() == 0:
                continue
            buf, grad = state["momentum_buffer"], view.grad
            buf.lerp_(grad, 1 - group["momentum"])
            begin, end = chunk.shard_range(index[id(view)][1])
            updates[begin:end] = grad.lerp(buf, group["momentum"]) if group["nesterov"] else buf
        full = chunk.gather_full(updates)
        for group, view in members:
            if view.numel() == 0:  # held by other ranks, which orthogonalise it
                continue
            slot = index[id(view)][1]
            update = _zeropower_via_newtonschulz(full[slot.offset:slot.end].view(slot.shape), group["ns_coefficients"],
                                                 group["ns_steps"], group["eps"])
            begin, end = chunk.shard_range(slot)
            first = chunk.shard_begin + begin - slot.offset  # this view's first element within the parameter
            own = update.reshape(-1)[first:first + end - begin].to(view.device)
            lr = group["lr"].item() if isinstance(group["lr"], torch.Tensor) else group["lr"]
            view.mul_(1 - lr * group["weight_decay"])
            view.add_(own, alpha=-_adjust_lr(lr, group["adjust_lr_fn"], slot.shape))
        if chunk.offloaded:  # no worker updated it: its compute shard is refreshed here ([Note: offloaded updates])
            chunk.refresh_shard()
