"""The gradient reductions of one backward: started in a fixed order, a bounded number in flight."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from lightning_elixir.plan import REDUCE_BUFFERS
from lightning_elixir.runtime.chunk import Chunk, Slot


class Reductions:
    """Reduce-scatters each chunk's full gradient into its shard, in the order backward completes them.

    The order is fixed (public chunks last to first, then the private ones) so that every rank issues
    the same collectives. ``offload`` starts an offloaded chunk's reduced shard on its way to the
    host (runtime/offload.py); ``views`` gives a chunk's optimizer views, which see the reduced
    gradient shards once a reduction retires.

    [Note: reductions in flight]
    A chunk holds a full-size gradient buffer from its first gradient until its reduction is
    retired. Retiring each one only at the end of backward would leave every rank holding the
    whole model's gradient there; retiring the oldest once ``REDUCE_BUFFERS`` are in flight keeps
    that many buffers waiting on the network while later chunks are computed (FSDP2 keeps one by default).
    Retiring waits for the collective: on a GPU the compute stream waits, and for an offloaded
    chunk the host waits for its shard to land. Retiring mid-backward is the end-of-backward
    retirement moved earlier: the gathered gradients were flushed when backward began
    (``ElixirRuntime._begin_backward``), and a retired chunk gets no more gradients in this backward
    (each parameter's gradient arrives once).
    """

    def __init__(self, chunks: list[Chunk], offload: Any,
                 views: Callable[[Chunk], list[tuple[Slot, nn.Parameter]]]) -> None:
        self.chunks = chunks
        self.offload = offload
        self.views = views
        self.valid = {c.index: False for c in chunks}
        """Whether a chunk's gradient shard holds the reduced gradient of this step's backwards."""
        self._grad_targets: dict[int, list[tuple[nn.Parameter, torch.Tensor, int]]] = {}
        """Per chunk, its optimizer views with their slices of the gradient shard (made once)."""
        self.seen: set[int] = set()
        """ids of the parameters that got a gradient on this rank since their shard was last overwritten
        ([Note: unused parameters] in grads.py)."""
        self.reorder()
        self._next_start = 0
        """The next chunk in ``order`` to reduce in this backward."""
        self._next_retire = 0
        """The next chunk in ``order`` to retire; those from it up to ``_next_start`` are in flight."""
        self.retired = 0
        """Reductions retired so far (their sums are in the shards): a count that only grows."""
        self._accumulating: dict[int, bool] = {}
        """Per chunk in flight, whether its reduction adds to the shard."""

    def reorder(self) -> None:
        """The fixed order over the chunks that have trainable parameters now."""
        self.views_changed()
        public = [c for c in self.chunks if not c.private]
        private = [c for c in self.chunks if c.private]
        self.order = [c for c in reversed(public) if c.grad_requiring] + [c for c in private if c.grad_requiring]

    def start_ready(self) -> None:
        """Start reductions in the fixed order while the next chunk in it has all its gradients."""
        while self._next_start < len(self.order) and self.order[self._next_start].grads_complete:
            self._start_next()

    def finish(self) -> None:
        """End of backward: reduce what is left (missing gradients count as zero), retire everything."""
        while self._next_start < len(self.order):
            self._start_next()
        while self._next_retire < self._next_start:
            self._retire()
        self._next_start = self._next_retire = 0

    def forget(self) -> None:
        """Gradients were zeroed: the next backward overwrites the shards rather than adding to them."""
        self.valid = dict.fromkeys(self.valid, False)
        self.seen.clear()

    def _start_next(self) -> None:
        """Start the next reduction; retire the oldest beyond ``REDUCE_BUFFERS`` in flight."""
        chunk = self.order[self._next_start]
        stream = self.offload.copy_stream if chunk.offloaded else None
        accumulate = self._accumulating[chunk.index] = self._accumulates(chunk)
        if accumulate:
            self._clear_zeroed(chunk)
        chunk.start_reduce(stream, accumulate=accumulate)
        self._next_start += 1
        while self._next_start - self._next_retire > REDUCE_BUFFERS:
            self._retire()

    def _retire(self) -> None:
        """Finish the oldest reduction in flight: its shard holds this backward's gradient, its buffers go."""
        chunk = self.order[self._next_retire]
        accumulate = self._accumulating.pop(chunk.index)  # as decided when it started
        chunk.finish_reduce(accumulate=accumulate)
        if not accumulate:
            self.seen -= chunk.param_ids
        self.seen.update(chunk.got_grads)
        self.valid[chunk.index] = True
        for view, grad, _ in self._targets(chunk):
            if view.requires_grad:  # read now: the flags follow the parameters' ([Note: trainable parameters can change])
                view.grad = grad
        if chunk.offloaded:
            self.offload.landed(chunk, complete=not (chunk.pending_grads or chunk.absent_grads))
        chunk.reset_grad_tracking()
        self._next_retire += 1
        self.retired += 1

    def hold(self, chunk: Chunk) -> None:
        """``chunk``'s gradient shard was filled outside a backward (gradients carried into a new plan):
        the optimizer's views see it, and the next backward adds to it."""
        self.valid[chunk.index] = True
        for view, grad, _ in self._targets(chunk):
            if view.requires_grad:
                view.grad = grad

    def _accumulates(self, chunk: Chunk) -> bool:
        """Add to the gradient shard (True) or overwrite it: after zero_grad(set_to_none) it is stale.

        It adds while any view holds a gradient, a frozen one included: a parameter frozen for this
        backward (toggle_optimizer) keeps what it accumulated, as its ``.grad`` would; the backward adds
        zero there. Views without one start from zero ([Note: zeroed by one optimizer])."""
        if not self.valid[chunk.index]:
            return False
        targets = self._targets(chunk)
        if not any(view.requires_grad for view, _, _ in targets):
            return True
        return any(view.grad is not None for view, _, _ in targets)

    def _clear_zeroed(self, chunk: Chunk) -> None:
        """Zero the slices of the views whose gradient was set to None while others of the chunk kept theirs.

        [Note: zeroed by one optimizer]
        The shard adds when any of its views still holds a gradient: two optimizers over the parameters of
        one chunk (a GAN, manual optimization), each calling ``zero_grad()`` after its own step, leave some
        views with a gradient and some without. A view without one starts from zero, as its parameter's
        ``.grad`` would after ``zero_grad(set_to_none=True)``: its slice is cleared before the sum is added
        (after the chunk's offloaded update, which may still read the shard)."""
        zeroed = [(grad, pid) for view, grad, pid in self._targets(chunk) if view.requires_grad and view.grad is None]
        if not zeroed:
            return
        chunk.settle()
        for grad, pid in zeroed:
            grad.zero_()
            self.seen.discard(pid)

    def views_changed(self) -> None:
        """Optimizer views were made: find each chunk's again when next needed."""
        self._grad_targets.clear()

    def _targets(self, chunk: Chunk) -> list[tuple[nn.Parameter, torch.Tensor, int]]:
        """(view, its slice of the gradient shard, id of its parameter) for each of ``chunk``'s views."""
        targets = self._grad_targets.get(chunk.index)
        if targets is None:
            targets = self._grad_targets[chunk.index] = [
                (view, chunk.grad_shard[slice(*chunk.shard_range(slot))], id(slot.param))
                for slot, view in self.views(chunk)]
        return targets
