"""The step protocol: the hooks that drive gathering, pinning, releasing and gradient reduction.

[Note: the step protocol]
The runtime is a stack of layers, each of which knows only those below it:

    ElixirRuntime   runtime.py    composes the layers; what the strategy and the optimizer call
    StepProtocol    protocol.py   hooks per unit and per parameter, the step's phase, residency
    AccessGuard     access.py     reads of parameters and gradients that the hooks do not cover
    GradientFlow    grads.py      gradient arrivals, reductions, trainable and unused parameters
    ChunkCache      cache.py      gathered public chunks: furthest-next-use eviction, prefetch
    ChunkTable      table.py      the chunks, the hook units, the optimizer's shard views
    Chunk           chunk.py      one chunk's storage, gathers, reductions (states.py: its states)

The protocol is the only layer that hooks the module; it calls down, never up, and nothing below
it calls back into the runtime.

[Note: host cost]
On a GPU the host issues kernels while the device runs them; every Python call on the hot path is
paid in device idle time once the host falls behind. On one H200 a GPT-2 medium step under the
first version of this runtime spent 62 ms of host time in hooks, as long as DDP's whole step: a
pre-forward hook per module holding parameters (170 us each), a post-accumulate-grad hook per
parameter that copied the gradient itself (87 us each) and a ``__torch_function__`` call on every
operator that touched a parameter. What a step costs the host now:

- per hook unit ([Note: hook units] in units.py), not per module: a transformer block is hooked
  once. Its pre-forward makes its parameters plain ``nn.Parameter``s (a class swap, 45 ns each) so
  that its operators run with no Python in between; its post-forward makes them report reads again
  (``ChunkedParameter``), so reads anywhere else are still served or refused
  ([Note: reading outside the hooks] in access.py);
- per chunk, in a resident plan, one post-accumulate-grad hook on the parameter learned to complete
  it ([Note: one hook per chunk] in grads.py); otherwise one per trainable parameter, which only
  counts arrivals. The gradients move to their chunk in one multi-tensor copy per chunk
  ([Note: gradients land per chunk]);
- per chunk, its gather and its reduction;
- no ``record_function`` unless a profiler runs (hotpath.py).

[Note: resident plans]
A plan whose chunks all stay gathered (nothing is offloaded, and every public chunk has a block or
there is one rank, whose shards are its chunks: [Note: a world of one]) needs no pins, no eviction and no
backward hooks: each chunk is gathered once per step, at the start of the first iteration after
the optimizer step (or right after it, into the blocks the views already point at), and kept. Its
units' hooks only swap parameter classes. ``plan.stays_gathered`` decides, and the search's
simulation and memory model use the same rule.

[Note: the hook protocol]
In a plan that is not resident, every hook unit gets:
- a forward pre-hook: gather its chunks and pin them; when autograd will run, open a
  ``BackwardCall`` for this call and wrap its tensor inputs in ``_PostBackward`` so that computing
  their gradients reports to that call;
- a forward hook: unpin; register tensor hooks on its outputs whose first firing is the call's
  pre-backward (gather and pin again for backward).
Every trainable parameter gets a post-accumulate-grad hook (registered by ``Trainable``, also
for parameters unfrozen later). A call's backward pins are dropped once its input gradients exist
and every trainable parameter of the unit has its gradient; a final autograd callback flushes the
rest. Bookkeeping is per call, not per unit, so a unit may run several times in one step (a
shared layer, a model called on two views): each call pins for its own backward, and a parameter's
gradient (accumulated by autograd over all calls) releases them all.
Forward calls that happen inside backward (activation-checkpoint recomputation) gather, pin and
unpin. Under non-reentrant checkpointing the unit still has the open call of its original forward,
whose backward this is, and that call keeps the bookkeeping. Under reentrant checkpointing
(``use_reentrant=True``) the original forward ran without grad and opened no call; the recomputed
forward is then differentiated by a backward of its own, nested in this one, so it opens a call
like any forward: without it the chunk could be released between the recomputation and that
nested backward, which reads the parameters it saved.

[Note: backward through a backward]
A graph may be differentiated more than once. With ``retain_graph=True`` a later backward reaches
the units' outputs again: each call's pre-backward remembers the backward it last fired in
(``StepProtocol.micro_batches``) and reopens the call there. ``torch.autograd.grad(..., create_graph=True)`` (a
penalty on gradients) builds a graph whose nodes read the parameters when a later backward
differentiates it, and they run before any gradient reaches the units' outputs, where the
pre-backward hooks would gather them. So a backward that creates a graph keeps every chunk it pins
pinned until a backward that creates none has finished, or the step ends
(``StepProtocol.release_graph_pins``): the parameters stay gathered in between, as the math needs.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

import torch
import torch.nn as nn
from torch.autograd import Variable
from torch.utils._pytree import tree_flatten, tree_unflatten

from lightning_elixir.runtime import layout
from lightning_elixir.runtime.access import AccessGuard, in_backward
from lightning_elixir.runtime.cache import ChunkCache
from lightning_elixir.runtime.chunk import Chunk
from lightning_elixir.runtime.collectives import Group
from lightning_elixir.runtime.grads import GradientFlow, Trainable
from lightning_elixir.runtime.hotpath import eager, label
from lightning_elixir.runtime.params import check_reads
from lightning_elixir.runtime.states import ChunkState
from lightning_elixir.runtime.table import ChunkTable, UnitState
from lightning_elixir.runtime.timeline import TimelineRecorder
from lightning_elixir.units import hook_units


class Phase(enum.Enum):
    """Where the step is, as the protocol sees it."""

    IDLE = "idle"
    """Between steps, or after a backward: nothing is running."""
    FORWARD = "forward"
    """An iteration has begun (a forward with or without grad, and the code around it)."""
    BACKWARD = "backward"
    """A backward is running; its end is queued on the autograd engine."""


class Wait(enum.Enum):
    """What a unit call's backward waits for besides its parameters' gradients."""

    INPUTS = "the gradients of the unit's inputs"


WaitKey = Union[int, Wait]
"""A trainable parameter's id, or a Wait."""


