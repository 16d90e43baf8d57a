"""Gradients from autograd to the shards: arrivals, reductions, trainable parameters, unused ones.

A post-accumulate-grad hook reports a parameter's arrival (protocol.py owns the hook;
``GradientFlow.arrived`` is what it does for gradients): autograd has accumulated the parameter's
whole gradient into ``.grad`` in C++, and once a chunk has all of its gradients its reduction may
start, in the fixed order of ``Reductions`` ([Note: gradients land per chunk] in chunk.py).

[Note: one hook per chunk]
A Python hook per parameter was the last per-parameter Python work in a resident plan's step: the
engine takes the GIL for each (about 1.3 us on these cores) and runs its body (a few calls). On the
launch-bound GPT (host_overhead.py: 292 parameters, one chunk) that was about 850 of the step's
7,400 Python calls; hooking one parameter per chunk instead took ZeRO-2's step from 1.03x to
1.00x DDP's at world size 1 and from 1.11x to 1.04x at world size 2 (means of three paired runs).
DDP's reducer hooks every parameter in C++; Python cannot, so a resident plan learns which
parameter completes each chunk and hooks only that one:
- Learning: every trainable parameter of the chunk is hooked and its arrivals counted, as before.
  The one whose gradient completes the chunk in a backward (autograd runs the same graph in the same
  order each time) becomes its watcher, and the other hooks go at the end of that backward.
- Watching: when the watcher's hook fires, the chunk is complete if every trainable parameter has a
  ``.grad`` (an attribute read each: a check, not a hook). If one has none (a step that used the
  parameters differently), the chunk waits for the end of backward, as an incomplete chunk always
  did, and learns again: correct either way, only the overlap of that one reduction is lost.
- A chunk keeps the watcher it learned for each set of trainable parameters: optimizers toggled in
  turn over a chunk that holds parts of both networks (a small GAN's) switch between two learned
  watchers, hooking nothing again after each set's first backward.
- The parameter whose gradient arrived first in a backward keeps its hook too: a backward begins,
  and queues its end, in the graph task it began in with every hook. (The first watcher to fire
  may be inside a reentrant checkpoint's nested backward, whose end is not the backward's.)
- A backward that fires no hook (one reaching only parameters that are not watchers) queues no
  end of backward. Its gradients are left in ``.grad``, so before anything reads or drops the
  shards (the optimizer step, clipping, ``zero_grad``, a gathered read, the agreement) and before
  the next forward, ``finish_unreported`` looks for them (one attribute read per parameter) and ends
  that backward there. Every rank issues the same reductions in the same order either way: a rank
  that ended it late issues them before its next collective, where the others issued them earlier.
Plans that are not resident keep a hook per parameter: their units' backward calls wait for each
parameter of the unit to release its chunks ([Note: the hook protocol] in protocol.py).

[Note: trainable parameters can change]
Users freeze and unfreeze parameters during training (a backbone unfrozen after some steps, a
layer frozen once it has converged) by setting ``requires_grad``. The chunks, the hook units and
the reductions all track which parameters get gradients, so at the start of every training
iteration ``Trainable.refresh`` compares the flags with those it last saw (one pass over the
parameters) and, when any changed, re-derives that tracking: each chunk's expected gradients and
zero-filled gaps, each unit's backward waits, the reduction order, the hooks of newly trainable
parameters and the ``requires_grad`` of the optimizer's shard views. The layout and the plan stay:
a frozen parameter already has its gradient and master shards (zero gaps until it trains), but a
plan searched for a partly frozen model counted no optimizer state for the frozen part, so a
warning says that memory use may now exceed the plan's estimate. As in a single process, a
parameter unfrozen mid-training is updated only by an optimizer that holds it (built over all
parameters, or given it with ``add_param_group``).

[Note: unused parameters]
In a single process, or under DDP, a parameter that no forward used has ``.grad`` None after
backward, and optimizers skip it: Adam's moments and step count do not move, weight decay does
not apply. The reductions treat a missing gradient as zero (every rank must join every chunk's
reduce-scatter), so before each optimizer step ``GradientFlow.settle_unused`` exchanges one flag
per shard view (did this rank see its gradient since the shard was last overwritten), takes the
maximum over the ranks, and sets the gradient of the views that no rank saw back to None. A
parameter used on some ranks only keeps its gradient (the others contributed zero), exactly as
DDP averages it. The exchange is one small all-reduce per optimizer step, which also compares what
the ranks gathered ([Note: silent divergence] in collectives.py); on a GPU a rank that saw every
gradient reads it only at the next step ([Note: reading the agreement later]).

[Note: reading the agreement later]
Reading the all-reduce's result on the host waits for the device to finish the backward, so the
loop's host work between steps (the optimizer's launches, Lightning's hooks and logging, the next
batch) then runs while the device idles; DDP without find_unused_parameters never waits there. The
result decides something on this rank only where it saw no gradient of some parameter (did any
rank?). Where it saw every one, it only checks what the ranks did (the signatures of [Note: silent
divergence], the hyperparameters), so on a GPU it is read at the next optimizer step, when the
device has long finished it, or before a checkpoint is written, a plan is switched or the run ends
(``ElixirRuntime.read_agreement``). Every rank issues the same all-reduce either way; a divergence
is then reported one step later, before anything is saved. A recovery from out of memory drops it
with the group it ran on (``forget_agreement``). With it forced on, the catalog, resume, recovery
and plan-switch suites pass on the CPU as they do without it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Optional

import torch
import torch.nn as nn

from lightning_elixir.devices import to_device
from lightning_elixir.runtime import collectives
from lightning_elixir.runtime.chunk import Chunk
from lightning_elixir.runtime.collectives import Group
from lightning_elixir.runtime.reductions import Reductions
from lightning_elixir.runtime.table import ChunkTable

log = logging.getLogger(__name__)


class GradientFlow:
    """One runtime's gradients: arrivals per chunk, the reductions, the shards the optimizer reads."""

    def __init__(self, table: ChunkTable, offload: Any) -> None:
        self.table = table
        self.offload = offload
        self.reductions = Reductions(table.chunks, offload, table.chunk_views)
        self.hyperparameters_differ = False
        """Whether an optimizer step found the optimizer's hyperparameters differing between ranks."""
        self.read_later = False
        """Whether an agreement this rank has nothing to decide from is read at the next step
        ([Note: reading the agreement later]); set where reading it waits for a device."""
        self._unread: Optional[tuple[collectives.Agreement, Any]] = None
        self._elsewhere: Optional[frozenset[int]] = None
        self.finish_unreported: Callable[[], None] = _nothing
        """Ends a backward whose gradients no hook reported ([Note: one hook per chunk]); set by the protocol."""

    def arrived(self, chunk: Chunk, pid: int) -> None:
        """A parameter of ``chunk`` has its gradient: start the reductions that are ready now."""
        pending = chunk.pending_grads
        if pid == chunk.watcher:  # it stands for the chunk ([Note: one hook per chunk])
            if not chunk.grads_all_here():
                chunk.watch_missed = True
                return
            pending.clear()
        else:
            pending.discard(pid)
            if pending:
                return
            chunk.last_arrival = pid
        self.reductions.start_ready()

    def absent(self, chunk: Chunk, pid: int) -> None:
        """A parameter of ``chunk`` gets no gradient in this backward: count it as arrived (zero)."""
        if pid in chunk.pending_grads:
            chunk.absent_grads.add(pid)
            self.arrived(chunk, pid)

    def finish(self) -> None:
        """End of backward: reduce what is left (missing gradients count as zero)."""
        self.reductions.finish()

    def valid(self, chunk: Chunk) -> bool:
        """Whether ``chunk``'s gradient shard holds this step's reduced gradient."""
        return self.reductions.valid[chunk.index]

    def shards(self) -> list[torch.Tensor]:
        """This rank's gradient shards, one per chunk that has trainable parameters."""
        self.finish_unreported()
        return [c.grad_shard for c in self.table.chunks if c.grad_requiring and self.reductions.valid[c.index]]

    def forget(self) -> None:
        """Gradients were zeroed: the next backward overwrites the shards; the views' gradients go."""
        self.finish_unreported()
        self.reductions.forget()
        for view in self.table.views.values():
            view.grad = None

    def forget_grad(self, param: nn.Parameter) -> None:
        """``param.grad = None`` for one parameter: its part of the gradient shard reads as zero."""
        self.finish_unreported()
        chunk, slot = self.table.where(param)
        begin, end = chunk.shard_range(slot)
        chunk.settle()
        chunk.grad_shard[begin:end].zero_()
        view = self.table.views.get(id(param))
        if view is not None:
            view.grad = None

    def restore_grad(self, param: nn.Parameter) -> None:
        """``param`` has a gradient again (assigned after ``forget_grad``): its view sees its slice of the shard."""
        view = self.table.views.get(id(param))
        if view is not None and view.grad is None and view.requires_grad:
            chunk, slot = self.table.where(param)
            view.grad = chunk.grad_shard[slice(*chunk.shard_range(slot))]
        self.reductions.seen.add(id(param))

    def start_assigned(self, chunk: Chunk) -> None:
        """``.grad`` is assigned to a parameter of ``chunk`` before any backward gave the chunk gradients (a
        zeroth-order estimate, gradients from ``torch.autograd.grad``): its shard starts at zero with no view
        holding a gradient, as a plain parameter's ``.grad`` starts at None; a later backward adds to it."""
        self.finish_unreported()
        chunk.settle()
        chunk.grad_shard.zero_()
        self.reductions.valid[chunk.index] = True
        for _, view in self.table.chunk_views(chunk):
            view.grad = None

    def rebuild(self) -> None:
        """The table's chunks changed (the module was detached from them)."""
        self.reductions = Reductions(self.table.chunks, self.offload, self.table.chunk_views)
        self._elsewhere = None

    @property
    def elsewhere(self) -> frozenset[int]:
        """ids of the parameters whose shard views are held elsewhere ([Note: shard views held elsewhere])."""
        if self._elsewhere is None:
            self._elsewhere = frozenset(id(s.param) for c in self.table.chunks for s in c.slots if c.elsewhere(s))
        return self._elsewhere

    def settle_unused(self, optimizer: Any, group: Group, device: torch.device) -> None:
        """Set to None the gradients of ``optimizer``'s shard views whose parameter no rank used
        ([Note: unused parameters]).

        The same all-reduce compares what the ranks gathered ([Note: silent divergence] in
        collectives.py) and the optimizer's hyperparameters: an LR scheduler stepped on a metric each
        rank computed alone (ReduceLROnPlateau on an unsynced loss) gives each rank its own lr, and each
        rank would update its shard with it. Under DDP the replicas drift apart instead; neither is
        what the user meant, so a warning says so, once."""
        self.read_agreement()
        stepped = {id(q) for g in optimizer.param_groups for q in g["params"]}
        pairs = [(pid, view) for pid, view in self.table.views.items() if view.requires_grad and id(view) in stepped]
        seen = self.reductions.seen
        hyper = _hyperparameter_print(optimizer)
        flags = [float(pid in seen) for pid, _ in pairs]
        local = torch.tensor(flags + [hyper, -hyper], dtype=torch.float32)
        if group.world_size > 1:  # with one rank nothing is reduced: the values stay on the host, no copies
            local = to_device(local, device)
        agreement = collectives.Agreement.start(local, group)
        if self.read_later and all(flags):  # used here: used somewhere, so no gradient goes back to None
            self._unread = (agreement, optimizer)
            return
        self._settle(agreement, optimizer, pairs)

    def read_agreement(self) -> None:
        """Read and check the agreement left unread at the last optimizer step, if any
        ([Note: reading the agreement later]): raises ``RankDivergenceError`` if the ranks diverged."""
        self.finish_unreported()
        if self._unread is not None:
            (agreement, optimizer), self._unread = self._unread, None
            self._settle(agreement, optimizer, [])

    def forget_agreement(self) -> None:
        """Drop the agreement left unread: its all-reduce ran on a group that was given up."""
        self._unread = None

    def _settle(self, agreement: collectives.Agreement, optimizer: Any, pairs: list[tuple[int, Any]]) -> None:
        *used, high, neg_low = agreement.values()
        if high != -neg_low and not self.hyperparameters_differ:
            self.hyperparameters_differ = True
            groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
            log.warning("rank %d: the optimizer's hyperparameters differ between ranks (here: %s), so each rank "
                        "updates its shard with its own. An LR scheduler that reads a metric (ReduceLROnPlateau) "
                        "needs one every rank agrees on: log it with self.log(..., sync_dist=True).",
                        agreement.group.rank, groups)
        for (_, view), anywhere in zip(pairs, used):
            if not anywhere:
                view.grad = None

    def hide_elsewhere(self, optimizer: Any) -> list[tuple[nn.Parameter, torch.Tensor]]:
        """Hide from ``optimizer``'s step the (empty) gradients of its views held elsewhere that have their
        state already ([Note: shard views held elsewhere] in optim.py); ``OffloadEngine.restore`` puts them
        back, with the offloaded chunks' gradients the step's launch hid.

        They keep their gradient between steps: ``_accumulates`` in reductions.py reads zero_grad's
        ``None`` on them, also where a rank holds nothing else of a chunk."""
        views, state = self.table.views, optimizer.state
        return self.offload.hide(view for view in (views.get(pid) for pid in self.elsewhere)
                                 if view is not None and state.get(view))


