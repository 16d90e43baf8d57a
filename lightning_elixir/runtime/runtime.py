"""ElixirRuntime: executes a plan on a module (chunks, cache, hooks, gradient reduction)."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Generator, Iterable
from typing import Any, Optional, Union

import torch
import torch.nn as nn
from torch.autograd import Variable
from torch.autograd.profiler import record_function

from lightning_elixir.plan import CACHE_ALL, ElixirPlan, min_plus_blocks, spare_blocks
from lightning_elixir.runtime import hooks
from lightning_elixir.runtime.access import AccessGuard
from lightning_elixir.runtime.cache import ChunkCache
from lightning_elixir.runtime.chunk import Chunk, GradBuffers, Slot
from lightning_elixir.runtime.collectives import Group
from lightning_elixir.runtime.hooks import BackwardCall, ModuleState, WaitKey, in_backward
from lightning_elixir.runtime import layout
from lightning_elixir.runtime.layout import build_chunks, materialize_buffers, resolve_specs
from lightning_elixir.runtime.offload import OffloadEngine, check_nvme_path_given
from lightning_elixir.runtime.phases import PhaseClock
from lightning_elixir.runtime.params import chunk_parameter, unchunk_parameter
from lightning_elixir.runtime.policy import PrecisionPolicy
from lightning_elixir.runtime.reductions import Reductions
from lightning_elixir.runtime.state_dict import per_element_nbytes
from lightning_elixir.runtime.states import ChunkState
from lightning_elixir.runtime.timeline import TimelineRecorder
from lightning_elixir.runtime.trainable import Trainable, settle_unused

log = logging.getLogger(__name__)


class ElixirRuntime:
    """Shards ``module``'s parameters into chunks and runs forward/backward through hooks.

    Args:
        module: the model (a LightningModule or any nn.Module); its parameters become chunk views.
        plan: the plan to execute.
        device: where chunks, gathered blocks and (for "device" placement) sharded state live.
        policy: the dtypes of the run (default: fp32 everywhere, or ``compute_dtype``/``master_dtype``).
        compute_dtype: dtype of the gathered parameters the model computes with (without ``policy``).
        master_dtype: dtype of the master shards the optimizer updates (default: compute dtype).
        group: the data-parallel group (default: the world, or a single process).
        private_params: names that get their own always-gathered chunk, besides the tied ones.
        grow_cache: let an int ``cache_blocks`` grow when more chunks are needed at once than it
            allows (a searched plan's prediction was short) instead of raising.
        broadcast_buffers: overwrite every rank's buffers with rank 0's before each forward that
            follows a training forward, as DDP does by default (BatchNorm running statistics).
        nvme_path: a directory on an NVMe drive for the chunks the plan places on "nvme".
        nvme_buffers: host page buffers NVMe records are paged through.
        values: False to leave the parameters' values unread and the chunks at zero, for a caller
            that fills the master shards itself (re-chunking, ``runtime.replan.switch_plan``).
    """

    def __init__(self, module: nn.Module, plan: Optional[ElixirPlan] = None, *, device: Union[str, torch.device] = "cpu",
                 policy: Optional[PrecisionPolicy] = None, compute_dtype: Optional[torch.dtype] = None,
                 master_dtype: Optional[torch.dtype] = None, group: Optional[Group] = None,
                 private_params: Iterable[str] = (), grow_cache: bool = False, broadcast_buffers: bool = True,
                 nvme_path: Optional[str] = None, nvme_buffers: int = 3, values: bool = True) -> None:
        self.module = module
        self.plan = plan or ElixirPlan()
        self.group = group or Group.default()
        self.device = torch.device(device)
        if policy is None:
            compute = compute_dtype or torch.float32
            policy = PrecisionPolicy(compute, master_dtype or compute)
        self.policy = dataclasses.replace(policy, reduce_in_fp32=policy.reduce_in_fp32 and self.plan.reduce_in_fp32)
        full_precision = self.policy.full_precision_params(module)
        self.private_params = tuple(private_params)
        specs = resolve_specs(module, self.plan, self.group.world_size, self.private_params, full_precision)
        check_nvme_path_given(specs, nvme_path)  # before any work
        materialize_buffers(module, self.device)
        self.chunks = build_chunks(module, specs, self.group, self.device, self.policy, full_precision, values)
        self.clock = PhaseClock()
        """Host time by phase of the step (runtime/phases.py), shared by every chunk."""
        self.grad_buffers = GradBuffers()
        """Full-size gradient buffers reused on the CPU ([Note: reused gradient buffers] in chunk.py)."""
        for chunk in self.chunks:
            chunk.clock = self.clock
            chunk.grad_buffers = self.grad_buffers
        self.offload = OffloadEngine(self.chunks, self.device, self.group.rank, nvme_path, nvme_buffers)
        self._buffers = [b for b in module.buffers()]
        if values:  # re-chunking keeps each rank's buffers as they are
            layout.broadcast_buffers(self._buffers, self.group)
        self.broadcast_buffers = broadcast_buffers
        self._sync_buffers_next = broadcast_buffers
        self.public = [c for c in self.chunks if not c.private]
        self.private = [c for c in self.chunks if c.private]
        self._where: dict[int, tuple[Chunk, Slot]] = {id(s.param): (c, s) for c in self.chunks for s in c.slots}
        self.handles: list[Any] = []
        spare = spare_blocks(self.plan.cache_blocks)  # "min" or "min+K": the fewest blocks (+ K), grown as needed
        self.cache = ChunkCache(self.public, self._capacity(), grow_cache or spare is not None, self.plan.prefetch_depth)
        self.access = AccessGuard(self)
        self.trainable = Trainable(self)  # before the hooks: their backward waits are its trainable parameters
        self.states = hooks.install(self, module)
        if spare is not None:
            fewest = max([len(s.public_ids) for s in self.states] + [1])
            self.cache.capacity = min_plus_blocks(spare, fewest, len(self.public))
        self._owner = {pid: s for s in reversed(self.states) for pid in s.param_ids}  # the first holder wins
        self._callback_queued = False
        self._recompute_pins: list[tuple[int, ...]] = []
        self._creating_graph = False
        """Whether the backward running now was asked for ``create_graph``."""
        self._graph_pins: list[tuple[int, ...]] = []
        """Chunks pinned for a later backward through a graph this one builds (see _release_graph_pins)."""
        self._views: dict[int, nn.Parameter] = {}
        self.optimizers: list[Any] = []
        """The optimizers whose parameters are shard views (``runtime.optim.shard_optimizer``)."""
        self.reductions = Reductions(self.chunks, self.offload, self._chunk_views)
        for chunk in self.chunks:
            for slot in chunk.slots:
                chunk_parameter(slot.param, self.access.on_param_read, self.access.on_grad_read)
        self.scaler: Any = None
        self.private_gathers = 0
        self.micro_batches = 0
        self.steps = 0
        self.skipped_steps = 0
        self._iterations_in_step = 0
        self.timeline_recorder: Optional[TimelineRecorder] = None
        """Records the memory timeline of one step when set (``record_timeline``)."""

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.policy.compute_dtype

    @property
    def master_dtype(self) -> torch.dtype:
        return self.policy.master_dtype

    # ---- layout queries ---------------------------------------------------------------------

    def _capacity(self) -> Optional[int]:
        blocks = self.plan.cache_blocks
        if blocks == CACHE_ALL or spare_blocks(blocks) is not None:
            return None
        return min(int(blocks), max(len(self.public), 1))

    def public_chunk_ids(self, params: Iterable[nn.Parameter]) -> tuple[int, ...]:
        """The public chunks holding ``params``, in chunk order."""
        ids = {self._where[id(p)][0].index for p in params if not self._where[id(p)][0].private}
        return tuple(sorted(ids))

    def is_public(self, param: nn.Parameter) -> bool:
        return not self._where[id(param)][0].private

    def where(self, param: nn.Parameter) -> tuple[Chunk, Slot]:
        """The chunk and slot of one of the module's parameters."""
        return self._where[id(param)]

    def owner(self, param: nn.Parameter) -> Optional[ModuleState]:
        """The state of the module that holds ``param`` directly (the first, for tied ones)."""
        return self._owner.get(id(param))

    def grad_valid(self, chunk: Chunk) -> bool:
        """Whether ``chunk``'s gradient shard holds this step's reduced gradient."""
        return self.reductions.valid[chunk.index]

    def param_ids(self) -> set[int]:
        """ids of every parameter the chunks hold."""
        return set(self._where)

    def view_index(self) -> dict[int, tuple[Chunk, Slot]]:
        """For each optimizer shard view (by id), the chunk and slot of its parameter."""
        return {id(view): self._where[pid] for pid, view in self._views.items()}

    def trainable_params(self) -> list[nn.Parameter]:
        return [s.param for c in self.chunks for s in c.slots if s.param.requires_grad]

    # ---- iteration and module hooks -----------------------------------------------------------

    def root_pre_forward(self) -> None:
        """The root module's forward starts; outside a strategy step it begins an iteration."""
        self.access.forward_depth += 1
        if self.access.forward_depth == 1 and not self.access.stepping:
            self.begin_iteration()

    def root_post_forward(self) -> None:
        self.access.forward_depth -= 1

    def begin_iteration(self) -> None:
        """A forward pass starts: replay the recorded order, gather the private chunks, sync buffers."""
        if in_backward():
            return
        if not torch.is_grad_enabled() and not self._callback_queued:
            self.end_iteration()  # a no-grad iteration holds nothing past its own end
        training = torch.is_grad_enabled()
        if training:
            self.trainable.refresh()
        self.cache.begin_iteration(training)
        for chunk in self.private:
            if chunk.state is ChunkState.FREE:
                self.gather_private(chunk)
        if self.timeline_recorder is not None:
            self.timeline_recorder.begin_iteration(training, starts_step=self._iterations_in_step == 0)
        self._iterations_in_step += training
        self._sync_buffers()

    def end_iteration(self) -> None:
        """A step without backward is over (evaluation): let go of what reads outside the hooks held."""
        if not self._callback_queued:
            self.access.release_sticky()
            self.cache.shrink()

    def _sync_buffers(self) -> None:
        """DDP's default: rank 0's buffers before a forward that follows a training forward."""
        if self.broadcast_buffers and self._sync_buffers_next and self._buffers:
            with record_function("Elixir::broadcast_buffers"):
                layout.broadcast_buffers(self._buffers, self.group)
        self._sync_buffers_next = torch.is_grad_enabled()

    def gather_private(self, chunk: Chunk) -> None:
        chunk.start_gather(async_op=False)
        chunk.finish_gather()
        self.private_gathers += 1

    def acquire_outside_hooks(self, chunk_index: int) -> None:
        """Gather and pin a public chunk for a read that no module hook covers."""
        self.cache.acquire_extra(chunk_index)

    def before_module(self, state: ModuleState) -> None:
        if state.public_ids:
            self.cache.acquire(state.public_ids)
            recompute = in_backward()
            if recompute:
                self._recompute_pins.append(state.public_ids)
            if self.timeline_recorder is not None:
                self.timeline_recorder.acquired("recompute" if recompute else "forward", state.name)
        state.active += 1

    def after_module(self, state: ModuleState) -> None:
        if not state.active:
            return  # the pre-hook failed (the forward hook runs even then)
        state.active -= 1
        if not state.public_ids:
            return
        if in_backward():
            if state.public_ids not in self._recompute_pins:
                return  # already dropped by _drop_recompute_pins
            self._recompute_pins.remove(state.public_ids)
        self.cache.release_pins(state.public_ids)

    def _drop_recompute_pins(self) -> None:
        """Recomputation under activation checkpointing may stop early, skipping forward hooks.

        Once any backward event arrives, recomputation is over and its pins can go: each
        module's own backward pins its chunks again before it runs.
        """
        while self._recompute_pins:
            self.cache.release_pins(self._recompute_pins.pop())

    def before_call_backward(self, call: BackwardCall) -> None:
        """The first gradient reached one forward call's outputs: pin its chunks for its backward."""
        self._drop_recompute_pins()
        self._begin_backward()
        if call not in call.state.calls:  # a graph differentiated again (retain_graph, create_graph): reopen
            call.pending = set(call.state.trainable) | ({hooks.Wait.INPUTS} if call.has_inputs else set())
            call.pinned = False
            call.state.calls.append(call)
        self.cache.acquire(call.state.public_ids)
        if self._creating_graph:  # the graph this backward builds reads these parameters in a later one
            self.cache.acquire(call.state.public_ids)
            self._graph_pins.append(call.state.public_ids)
        if self.timeline_recorder is not None:
            self.timeline_recorder.acquired("backward", call.state.name)
        call.pinned = True
        if not call.pending:  # nothing to wait for: hold until the end of backward
            call.pending.add(hooks.Wait.INPUTS)

    def call_event(self, call: BackwardCall, key: WaitKey) -> None:
        """One thing a call's backward waits for has happened; unpin once nothing is left."""
        self._drop_recompute_pins()
        call.pending.discard(key)
        if call.pending or not call.pinned:
            return
        call.pinned = False
        self.cache.release_pins(call.state.public_ids)
        call.state.calls.remove(call)

    # ---- gradients ----------------------------------------------------------------------------

    def on_param_grad(self, param: torch.Tensor) -> None:
        """Post-accumulate-grad hook: move the gradient into its chunk and reduce when complete."""
        with record_function("Elixir::post_accumulate_grad"):
            self._drop_recompute_pins()
            self._begin_backward()
            chunk, slot = self._where[id(param)]
            chunk.add_grad(slot, param.grad)
            param.grad = None
            if chunk.grads_complete:
                self.reductions.start_ready()
            state = self._owner.get(id(param))
            if state is not None and id(param) in state.trainable:
                for call in list(state.calls):
                    self.call_event(call, id(param))

    def _begin_backward(self) -> None:
        """The first event of a backward: queue its end, and keep changes to gathered gradients first.

        In-place changes to gradients gathered before this backward (``AccessGuard.flush_grads``)
        belong in the shards before its reductions, which may finish during backward, write or add
        to them ([Note: reductions in flight]).
        """
        if self._callback_queued:
            return
        self._callback_queued = True
        self._creating_graph = torch.is_grad_enabled()  # the engine's grad mode is create_graph's
        self.access.flush_grads()
        Variable._execution_engine.queue_callback(self._finish_backward)

    def _finish_backward(self) -> None:
        """End of backward: reduce what is left (missing gradients count as zero), publish shards."""
        with record_function("Elixir::finish_backward"):
            self._callback_queued = False
            self._drop_recompute_pins()
            self.reductions.finish()
            self._release_backward_calls()
            if not self._creating_graph:
                self._release_graph_pins()
            self.access.release_sticky()
            self.cache.shrink()
            self.micro_batches += 1

    def _release_graph_pins(self) -> None:
        """A backward without ``create_graph`` is over: the graphs earlier ones built have been used
        ([Note: backward through a backward] in hooks.py)."""
        while self._graph_pins:
            self.cache.release_pins(self._graph_pins.pop())

    def _release_backward_calls(self) -> None:
        for state in self.states:
            for call in state.calls:
                if call.pinned:
                    self.cache.release_pins(state.public_ids)
            state.calls = []

    def _chunk_views(self, chunk: Chunk) -> list[tuple[Slot, nn.Parameter]]:
        return [(s, self._views[id(s.param)]) for s in chunk.slots if id(s.param) in self._views]

    def forget_grad(self, param: nn.Parameter) -> None:
        """``param.grad = None`` for one parameter: its part of the gradient shard reads as zero."""
        chunk, slot = self._where[id(param)]
        begin, end = chunk.shard_range(slot)
        chunk.settle()
        chunk.grad_shard[begin:end].zero_()
        view = self._views.get(id(param))
        if view is not None:
            view.grad = None

    def zero_grad(self) -> None:
        """Forget accumulated gradients (the optimizer's own zero_grad does the same through views)."""
        self.reductions.forget()
        self.access.drop_grads()
        for view in self._views.values():
            view.grad = None

    # ---- optimizer-facing ---------------------------------------------------------------------

    def view_param(self, param: nn.Parameter) -> nn.Parameter:
        """The flat view of this rank's master shard of ``param`` (possibly empty), made once."""
        view = self._views.get(id(param))
        if view is not None:
            return view
        if id(param) not in self._where:
            raise ValueError(f"a parameter of shape {tuple(param.shape)} given to the optimizer is not a parameter "
                             "of the model this strategy wraps; build optimizers from self.parameters()")
        chunk, slot = self._where[id(param)]
        begin, end = chunk.shard_range(slot)
        view = nn.Parameter(chunk.master[begin:end], requires_grad=param.requires_grad)
        self._views[id(param)] = view
        return view

    def shard_views(self) -> dict[int, nn.Parameter]:
        """The optimizer's shard views made so far, by the id of their parameter."""
        return self._views

    def grad_shards(self) -> list[torch.Tensor]:
        """This rank's gradient shards, one per chunk that has trainable parameters."""
        return [c.grad_shard for c in self.chunks if c.grad_requiring and self.reductions.valid[c.index]]

    def before_step(self) -> None:
        """The optimizer is about to update the masters: keep what code wrote to gathered values first."""
        self.access.flush_grads()
        for chunk in self.chunks:
            if chunk.exposed and chunk.state in (ChunkState.HOLD, ChunkState.COMPUTE):
                with self.offload.resident(chunk, write=True):
                    chunk.write_back()

    @contextlib.contextmanager
    def stepping(self, optimizer: Any) -> Generator[None, None, None]:
        """Context around the user's ``optimizer.step()``: the offloaded chunks update on the worker
        (their gradients hidden from the user's step), the rest in the step; shards refreshed after.

        See [Note: offloaded updates] in offload.py.
        """
        with self.clock.timing("optimizer"):
            self.before_step()
            settle_unused(self, optimizer)
            hidden = self.offload.launch(optimizer)
            try:
                yield
            finally:
                self.offload.restore(hidden)
            self.after_step(stepped=True)

    def after_step(self, stepped: bool = True) -> None:
        """The optimizer has updated the masters: refresh the shards and mark gathered chunks stale."""
        self.access.drop_grads()
        self._iterations_in_step = 0
        if self.timeline_recorder is not None:
            self._end_recorded_step()
        if not stepped:
            self.skipped_steps += 1
            return
        self.steps += 1
        for chunk in self.chunks:
            chunk.exposed = False  # written back by before_step; the gathered values are stale now
            if not chunk.offloaded:  # offloaded shards are refreshed by their update on the worker
                chunk.refresh_shard()
        self.release_all()

    def release_all(self) -> None:
        """Free every gathered block (e.g. before a state-dict load, or at teardown), keeping writes."""
        self._release_graph_pins()
        self.access.release_sticky()
        self.cache.invalidate()
        for chunk in self.private:
            if chunk.state is not ChunkState.FREE:
                chunk.release()

    def step_region(self):
        """Context: code every rank runs together (a step); reads outside the hooks gather on demand."""
        return self.access.step()

    def gathered(self, params: Optional[Iterable[nn.Parameter]] = None, grads: bool = False):
        """Context: full parameters (and gradients) for reads; see ``AccessGuard.gathered``."""
        return self.access.gathered(params, grads)

    # ---- accounting -----------------------------------------------------------------------------

    def record_timeline(self, budget_bytes: Optional[int] = None) -> TimelineRecorder:
        """Record the device bytes at every cache acquisition of the next optimizer step.

        Call it between optimizer steps, after the first (see ``TimelineRecorder``); a step already
        under way is not recorded, the next one is. Replaces a recorder that has not finished.

        Args:
            budget_bytes: the device budget the plan was searched for, carried into the timeline.

        Returns:
            The recorder; its ``timeline`` is complete once ``done`` (after ``optimizer.step()``).
        """
        self.timeline_recorder = TimelineRecorder(self, budget_bytes)
        return self.timeline_recorder

    def _end_recorded_step(self) -> None:
        """An optimizer step ends the recorded step, if it has begun; the recorder then detaches."""
        self.timeline_recorder.end_step()
        if self.timeline_recorder.done:
            self.timeline_recorder = None

    def memory_stats(self) -> dict[str, int]:
        """Bytes the runtime holds (device, host, NVMe) and how many chunks are gathered.

        ``param_shard_bytes``, ``device_state_bytes``, ``host_bytes`` and ``nvme_bytes`` are counted
        as the search's ``MemoryBreakdown`` predicts them (optimizer state as the optimizers hold it).
        """
        self.offload.settle()
        param_shards = sum(c.shard.nbytes for c in self.chunks)
        device_state = 0
        for c in self.chunks:
            if not c.offloaded:
                device_state += c.grad_shard.nbytes + (0 if c.master is c.shard else c.master.nbytes)
                device_state += self.optimizer_state_bytes(c)
        block = self.public[0].full_bytes if self.public else 0
        gathered_private = [c for c in self.private if c.state is not ChunkState.FREE]
        return {
            "param_shard_bytes": param_shards,
            "device_state_bytes": device_state,
            "host_bytes": self.offload.host_bytes(),
            "nvme_bytes": self.offload.nvme_bytes(),
            "shard_bytes": param_shards + device_state,
            "cache_bytes": len(self.cache.gathered) * block,
            "private_bytes": sum(c.full_bytes for c in gathered_private),
            "cache_blocks": self.cache.capacity,
            "gathered_public_chunks": len(self.cache.gathered),
            "peak_gathered_public_chunks": self.cache.peak_gathered,
            "gathers": self.cache.gathers,
            "private_gathers": self.private_gathers,
        }

    def optimizer_state_bytes(self, chunk: Chunk) -> int:
        """Per-element optimizer state bytes held for a device chunk's views."""
        return sum(per_element_nbytes(values, view.shape) for _, view in self._chunk_views(chunk)
                   for values in self._optimizer_states(view))

    def _optimizer_states(self, view: nn.Parameter) -> list[dict]:
        return [opt.state[view] for opt in self.optimizers if view in opt.state]

    # ---- giving the module back -------------------------------------------------------------------

    def remove_hooks(self) -> None:
        for state in self.states:
            for handle in state.handles:
                handle.remove()
        for handle in self.handles:
            handle.remove()

    def detach_module(self) -> None:
        """Drop the chunks without gathering: the parameters become placeholders of their shape and
        dtype (one element, expanded), the hooks and the NVMe files go. For re-chunking, which has
        copied out what it keeps (runtime/replan.py); the module holds no values afterwards."""
        self.release_all()
        for chunk in self.chunks:
            for slot in chunk.slots:
                unchunk_parameter(slot.param)
                one = torch.empty(1, dtype=slot.dtype, device=self.device)
                slot.param.data = one.expand(slot.shape) if len(slot.shape) else one[0]
                slot.param.grad = None
        self.remove_hooks()
        self.offload.close()
        self.chunks, self.public, self.private = [], [], []
        self.reductions = Reductions([], self.offload, self._chunk_views)
        self._where.clear()
        self._views.clear()
        self.grad_buffers.clear()
        self.optimizers = []

    def restore_module(self) -> None:
        """Give the module plain parameters with the trained values on every rank; remove the hooks.

        Chunk by chunk: each chunk's master is gathered, its parameters get their own copies in
        their original dtype, and the gathered buffer goes before the next chunk.
        """
        self.release_all()
        with torch.no_grad():
            for chunk in self.chunks:
                with self.offload.resident(chunk):
                    full = chunk.gather_full(chunk.master)
                for slot in chunk.slots:
                    unchunk_parameter(slot.param)
                    slot.param.data = full[slot.offset:slot.end].view(slot.shape).to(slot.dtype, copy=True)
                    slot.param.grad = None
                del full
        self.remove_hooks()
        self.offload.close()
