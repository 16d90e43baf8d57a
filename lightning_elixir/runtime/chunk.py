"""One chunk: a flat buffer of parameters, sharded over ranks, gathered on demand.

[Note: parameter storage]
Each chunk owns a ``full`` tensor whose views are the module's parameters. Releasing the chunk
resizes that tensor's *storage* to zero and points each parameter's ``.data`` at an empty
placeholder; gathering resizes the same storage back and re-points ``.data`` at the views.
Keeping the storage object alive (rather than allocating a new block per gather) matters for
autograd: a view of a parameter saved in forward (``w.t()``) refers to this storage, so after the
pre-backward re-gather it reads the right values even though the chunk was released in between.
While released, a parameter is a zero-stride expansion of one NaN of the right shape: ``shape``,
``dim()`` and ``numel()`` stay true (``configure_optimizers`` commonly groups by ``p.dim()``), a
read outside the hooks yields NaN rather than freed memory, and an in-place write raises.

[Note: a world of one]
With one rank a chunk's shard is the whole chunk, so gathering it into a block of its own only
copies it, and releasing that block frees nothing the shard does not still hold. So with one rank
every plan that keeps its state on the device keeps every chunk gathered ([Note: resident plans] in
protocol.py, whatever its ``cache_blocks``: a ZeRO-3 plan on one GPU runs as ZeRO-2 does, in less
memory than evicting would take), and ``shard`` *is* ``full`` (``Chunk.aliased``): a gather binds
the views, a release unbinds them and frees nothing, and the optimizer's update of a master that is
the shard (fp32) writes the parameters the model computes with, as in a plain training loop. A plan
that offloads keeps the two apart: its shards live on the host.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn as nn

from lightning_elixir.plan import ChunkSpec
from lightning_elixir.runtime import collectives
from lightning_elixir.runtime.buffers import GradBuffers
from lightning_elixir.runtime.collectives import Group
from lightning_elixir.runtime.hostmem import HostArena
from lightning_elixir.runtime.phases import PhaseClock
from lightning_elixir.runtime.states import ChunkState, check_transition


@dataclass
class Slot:
    """Where one parameter lives inside its chunk."""

    name: str
    param: nn.Parameter
    offset: int
    numel: int
    shape: torch.Size
    dtype: torch.dtype = torch.float32
    """The parameter's dtype before chunking (teardown gives it back in this dtype)."""
    view: Optional[torch.Tensor] = None
    stride: Optional[tuple[int, ...]] = None
    """The parameter's strides before chunking where they were not the contiguous ones (a channels_last
    convolution weight, a transposed tensor), else None: teardown gives its values back in that layout,
    as DDP leaves it. Within the chunk its values are in row-major order, as for any parameter."""

    @property
    def end(self) -> int:
        return self.offset + self.numel

    def check_new_data(self, value: torch.Tensor) -> None:
        """``.data = value`` for this slot's parameter: values of its shape (and kind, real or complex) are
        copied into its view; anything else cannot live in the chunk's fixed layout."""
        if tuple(value.shape) != tuple(self.shape) or value.is_complex() != self.dtype.is_complex:
            raise RuntimeError(f"{self.name!r}.data = a tensor of shape {tuple(value.shape)} and dtype {value.dtype}: "
                               "under the Elixir strategy a parameter's values live in a chunk of fixed layout, so "
                               f"its data can only be given new values of its shape {tuple(self.shape)} (copied in)")


