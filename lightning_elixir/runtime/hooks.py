"""Module and parameter hooks that drive gather, pin, release and gradient reduction.

[Note: the hook protocol]
Every module that directly holds parameters gets:
- a forward pre-hook: gather its chunks and pin them; when autograd will run, wrap its tensor
  inputs in ``_PostBackward`` so that computing their gradients signals the module's backward end;
- a forward hook: unpin; register tensor hooks on its outputs whose first firing is the module's
  pre-backward (gather and pin again for backward).
Every trainable parameter gets a post-accumulate-grad hook that moves its gradient into the
chunk's buffer. A module's backward pins are dropped once its input gradients exist and every
trainable parameter it holds has its gradient; a final autograd callback flushes the rest.
Forward calls that happen inside backward (activation-checkpoint recomputation) only gather, pin
and unpin: the backward bookkeeping belongs to the original forward call.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.hooks import RemovableHandle

if TYPE_CHECKING:
    from lightning_elixir.runtime.runtime import ElixirRuntime

INPUTS = "inputs"


def in_backward() -> bool:
    """Whether autograd is executing a backward pass on this thread."""
    return torch._C._current_graph_task_id() != -1


@dataclass
class ModuleState:
    """Per-module bookkeeping: which chunks it needs and what its backward still waits for."""

    name: str
    public_ids: tuple[int, ...]
    trainable: frozenset[int]
    """ids of the trainable parameters it holds that live in public chunks."""
    calls: int = 0
    inputs_need_grad: bool = False
    backward_pending: Optional[set] = None
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
    root_handle = module.register_forward_pre_hook(lambda mod, args: runtime.begin_iteration(), prepend=True)
    for name, mod in module.named_modules():
        direct = [p for p in mod._parameters.values() if p is not None]
        if not direct:
            continue
        public = runtime.public_chunk_ids(direct)
        trainable = frozenset(id(p) for p in direct if p.requires_grad and runtime.is_public(p))
        state = ModuleState(name or "<root>", public, trainable)
        state.handles.append(mod.register_forward_pre_hook(_pre_forward(runtime, state), with_kwargs=True))
        state.handles.append(mod.register_forward_hook(_post_forward(runtime, state)))
        states.append(state)
    for p in runtime.trainable_params():
        runtime.handles.append(p.register_post_accumulate_grad_hook(runtime.on_param_grad))
    runtime.handles.append(root_handle)
    return states


def _pre_forward(runtime: "ElixirRuntime", state: ModuleState):
    def hook(mod: nn.Module, args: tuple, kwargs: dict) -> Optional[tuple[tuple, dict]]:
        runtime.before_module(state)
        if not state.public_ids or not torch.is_grad_enabled() or in_backward():
            return None
        return _wrap_inputs(runtime, state, args, kwargs)

    return hook


def _post_forward(runtime: "ElixirRuntime", state: ModuleState):
    def hook(mod: nn.Module, args: tuple, output: Any) -> None:
        runtime.after_module(state)
        if state.public_ids and torch.is_grad_enabled() and not in_backward():
            _register_pre_backward(runtime, state, output)

    return hook


def _wrap_inputs(runtime: "ElixirRuntime", state: ModuleState, args: tuple, kwargs: dict) -> Optional[tuple]:
    flat, spec = tree_flatten((args, kwargs))
    positions = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
    state.inputs_need_grad = bool(positions)
    if not positions:
        return None
    wrapped = _PostBackward.apply(lambda: runtime.module_event(state, INPUTS), *(flat[i] for i in positions))
    for i, t in zip(positions, wrapped):
        flat[i] = t
    return tree_unflatten(flat, spec)


def _register_pre_backward(runtime: "ElixirRuntime", state: ModuleState, output: Any) -> None:
    tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
    if not tensors:
        return
    fired = [False]

    def hook(grad: torch.Tensor) -> None:
        if not fired[0]:
            fired[0] = True
            runtime.before_module_backward(state)

    for t in tensors:
        t.register_hook(hook)