@dataclass(eq=False)
class BackwardCall:
    """One forward call of a unit under autograd, until its backward is done."""

    unit: UnitState
    pending: set[WaitKey]
    pinned: bool = False
    hooked: bool = False
    """Whether its outputs carry the pre-backward hooks (registered once, by the forward hook)."""
    has_inputs: bool = False
    """Whether its inputs report their gradients (``Wait.INPUTS``)."""


class _PostBackward(torch.autograd.Function):
    """Identity on the unit's inputs whose backward reports that the unit's backward is done."""

    @staticmethod
    def forward(ctx, on_backward: Callable[[], None], *inputs: torch.Tensor):  # type: ignore[override]
        ctx.on_backward = on_backward
        return inputs

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):  # type: ignore[override]
        ctx.on_backward()
        return (None,) + grads


class StepProtocol:
    """The hooks of one runtime's module and what they do ([Note: the step protocol]).

    Args:
        module: the module whose units are hooked.
        table, cache, guard, grads: the layers below.
        group: the data-parallel group (buffers are broadcast over it).
        broadcast_buffers: rank 0's buffers before each forward that follows a training forward.
    """

    def __init__(self, module: nn.Module, table: ChunkTable, cache: ChunkCache, guard: AccessGuard,
                 grads: GradientFlow, group: Group, broadcast_buffers: bool) -> None:
        self.module = module
        self.table, self.cache, self.guard, self.grads = table, cache, guard, grads
        self.group = group
        self.phase = Phase.IDLE
        self.resident = False
        """Whether every chunk stays gathered ([Note: resident plans]); set by ``install``."""
        self.micro_batches = 0
        """Backwards finished."""
        self.iterations_in_step = 0
        self._evaluated = False  # a no-grad iteration ran since the last training one
        """Training iterations since the last optimizer step."""
        self.recorder: Optional[TimelineRecorder] = None
        self._buffer_slots = _buffer_slots(module)
        self.broadcast_buffers = broadcast_buffers
        self._sync_buffers_next = broadcast_buffers
        self.accumulating = False
        """Inside the strategy's ``block_backward_sync`` (a micro-batch that accumulates): as under
        DDP's ``no_sync``, the next forward does not broadcast buffers."""
        self._creating_graph = False
        """Whether the backward running now was asked for ``create_graph``."""
        self._recomputing: list[UnitState] = []
        """Units whose forward runs inside backward (recomputation) and has not ended."""
        self._graph_pins: list[tuple[int, ...]] = []
        """Chunks pinned for a later backward through a graph this one builds (see release_graph_pins)."""
        self._handles: list[Any] = []
        self.trainable = Trainable(table, self._param_hook, self._trainable_changed)
        self.held_before = self.trainable.unreported()
        """Whether trainable parameters held gradients when the runtime took them (a backward of the user's
        own before fit, the last step of a fit under another strategy): until they are reduced into the
        shards as an unreported backward's are ([Note: gradients held before the runtime])."""
        grads.finish_unreported = self.finish_unreported
        table.set_units(self._units(module))

    def _units(self, module: nn.Module) -> list[UnitState]:
        named = dict(module.named_parameters())
        states = []
        for unit in hook_units(module):
            params = tuple(named[name] for name in unit.params)
            chunks = tuple(dict.fromkeys(self.table.where(p)[0] for p in params))
            pids = frozenset(id(p) for p in params)
            states.append(UnitState(unit.name or "<root>", module.get_submodule(unit.name), params, chunks,
                                    self.table.public_chunk_ids(params), pids, self.trainable.trainable_ids(pids)))
        return states

    # ---- installing -------------------------------------------------------------------------------

    def install(self, resident: bool) -> None:
        """Register the root's and every unit's hooks; ``resident``: see [Note: resident plans]."""
        self.resident = resident
        self.trainable.watching = resident  # [Note: one hook per chunk] in grads.py
        root = self.module
        self._handles.append(root.register_forward_pre_hook(eager(lambda mod, args: self.root_pre_forward()),
                                                            prepend=True))
        self._handles.append(root.register_forward_hook(eager(lambda mod, args, out: self.root_post_forward()),
                                                        always_call=True))
        for unit in self.table.units:
            unit.handles.append(unit.module.register_forward_pre_hook(eager(self._pre_forward_hook(unit)),
                                                                      with_kwargs=True))
            unit.handles.append(unit.module.register_forward_hook(eager(self._post_forward_hook(unit)),
                                                                  always_call=True))

    def remove_hooks(self) -> None:
        for unit in self.table.units:
            for handle in unit.handles:
                handle.remove()
            unit.handles = []
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.trainable.remove_hooks()

    def _trainable_changed(self) -> None:
        for unit in self.table.units:
            unit.trainable = self.trainable.trainable_ids(unit.param_ids)
        self.grads.reductions.reorder()

    # ---- iterations -------------------------------------------------------------------------------

    def root_pre_forward(self) -> None:
        """The root module's forward starts; outside a strategy step it begins an iteration."""
        self.guard.forward_depth += 1
        if self.guard.forward_depth == 1 and not self.guard.stepping:
            self.begin_iteration()

    def root_post_forward(self) -> None:
        self.guard.forward_depth -= 1

    def begin_iteration(self) -> None:
        """A forward pass starts: gather what the plan keeps, replay the recorded order, sync buffers."""
        if in_backward():
            return
        training = torch.is_grad_enabled()
        if not training and self.phase is not Phase.BACKWARD:
            self.end_iteration()  # a no-grad iteration holds nothing past its own end
        if training and self._evaluated and self.iterations_in_step == 0 and not self.resident:
            self.cache.invalidate()  # nor into the next step: it starts from an empty cache, as planned
        self._evaluated = not training
        if training:
            self.finish_unreported()
            self.trainable.refresh()
        if self.phase is not Phase.BACKWARD:
            self.phase = Phase.FORWARD
        if self.resident:
            self.cache.gather_all()
        else:
            self.cache.begin_iteration(training)
        for chunk in self.table.private:
            if chunk.state is ChunkState.GATHERING:
                chunk.finish_gather()
            elif chunk.state is ChunkState.FREE:
                self.table.gather_private(chunk)
        if self.recorder is not None:
            self.recorder.begin_iteration(training, starts_step=self.iterations_in_step == 0)
        self.iterations_in_step += training
        self._sync_buffers()

    def end_iteration(self) -> None:
        """A step without backward is over (evaluation): let go of what reads outside the hooks held."""
        if self.phase is not Phase.BACKWARD:
            self.guard.release_sticky()
            self.cache.shrink()
            self.phase = Phase.IDLE

    def _sync_buffers(self) -> None:
        """DDP's default: rank 0's buffers before a forward that follows a training forward that
        synchronised gradients (not one inside ``no_sync``). The buffers are read from their modules
        each time, as DDP does: a module may assign new ones (SWA's BatchNorm reset)."""
        if self.broadcast_buffers and self._sync_buffers_next and self._buffer_slots:
            buffers = [b for b in (m._buffers.get(name) for m, name in self._buffer_slots) if b is not None]
            with label("Elixir::broadcast_buffers"):
                layout.broadcast_buffers(buffers, self.group)
        self._sync_buffers_next = torch.is_grad_enabled() and not self.accumulating

    def after_step(self) -> None:
        """The optimizer has updated the masters and the shards: renew what is gathered."""
        self.iterations_in_step = 0
        if not self.resident:
            self.release_all()
            return
        self.release_graph_pins()
        self.guard.release_sticky()
        if not all(c.aliased for c in self.table.chunks):  # else nothing to gather: the shard is the chunk
            self.cache.regather_all()
            for chunk in self.table.private:
                if chunk.state is ChunkState.GATHERING:
                    chunk.finish_gather()
                if chunk.state is ChunkState.HOLD:
                    chunk.regather()
                    self.table.private_gathers += 1

    def release_all(self) -> None:
        """Free every gathered block (e.g. before a state-dict load, or at teardown), keeping writes."""
        self._abandon_backward()
        self.release_graph_pins()
        self.guard.release_sticky()
        self.cache.invalidate()
        for chunk in self.table.private:
            if chunk.state is ChunkState.GATHERING:
                chunk.finish_gather()
            if chunk.state is not ChunkState.FREE:
                chunk.release()

    # ---- unit hooks -------------------------------------------------------------------------------

    def _pre_forward_hook(self, unit: UnitState) -> Callable:
        def hook(mod: nn.Module, args: tuple, kwargs: dict) -> Optional[tuple[tuple, dict]]:
            with label("Elixir::pre_forward"):
                return self._enter(unit, args, kwargs)
        return hook

    def _post_forward_hook(self, unit: UnitState) -> Callable:
        def hook(mod: nn.Module, args: tuple, output: Any) -> None:
            with label("Elixir::post_forward"):
                self._exit(unit, output)
        return hook

    def _enter(self, unit: UnitState, args: tuple, kwargs: dict) -> Optional[tuple[tuple, dict]]:
        recompute = in_backward()
        if self.resident:  # gathered at the step's start; wait for this unit's chunks now
            for chunk in unit.chunks:
                if chunk.state is ChunkState.GATHERING:
                    chunk.finish_gather()
        elif unit.public_ids:
            self.cache.acquire(unit.public_ids)
        if recompute:
            self._recomputing.append(unit)
        if self.recorder is not None and unit.public_ids:
            self.recorder.acquired("recompute" if recompute else "forward", unit.name)
        unit.active += 1
        if unit.active == 1 and unit.gathered:
            check_reads(unit.params, False)  # its operators run with no Python in between
        if self.resident or not unit.public_ids or not torch.is_grad_enabled():
            return None
        if recompute and unit.calls:  # recomputation for the call whose backward this is
            return None
        call = BackwardCall(unit, set(unit.trainable))
        unit.calls.append(call)
        wrapped = self._wrap_inputs(call, args, kwargs)
        call.has_inputs = wrapped is not None
        return wrapped

    def _exit(self, unit: UnitState, output: Any) -> None:
        if not unit.active:
            return  # the pre-hook failed (the forward hook runs even then)
        if in_backward():
            if unit not in self._recomputing:
                return  # already dropped by _drop_recomputation
            self._recomputing.remove(unit)
        self._leave(unit)
        if not torch.is_grad_enabled():
            return
        if not self.resident and unit.public_ids and unit.calls and not unit.calls[-1].hooked:
            call = unit.calls[-1]
            call.hooked = True
            self._hook_pre_backward(output, lambda: self._before_call_backward(call))
        elif self.resident and self.recorder is not None and unit.public_ids:  # positions of a recorded step
            self._hook_pre_backward(output, lambda: self.recorder and self.recorder.acquired("backward", unit.name))

    def _leave(self, unit: UnitState) -> None:
        """One forward call of ``unit`` ends (or its recomputation was dropped)."""
        unit.active -= 1
        if unit.active == 0:
            check_reads(unit.params, True)
        if unit.public_ids and not self.resident:
            self.cache.release_pins(unit.public_ids)

    def _drop_recomputation(self) -> None:
        """Recomputation under activation checkpointing may stop early, skipping forward hooks.

        Once any backward event arrives, recomputation is over and its pins can go: each unit's
        own backward pins its chunks again before it runs.
        """
        while self._recomputing:
            self._leave(self._recomputing.pop())

    def _wrap_inputs(self, call: BackwardCall, args: tuple, kwargs: dict) -> Optional[tuple]:
        if not kwargs and all(type(a) is torch.Tensor for a in args):  # ``block(x)``: no pytree walk
            flat, spec = list(args), None
        else:
            flat, spec = tree_flatten((args, kwargs))
        positions = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not positions:
            return None
        call.pending.add(Wait.INPUTS)
        wrapped = _PostBackward.apply(lambda: self._call_event(call, Wait.INPUTS), *(flat[i] for i in positions))
        for i, t in zip(positions, wrapped):
            flat[i] = t
        return (tuple(flat), kwargs) if spec is None else tree_unflatten(flat, spec)

    def _hook_pre_backward(self, output: Any, fire: Callable[[], Any]) -> None:
        """``fire()`` once per backward, when the first gradient reaches any of ``output``'s tensors.

        [Note: outputs written in place]
        A tensor hook belongs to the node that made the tensor when it was registered. Code after the
        module may write into its output in place (wav2vec2's SpecAugment sets masked frames to a learned
        embedding): a plain tensor keeps its node in the graph, below the write's, and the hook fires as
        before. A view does not: writing into it rewrites its base's history (the write's node takes the
        base's place) and the view's own node leaves the graph, with its hook. ``nn.Linear`` on a contiguous
        3-D input returns such a view (of its 2-D matmul), so its weight's chunk was never gathered for its
        backward. The base's node stays in the graph below the write, so a view's base is hooked as well:
        in an unwritten graph its gradient arrives after the view's, and the hook fires only once.
        """
        flat = [output] if type(output) is torch.Tensor else tree_flatten(output)[0]
        tensors = [t for t in flat if isinstance(t, torch.Tensor) and t.requires_grad]
        if not tensors:
            return
        fired = [-1]

        def hook(grad: torch.Tensor) -> None:
            if fired[0] != self.micro_batches:  # the first of its outputs' gradients in this backward
                fired[0] = self.micro_batches
                with label("Elixir::pre_backward"):
                    fire()

        for t in tensors:
            t.register_hook(hook)
            base = t._base if t._is_view() else None
            if base is not None and base.grad_fn is not None:  # [Note: outputs written in place]
                base.register_hook(hook)

    # ---- backward ---------------------------------------------------------------------------------

    def _before_call_backward(self, call: BackwardCall) -> None:
        """The first gradient reached one forward call's outputs: pin its chunks for its backward."""
        self._backward_event()
        unit = call.unit
        if call not in unit.calls:  # a graph differentiated again (retain_graph, create_graph): reopen
            call.pending = set(unit.trainable) | ({Wait.INPUTS} if call.has_inputs else set())
            call.pinned = False
            unit.calls.append(call)
        self.cache.acquire(unit.public_ids)
        if self._creating_graph:  # the graph this backward builds reads these parameters in a later one
            self.cache.acquire(unit.public_ids)
            self._graph_pins.append(unit.public_ids)
        if self.recorder is not None:
            self.recorder.acquired("backward", unit.name)
        call.pinned = True
        if not call.pending:  # nothing to wait for: hold until the end of backward
            call.pending.add(Wait.INPUTS)

    def _call_event(self, call: BackwardCall, key: WaitKey) -> None:
        """One thing a call's backward waits for has happened; unpin once nothing is left."""
        self._backward_event()
        call.pending.discard(key)
        if key is Wait.INPUTS and call.pending and call.unit.calls == [call]:
            self._declare_absent(call)
        if call.pending or not call.pinned:
            return
        call.pinned = False
        self.cache.release_pins(call.unit.public_ids)
        call.unit.calls.remove(call)

    def _declare_absent(self, call: BackwardCall) -> None:
        """The unit's last open call has its input gradients: parameters of the unit that got none are unused.

        [Note: parameters a rank did not use]
        A unit may run only some of its modules on a rank (a mixture-of-experts block whose tokens
        here chose no token for an expert), and those parameters get no gradient in this backward.
        Waiting for them would hold the unit's chunks, and the reductions behind them in the fixed
        order, until the end of backward on this rank only, while the other ranks reduce them at
        once: the ranks would interleave reductions and gathers differently and their collectives
        would no longer pair. So when the unit's inputs have their gradients, its parameters that
        have none count as arrived with a zero gradient: the unit's backward ends at the same point
        on every rank. Autograd accumulates a leaf's gradient as soon as it is computed (its
        accumulation has the highest priority in the engine's queue), so a parameter the unit used
        has arrived by then; for a unit called several times, only its last open call decides.
        A parameter read outside the unit's forward in this step (an L2 penalty over
        ``self.parameters()`` before the forward, a weight-norm pre-hook, ``functional_call`` over
        the module's own parameters) is the exception: its gradient sums a contribution from an
        operator autograd runs later, so it keeps waiting. Every rank runs the same step code, so
        such reads, and the wait, are the same on every rank.
        Unused here, the parameter still counts as unused for the optimizer only where no rank used
        it ([Note: unused parameters] in grads.py).
        """
        read_outside = self.guard.read_outside
        for pid in [k for k in call.pending if isinstance(k, int) and k not in read_outside]:
            call.pending.discard(pid)
            self.grads.absent(self.trainable.by_id[pid][1], pid)

    def _param_hook(self, chunk: Chunk, pid: int) -> Callable[[torch.Tensor], None]:
        """The post-accumulate-grad hook of one trainable parameter: count it, release what waited for it."""
        owner = self.table.owner_of
        grads = self.grads

        def hook(param: torch.Tensor) -> None:
            with label("Elixir::post_accumulate_grad"):
                if self.phase is not Phase.BACKWARD:
                    self.trainable.first_arrival = pid  # its hook stays: it begins backward where it did
                self._backward_event()
                if not self.resident:  # a resident plan opens no backward calls
                    unit = owner(pid)
                    if unit is not None and unit.calls and pid in unit.trainable:
                        for call in list(unit.calls):
                            self._call_event(call, pid)
                grads.arrived(chunk, pid)

        return hook

    def _backward_event(self) -> None:
        """Any event of a backward: it has begun (queue its end), and recomputation is over."""
        if self._recomputing:
            self._drop_recomputation()
        if self.phase is not Phase.BACKWARD:
            self._begin_backward()

    def _begin_backward(self) -> None:
        """The first event of a backward: queue its end, and keep changes to gathered gradients first.

        In-place changes to gradients gathered before this backward (``AccessGuard.flush_grads``)
        belong in the shards before its reductions, which may finish during backward, write or add
        to them ([Note: reductions in flight] in reductions.py).
        """
        self.phase = Phase.BACKWARD
        self._creating_graph = torch.is_grad_enabled()  # the engine's grad mode is create_graph's
        self.guard.flush_grads()
        Variable._execution_engine.queue_callback(self._finish_backward)

    def _finish_backward(self) -> None:
        """End of backward: reduce what is left (missing gradients count as zero), publish shards."""
        with label("Elixir::finish_backward"):
            self.phase = Phase.IDLE
            self._drop_recomputation()
            self.grads.finish()
            if self.trainable.watching:
                self.trainable.watch_learned()
            self._release_backward_calls()
            if not self._creating_graph:
                self.release_graph_pins()
            self.guard.release_sticky()
            self.cache.shrink()
            self.micro_batches += 1

    def _abandon_backward(self) -> None:
        """A backward that raised (out of memory, given up by every rank) never reaches its end: let go of
        the pins its units' calls and its recomputation hold, without reducing what it left; the
        recovery redoes the micro-batch under a new plan ([Note: recovering from out of memory])."""
        if self.phase is not Phase.BACKWARD or in_backward():
            return
        self.phase = Phase.IDLE
        self._drop_recomputation()
        self._release_backward_calls()
        self.cache.unpin_all()

    def finish_unreported(self) -> None:
        """End a backward that left gradients no hook reported ([Note: one hook per chunk] in grads.py), or
        take the gradients the parameters held before the runtime took them.

        [Note: gradients held before the runtime]
        A parameter's ``.grad`` may hold a gradient when the runtime takes the module: a backward of the
        user's own before fit, or the last step of a fit under another strategy (DDP leaves its last
        step's averaged gradients in ``.grad``). A plain parameter keeps it until the optimizer's
        ``zero_grad`` (which Lightning's automatic optimization calls before the first backward), and a
        backward before that adds to it. The runtime takes it as a backward that no hook reported: reduced
        into the shards before the first forward, ``zero_grad`` or read of a gradient, so that ``zero_grad``
        drops it and a backward adds to it, as for the plain parameter. Left in ``.grad``, autograd would
        add it to the first backward's gradient of a plan that hooks every parameter, after ``zero_grad``.
        """
        if not (self.trainable.watching or self.held_before) or self.phase is Phase.BACKWARD or in_backward():
            return
        self.held_before = False
        if self.trainable.unreported():
            self.guard.flush_grads()
            self._creating_graph = False
            self._finish_backward()

    @property
    def holds_graphs(self) -> bool:
        """Whether a backward that created a graph keeps its chunks for a later backward through it."""
        return bool(self._graph_pins)

    def release_graph_pins(self) -> None:
        """A backward without ``create_graph`` is over: the graphs earlier ones built have been used
        ([Note: backward through a backward])."""
        while self._graph_pins:
            self.cache.release_pins(self._graph_pins.pop())

    def _release_backward_calls(self) -> None:
        for unit in self.table.units:
            for call in unit.calls:
                if call.pinned:
                    self.cache.release_pins(unit.public_ids)
            unit.calls = []


def _buffer_slots(module: nn.Module) -> list[tuple[nn.Module, str]]:
    """(module, name) of every buffer of ``module``, each once (a buffer shared by two modules too)."""
    seen: set[int] = set()
    out = []
    for sub in module.modules():
        for name, buffer in sub._buffers.items():
            if buffer is not None and id(buffer) not in seen:
                seen.add(id(buffer))
                out.append((sub, name))
    return out
