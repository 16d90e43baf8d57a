"""Ground truth for the model profiler: run the same step for real and watch it.

Independent of the library's tracer: it records hook order with its own hooks and measures live
activation bytes two ways, so a shared bug in the library cannot agree with itself.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_elixir.units import hook_units


@dataclass
class RealStep:
    """What a real step did."""

    sequence: list[tuple[str, str]] = field(default_factory=list)
    """(phase, module) per hook firing, like the runtime's hooks."""
    forward_peak_bytes: int = 0
    backward_peak_bytes: int = 0


class _Lifetimes(TorchDispatchMode):
    """Live bytes of storages created by operators, freed when the storage dies."""

    def __init__(self, result: RealStep) -> None:
        super().__init__()
        self.result = result
        self.backward = False
        self.live = 0
        self.sizes: dict[int, tuple[Any, int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        flat_in = [t for t in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        inputs = {t.untyped_storage().data_ptr() for t in flat_in}
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._born(t.untyped_storage(), inputs)
        self._peak()
        return out

    def _born(self, storage: torch.UntypedStorage, inputs: set[int]) -> None:
        ptr = storage.data_ptr()
        if ptr in inputs or ptr in self.sizes or storage.nbytes() == 0:
            return
        self.sizes[ptr] = (weakref.ref(storage, lambda _r, p=ptr: self._die(p)), storage.nbytes())
        self.live += storage.nbytes()

    def _die(self, ptr: int) -> None:
        entry = self.sizes.pop(ptr, None)
        if entry is not None:
            self.live -= entry[1]

    def _peak(self) -> None:
        name = "backward_peak_bytes" if self.backward else "forward_peak_bytes"
        setattr(self.result, name, max(getattr(self.result, name), self.live))


def run_real_step(module: nn.Module, batch: Any, step_fn: Callable[[nn.Module, Any], torch.Tensor],
                  compute_dtype: torch.dtype = torch.float32) -> RealStep:
    """Run forward, loss and backward for real with hooks like the runtime's and a lifetime tracker."""
    result = RealStep()
    tracker = _Lifetimes(result)
    units = [unit.name for unit in hook_units(module)]  # the modules the runtime hooks
    handles = [h for name in units for h in _hooks(name, module.get_submodule(name), result, tracker)]
    handles += [p.register_post_accumulate_grad_hook(lambda p: tracker._die(p.grad.untyped_storage().data_ptr()))
                for p in module.parameters()]
    try:
        with tracker:
            with torch.autocast("cpu", dtype=compute_dtype, enabled=compute_dtype != torch.float32):
                loss = step_fn(module, batch)
            tracker.backward = True
            result.backward_peak_bytes = tracker.live
            loss.backward()
    finally:
        for h in handles:
            h.remove()
        for p in module.parameters():
            p.grad = None
    return result


def _hooks(name: str, module: nn.Module, result: RealStep, tracker: _Lifetimes) -> list:
    def pre(_m, _a):
        result.sequence.append(("recompute" if tracker.backward else "forward", name))

    def post(_m, _a, out):
        fired = []

        def on_grad(_g):
            if not fired:
                fired.append(1)
                result.sequence.append(("backward", name))

        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(on_grad)

    return [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]


def allocator_peaks(module: nn.Module, batch: Any, step_fn: Callable[[nn.Module, Any], torch.Tensor],
                    compute_dtype: torch.dtype = torch.float32) -> tuple[int, int]:
    """(forward, backward) peak activation bytes from PyTorch's own memory profiler.

    A second, allocator-level oracle: torch.profiler records every CPU allocation and free and
    categorises each tensor (parameter, gradient, input, activation, temporary, ...). A sentinel
    allocation of an odd size marks where backward starts in the timeline.
    """
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import Action, Category

    sentinel_bytes = 777_773
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as prof:
        with torch.autocast("cpu", dtype=compute_dtype, enabled=compute_dtype != torch.float32):
            loss = step_fn(module, batch)
        torch.empty(sentinel_bytes, dtype=torch.uint8)  # allocated and freed at once: the marker
        loss.backward()
        del loss
    memory = prof._memory_profile()
    skip = {Category.PARAMETER, Category.GRADIENT, Category.INPUT, Category.OPTIMIZER_STATE}
    live, peaks, phase = 0, [0, 0], 0
    for _, action, (key, version), size in memory.timeline:
        if size == sentinel_bytes:
            phase = 1
            continue
        if action == Action.PREEXISTING or memory._categories.get(key, version) in skip:
            continue
        live += size if action == Action.CREATE else -size if action == Action.DESTROY else 0
        peaks[phase] = max(peaks[phase], live)
    for p in module.parameters():
        p.grad = None
    return peaks[0], peaks[1]