def _nothing() -> None:
    pass


def _hyperparameter_print(optimizer: Any) -> float:
    """A fingerprint of the param groups' scalar hyperparameters (lr, betas, ...)."""
    return collectives.fingerprint([sorted((k, v) for k, v in group.items() if isinstance(v, (bool, int, float, tuple)))
                                    for group in optimizer.param_groups])


class Trainable:
    """The ``requires_grad`` flags of a table's parameters, and the hooks that follow them.

    Args:
        table: the chunks and their shard views.
        make_hook: the post-accumulate-grad hook of one parameter, given its chunk and id.
        on_change: called when the flags changed, after the chunks took them (the protocol re-derives
            what its units wait for, the gradient flow its order).
    """

    def __init__(self, table: ChunkTable, make_hook: Callable[[Chunk, int], Callable],
                 on_change: Callable[[], None]) -> None:
        self.table = table
        self.make_hook = make_hook
        self.on_change = on_change
        self.by_id: dict[int, tuple[nn.Parameter, Chunk]] = {id(s.param): (s.param, c) for c in table.chunks
                                                              for s in c.slots}
        self.flags = self._flags()
        self._initially = self.flags
        self._hooks: dict[int, Any] = {}
        self._warned = False
        self.watching = False
        """Whether chunks keep one hook each once learned ([Note: one hook per chunk]); set for resident plans."""
        self.first_arrival: Optional[int] = None
        """id of the parameter whose hook fired first in a backward: its hook is kept, so that a backward
        begins (and its end is queued) in the same graph task as with every hook."""
        self._trainable = self._trainable_params()
        self.registered = 0
        """Hooks registered so far."""
        self.hook_new()

    def _trainable_params(self) -> list[nn.Parameter]:
        return [p for (p, _), trainable in zip(self.by_id.values(), self.flags) if trainable]

    def _flags(self) -> list[bool]:
        with torch._C.DisableTorchFunctionSubclass():  # an attribute read: no ChunkedParameter dispatch
            return [p.requires_grad for p, _ in self.by_id.values()]

    def hook_new(self) -> None:
        """A post-accumulate-grad hook on every trainable parameter that has none yet (of a chunk that has
        learned its watcher, on the watcher and the first to arrive)."""
        for pid, (p, chunk) in self.by_id.items():
            if (p.requires_grad and pid not in self._hooks
                    and (chunk.watcher is None or pid in (chunk.watcher, self.first_arrival))):
                self._hook(p, chunk)

    def _hook(self, param: nn.Parameter, chunk: Chunk) -> None:
        self._hooks[id(param)] = param.register_post_accumulate_grad_hook(self.make_hook(chunk, id(param)))
        self.registered += 1

    def watch_learned(self) -> None:
        """End of a backward: a chunk that learned which gradient completes it keeps that one hook; one
        whose watcher reported early gets every hook back ([Note: one hook per chunk])."""
        for chunk in self.table.chunks:
            if chunk.watch_missed:
                chunk.learned.pop(chunk.learned_for, None)
                chunk.forget_watcher()
                for slot in chunk.trainable_slots:
                    pid = id(slot.param)
                    if pid not in self._hooks:
                        self._hook(slot.param, chunk)
            elif chunk.watcher is None and chunk.last_arrival is not None:
                chunk.learn_watcher(chunk.last_arrival)
                for slot in chunk.trainable_slots:
                    pid = id(slot.param)
                    if pid not in (chunk.watcher, self.first_arrival) and pid in self._hooks:
                        self._hooks.pop(pid).remove()

    @property
    def params(self) -> list[nn.Parameter]:
        """The trainable parameters, as of the last ``refresh``."""
        return self._trainable

    @property
    def hooked(self) -> int:
        """How many parameters have a hook now."""
        return len(self._hooks)

    def unreported(self) -> bool:
        """Whether a trainable parameter holds a gradient that no reduction took yet."""
        with torch._C.DisableTorchFunctionSubclass():  # an attribute read: no ChunkedParameter dispatch
            return any(p.grad is not None for p in self._trainable)

    def trainable_ids(self, param_ids: frozenset[int]) -> frozenset[int]:
        """Those of ``param_ids`` that are trainable now and live in public chunks."""
        return frozenset(pid for pid in param_ids if pid in self.by_id and self.by_id[pid][0].requires_grad
                         and not self.by_id[pid][1].private)

    def refresh(self) -> bool:
        """Follow ``requires_grad`` changes since the last call; return whether any changed."""
        flags = self._flags()
        if flags == self.flags:
            return False
        self.flags = flags
        self._trainable = self._trainable_params()
        for chunk in self.table.chunks:
            chunk.track_trainable()  # a chunk whose trainable parameters changed learns its watcher again
        self.on_change()
        self.hook_new()
        for pid, view in self.table.views.items():
            view.requires_grad_(self.by_id[pid][0].requires_grad)
        if not self._warned and any(now and not before for now, before in zip(flags, self._initially)):
            self._warned = True
            log.warning("parameters that were frozen when the plan was made now train: the plan counted no "
                        "gradients or optimizer state for them, so memory use may exceed its estimate")
        return True

    def remove_hooks(self) -> None:
        for handle in self._hooks.values():
            handle.remove()
        self._hooks.clear()
        for chunk in self.table.chunks:
            chunk.forget_watcher(everything=True)
