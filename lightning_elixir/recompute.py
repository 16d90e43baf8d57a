"""Recomputation chosen by the search: blocks checkpointed by hooks, their names and structure unchanged.

[Note: searched recomputation]
At a tight budget the activations, not the model state, often fill the device, and offloading is
then forced to the maximum while the host's update sets the step time. Recomputing a block's
activations in backward (activation checkpointing) keeps only its input for about one more
forward of it. plan="auto" weighs the two together (planner.py): when the plan without
recomputation is short of memory (it offloads, or nothing fits), the step is traced again with
every other block and with every block recomputing, each variant is searched, and the fastest
prediction that fits wins; the plan lists the blocks (``ElixirPlan.recompute``). The traced variants
are kept, and the self-correction and out-of-memory recovery search them all again ([Note:
recomputation variants] in search/variants.py). The blocks are
the hook units' blocks ([Note: hook units] in units.py): the repeated layers of the model, less
those with persistent buffers (a recomputed BatchNorm would update its running statistics twice);
a block that is a list of layers (never called itself) stands for its layers. A
model that already recomputes is left as it is: the trace sees forward operators re-run in backward
(``ModelProfile.recomputes``), also where no hook sees the recomputation (a layer that checkpoints
inside its own forward, as Hugging Face layers do after ``gradient_checkpointing_enable()``). A call of a block whose arguments include an object other than tensors
and plain values (a key-value cache the call appends to) runs without recomputation: the
recomputation would see the object as the call left it; so does a call under
``torch.func.functional_call`` (tensors in place of the parameters, gone by the time of the
recomputation), and a call inside code that ``torch.compile`` compiles (the generator that opens
and closes the region is not something Dynamo traces through; compiled blocks are not candidates,
and a block inside a compiled function keeps its activations). Hugging Face models pass their
key-value cache to every layer, in training too, unless called with ``use_cache=False``: the
planner names the blocks that kept their activations for such an object, and the object's type,
among its notes (or in the error when no plan fits), so that the user can let them recompute.

The runtime applies it as PyTorch's composable checkpointing does: a forward pre-hook on the block
opens a non-reentrant checkpoint region and its forward hook closes it, so parameter names, the
module tree and the user's code are untouched. In backward the region re-runs the block by
calling the module, so its hooks fire again exactly as under ``torch.utils.checkpoint(block, x)``
written by hand, which the runtime already serves ([Note: the hook protocol] in runtime/protocol.py).
The hooks are removed when the strategy lets go of the module.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.nn as nn
from torch.utils import checkpoint as _checkpoint

from lightning_elixir.units import block_names


class Recomputation:
    """Checkpointing hooks on the named blocks of a module; ``remove()`` takes them off."""

    def __init__(self, module: nn.Module, names: Iterable[str]) -> None:
        modules = dict(module.named_modules())
        missing = [n for n in names if n not in modules]
        if missing:
            raise ValueError(f"the plan recomputes modules the model does not have: {missing[:4]}; plan again for "
                             "this model, or remove them from the plan's 'recompute'")
        self.names = tuple(names)
        self._handles: list[Any] = []
        for name in self.names:
            self._install(name, modules[name])

    def _install(self, name: str, block: nn.Module) -> None:
        state = _BlockState()

        def open_region(mod: nn.Module, args: tuple, kwargs: dict) -> None:
            if not state.enabled or torch.compiler.is_compiling():
                return
            objects = _objects((args, kwargs))
            if objects and _skips:
                for found in _skips:
                    found.setdefault(name, objects)
            if not objects and not _reparametrized(mod):
                region = _checkpoint._checkpoint_without_reentrant_generator(
                    mod, True, lambda: (contextlib.nullcontext(), state), "default", False, *_EARLY_STOP, *args,
                    **kwargs)
                next(region)
                state.region = region

        def close_region(mod: nn.Module, args: tuple, output: Any) -> None:
            region, state.region = state.region, None
            if region is not None:
                with contextlib.suppress(StopIteration):
                    next(region)

        self._handles.append(block.register_forward_pre_hook(open_region, with_kwargs=True, prepend=True))
        self._handles.append(block.register_forward_hook(close_region, prepend=True, always_call=True))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


_EARLY_STOP = (True,) if "early_stop" in inspect.signature(
    _checkpoint._checkpoint_without_reentrant_generator).parameters else ()
"""The region's ``early_stop`` argument where this torch takes one (newer releases; before, early stopping is
the default, set by ``torch.utils.checkpoint.set_checkpoint_early_stop``)."""


class _BlockState:
    """One block's region, and the context its recomputation runs in: the block's call inside backward
    opens no region of its own. Entered once per recomputation (twice when a graph is kept and
    differentiated again), so a class rather than a one-shot generator context."""

    def __init__(self) -> None:
        self.enabled = True
        self.region: Any = None

    def __enter__(self) -> None:
        self.enabled = False

    def __exit__(self, *exc: Any) -> None:
        self.enabled = True


def _objects(value: Any) -> tuple[str, ...]:
    """The type names of the objects other than tensors and plain values among a call's arguments. Such
    an object (a key-value cache that the call appends to, say) may be changed by the call, and the
    recomputation would then see it changed: calls with any keep their activations."""
    if value is None or isinstance(value, (torch.Tensor, bool, int, float, str, torch.dtype, torch.device)):
        return ()
    if isinstance(value, (tuple, list)):
        return tuple(dict.fromkeys(name for v in value for name in _objects(v)))
    if isinstance(value, dict):
        return _objects(tuple(value.values()))
    return (type(value).__name__,)


_skips: list[dict[str, tuple[str, ...]]] = []
"""The open ``skipped_calls`` collections."""


@contextlib.contextmanager
def skipped_calls() -> Iterator[dict[str, tuple[str, ...]]]:
    """Block name -> the type names of the objects among its arguments, for the calls of blocks to
    recompute that ran without recomputation inside the block (a trace of a variant): what keeps
    plan="auto" from recomputing them, for the planner to tell."""
    found: dict[str, tuple[str, ...]] = {}
    _skips.append(found)
    try:
        yield found
    finally:
        _skips.remove(found)


def _reparametrized(block: nn.Module) -> bool:
    """Whether the block runs with tensors in place of its parameters (``torch.func.functional_call``):
    the recomputation, after the call, would run with the parameters instead."""
    return any(p is not None and not isinstance(p, nn.Parameter) for m in block.modules() for p in m._parameters.values())


def recompute_candidates(module: nn.Module) -> tuple[str, ...]:
    """The blocks plan="auto" may recompute: those without persistent buffers (BatchNorm's running
    statistics would be updated again by the recomputation) and not compiled (``block.compile()``).

    A block that is itself an ``nn.ModuleList`` or ``nn.ModuleDict`` (a stage of layers kept in a
    list of lists, as Funnel Transformer keeps its blocks) is never called, so hooks on it never fire
    and recomputing it would change nothing: its layers are the candidates instead."""
    modules = dict(module.named_modules())
    return tuple(name for block in block_names(module) for name in _called_parts(block, modules[block])
                 if getattr(modules[name], "_compiled_call_impl", None) is None
                 and not any(name_ not in m._non_persistent_buffers_set for m in modules[name].modules()
                             for name_ in m._buffers))


def _called_parts(name: str, mod: nn.Module) -> Iterator[str]:
    """``name``, or for a list or dict of modules (no forward of its own) the parts of its children with parameters."""
    if not isinstance(mod, (nn.ModuleList, nn.ModuleDict)):
        yield name
        return
    for child_name, child in mod.named_children():
        if any(True for _ in child.parameters()):
            yield from _called_parts(f"{name}.{child_name}", child)


@contextlib.contextmanager
def recomputing(module: nn.Module, names: Iterable[str]) -> Iterator[None]:
    """``module`` with ``names`` recomputed inside the block (a trace of the variant)."""
    hooks = Recomputation(module, names)
    try:
        yield
    finally:
        hooks.remove()
