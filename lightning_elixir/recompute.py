"""Recomputation chosen by the search: blocks checkpointed by hooks, their names and structure unchanged.

[Note: searched recomputation]
At a tight budget the activations, not the model state, often fill the device, and offloading is
then forced to the maximum while the host's update sets the step time. Recomputing a block's
activations in backward (activation checkpointing) keeps only its input for about one more
forward of it. plan="auto" weighs the two together (planner.py): when the plan without
recomputation is short of memory (it offloads, or nothing fits), the step is traced again with
every other block and with every block recomputing, each variant is searched, and the fastest
prediction that fits wins; the plan lists the blocks (``ElixirPlan.recompute``). The blocks are
the hook units' blocks ([Note: hook units] in units.py): the repeated layers of the model. A
model that already recomputes (the user's own checkpointing, seen as "recompute" accesses in the
trace) is left as it is.

The runtime applies it as PyTorch's composable checkpointing does: a forward pre-hook on the block
opens a non-reentrant checkpoint region and its forward hook closes it, so parameter names, the
module tree and the user's code are untouched. In backward the region re-runs the block by
calling the module, so its hooks fire again exactly as under ``torch.utils.checkpoint(block, x)``
written by hand, which the runtime already serves ([Note: the hook protocol] in runtime/protocol.py).
The hooks are removed when the strategy lets go of the module.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch.nn as nn
from torch.utils import checkpoint as _checkpoint


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
            self._install(modules[name])

    def _install(self, block: nn.Module) -> None:
        state = {"enabled": True, "region": None}

        @contextlib.contextmanager
        def recomputing() -> Iterator[None]:  # the block's call inside backward runs without a new region
            state["enabled"] = False
            try:
                yield
            finally:
                state["enabled"] = True

        def open_region(mod: nn.Module, args: tuple, kwargs: dict) -> None:
            if state["enabled"]:
                region = _checkpoint._checkpoint_without_reentrant_generator(
                    mod, True, lambda: (contextlib.nullcontext(), recomputing()), "default", False, True,
                    *args, **kwargs)
                next(region)
                state["region"] = region

        def close_region(mod: nn.Module, args: tuple, output: Any) -> None:
            region, state["region"] = state["region"], None
            if region is not None:
                with contextlib.suppress(StopIteration):
                    next(region)

        self._handles.append(block.register_forward_pre_hook(open_region, with_kwargs=True, prepend=True))
        self._handles.append(block.register_forward_hook(close_region, prepend=True, always_call=True))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


@contextlib.contextmanager
def recomputing(module: nn.Module, names: Iterable[str]) -> Iterator[None]:
    """``module`` with ``names`` recomputed inside the block (a trace of the variant)."""
    hooks = Recomputation(module, names)
    try:
        yield
    finally:
        hooks.remove()
