"""Module and parameter hooks that drive gather, pin, release and gradient reduction.

[Note: the hook protocol]
Every module that directly holds parameters gets:
- a forward pre-hook: gather its chunks and pin them; when autograd will run, open a
  ``BackwardCall`` for this call and wrap its tensor inputs in ``_PostBackward`` so that computing
  their gradients reports to that call;
- a forward hook: unpin; register tensor hooks on its outputs whose first firing is the call's
  pre-backward (gather and pin again for backward).
Every trainable parameter gets a post-accumulate-grad hook that moves its gradient into the
chunk's buffer (runtime/trainable.py registers them, also for parameters unfrozen later). A call's backward pins are dropped once its input gradients exist and every
trainable parameter of the module has its gradient; a final autograd callback flushes the rest.
Bookkeeping is per call, not per module, so a module may run several times in one step (a
shared layer, a model called on two views): each call pins for its own backward, and a
parameter's gradient (accumulated by autograd over all calls) releases them all.
Forward calls that happen inside backward (activation-checkpoint recomputation) gather, pin and
unpin. Under non-reentrant checkpointing the module still has the open call of its original forward,
whose backward this is, and that call keeps the bookkeeping. Under reentrant checkpointing
(``use_reentrant=True``) the original forward ran without grad and opened no call; the recomputed
forward is then differentiated by a backward of its own, nested in this one, so it opens a call
like any forward: without it the chunk could be released between the recomputation and that
nested backward, which reads the parameters it saved.

[Note: backward through a backward]
A graph may be differentiated more than once. With ``retain_graph=True`` a later backward reaches
the modules' outputs again: each call remembers the backward its pre-backward last fired in
(``BackwardCall.generation``) and reopens there. ``torch.autograd.grad(..., create_graph=True)`` (a
penalty on gradients) builds a graph whose nodes read the parameters when a later backward
differentiates it, and they run before any gradient reaches the modules' outputs, where the
pre-backward hooks would gather them. So a backward that creates a graph keeps every chunk it pins
pinned until a backward that creates none has finished, or the step ends
(``ElixirRuntime._release_graph_pins``): the parameters stay gathered in between, as the math needs.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional, Union

import torch
import torch.nn as nn
from torch.autograd.profiler import record_function
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.hooks import RemovableHandle

if TYPE_CHECKING:
    from lightning_elixir.runtime.runtime import ElixirRuntime


class Wait(enum.Enum):
    """What a module call's backward waits for besides its parameters' gradients."""

    INPUTS = "the gradients of the module's inputs"


WaitKey = Union[int, Wait]
"""A trainable parameter's id, or a Wait."""


def in_backward() -> bool:
    """Whether autograd is executing a backward pass on this thread."""
    return torch._C._current_graph_task_id() != -1


@dataclass(eq=False)
class BackwardCall:
    """One forward call of a module under autograd, until its backward is done."""

    state: "ModuleState"
    pending: set[WaitKey]
    pinned: bool = False
    hooked: bool = False
    """Whether its outputs carry the pre-backward hooks (registered once, by the forward hook)."""
    has_inputs: bool = False
    """Whether its inputs report their gradients (``Wait.INPUTS``)."""
    generation: int = -1
    """The backward in which its pre-backward last fired (``ElixirRuntime.micro_batches``, the backwards
    finished before it): a graph kept by ``retain_graph``/``create_graph`` and differentiated again in a
    later backward reopens the call there."""


@dataclass(eq=False)
class ModuleState:
    """Per-module bookkeeping: which chunks it needs, whether it runs, what its backward waits for."""

    name: str
    public_ids: tuple[int, ...]
    trainable: frozenset[int]
    """ids of the trainable parameters it holds that live in public chunks."""
    param_ids: frozenset[int] = frozenset()
    """ids of every parameter it holds directly."""
    active: int = 0
    """Forward calls of this module running right now (its chunks are pinned meanwhile)."""
    calls: list[BackwardCall] = field(default_factory=list)
    """Calls of this step whose backward has not finished."""
    handles: list[RemovableHandle] = field(default_factory=list)


class _PostBackward(torch.autograd.Function):
    """Identity on the module's inputs whose backward reports that the module's backward is done."""

    @staticmethod
    def forward(ctx, on_backward: Callable[[], None], *inputs: torch.Tensor):  # type: ignore[override]
        ctx.on_backward = on_backward
        return inputs

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):  # type: ignore[override]
        ctx.on_backward()
        return (None,) + grads


def install(runtime: "ElixirRuntime", module: nn.Module) -> list[ModuleState]:
    """Register the hooks of the protocol on ``module``'s tree; return the per-module states."""
    states = []
    runtime.handles.append(module.register_forward_pre_hook(lambda mod, args: runtime.root_pre_forward(), prepend=True))
    runtime.handles.append(module.register_forward_hook(lambda mod, args, out: runtime.root_post_forward(),
                                                        always_call=True))
    for name, mod in module.named_modules():
        direct = [p for p in mod._parameters.values() if p is not None]
        if not direct:
            continue
        public = runtime.public_chunk_ids(direct)
        param_ids = frozenset(id(p) for p in direct)
        state = ModuleState(name or "<root>", public, runtime.trainable.trainable_ids(param_ids), param_ids)
        state.handles.append(mod.register_forward_pre_hook(_pre_forward(runtime, state), with_kwargs=True))
        state.handles.append(mod.register_forward_hook(_post_forward(runtime, state), always_call=True))
        states.append(state)
    return states


def _pre_forward(runtime: "ElixirRuntime", state: ModuleState):
    def hook(mod: nn.Module, args: tuple, kwargs: dict) -> Optional[tuple[tuple, dict]]:
        with record_function("Elixir::pre_forward"):
            runtime.before_module(state)
            if not state.public_ids or not torch.is_grad_enabled():
                return None
            if in_backward() and state.calls:  # recomputation for the call whose backward this is
                return None
            call = BackwardCall(state, set(state.trainable))
            state.calls.append(call)
            wrapped = _wrap_inputs(runtime, call, args, kwargs)
            call.has_inputs = wrapped is not None
            return wrapped

    return hook


def _post_forward(runtime: "ElixirRuntime", state: ModuleState):
    def hook(mod: nn.Module, args: tuple, output: Any) -> None:
        with record_function("Elixir::post_forward"):
            runtime.after_module(state)
            if state.public_ids and torch.is_grad_enabled() and state.calls and not state.calls[-1].hooked:
                state.calls[-1].hooked = True
                _register_pre_backward(runtime, state.calls[-1], output)

    return hook


def _wrap_inputs(runtime: "ElixirRuntime", call: BackwardCall, args: tuple, kwargs: dict) -> Optional[tuple]:
    flat, spec = tree_flatten((args, kwargs))
    positions = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
    if not positions:
        return None
    call.pending.add(Wait.INPUTS)
    wrapped = _PostBackward.apply(lambda: runtime.call_event(call, Wait.INPUTS), *(flat[i] for i in positions))
    for i, t in zip(positions, wrapped):
        flat[i] = t
    return tree_unflatten(flat, spec)


def _register_pre_backward(runtime: "ElixirRuntime", call: BackwardCall, output: Any) -> None:
    tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
    if not tensors:
        return

    def hook(grad: torch.Tensor) -> None:
        if call.generation != runtime.micro_batches:  # the first of its outputs' gradients in this backward
            call.generation = runtime.micro_batches
            with record_function("Elixir::pre_backward"):
                runtime.before_call_backward(call)

    for t in tensors:
        t.register_hook(hook)
