"""Reads of parameters and gradients that the module hooks do not cover.

[Note: reading outside the hooks]
``ChunkedParameter`` (params.py) reports every value read of a parameter; while the hook unit that
owns a parameter runs forward, the parameter is a plain ``nn.Parameter`` and its reads cost
nothing ([Note: host cost] in protocol.py). A reported read is served at once when the hooks
already hold the chunk: the owning unit is running, or it is a private chunk inside the step, or
autograd is running a backward that uses it. Otherwise what happens
depends on where the read is:

- In the step (between ``begin_iteration`` and the end of backward, inside a forward, or inside
  a step region: the strategy's ``training_step`` and ``backward``, and the closure the precision
  plugin runs, whose hooks between the two Lightning runs on every rank): every rank runs the
  same code, so the chunk is gathered on demand and *held* ("sticky") until the end of backward
  (until the end of the iteration without grad): autograd may have saved the parameter for the backward of the operator that read it.
  ``nn.MultiheadAttention`` reading ``out_proj.weight``, a tied head, an L2 penalty over
  ``self.parameters()`` all work this way; a profiled plan gives such parameters private chunks.
- In a gathered region (``gathered()``; the strategy opens one around the hooks Lightning runs
  after backward and before the optimizer step): the same on-demand gather, held until the region
  ends; gradients read through ``.grad`` are gathered from the shards, and in-place changes to
  values or gradients are kept (written back to this rank's shard) when it ends. The strategy
  also opens one after the step inside a module's own ``optimizer_step`` hook (after_step.py).
- Anywhere else (a callback after the step, code after fit with the shards kept): there is no
  point at which every rank is known to read, so the read raises ``OutsideStepError`` saying how
  to read it. A placeholder value is never returned.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterable, Iterator
from typing import Optional

import torch
import torch.nn as nn

from lightning_elixir.runtime.cache import ChunkCache
from lightning_elixir.runtime.chunk import Chunk
from lightning_elixir.runtime.grads import GradientFlow
from lightning_elixir.runtime.states import ChunkState
from lightning_elixir.runtime.table import ChunkTable

log = logging.getLogger(__name__)

_HOW = ("read (or write) it inside `with trainer.strategy.gathered_params():` (entered on every rank; "
        "ElixirRuntime.gathered() without the Trainer), or after fit, when the module has its full parameters back")


def _called_from_module_zero_grad() -> bool:
    """Whether ``nn.Module.zero_grad`` is reading ``.grad`` (a few frames up: the hook, ``__torch_function__``)."""
    frame = sys._getframe(1)
    for _ in range(4):
        frame = frame.f_back
        if frame is None:
            return False
        if frame.f_code is _ZERO_GRAD_CODE:
            return True
    return False


_ZERO_GRAD_CODE = nn.Module.zero_grad.__code__


def in_backward() -> bool:
    """Whether autograd is executing a backward pass on this thread."""
    return torch._C._current_graph_task_id() != -1


class OutsideStepError(RuntimeError):
    """A sharded parameter or gradient was read where the ranks cannot gather it together."""


class _Region:
    """What one gathered region holds, to let go of when it ends."""

    def __init__(self) -> None:
        self.public: list[int] = []
        self.private: list[Chunk] = []


class AccessGuard:
    """Serves the reads of [Note: reading outside the hooks] for one runtime's chunks."""

    def __init__(self, table: ChunkTable, cache: ChunkCache, grads: GradientFlow) -> None:
        self.table, self.cache, self.grads = table, cache, grads
        self.stepping = 0
        """Open step regions (the strategy's training/validation/... step)."""
        self.forward_depth = 0
        """Running forward calls of the root module."""
        self.sticky: list[int] = []
        """Public chunks held until the end of backward (or of a no-grad iteration)."""
        self.read_outside: set[int] = set()
        """Ids of the parameters read outside their unit's forward in this step (their gradients may
        arrive after the unit's backward: [Note: parameters a rank did not use] in protocol.py)."""
        self.full_grads: dict[int, torch.Tensor] = {}
        """Gradients gathered for reads, by chunk index, until written back."""
        self._region: Optional[_Region] = None
        self._warned: set[str] = set()

    # ---- where are we --------------------------------------------------------------------------

    def in_step(self) -> bool:
        return self.stepping > 0 or self.forward_depth > 0 or in_backward()

    def in_region(self) -> bool:
        return self._region is not None or self.in_step()

    # ---- reads ---------------------------------------------------------------------------------

    def on_param_read(self, param: nn.Parameter, aliasing: bool = False) -> bool:
        """Make ``param``'s values real for a read; True when it was read outside the hooks. ``aliasing``:
        a read of ``.data``, whose in-place writes move no version counter of the parameter."""
        chunk, slot = self.table.where(param)
        if chunk.state in (ChunkState.HOLD, ChunkState.COMPUTE):
            owner = self.table.owner(param)
            if (owner is not None and owner.active) or in_backward():
                return False
            if chunk.private and self.in_region():
                if aliasing:  # its writes are found only by comparing the chunk with its shard at release
                    chunk.exposed = True
                return False
        if not self.in_region():
            raise OutsideStepError(f"parameter {slot.name!r} is sharded over the ranks outside the training step "
                                   f"(this rank holds only its shard); {_HOW}")
        self._hold(chunk, slot.name)
        chunk.exposed = True
        self.read_outside.add(id(param))
        return True

    def on_grad_read(self, param: nn.Parameter) -> Optional[torch.Tensor]:
        """``param.grad``: autograd's own while it accumulates, else gathered from the shards."""
        raw = self._own_grad(param)
        if raw is not None or in_backward() or not param.requires_grad:
            return raw
        chunk, slot = self.table.where(param)
        if not self.grads.valid(chunk):
            return None
        if not self.in_region():
            if _called_from_module_zero_grad():  # Lightning zeroes before validation; the reads only test for None
                self.grads.forget_grad(param)
                return None
            raise OutsideStepError(f"the gradient of {slot.name!r} is sharded over the ranks outside the training step "
                                   f"(reduce-scattered into shards); {_HOW}")
        return self._gathered_grad(chunk)[slot.offset:slot.end].view(slot.shape)

    def _own_grad(self, param: nn.Parameter) -> Optional[torch.Tensor]:
        """``param``'s ``.grad`` attribute itself; outside a backward, once a backward that left gradients no
        hook reported has been ended (its gradients go into the shards, the attribute to None)."""
        with torch._C.DisableTorchFunctionSubclass():
            raw = param.grad
        if raw is not None and not in_backward():
            self.grads.finish_unreported()
            with torch._C.DisableTorchFunctionSubclass():
                raw = param.grad
        return raw

    def _gathered_grad(self, chunk: Chunk) -> torch.Tensor:
        """``chunk``'s gradient gathered from the shards, once per region (kept changes go back when it ends)."""
        full = self.full_grads.get(chunk.index)
        if full is None:
            full = self.full_grads[chunk.index] = chunk.gather_full(chunk.grad_shard)
        return full

    def on_grad_write(self, param: nn.Parameter, value: Optional[torch.Tensor]) -> bool:
        """``param.grad = value`` outside autograd: the gradient shards take it (True), so that the optimizer
        steps with it, as it would with a plain parameter's; in a backward the attribute is autograd's (False).

        None (or ``del param.grad``): the parameter has no gradient this step; its view's gradient goes and
        its part of the shard reads as zero (``GradientFlow.forget_grad``), as ``zero_grad()`` leaves it.
        A tensor: written into the gathered gradient, kept in the shard when the region ends, as an in-place
        change is; it needs the gathered region (the hooks before the optimizer step, ``gathered()``).
        """
        if in_backward():
            return False
        chunk, slot = self.table.where(param)
        if value is None:
            self.grads.forget_grad(param)
            full = self.full_grads.get(chunk.index)
            if full is not None:  # written back when the region ends: as zero, not the old values
                full[slot.offset:slot.end].zero_()
            return True
        if tuple(value.shape) != tuple(slot.shape):
            raise RuntimeError(f"assigned grad has data of a different size: {tuple(value.shape)} for parameter "
                               f"{slot.name!r} of shape {tuple(slot.shape)}")
        if not self.in_region():
            raise OutsideStepError(f"the gradient of {slot.name!r} is sharded over the ranks outside the training step "
                                   f"(reduce-scattered into shards); assign it {_HOW.removeprefix('read (or write) it ')}")
        self._own_grad(param)  # a backward no hook reported: its gradients go into the shards first
        if not self.grads.valid(chunk):
            self.grads.start_assigned(chunk)
        self._gathered_grad(chunk)[slot.offset:slot.end].copy_(value.detach().reshape(-1))
        self.grads.restore_grad(param)
        return True

    def on_data_write(self, param: nn.Parameter, value: torch.Tensor) -> bool:
        """``param.data = value`` outside the forward of its owner: copied into the parameter's values in the
        chunk (gathered on demand, kept when the region ends, as an in-place write is), since rebinding
        ``.data`` would cut the parameter off from the chunk that trains it. Needs what a read needs."""
        if in_backward() or not isinstance(value, torch.Tensor):
            return False
        chunk, slot = self.table.where(param)
        slot.check_new_data(value)
        self.on_param_read(param)  # gathered and held, or an error that says where it can be written
        with torch._C.DisableTorchFunctionSubclass(), torch.no_grad():
            param.data.copy_(value)
        chunk.exposed = True  # written back to the master (a private chunk's read does not mark it)
        return True

    def _hold(self, chunk: Chunk, name: str) -> None:
        """Gather ``chunk`` if needed and keep it until the region or step lets go."""
        if chunk.private:
            if chunk.state is ChunkState.GATHERING:
                chunk.finish_gather()
            if chunk.state is ChunkState.FREE:
                self.table.gather_private(chunk)
                if self._region is not None:
                    self._region.private.append(chunk)
            return
        held = self._region.public if self._region is not None else self.sticky
        if chunk.index in held:
            return
        self.cache.acquire_extra(chunk.index)
        held.append(chunk.index)
        if self._region is None and name not in self._warned:
            self._warned.add(name)
            log.info("parameter %r is read outside the forward of the module that holds it: its chunk stays "
                     "gathered until the end of backward (plan='auto' or private_params=[...] gives it a private "
                     "chunk)", name)

    # ---- letting go ----------------------------------------------------------------------------

    def release_sticky(self) -> None:
        """End of backward or of the iteration: unpin what reads outside the hooks held."""
        self.read_outside.clear()
        if self.sticky:
            self.cache.release_pins(tuple(self.sticky))
            self.sticky = []

    def flush_grads(self) -> None:
        """Keep in-place changes to gathered gradients in the shards, and drop the gathered copies."""
        for index, full in self.full_grads.items():
            self.table.chunks[index].write_back_grad(full)
        self.full_grads = {}

    def drop_grads(self) -> None:
        """Forget gathered gradients without keeping changes (they were zeroed)."""
        self.full_grads = {}

    # ---- regions -------------------------------------------------------------------------------

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Code every rank runs in the same order (a training or evaluation step)."""
        self.stepping += 1
        try:
            yield
        finally:
            self.stepping -= 1

    @contextlib.contextmanager
    def gathered(self, params: Optional[Iterable[nn.Parameter]] = None, grads: bool = False) -> Iterator[None]:
        """Full parameters (and gradients) for reads until exit; what is written to them is kept.

        Args:
            params: chunks holding these parameters are gathered on entry, so code inside may read
                them on some ranks only; others are gathered when read (every rank must read them).
                Default: none up front.
            grads: also gather these parameters' gradients on entry.
        """
        if self._region is not None:  # nested: the outer region holds and writes back what this one gathers
            self._gather_up_front(params, grads)
            yield
            return
        self._region = _Region()
        self.grads.finish_unreported()  # gradients a backward left unreduced belong in the shards first
        try:
            self._gather_up_front(params, grads)
            yield
        finally:
            region, self._region = self._region, None
            self.flush_grads()
            self._let_go(region)

    def _gather_up_front(self, params: Optional[Iterable[nn.Parameter]], grads: bool) -> None:
        """Gather ``params`` (and their gradients) now, on every rank: code inside may read them on some."""
        for p in params or ():
            self.on_param_read(p)
            if grads:
                self.on_grad_read(p)

    def _let_go(self, region: _Region) -> None:
        for index in region.public:
            chunk = self.table.chunks[index]
            if chunk.written():
                chunk.write_back()
        self.cache.release_pins(tuple(region.public))
        for chunk in region.private:
            if chunk.state is ChunkState.HOLD:
                chunk.release()
        self.cache.shrink()