class Chunk:
    """A flat, sharded buffer of parameters with its gradient and master shards."""

    def __init__(self, index: int, spec: ChunkSpec, slots: list[Slot], group: Group, device: torch.device,
                 compute_dtype: torch.dtype, master_dtype: torch.dtype, reduce_dtype: torch.dtype,
                 state_device: Optional[torch.device] = None, host: Optional[HostArena] = None,
                 aliased: bool = False) -> None:
        """``state_device``: where the master and gradient shards live (default ``device``); an offloaded
        chunk's are on the host, and its master is always a copy of its own. ``host``: where the
        offloaded tensors that stay in host memory come from (``host_requests``; pinned on a GPU).
        ``aliased``: the shard is the gathered block (one rank, a plan that keeps its chunks gathered)."""
        self.index = index
        self.spec = spec
        self.clock = PhaseClock()
        """Where this chunk's waits are timed; the runtime sets its one clock on every chunk."""
        self.grad_buffers = GradBuffers()
        """Where full-size gradient buffers come from; the runtime's chunks share one."""
        self.slots = slots
        self.param_ids = frozenset(id(s.param) for s in slots)
        self.group = group
        self.numel = spec.numel
        self.shard_numel = spec.numel // group.world_size
        self.shard_begin = group.rank * self.shard_numel
        self.reduce_dtype = reduce_dtype
        self.state = ChunkState.HOLD  # born gathered: views are made while the storage exists (see fill)
        self.bound = False
        """Whether the parameters' ``.data`` are their views of the block (else placeholders)."""
        self.pins = 0
        self.exposed = False
        """Code outside the hooks got hold of the gathered values and may write to them."""
        self._gather_work: Any = None
        nan = torch.full((1,), float("nan") if compute_dtype.is_floating_point or compute_dtype.is_complex else 0,
                         dtype=compute_dtype, device=device)  # an integer chunk's placeholder reads zero
        self._placeholders = [nan.expand(slot.shape) if len(slot.shape) else nan[0] for slot in slots]
        self.full = torch.zeros(self.numel, dtype=compute_dtype, device=device)
        for slot in slots:
            slot.view = self.full[slot.offset:slot.end].view(slot.shape)
        assert not aliased or group.world_size == 1, "only one rank's shard can be the whole chunk"
        self.aliased = aliased
        """The shard is the gathered block itself ([Note: a world of one])."""
        if not aliased:  # the block is allocated when filled: building holds one chunk's block at a time
            self.full.untyped_storage().resize_(0)
        self.shard = self.full if self.aliased else torch.zeros(self.shard_numel, dtype=compute_dtype, device=device)
        state_device = device if state_device is None else state_device
        self.offloaded = spec.placement != "device"
        same = master_dtype == compute_dtype and not self.offloaded
        kept = host_requests(spec, self.shard_numel, compute_dtype, master_dtype) if host is not None else {}

        def zeros(name: str) -> torch.Tensor:  # from the arena what it holds, in its order
            if name in kept:
                return host.zeros(*kept[name])
            return torch.zeros(self.shard_numel, dtype=master_dtype, device=state_device)

        self.master = self.shard if same else zeros("master")
        self.grad_shard = zeros("grad_shard")
        self.host_arena = host if kept else None
        """The arena this chunk's host tensors are cut from, if any (its slack is counted as host memory)."""
        self.pending_update: Optional[Future] = None
        """The offloaded optimizer update of this chunk still running on a worker thread, if any."""
        self.learned: dict[frozenset[int], int] = {}
        """The watcher learned for each set of trainable parameters: optimizers toggled in turn (a GAN's
        over a chunk holding parts of both networks) reuse theirs at every switch."""
        self.forget_watcher()
        self.track_trainable()

    # ---- state ------------------------------------------------------------------------------

    @property
    def private(self) -> bool:
        return self.spec.private

    @property
    def full_bytes(self) -> int:
        return self.numel * self.full.element_size()

    @property
    def block_bytes(self) -> int:
        """Device bytes a gathered copy holds beyond the shard (none when the shard is the chunk)."""
        return 0 if self.aliased else self.full_bytes

    def _move(self, new: ChunkState) -> None:
        check_transition(self.index, self.state, new)
        self.state = new

    @property
    def placement(self) -> str:
        return self.spec.placement

    def settle(self) -> None:
        """Wait for this chunk's offloaded update (its master, shard and gradient are then current).

        An error raised by the update (an NVMe read that failed validation) is raised here.
        """
        if self.pending_update is not None:
            future, self.pending_update = self.pending_update, None
            with self.clock.timing("offload_wait"):
                future.result()

    def start_gather(self, async_op: bool) -> None:
        """FREE -> GATHERING: allocate the block and all-gather the shards into it."""
        self.settle()
        self._move(ChunkState.GATHERING)
        if self.aliased:
            return
        self.full.untyped_storage().resize_(self.full_bytes)
        self._all_gather(async_op)

    def regather(self) -> None:
        """HOLD -> GATHERING: all-gather fresh shards into the block the views already point at (a chunk
        that stays gathered across steps, [Note: resident plans] in runtime/protocol.py)."""
        self._move(ChunkState.GATHERING)
        if not self.aliased:
            self._all_gather(async_op=True)

    def _all_gather(self, async_op: bool) -> None:
        if async_op:
            self._gather_work = collectives.all_gather(self.full, self.shard, self.group, async_op=True,
                                                        chunk=self.index)
            return
        with self.clock.timing("gather_wait", self.full.device):  # a demand gather: the step waits for all of it
            collectives.all_gather(self.full, self.shard, self.group, chunk=self.index)

    def finish_gather(self) -> None:
        """GATHERING -> HOLD: wait for the all-gather and point parameters at their views."""
        if self._gather_work is not None:
            with self.clock.timing("gather_wait", self.full.device):  # a stream wait on a GPU
                self._gather_work.wait()
            self._gather_work = None
        self._move(ChunkState.HOLD)
        if not self.bound:
            self.bind_views()

    def pin(self) -> None:
        """Mark one more running module as computing with this chunk."""
        if self.pins == 0:
            self._move(ChunkState.COMPUTE)
        self.pins += 1

    def unpin(self) -> None:
        """One running module is done with this chunk."""
        assert self.pins > 0, f"chunk {self.index} unpinned more often than pinned"
        self.pins -= 1
        if self.pins == 0:
            self._move(ChunkState.HOLD)

    def release(self) -> None:
        """HOLD -> FREE: keep what was written to the gathered values, free the block; placeholders in."""
        self._move(ChunkState.FREE)
        if self.written():
            self.write_back()
        with torch._C.DisableTorchFunctionSubclass():  # a ChunkedParameter's ``.data =`` reads nothing
            for slot, placeholder in zip(self.slots, self._placeholders):
                slot.param.data = placeholder
        self.bound = False
        if not self.aliased:
            self.full.untyped_storage().resize_(0)

    def fill(self, values: torch.Tensor) -> None:
        """Building a chunk: allocate its block, copy the whole chunk's ``values`` into it and point the
        parameters at their views (it is released before the next chunk is filled, so that building a
        model that fits the device only sharded never holds more than one chunk's block)."""
        storage = self.full.untyped_storage()
        if storage.nbytes() != self.full_bytes:
            storage.resize_(self.full_bytes)
        self.full.copy_(values)
        self.bind_views()

    def bind_views(self) -> None:
        """Point each parameter's data at its view of the gathered block."""
        with torch._C.DisableTorchFunctionSubclass():  # as in release: no ChunkedParameter dispatch per slot
            for slot in self.slots:
                slot.param.data = slot.view
        self._marks = self._param_marks()
        self.bound = True

    def _param_marks(self) -> list[tuple[int, int]]:
        """Each parameter's version counter (which in-place operations on it move) and data pointer (which
        assigning its ``.data`` moves)."""
        with torch._C.DisableTorchFunctionSubclass():  # attribute reads: no ChunkedParameter dispatch
            return [(slot.param._version, slot.param.data_ptr()) for slot in self.slots]

    def written(self) -> bool:
        """Whether code may have written to the gathered values since they were bound or written back: it
        read them outside the hooks (``exposed``), or an in-place operation on a parameter moved its version
        counter ([Note: writes to parameters])."""
        return self.exposed or (self.bound and self._param_marks() != self._marks)

    def write_back(self) -> None:
        """Copy values written to this rank's part of the gathered block into the master shard.

        [Note: writes to parameters]
        Code that writes to parameters in place (``p.data.clamp_()``, an EMA swap inside
        ``gathered_params()``, ``weight.clamp_()`` under no_grad in a module's own forward, a tied
        embedding renormalised before the step) writes to the gathered block, which the next gather
        overwrites. Such a chunk is found two ways: a read outside the hooks marks it ``exposed``
        (it may be written through ``.data``), and an in-place operation on a parameter itself moves
        that parameter's version counter, which ``written`` compares with the one it had when its
        view was bound (a list of attribute reads, when a chunk is released and before each
        optimizer step; a write through ``.data`` inside a module's own forward, where nothing is
        intercepted, moves no counter of the parameter and is not seen). Assigning ``.data`` there (a
        max-norm constraint, ``w.data = torch.renorm(w.data, ...)``) points the parameter at a tensor of
        its own, which the comparison finds by the parameter's data pointer: its values are copied
        into the view and the parameter is bound to it again (``_take_rebound``).
        Every rank runs the same code, so each one compares its own part of the block with its
        compute-dtype shard and copies only the elements that changed into the master: the fp32
        master keeps its precision wherever nothing was written. Where the shard is the block
        ([Note: a world of one]) the writes are in the shard already; the master, if it is not the
        shard itself, is compared in the compute dtype instead.
        """
        self.exposed = False
        if self.bound:
            self._take_rebound()
            self._marks = self._param_marks()
        own = self.full[self.shard_begin:self.shard_begin + self.shard_numel]
        if self.aliased and self.master is self.shard:
            return  # the writes went to the master itself
        self.settle()
        reference = self.master.to(own.device, own.dtype) if self.aliased else self.shard
        changed = own.ne(reference)
        if not bool(changed.any()):
            return
        if self.master is not self.shard:
            kept = self.master.to(own.device)
            self.master.copy_(torch.where(changed, own.to(self.master.dtype), kept))
        if not self.aliased:
            self.shard.copy_(own)

    def _take_rebound(self) -> None:
        """Parameters whose ``.data`` was assigned where nothing intercepts it (a module's own forward, as
        a max-norm constraint does it): their values go into their views, which they are bound to again."""
        with torch._C.DisableTorchFunctionSubclass():
            for slot in self.slots:
                param = slot.param
                if param.data_ptr() == slot.view.data_ptr():
                    continue
                data = param.data
                slot.check_new_data(data)
                slot.view.copy_(data)
                param.data = slot.view

    def gather_full(self, shard: torch.Tensor) -> torch.Tensor:
        """A new chunk-sized tensor gathered from every rank's ``shard`` (master, gradient, optimizer state)."""
        self.settle()
        device = self.full.device  # the collectives' device: an offloaded shard travels there first
        full = torch.empty(self.numel, dtype=shard.dtype, device=device)
        collectives.all_gather(full, shard.to(device), self.group, chunk=self.index)
        return full

    def gather_to_first(self, shard: torch.Tensor, out: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
        """``gather_full`` on rank 0 only (None elsewhere): for saving, where no other rank needs the values
        and none should hold more than its shard. ``out``: rank 0's chunk-sized result (a new tensor when
        None), whose first shard may already be ``shard``."""
        self.settle()
        device = self.full.device
        if self.group.rank == 0 and out is None:
            out = torch.empty(self.numel, dtype=shard.dtype, device=device)
        collectives.gather_to_first(out, shard.to(device), self.group, chunk=self.index)
        return out

    def write_back_grad(self, full: torch.Tensor) -> None:
        """Keep in-place changes to a gathered gradient (manual clipping) in this rank's shard."""
        own = full[self.shard_begin:self.shard_begin + self.shard_numel].to(self.grad_shard.device)
        # On a GPU ``torch.equal`` makes the host wait for the device, and reads as many bytes as the copy:
        # a shard on the device is copied as it is (unchanged values stay what they were).
        if own.device.type != "cpu" or not torch.equal(own, self.grad_shard):
            self.grad_shard.copy_(own)

    # ---- gradients --------------------------------------------------------------------------

    def track_trainable(self) -> None:
        """Take the parameters' ``requires_grad`` as it is now (at construction, or after it changed)."""
        self.trainable_slots = [s for s in self.slots if s.param.requires_grad]
        self.grad_requiring = {id(s.param) for s in self.trainable_slots}
        self._view_cache: list[tuple[torch.Tensor, list[torch.Tensor]]] = []
        self._grad_holes = _holes(self.numel, [(s.offset, s.end) for s in self.trainable_slots])
        self._frozen = [(s.offset, s.end) for s in self.slots if s.numel and not s.param.requires_grad]
        """Slots of frozen parameters: zero in a reduced gradient shard, and so where one rank writes its own."""
        if self.grad_requiring and self.grad_requiring != self.learned_for:
            learned = self.learned.get(frozenset(self.grad_requiring))
            if learned is None:
                self.forget_watcher()
            else:  # these parameters trained before (optimizers toggled in turn): their watcher is known
                self.learn_watcher(learned)
        self.reset_grad_tracking()

    def learn_watcher(self, pid: int) -> None:
        """``pid``'s gradient completes the chunk while the parameters trainable now train."""
        self.watcher, self.learned_for = pid, frozenset(self.grad_requiring)
        self.learned[self.learned_for] = pid

    def forget_watcher(self, everything: bool = False) -> None:
        """Learn again which parameter completes the chunk ([Note: one hook per chunk] in grads.py);
        ``everything``: forget the watchers learned for other sets of trainable parameters too."""
        if everything:
            self.learned.clear()
        self.watcher: Optional[int] = None
        """id of the one trainable parameter whose hook stands for the chunk, once learned; None while
        every trainable parameter has a hook."""
        self.learned_for: frozenset[int] = frozenset()
        """The trainable parameters the watcher was learned for: kept while they are frozen (an
        optimizer toggled off) and used again when the same ones train."""
        self.last_arrival: Optional[int] = None
        """id of the parameter whose gradient completed the chunk in the last backward that hooked them all."""
        self.watch_missed = False
        """The watcher reported before the chunk's other gradients in this backward: hook them all again."""

    def reset_grad_tracking(self) -> None:
        """Start a new backward: no gradients have arrived yet."""
        self.pending_grads = set(self.grad_requiring)
        self.absent_grads: set[int] = set()
        """Trainable parameters whose unit finished its backward without them ([Note: parameters a rank
        did not use] in runtime/protocol.py): their gradient is zero on this rank."""
        self.got_grads: set[int] = set()
        """ids of the trainable parameters whose gradient the reduction took (those that got one here)."""
        self.grad_full: Optional[torch.Tensor] = None
        self._reduce: Optional[tuple[Any, Optional[torch.Tensor]]] = None
        self._received: Optional[torch.Tensor] = None
        """On the CPU, where the peers' parts of the reduction in flight arrive (a reused buffer)."""

    @property
    def grads_complete(self) -> bool:
        return not self.pending_grads

    def grads_all_here(self) -> bool:
        """Whether every trainable parameter has a gradient in ``.grad`` now (an attribute read each)."""
        with torch._C.DisableTorchFunctionSubclass():  # the parameters may be ChunkedParameters
            return all(slot.param.grad is not None for slot in self.trainable_slots)

    def take_grads(self) -> list[Optional[torch.Tensor]]:
        """The gradients autograd accumulated into the trainable parameters' ``.grad`` (None where a
        parameter got none), in ``trainable_slots`` order; the ``.grad``s go back to None.

        [Note: gradients land per chunk]
        Autograd accumulates each parameter's gradient into its ``.grad`` in C++; the runtime's hooks
        only say when the chunk has them all ([Note: one hook per chunk] in grads.py). When a
        chunk's reduction starts, all its gradients move into the reduction's buffer in one
        multi-tensor copy, averaged over the ranks as DDP's buckets are: one Python call per chunk
        where there was one operator per parameter. The
        views of the buffer at the parameters' slots are made once for buffers that live on (the
        gradient shard where it is the chunk, the reused CPU buffers).
        """
        taken: list[Optional[torch.Tensor]] = []
        with torch._C.DisableTorchFunctionSubclass():  # the parameters may be ChunkedParameters
            for slot in self.trainable_slots:
                grad = slot.param.grad
                if grad is not None:
                    slot.param.grad = None
                    self.got_grads.add(id(slot.param))
                    if grad.layout != torch.strided:
                        grad = grad.to_dense()
                taken.append(grad)
        return taken

    def _views_into(self, target: torch.Tensor) -> list[torch.Tensor]:
        """Views of a chunk-sized ``target`` at the trainable slots (cached while ``target`` lives on)."""
        for cached, views in self._view_cache:
            if cached is target:
                return views
        views = [target[slot.offset:slot.end].view(slot.shape) for slot in self.trainable_slots]
        if target is self.grad_shard or target.device.type == "cpu":  # kept alive anyway: the shard, the pool
            self._view_cache = [*self._view_cache[-3:], (target, views)]
        return views

    def _fill(self, target: torch.Tensor, grads: list[Optional[torch.Tensor]], accumulate: bool) -> None:
        """Write (or add) ``grads`` into their slots of a chunk-sized ``target``; zero the trained slots
        that got none when overwriting (a trainable parameter unused this time: a zero gradient)."""
        views = self._views_into(target)
        with torch.no_grad():  # create_graph: the gradients carry a graph; the chunk's copy does not
            got = [(v, g if g.device == target.device else g.to(target.device))
                   for v, g in zip(views, grads) if g is not None]
            if len(got) < len(views) and not accumulate:
                for v, g in zip(views, grads):
                    if g is None:
                        v.zero_()
            if got:
                dst, src = [v for v, _ in got], [g for _, g in got]
                if accumulate:
                    torch._foreach_add_(dst, src)
                else:
                    torch._foreach_copy_(dst, src)

    def _new_grad_buffer(self) -> torch.Tensor:
        """An uninitialised buffer whose gaps (padding, frozen parameters) are zero."""
        buf = self.grad_buffers.take(self.numel, self.reduce_dtype, self.full.device)
        for begin, end in self._grad_holes:
            buf[begin:end].zero_()
        return buf

    def start_reduce(self, copy_stream: Any = None, accumulate: bool = False) -> None:
        """Sum the gradients over ranks, averaged, into this rank's shard (async).

        With one rank the gradient shard is chunk-sized and there is nothing to sum: on the device the
        gradients go straight into it, and an offloaded chunk's leave from the buffer they were copied
        into. With a ``copy_stream`` (an offloaded chunk on a GPU) the reduced shard also starts its way
        to the host gradient shard at once, overlapping the rest of backward ([Note: landing gradients
        on the host]).
        """
        grads = self.take_grads()
        if self.group.world_size == 1 and not self.offloaded:
            self._fill(self.grad_shard, grads, accumulate)
            if not accumulate:
                for begin, end in self._frozen:
                    self.grad_shard[begin:end].zero_()
            self._reduce = (_DONE, None)
            return
        self.grad_full = self._new_grad_buffer()
        self._fill(self.grad_full, grads, accumulate=False)
        if self.group.world_size > 1:  # averaged before the sum, as DDP divides its buckets
            self.grad_full.div_(self.group.world_size)
        received = None
        if self.full.device.type == "cpu":  # summed in place ([Note: reduce-scatter on gloo]): read this rank's part
            out = self.grad_full[self.shard_begin:self.shard_begin + self.shard_numel]
            if self.group.world_size > 1:  # the peers' parts land in a reused buffer too
                received = self._received = self.grad_buffers.take(
                    (self.group.world_size - 1) * self.shard_numel, self.reduce_dtype, self.full.device)
        elif self.group.world_size == 1:  # the shard is the chunk
            out = self.grad_full
        else:
            out = torch.empty(self.shard_numel, dtype=self.reduce_dtype, device=self.full.device)
        work = collectives.reduce_scatter(out, self.grad_full, self.group, async_op=True, chunk=self.index,
                                          received=received)
        self._reduce = (work, out)
        if copy_stream is not None:
            self._reduce = self._land_on_host(work, out, copy_stream, accumulate)

    def _land_on_host(self, work: Any, out: torch.Tensor, stream: Any, accumulate: bool) -> tuple[Any, torch.Tensor]:
        """Queue the device-to-host copy of a reduced shard behind its reduce-scatter.

        [Note: landing gradients on the host]
        The copy stream waits for the compute stream (what the gradients were computed by; with one
        rank ``out`` is their buffer itself), then, inside it, ``work.wait()`` on an NCCL work makes
        the *current* stream, the copy stream there, wait for the collective: neither the host nor
        the compute stream waits, and the rest of backward runs beside the reduction. (Waited for on
        the compute stream, every later backward kernel queued behind each offloaded chunk's
        reduce-scatter.) The copy writes the shard into pinned host memory without blocking:
        directly into the gradient shard when it is overwritten, or into a staging buffer when it
        accumulates (added on the host when the reduction is retired). The event recorded after the
        copy is what ``finish_reduce`` waits for; ``out`` and the full gradient buffer stay
        referenced until then, so the allocator cannot reuse them while the collective or the copy
        reads them.
        """
        self.settle()  # the previous update reads the gradient shard this copy overwrites
        stream.wait_stream(torch.cuda.current_stream(out.device))
        target = (torch.empty(out.shape, dtype=self.grad_shard.dtype, pin_memory=True) if accumulate
                  else self.grad_shard)
        with torch.cuda.stream(stream):
            work.wait()
            target.copy_(out.to(target.dtype), non_blocking=True)
            event = torch.cuda.Event(blocking=True)  # waited for without spinning on a core the worker needs
            event.record(stream)
        return _Landed(event, out, into_shard=not accumulate), target

    def finish_reduce(self, accumulate: bool) -> None:
        """Wait for the reduce-scatter and write (or add) the result into the gradient shard."""
        assert self._reduce is not None, f"chunk {self.index}: finish_reduce without start_reduce"
        work, out = self._reduce
        if work is _DONE:  # landed in the shard when it started
            self._reduce = None
            return
        stream_wait = not isinstance(work, _Landed)  # a landing is waited for on the host
        with self.clock.timing("reduce_wait", self.full.device if stream_wait else None):
            work.wait()
        self.settle()  # an offloaded update may still read the previous step's gradient
        if not (isinstance(work, _Landed) and work.into_shard):  # else: already copied into the shard
            out = out.to(self.grad_shard.device)
            if accumulate:
                self.grad_shard.add_(out)
            else:
                self.grad_shard.copy_(out)
        for buffer in (self.grad_full, self._received):
            if buffer is not None:
                self.grad_buffers.give(buffer)
        self.grad_full = self._received = None
        self._reduce = None

    @property
    def reduce_started(self) -> bool:
        """Whether a reduce-scatter's output is in flight (not for gradients that landed in the shard)."""
        return self._reduce is not None and self._reduce[0] is not _DONE

    # ---- shards -----------------------------------------------------------------------------

    def shard_range(self, slot: Slot) -> tuple[int, int]:
        """The part of ``slot`` this rank owns, as [begin, end) offsets into the shard (may be empty)."""
        begin = max(slot.offset, self.shard_begin) - self.shard_begin
        end = min(slot.end, self.shard_begin + self.shard_numel) - self.shard_begin
        return begin, max(begin, end)

    def elsewhere(self, slot: Slot) -> bool:
        """Whether other ranks own all of ``slot`` and this rank none ([Note: shard views held elsewhere]
        in optim.py)."""
        begin, end = self.shard_range(slot)
        return slot.numel > 0 and begin == end

    def owner(self, slot: Slot) -> int:
        """The rank that owns ``slot``'s first element (its optimizer scalars are the ones kept)."""
        return slot.offset // self.shard_numel if self.shard_numel else 0

    def refresh_shard(self) -> None:
        """Copy the updated master shard into the compute-dtype shard that gets gathered."""
        if self.master is not self.shard:
            self.shard.copy_(self.master)


_DONE = object()
"""The work handle of a reduction that had nothing to wait for."""


@dataclass
class _Landed:
    """A reduced shard on its way to the host: done when the copy's event has completed."""

    event: Any
    source: torch.Tensor
    """The device shard being copied (kept alive until the copy is done)."""
    into_shard: bool
    """The copy goes straight into the gradient shard (else into a staging buffer to add)."""

    def wait(self) -> None:
        self.event.synchronize()


def host_requests(spec: ChunkSpec, shard_numel: int, compute_dtype: torch.dtype,
                  master_dtype: torch.dtype) -> dict[str, tuple[int, torch.dtype]]:
    """(numel, dtype) by name of the tensors an offloaded chunk keeps in host memory for the whole run, in the
    order it takes them from its ``HostArena`` ([Note: pinned memory in slabs] in hostmem.py): pinned on
    a GPU, as what crosses the bus itself is. Its master, where it has the compute dtype and is not paged
    out to NVMe (a master of another dtype goes up through the uploads' staging buffer, [Note: uploads
    of updated shards] in upload.py), then its gradient shard."""
    kept = {}
    if spec.placement == "cpu" and master_dtype == compute_dtype:
        kept["master"] = (shard_numel, master_dtype)
    if spec.placement != "device":
        kept["grad_shard"] = (shard_numel, master_dtype)
    return kept


def _holes(numel: int, covered: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The [begin, end) ranges of [0, numel) that no range in ``covered`` touches."""
    holes, cursor = [], 0
    for begin, end in sorted(covered):
        if begin > cursor:
            holes.append((cursor, begin))
        cursor = max(cursor, end)
    if cursor < numel:
        holes.append((cursor, numel))
    return holes
