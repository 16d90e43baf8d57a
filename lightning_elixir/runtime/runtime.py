"""ElixirRuntime: executes a plan on a module (chunks, cache, hooks, gradient reduction)."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import weakref
from collections.abc import Generator, Iterable, Sequence
from typing import Any, Optional, Union

import torch
import torch.nn as nn

from lightning_elixir.plan import CACHE_ALL, ChunkSpec, ElixirPlan, min_plus_blocks, spare_blocks, stays_gathered
from lightning_elixir.runtime import layout
from lightning_elixir.runtime.access import AccessGuard
from lightning_elixir.runtime.cache import ChunkCache
from lightning_elixir.runtime.buffers import GradBuffers
from lightning_elixir.runtime.chunk import Chunk, Slot
from lightning_elixir.runtime.collectives import Group
from lightning_elixir.runtime.deferred import InitRecord
from lightning_elixir.runtime.grads import GradientFlow
from lightning_elixir.runtime.layout import build_chunks, materialize_buffers, resolve_specs
from lightning_elixir.runtime.offload import OffloadEngine, check_nvme_path_given
from lightning_elixir.runtime.params import chunk_parameter, unchunk_parameter
from lightning_elixir.runtime.phases import PhaseClock
from lightning_elixir.runtime.policy import PrecisionPolicy
from lightning_elixir.runtime.protocol import StepProtocol
from lightning_elixir.runtime.state_dict import per_element_nbytes
from lightning_elixir.runtime.states import ChunkState
from lightning_elixir.runtime.table import ChunkTable, UnitState
from lightning_elixir.runtime.timeline import TimelineRecorder
from lightning_elixir.units import hook_units, most_public_chunks

log = logging.getLogger(__name__)

_HOLDER: "weakref.WeakKeyDictionary[nn.Module, weakref.ref]" = weakref.WeakKeyDictionary()
"""The runtime whose chunks hold each module's parameters, until it gives them back or lets them go."""


def _take_back(module: nn.Module) -> None:
    """A module that a runtime still holds, left sharded by a stage that failed (its teardown gathers
    nothing: the failure may have been a collective's), gets its parameters back before a new runtime
    reads them. Every rank builds the new runtime, so every rank gathers here."""
    holder = _HOLDER.get(module)
    runtime = holder() if holder is not None else None
    if holder is not None and runtime is None:
        raise RuntimeError("the module's parameters are still sharded by an Elixir run that failed and is gone, so "
                           "their values cannot be gathered: build the module again, or load a checkpoint into it")
    if runtime is not None:
        log.info("the module was left sharded by a stage that failed: gathering its parameters back first")
        runtime.restore_module()


def _cache_blocks(plan: ElixirPlan, specs: tuple[ChunkSpec, ...], module: nn.Module) -> int:
    """The blocks of ``plan.cache_blocks`` for ``specs``: "all" one per public chunk, "min+K" the most public
    chunks one hook unit needs plus K, an int as it is; never more than one per public chunk."""
    n_public = max(sum(not spec.private for spec in specs), 1)
    spare = spare_blocks(plan.cache_blocks)
    if plan.cache_blocks == CACHE_ALL:
        return n_public
    if spare is None:
        return min(int(plan.cache_blocks), n_public)
    chunk_of = {name: i for i, spec in enumerate(specs) for name in spec.params}
    private = {i for i, spec in enumerate(specs) if spec.private}
    return min_plus_blocks(spare, most_public_chunks(hook_units(module), chunk_of, private), n_public)


class ElixirRuntime:
    """Shards ``module``'s parameters into chunks and runs forward/backward through hooks.

    The layers it composes are pictured in [Note: the step protocol] (protocol.py).

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
        deferred: the recordings of the builds that made the module's meta tensors
            (``runtime.deferred.record_init``); their values are replayed at materialisation.
    """

    def __init__(self, module: nn.Module, plan: Optional[ElixirPlan] = None, *, device: Union[str, torch.device] = "cpu",
                 policy: Optional[PrecisionPolicy] = None, compute_dtype: Optional[torch.dtype] = None,
                 master_dtype: Optional[torch.dtype] = None, group: Optional[Group] = None,
                 private_params: Iterable[str] = (), grow_cache: bool = False, broadcast_buffers: bool = True,
                 nvme_path: Optional[str] = None, nvme_buffers: int = 3, values: bool = True,
                 deferred: Sequence[InitRecord] = ()) -> None:
        _take_back(module)
        self.module = module
        self.plan = plan or ElixirPlan()
        self.group = group or Group.default()
        self.device = torch.device(device)
        if policy is None:
            compute = compute_dtype or torch.float32
            policy = PrecisionPolicy(compute, master_dtype or compute)
        self.policy = dataclasses.replace(policy, reduce_in_fp32=policy.reduce_in_fp32 and self.plan.reduce_in_fp32)
        full_precision = self.policy.full_precision_params(module)
        own_dtypes = self.policy.own_dtype_params(module)  # [Note: parameters of other dtypes] in policy.py
        self.private_params = tuple(private_params)
        specs = resolve_specs(module, self.plan, self.group.world_size, self.private_params, full_precision, own_dtypes)
        check_nvme_path_given(specs, nvme_path)  # before any work
        capacity = _cache_blocks(self.plan, specs, module)
        n_public = sum(not spec.private for spec in specs)
        self.resident = stays_gathered(capacity, n_public, offloads=any(s.placement != "device" for s in specs),
                                      world_size=self.group.world_size)
        """Whether every chunk stays gathered ([Note: resident plans] in protocol.py)."""
        if self.resident:
            capacity = n_public  # also at one rank with fewer cache blocks: the shards are the chunks
        materialize_buffers(module, self.device, deferred)
        chunks = build_chunks(module, specs, self.group, self.device, self.policy, full_precision, values,
                              aliased=self.resident and self.group.world_size == 1, deferred=deferred,
                              own_dtypes=own_dtypes)
        self.clock = PhaseClock()
        """Host time by phase of the step (runtime/phases.py), shared by every chunk."""
        self.grad_buffers = GradBuffers()
        """Full-size gradient buffers reused on the CPU ([Note: reused gradient buffers] in buffers.py)."""
        for chunk in chunks:
            chunk.clock = self.clock
            chunk.grad_buffers = self.grad_buffers
        self.offload = OffloadEngine(chunks, self.device, self.group.rank, nvme_path, nvme_buffers)
        self.table = ChunkTable(chunks)
        if values:  # re-chunking keeps each rank's buffers as they are
            layout.broadcast_buffers(list(module.buffers()), self.group)
        grow = grow_cache or spare_blocks(self.plan.cache_blocks) is not None  # "min", "min+K": grown as needed
        self.cache = ChunkCache(self.table.public, capacity, grow, self.plan.prefetch_depth)
        self.grads = GradientFlow(self.table, self.offload)
        self.grads.read_later = self.device.type != "cpu"  # [Note: reading the agreement later] in grads.py
        self.access = AccessGuard(self.table, self.cache, self.grads)
        self.protocol = StepProtocol(module, self.table, self.cache, self.access, self.grads, self.group,
                                     broadcast_buffers)
        self.protocol.install(self.resident)
        for chunk in chunks:
            for slot in chunk.slots:
                chunk_parameter(slot.param, self.access.on_param_read, self.access.on_grad_read,
                                self.access.on_grad_write, self.access.on_data_write)
        self.optimizers: list[Any] = []
        """The optimizers whose parameters are shard views (``runtime.optim.shard_optimizer``)."""
        _HOLDER[module] = weakref.ref(self)
        self.scaler: Any = None
        self.steps = 0
        self.skipped_steps = 0
        self.updating = False
        """Inside the optimizer's update (``stepping``, after the agreement on unused gradients), or left
        by an error raised there: the masters may be partly updated."""
        self.companions: dict[str, list[torch.Tensor]] = {}
        """Sharded tensors of the masters' layout that others keep, by name ([Note: companion shards])."""

    # ---- the layers' state, as callers read it --------------------------------------------------

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.policy.compute_dtype

    @property
    def master_dtype(self) -> torch.dtype:
        return self.policy.master_dtype

    @property
    def chunks(self) -> list[Chunk]:
        return self.table.chunks

    @property
    def public(self) -> list[Chunk]:
        return self.table.public

    @property
    def private(self) -> list[Chunk]:
        return self.table.private

    @property
    def units(self) -> list[UnitState]:
        """The hook units ([Note: hook units] in units.py) with their bookkeeping."""
        return self.table.units

    @property
    def trainable(self) -> Any:
        return self.protocol.trainable

    @property
    def hyperparameters_differ(self) -> bool:
        """Whether an optimizer step found the optimizer's hyperparameters differing between ranks."""
        return self.grads.hyperparameters_differ

    @property
    def private_gathers(self) -> int:
        return self.table.private_gathers

    @property
    def micro_batches(self) -> int:
        return self.protocol.micro_batches

    @micro_batches.setter
    def micro_batches(self, value: int) -> None:
        self.protocol.micro_batches = value

    @property
    def broadcast_buffers(self) -> bool:
        return self.protocol.broadcast_buffers

    @property
    def timeline_recorder(self) -> Optional[TimelineRecorder]:
        """Records the memory timeline of one step when set (``record_timeline``)."""
        return self.protocol.recorder

    def public_chunk_ids(self, params: Iterable[nn.Parameter]) -> tuple[int, ...]:
        """The public chunks holding ``params``, in chunk order."""
        return self.table.public_chunk_ids(params)

    def is_public(self, param: nn.Parameter) -> bool:
        return self.table.is_public(param)

    def where(self, param: nn.Parameter) -> tuple[Chunk, Slot]:
        """The chunk and slot of one of the module's parameters."""
        return self.table.where(param)

    def owner(self, param: nn.Parameter) -> Optional[UnitState]:
        """The hook unit that owns ``param``."""
        return self.table.owner(param)

    def param_ids(self) -> set[int]:
        """ids of every parameter the chunks hold."""
        return self.table.param_ids()

    def view_index(self) -> dict[int, tuple[Chunk, Slot]]:
        """For each optimizer shard view (by id), the chunk and slot of its parameter."""
        return self.table.view_index()

    def follow_requires_grad(self) -> None:
        """Follow ``requires_grad`` changes now, not at the next iteration (between backwards of a step:
        Lightning's toggle_optimizer, [Note: toggling optimizers] in toggling.py)."""
        self.protocol.finish_unreported()
        self.protocol.trainable.refresh()

    def trainable_params(self) -> list[nn.Parameter]:
        return [p for p in self.table.parameters() if p.requires_grad]

    # ---- iterations -----------------------------------------------------------------------------

    def root_pre_forward(self) -> None:
        self.protocol.root_pre_forward()

    def root_post_forward(self) -> None:
        self.protocol.root_post_forward()

    def begin_iteration(self) -> None:
        """A forward pass starts: gather what the plan keeps, replay the recorded order, sync buffers."""
        self.protocol.begin_iteration()

    def end_iteration(self) -> None:
        """A step without backward is over (evaluation): let go of what reads outside the hooks held."""
        self.protocol.end_iteration()

    def gather_private(self, chunk: Chunk) -> None:
        self.table.gather_private(chunk)

    # ---- gradients ----------------------------------------------------------------------------

    def _chunk_views(self, chunk: Chunk) -> list[tuple[Slot, nn.Parameter]]:
        return self.table.chunk_views(chunk)

    def forget_grad(self, param: nn.Parameter) -> None:
        """``param.grad = None`` for one parameter: its part of the gradient shard reads as zero."""
        self.grads.forget_grad(param)

    def zero_grad(self) -> None:
        """Forget accumulated gradients (the optimizer's own zero_grad does the same through views)."""
        self.grads.forget()
        self.access.drop_grads()

    # ---- optimizer-facing ---------------------------------------------------------------------

    def view_param(self, param: nn.Parameter) -> nn.Parameter:
        """The flat view of this rank's master shard of ``param`` (possibly empty), made once."""
        view = self.table.views.get(id(param))
        if view is not None:
            return view
        if not self.table.holds(param):
            raise ValueError(f"a parameter of shape {tuple(param.shape)} given to the optimizer is not a parameter "
                             "of the model this strategy wraps; build optimizers from self.parameters()")
        chunk, slot = self.table.where(param)
        begin, end = chunk.shard_range(slot)
        view = nn.Parameter(chunk.master[begin:end], requires_grad=param.requires_grad)
        self.table.views[id(param)] = view
        self.grads.reductions.views_changed()
        return view

    def shard_views(self) -> dict[int, nn.Parameter]:
        """The optimizer's shard views made so far, by the id of their parameter."""
        return self.table.views

    def grad_shards(self) -> list[torch.Tensor]:
        """This rank's gradient shards, one per chunk that has trainable parameters."""
        return self.grads.shards()

    def before_step(self) -> None:
        """The optimizer is about to update the masters: keep what code wrote to gathered values first."""
        self.access.flush_grads()
        for chunk in self.chunks:
            if chunk.state is ChunkState.GATHERING:  # gathered after the last step, unused since: its all-gather
                chunk.finish_gather()                # reads the shard the step writes (on a GPU, another stream)
            if chunk.state in (ChunkState.HOLD, ChunkState.COMPUTE) and chunk.written():
                with self.offload.resident(chunk, write=True):
                    chunk.write_back()

    @contextlib.contextmanager
    def stepping(self, optimizer: Any) -> Generator[None, None, None]:
        """Context around the user's ``optimizer.step()``: the offloaded chunks update on the worker
        (their gradients hidden from the user's step), the rest in the step; shards refreshed after.

        See [Note: offloaded updates] in offload.py.
        """
        with self.clock.timing("optimizer", self.device):
            self.before_step()
            self.grads.settle_unused(optimizer, self.group, self.device)
            self.updating = True  # from here on the update may be partly applied; an error leaves it set
            elsewhere = self.grads.hide_elsewhere(optimizer)
            hidden = self.offload.launch(optimizer)
            try:
                yield
            finally:
                self.offload.restore(hidden + elsewhere)
            self.updating = False
            self.after_step(stepped=True)

    def after_step(self, stepped: bool = True) -> None:
        """The optimizer has updated the masters: refresh the shards and renew what is gathered."""
        self.access.drop_grads()
        if self.timeline_recorder is not None:
            self._end_recorded_step()
        if not stepped:
            self.protocol.iterations_in_step = 0
            self.skipped_steps += 1
            return
        self.steps += 1
        for chunk in self.chunks:
            chunk.exposed = False  # written back by before_step; the gathered values are stale now
            if not chunk.offloaded:  # offloaded shards are refreshed by their update on the worker
                chunk.refresh_shard()
        self.protocol.after_step()

    def regroup(self, group: Group) -> None:
        """Issue every later collective on ``group`` (the same ranks, a fresh process group): after a step
        was given up, the old group may hold collectives some ranks issued and others never will."""
        assert (group.rank, group.world_size) == (self.group.rank, self.group.world_size)
        self.grads.forget_agreement()  # its all-reduce ran on the old group, which some ranks may not have joined
        self.group = self.protocol.group = group
        for chunk in self.chunks:
            chunk.group = group

    def finish_unreported(self) -> None:
        """End a backward whose gradients no hook reported ([Note: one hook per chunk] in grads.py), so
        that they are in the shards; every rank calls it at the same point."""
        self.protocol.finish_unreported()

    def read_agreement(self) -> None:
        """Check the ranks' agreement of the last optimizer step if it was left unread ([Note: reading the
        agreement later] in grads.py): before anything is saved, and when the run ends."""
        self.grads.read_agreement()

    def release_all(self) -> None:
        """Free every gathered block (e.g. before a state-dict load, or at teardown), keeping writes."""
        self.protocol.release_all()

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
        self.protocol.recorder = TimelineRecorder(
            self.table, self.cache, self.device, lambda: self.steps,
            lambda: sum((0 if c.master is c.shard else c.master.nbytes) + self.optimizer_state_bytes(c)
                        for c in self.chunks if not c.offloaded), budget_bytes)
        return self.protocol.recorder

    def _end_recorded_step(self) -> None:
        """An optimizer step ends the recorded step, if it has begun; the recorder then detaches."""
        recorder = self.protocol.recorder
        recorder.end_step()
        if recorder.done:
            self.protocol.recorder = None

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
        gathered_private = [c for c in self.private if c.state is not ChunkState.FREE]
        return {
            "param_shard_bytes": param_shards,
            "device_state_bytes": device_state,
            "host_bytes": self.offload.host_bytes(),
            "nvme_bytes": self.offload.nvme_bytes(),
            "shard_bytes": param_shards + device_state,
            "cache_bytes": sum(c.block_bytes for c in self.cache.gathered.values()),
            "private_bytes": sum(c.block_bytes for c in gathered_private),
            "cache_blocks": self.cache.capacity,
            "gathered_public_chunks": len(self.cache.gathered),
            "peak_gathered_public_chunks": self.cache.peak_gathered,
            "gathers": self.cache.gathers,
            "private_gathers": self.private_gathers,
        }

    def device_bytes_between_steps(self) -> int:
        """Device bytes the runtime holds after an optimizer step: parameter shards, the gradient shards,
        separate masters and optimizer state of device chunks, and the blocks that stay gathered.

        Counted without waiting for offloaded updates (``memory_stats`` would), so asking changes no overlap."""
        held = sum(c.shard.nbytes for c in self.chunks)
        for chunk in self.chunks:
            if not chunk.offloaded:
                held += chunk.grad_shard.nbytes + (0 if chunk.master is chunk.shard else chunk.master.nbytes)
                held += self.optimizer_state_bytes(chunk)
        gathered = list(self.cache.gathered.values()) + [c for c in self.private if c.state is not ChunkState.FREE]
        return held + sum(c.block_bytes for c in gathered if c.full is not c.shard)

    def optimizer_state_bytes(self, chunk: Chunk) -> int:
        """Per-element optimizer state bytes held for a device chunk's views."""
        return sum(per_element_nbytes(values, view.shape) for _, view in self._chunk_views(chunk)
                   for values in self._optimizer_states(view))

    def _optimizer_states(self, view: nn.Parameter) -> list[dict]:
        return [opt.state[view] for opt in self.optimizers if view in opt.state]

    # ---- companions -------------------------------------------------------------------------------

    def add_companion(self, name: str, device: Optional[torch.device] = None) -> list[torch.Tensor]:
        """One tensor per chunk shaped like its master shard, a copy of it, kept under ``name``.

        [Note: companion shards]
        State laid out like the parameters that is not the optimizer's (the averaged weights of an
        EMA or SWA callback) is held sharded as the masters are: this rank's piece of every chunk,
        where the chunk's master lives (the host for offloaded chunks) or on ``device``. The runtime
        carries companions wherever it carries the masters: into a new plan (replan.py), into full
        checkpoints (as ``("companion", name, id(param))`` deferred tensors) and into sharded ones
        (as ``companion.<name>.<param>``, resharded on load like the masters).
        """
        shards = []
        with torch.no_grad():
            for chunk in self.chunks:
                with self.offload.resident(chunk):
                    where = device if device is not None else (
                        chunk.master.device if chunk.placement != "nvme" else torch.device("cpu"))
                    shards.append(chunk.master.detach().to(where, copy=True))
        self.companions[name] = shards
        return shards

    # ---- giving the module back -------------------------------------------------------------------

    def remove_hooks(self) -> None:
        self.protocol.remove_hooks()

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
                if slot.stride is not None:  # for the chunks it is put in next (layout.dense_stride)
                    slot.param._elixir_stride = slot.stride
                slot.param.grad = None
        self.remove_hooks()
        self.offload.close()
        self._let_go()
        self.table.clear()
        self.grads.rebuild()
        self.grad_buffers.clear()
        self.optimizers = []

    def _let_go(self) -> None:
        """The module's parameters are no longer this runtime's."""
        holder = _HOLDER.get(self.module)
        if holder is not None and holder() is self:
            del _HOLDER[self.module]

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
                    values = full[slot.offset:slot.end].view(slot.shape)
                    if slot.stride is None:
                        slot.param.data = values.to(slot.dtype, copy=True)
                    else:  # in the layout it came with (channels_last, transposed), as DDP leaves it
                        slot.param.data = torch.empty_strided(slot.shape, slot.stride, dtype=slot.dtype,
                                                              device=values.device).copy_(values)
                    slot.param.__dict__.pop("_elixir_stride", None)
                    slot.param.grad = None
                del full
        self.remove_hooks()
        self.offload.close()
        self._let_go()
