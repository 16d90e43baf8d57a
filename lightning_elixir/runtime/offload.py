"""Offloaded chunks: sharded state in host memory or on NVMe, updated on a worker thread.

[Note: offloaded updates]
A chunk placed "cpu" keeps its fp32 master and gradient shards in host memory (pinned on GPU
machines) and its optimizer state where torch creates it, next to the master. A chunk placed
"nvme" keeps master and optimizer state in one record per chunk under ``nvme_path`` (one file,
written and read whole, validated on read: runtime/nvme.py); its gradient shard stays in host
memory because every micro-batch writes it.

The reduce-scatter of an offloaded chunk lands its gradient in the host shard when the reduction is
retired (two reductions later, or at the end of backward: [Note: reductions in flight] in
reductions.py). When the optimizer steps, the user's ``optimizer.step()`` updates the device chunks on
the main thread and the offloaded chunks are handed to one worker thread, in the order the next
forward needs them (private chunks, then public chunks in first-use order). Per chunk the worker
reads the NVMe record (the next chunk's read is issued before this chunk's update: read-ahead),
runs the chunk's shadow optimizer ([Note: shadow optimizers] in shadow.py), copies the updated
master into the chunk's compute-dtype shard on the device, and writes the record back in the
background (write-behind). The next forward does not wait for the whole update: each chunk's
gather waits for that chunk only (``Chunk.settle``), so the update hides behind the device step,
the loop's bookkeeping and the next forward up to the chunk's first use. The offloaded chunks are
the ones reduced first in backward, which are the ones the forward needs last.

Exact semantics: the update uses the gradients and hyperparameters the step would use, after
gradient clipping, the fp16 overflow decision and ``on_before_optimizer_step`` hooks (an LR
scheduler that steps afterwards does not reach it). Nothing is speculative and nothing is rolled
back. By default it starts when the step is taken; see [Note: updates started in backward] for
when it starts earlier.

[Note: updates started in backward]
A chunk's gradient is final once its reduction retires, often long before the backward ends: the
offloaded chunks are reduced first. When nothing between that moment and the optimizer step can
change what the update computes, the chunk's update starts on the worker at once
(``OffloadEngine.landed``), overlapping the rest of the backward, as the step's own launch would
have, only earlier. What could change it is global: clipping by norm reads every gradient, the
fp16 overflow check may skip the step, a later micro-batch adds to the gradient, and user code
between backward and step (``on_after_backward``, ``on_before_optimizer_step``,
``configure_gradient_clipping``, an overridden ``optimizer_step``, manual optimization) may read or
change gradients or hyperparameters, and an overridden ``backward`` may keep the graph for a second
backward, which would read parameters already updated. A backward through a graph that
``torch.autograd.grad(..., create_graph=True)`` built earlier in the step (a penalty on gradients)
reads a parameter's value after its gradient is complete: the gradient of another parameter's
gradient needs it (the catalog's gradient-norm penalty showed it). So the strategy allows it
(``OffloadEngine.early``) only for a backward under automatic optimization that ends its
accumulation, with no gradient clipping, no fp16 scaler, no graph kept from such an earlier
backward (``StepProtocol.holds_graphs``), and none of those hooks overridden by the module or a
callback; otherwise the update waits for the step: the runtime holds rather than speculates. By
default only on an accelerator: on a CPU-only machine the host is the device, and the update would
compete with the backward for the same cores (examples/benchmarks/offload.py showed no gain there).
Per chunk, it starts only when every trainable parameter of the chunk got its gradient on this rank
in this backward, so that no
parameter can turn out unused at the step ([Note: unused parameters] in grads.py), and only for
chunks in host memory (NVMe chunks keep the step's read-ahead). The started chunks' gradients are
hidden from the user's views until the step has run, as the step's own launch hides them, and the
step checks that the hyperparameters it would have used are the ones the update used (it warns if
not: code the strategy could not see changed them). Gradients land in the reverse of the order the
next forward needs the chunks, so when the worker falls behind, the chunk it takes next is the one
needed first of those that have landed, not the one that landed first: otherwise the first layers'
chunks, landing last, would wait behind every other update while the next forward waits for them.
"""

from __future__ import annotations

import contextlib
import heapq
import logging
import math
import os
import threading
import time
from collections.abc import Generator, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.nn as nn
from torch.optim import Optimizer

from lightning_elixir.devices import indexed, release_pinned_cache, start_worker
from lightning_elixir.plan import ChunkSpec, PlanError
from lightning_elixir.runtime.chunk import Chunk, Slot
from lightning_elixir.runtime.hotpath import label
from lightning_elixir.runtime.nvme import NvmeStore, Page
from lightning_elixir.runtime.shadow import Shadow, per_element_keys, views_of
from lightning_elixir.runtime.states import ChunkState
from lightning_elixir.runtime.upload import Uploads
from lightning_elixir.runtime.state_dict import is_per_element, per_element_nbytes

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class RecordLayout:
    """Where each field of an NVMe chunk's record lies: the master first, then per-element optimizer state."""

    fields: tuple[tuple[str, torch.dtype], ...]
    """(name, dtype) of each field; every field has ``numel`` elements."""
    numel: int
    """Elements per field: the chunk's shard numel."""

    def offsets(self) -> list[int]:
        """Byte offset of each field, then the record's size: fields back to back, each aligned to its
        own element size (fp32 master and fp32 state: no gaps, the bytes the search counts)."""
        out, at = [], 0
        for _, dtype in self.fields:
            at = _round_up(at, dtype.itemsize)
            out.append(at)
            at += self.numel * dtype.itemsize
        return out + [at]

    @property
    def nbytes(self) -> int:
        return self.offsets()[-1]

    def views(self, data: torch.Tensor) -> dict[str, torch.Tensor]:
        """Typed views of a page's bytes, one per field."""
        offsets = self.offsets()
        return {name: data[offsets[i]:offsets[i] + self.numel * dtype.itemsize].view(dtype)
                for i, (name, dtype) in enumerate(self.fields)}


@dataclass
class _Job:
    """One chunk's update in a launched step."""

    chunk: Chunk
    shadow: Shadow
    hypers: list[dict[str, Any]]
    grads: list[Optional[torch.Tensor]]
    ready: Any = None
    """On a GPU, an event on the launching thread's stream after every read of the chunk's device shard
    queued so far; the upload waits for it before it overwrites the shard."""
    future: Future = field(default_factory=Future)


class OffloadEngine:
    """Runs the offloaded chunks of a runtime (see [Note: offloaded updates]).

    Args:
        chunks: every chunk of the runtime; those placed "cpu" or "nvme" are handled here.
        device: the training device (copies to it are waited for before an update counts as done).
        rank: this process's rank (NVMe files are per rank).
        nvme_path: directory for NVMe records; required when a chunk is placed "nvme".
        nvme_buffers: page buffers for NVMe records (one updating, one reading ahead, one writing).
    """

    def __init__(self, chunks: list[Chunk], device: torch.device, rank: int, nvme_path: Optional[str] = None,
                 nvme_buffers: int = 3) -> None:
        self.chunks = sorted((c for c in chunks if c.offloaded), key=lambda c: (not c.private, c.index))
        self.nvme = [c for c in self.chunks if c.placement == "nvme"]
        check_nvme_path_given([c.spec for c in chunks], nvme_path)
        self.device = device
        self.rank = rank
        self.nvme_path = nvme_path
        self.nvme_buffers = nvme_buffers
        self.optimizers: list[Optimizer] = []
        self.shadows: dict[tuple[int, int], Shadow] = {}
        self.members: dict[int, list[tuple[Slot, nn.Parameter]]] = {c.index: [] for c in self.chunks}
        """Per offloaded chunk: every (slot, view) whose data is its master (user and shadow views)."""
        self.user_views: dict[int, list[tuple[Slot, nn.Parameter]]] = {c.index: [] for c in self.chunks}
        self.owner: dict[int, Optimizer] = {}
        """id(user view) -> the optimizer whose state holds it."""
        self.store: Optional[NvmeStore] = None
        self.layout_fields: tuple[tuple[str, torch.dtype], ...] = ()
        self.on_disk: set[int] = set()
        threads = worker_threads(device, torch.get_num_threads())
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="elixir-offload", initializer=start_worker,
                                          initargs=(indexed(device), threads)) if self.chunks else None
        self.copy_stream = torch.cuda.Stream(device) if self.chunks and device.type == "cuda" else None
        """Where offloaded gradient shards are copied to the host as their reduce-scatters finish."""
        self.uploads = Uploads(device if self.chunks else None)
        """The updated shards' way back to the device ([Note: uploads of updated shards] in upload.py)."""
        self.update_s = 0.0
        self.updates = 0
        self.early = False
        """Whether the backward running now may start updates ([Note: updates started in backward])."""
        self.early_updates = 0
        """Chunk updates started in backward so far."""
        self._early: dict[tuple[int, int], tuple[list[dict[str, Any]], list[tuple[nn.Parameter, torch.Tensor]]]] = {}
        """(id(optimizer), chunk index) -> the hyperparameters an update started in backward used, and the
        gradients it hid from the user's views; taken by that optimizer's next launch."""
        self._warned_hypers = False
        self._order = {chunk.index: i for i, chunk in enumerate(self.chunks)}
        """Chunk index -> its place in the order the next forward needs the chunks (private first)."""
        self._waiting: list[tuple[int, int, list[_Job]]] = []
        """Updates started in backward, not yet taken by the worker: a heap by ``_order``."""
        self._waiting_lock = threading.Lock()
        if self.nvme:
            self._relayout((("master", self.nvme[0].master.dtype),))

    # ---- optimizers -------------------------------------------------------------------------------

    def attach(self, optimizer: Optimizer, view_index: dict[int, tuple[Chunk, Slot]]) -> None:
        """Make shadows for ``optimizer``'s views of offloaded chunks; extend the NVMe records by its state."""
        self.settle()
        by_chunk: dict[int, list[tuple[int, nn.Parameter, nn.Parameter]]] = {}
        for g, view in views_of(optimizer):
            chunk, slot = view_index[id(view)]
            if not chunk.offloaded:
                continue
            begin, end = chunk.shard_range(slot)
            shadow_view = nn.Parameter(chunk.master[begin:end], requires_grad=view.requires_grad)
            by_chunk.setdefault(chunk.index, []).append((g, view, shadow_view))
            self.members[chunk.index] += [(slot, view), (slot, shadow_view)]
            self.user_views[chunk.index].append((slot, view))
            self.owner[id(view)] = optimizer
        if not by_chunk:
            return
        self.optimizers.append(optimizer)
        for index, members in by_chunk.items():
            self.shadows[(id(optimizer), index)] = Shadow(optimizer, members, fused_when_unset=self.device.type != "cpu")
        if self.nvme:
            known = dict(self.layout_fields)
            extra = {k: d for k, d in per_element_keys(optimizer).items() if k not in known}
            if extra:
                self._relayout(self.layout_fields + tuple(extra.items()))

    def reattach(self, optimizer: Optimizer, view_index: dict[int, tuple[Chunk, Slot]]) -> None:
        """``optimizer`` has new param groups (``add_param_group``): make its shadows again over all of them.
        Its state stays where it is, in the user's optimizer, which the shadows' state aliases."""
        self.settle()
        mine = [key for key in self.shadows if key[0] == id(optimizer)]
        for key in mine:
            shadow = self.shadows.pop(key)
            gone = {id(t) for pair in shadow.pairs for t in pair}
            self.members[key[1]] = [(slot, t) for slot, t in self.members[key[1]] if id(t) not in gone]
            self.user_views[key[1]] = [(slot, t) for slot, t in self.user_views[key[1]] if id(t) not in gone]
        self.owner = {k: o for k, o in self.owner.items() if o is not optimizer}
        self.optimizers = [o for o in self.optimizers if o is not optimizer]
        self.attach(optimizer, view_index)

    def launch(self, optimizer: Optimizer) -> list[tuple[nn.Parameter, torch.Tensor]]:
        """Hand ``optimizer``'s offloaded chunks to the worker; hide their gradients from its own step.

        Returns the (user view, gradient) pairs hidden; ``restore`` puts them back after the step.
        """
        jobs, hidden = [], []
        ready: Any = None
        for chunk in self.chunks:
            shadow = self.shadows.get((id(optimizer), chunk.index))
            if shadow is None:
                continue
            early = self._early.pop((id(optimizer), chunk.index), None)
            if early is not None:  # started in backward: only give its gradients back after the step
                hypers, started_hidden = early
                hidden += started_hidden
                self._check_hypers(hypers, shadow.snapshot())
                continue
            grads = [view.grad for view in shadow.user_views]
            if all(g is None for g in grads):
                continue
            if not jobs:  # one event for the launch: nothing is queued on the device between its jobs
                ready = self.uploads.ready()
            jobs.append(_Job(chunk, shadow, shadow.snapshot(), grads, ready))
            hidden += self.hide(shadow.user_views)
        for job in jobs:
            job.chunk.pending_update = job.future
        if jobs:
            assert self._worker is not None
            self._worker.submit(self._run, jobs)
        return hidden

    def landed(self, chunk: Chunk, complete: bool) -> None:
        """``chunk``'s reduced gradient is in its host shard and in its views; ``complete``: every trainable
        parameter of it got a gradient on this rank in this backward. Start its update now when this
        backward allows it ([Note: updates started in backward])."""
        if not self.early or not complete or chunk.placement != "cpu":
            return
        if chunk.state in (ChunkState.HOLD, ChunkState.COMPUTE) and chunk.written():
            # Read outside the hooks (a temperature in the loss, an L2 penalty): what was written to the
            # gathered values goes into the master before the update reads it. Left exposed, the block's
            # pre-update values would be written back over the update when the chunk is released.
            chunk.write_back()
        slots = {id(view): slot for slot, view in self.user_views[chunk.index]}
        jobs = []
        for optimizer in self.optimizers:
            key = (id(optimizer), chunk.index)
            shadow = self.shadows.get(key)
            if shadow is None or key in self._early:
                continue
            views, state = shadow.user_views, optimizer.state
            grads = [None if view.grad is None or (chunk.elsewhere(slots[id(view)]) and state.get(view)) else view.grad
                     for view in views]  # as the step sees them (GradientFlow.hide_elsewhere)
            if all(g is None for g in grads):
                continue
            job = _Job(chunk, shadow, shadow.snapshot(), grads, self.uploads.ready())
            self._early[key] = (job.hypers, self.hide(views))
            jobs.append(job)
        if jobs:
            assert self._worker is not None
            chunk.pending_update = jobs[-1].future  # the worker runs them in order
            self.early_updates += len(jobs)
            with self._waiting_lock:
                heapq.heappush(self._waiting, (self._order[chunk.index], chunk.index, jobs))
            self._worker.submit(self._run_waiting)  # one task per entry: each runs the best entry waiting then

    def _run_waiting(self) -> None:
        """On the worker: run the updates of the chunk started in backward that the next forward needs
        first, of those whose gradients have landed ([Note: updates started in backward])."""
        with self._waiting_lock:
            _, _, jobs = heapq.heappop(self._waiting)
        self._run(jobs)

    def _check_hypers(self, used: list[dict[str, Any]], now: list[dict[str, Any]]) -> None:
        if not self._warned_hypers and repr(used) != repr(now):
            self._warned_hypers = True
            log.warning("an offloaded chunk's update started in backward with hyperparameters that changed before "
                        "the optimizer step (%s, now %s): code the strategy could not see ran in between. Pass "
                        "ElixirStrategy(updates_in_backward=False) to start offloaded updates at the step.", used, now)

    @property
    def started_early(self) -> bool:
        """Whether updates started in backward wait for their optimizer's step."""
        return bool(self._early)

    @staticmethod
    def hide(views: Iterable[nn.Parameter]) -> list[tuple[nn.Parameter, torch.Tensor]]:
        """Set the gradients of ``views`` to None (the user's step skips them); the (view, gradient) pairs
        hidden, for ``restore``."""
        hidden = [(view, view.grad) for view in views if view.grad is not None]
        for view, _ in hidden:
            view.grad = None
        return hidden

    @staticmethod
    def restore(hidden: list[tuple[nn.Parameter, torch.Tensor]]) -> None:
        """Give the user's views back the gradients ``launch`` (or ``GradientFlow.hide_elsewhere``) hid."""
        for view, grad in hidden:
            view.grad = grad

    def settle(self) -> None:
        """Wait for every offloaded update in flight."""
        for chunk in self.chunks:
            chunk.settle()

    # ---- the worker --------------------------------------------------------------------------------

    def _run(self, jobs: list[_Job]) -> None:
        """Update the chunks of one step in order, reading NVMe records one chunk ahead."""
        reads: dict[int, Future] = {}
        try:
            for i, job in enumerate(jobs):
                self._read_ahead(jobs[i:i + 2], reads)
                self._update(job, reads.pop(job.chunk.index, None))
                job.future.set_result(None)
        except BaseException as err:  # noqa: BLE001 (handed to the main thread through the futures)
            for job in jobs:
                if not job.future.done():
                    job.future.set_exception(err)
            for read in reads.values():
                with contextlib.suppress(BaseException):
                    self._release(read.result())

    def _read_ahead(self, jobs: list[_Job], reads: dict[int, Future]) -> None:
        for job in jobs:
            index = job.chunk.index
            if index in self.on_disk and index not in reads:
                assert self.store is not None
                reads[index] = self.store.read(index, self.store.acquire())

    def _update(self, job: _Job, read: Optional[Future]) -> None:
        chunk = job.chunk
        start = time.perf_counter()
        with label("Elixir::offloaded_update"):
            page = read.result() if read is not None else None
            fields = self._bind(chunk, page, state=True) if page is not None else None
            job.shadow.step(job.hypers, job.grads)
            if fields is not None:
                self._capture(chunk, fields)
            self.uploads.upload(chunk, job.ready)
            if page is not None:
                self._unbind(chunk)
                assert self.store is not None
                self.store.write(chunk.index, page, release=True)
        self.update_s += time.perf_counter() - start
        self.updates += 1

    # ---- NVMe records ------------------------------------------------------------------------------

    def layout(self, chunk: Chunk, fields: Optional[tuple[tuple[str, torch.dtype], ...]] = None) -> RecordLayout:
        return RecordLayout(fields or self.layout_fields, chunk.shard_numel)

    @contextlib.contextmanager
    def resident(self, chunk: Chunk, write: bool = False, bind_state: bool = True) -> Generator[None, None, None]:
        """Context: ``chunk``'s master (and optimizer state) in host memory; written back with ``write``.

        For a chunk that is not on NVMe it only waits for the chunk's update. ``bind_state=False``
        keeps the optimizer's own state tensors (just loaded) and writes them into the record.
        """
        chunk.settle()
        if chunk.index not in self.on_disk:
            yield
            return
        assert self.store is not None
        page = self.store.read(chunk.index, self.store.acquire()).result()
        fields = self._bind(chunk, page, state=bind_state)
        try:
            yield
        finally:
            if write:
                self._capture(chunk, fields)
            self._unbind(chunk)
            if write:
                self.store.write(chunk.index, page, release=True).result()
            else:
                self.store.release(page)

    def _bind(self, chunk: Chunk, page: Page, state: bool) -> dict[str, torch.Tensor]:
        """Point the chunk's master, its views and (with ``state``) their optimizer state at a page."""
        fields = self.layout(chunk).views(page.data)
        chunk.master = fields["master"]
        self._point(chunk, fields, state)
        return fields

    def _unbind(self, chunk: Chunk) -> None:
        """The page is about to be reused: point master, views and state at NaN placeholders."""
        placeholders = {name: _placeholder(dtype, chunk.shard_numel) for name, dtype in self.layout_fields}
        chunk.master = placeholders["master"]
        self._point(chunk, placeholders, state=True)

    def _point(self, chunk: Chunk, fields: dict[str, torch.Tensor], state: bool) -> None:
        for slot, view in self.members[chunk.index]:
            begin, end = chunk.shard_range(slot)
            view.data = fields["master"][begin:end]
        if not state:
            return
        for slot, view, values in self._states(chunk):
            begin, end = chunk.shard_range(slot)
            for key in values:
                if key in fields and key != "master":
                    values[key] = fields[key][begin:end]

    def _capture(self, chunk: Chunk, fields: dict[str, torch.Tensor]) -> None:
        """Copy optimizer state the step created (or a load replaced) into the page, and point at it."""
        for slot, view, values in self._states(chunk):
            begin, end = chunk.shard_range(slot)
            for key, value in list(values.items()):
                if not is_per_element(key, value, view.shape):
                    continue
                if key not in fields:
                    raise RuntimeError(f"the optimizer created per-element state {key!r} that its probe did not show; "
                                       "place this chunk on 'cpu' instead of 'nvme'")
                region = fields[key][begin:end]
                if value.data_ptr() != region.data_ptr() or value.numel() == 0:
                    region.copy_(value)
                    values[key] = region

    def _states(self, chunk: Chunk) -> Iterable[tuple[Slot, nn.Parameter, dict[str, Any]]]:
        for slot, view in self.user_views[chunk.index]:
            values = self.owner[id(view)].state.get(view)
            if values:
                yield slot, view, values

    def _relayout(self, fields: tuple[tuple[str, torch.dtype], ...]) -> None:
        """Write every NVMe chunk's record in a new layout (new optimizer state), in a new store."""
        assert self.nvme_path is not None
        old, old_fields = self.store, self.layout_fields
        new = NvmeStore(self.nvme_path, self.rank, buffers=self.nvme_buffers, pin_memory=self.device.type == "cuda")
        for chunk in self.nvme:
            new.define(chunk.index, self.layout(chunk, fields).nbytes)
        new.reserve()
        for chunk in self.nvme:
            page = new.acquire()
            page.data.zero_()
            target = self.layout(chunk, fields).views(page.data)
            if chunk.index in self.on_disk:
                assert old is not None
                old_page = old.read(chunk.index, old.acquire()).result()
                for name, values in self.layout(chunk, old_fields).views(old_page.data).items():
                    target[name].copy_(values)
                old.release(old_page)
            else:
                target["master"].copy_(chunk.master)
            new.write(chunk.index, page, release=True)
        new.flush()
        self.store, self.layout_fields = new, fields
        if old is not None:
            old.close()
            release_pinned_cache(self.device)  # its pages: pinned blocks of a size the new pages do not reuse
        for chunk in self.nvme:
            self.on_disk.add(chunk.index)
            self._unbind(chunk)

    def _release(self, page: Page) -> None:
        assert self.store is not None
        self.store.release(page)

    # ---- accounting and shutdown ------------------------------------------------------------------

    def state_bytes(self, chunk: Chunk) -> int:
        """Bytes of per-element optimizer state the user's optimizers hold for ``chunk`` in memory."""
        if chunk.index in self.on_disk:
            return 0
        return sum(per_element_nbytes(values, view.shape) for _, view, values in self._states(chunk))

    def host_bytes(self) -> int:
        """Host memory of offloaded state: gradient shards, in-memory masters and state, NVMe pages, the
        slack of the slabs they are cut from."""
        total = self.store.host_bytes if self.store is not None else 0
        total += self.uploads.host_bytes
        arenas = {id(c.host_arena): c.host_arena for c in self.chunks if c.host_arena is not None}
        total += sum(arena.slack_bytes for arena in arenas.values())  # [Note: pinned memory in slabs]
        for chunk in self.chunks:
            total += chunk.grad_shard.nbytes
            if chunk.index not in self.on_disk:
                total += chunk.master.nbytes + self.state_bytes(chunk)
        return total

    def nvme_bytes(self) -> int:
        """Bytes of the NVMe files."""
        if self.store is None:
            return 0
        return sum(entry.stat().st_size for entry in os.scandir(self.store.path) if entry.is_file())

    def close(self, keep_files: bool = False) -> None:
        """Finish in-flight updates, stop the worker, remove the NVMe files (``keep_files``: leave them to a
        later gather of the module, and to the store's own clean-up when it goes)."""
        try:
            self.settle()
        finally:
            if self._worker is not None:
                self._worker.shutdown(wait=True)
                self._worker = None
            if self.store is not None and not keep_files:
                self.store.close()
                self.store = None


def worker_threads(device: torch.device, threads: int) -> int:
    """The intra-op threads the offload worker updates with, where the main thread has ``threads``.

    [Note: a core for the thread that feeds the device]
    The worker's AdamW is bound by host memory bandwidth, not by cores: on the 2-core CPU machine it
    updated 4 shards of 25M elements in 175 ms per shard with two threads and 176 ms with one. Its
    threads spin on every core, though, next to the main thread, which launches the device's kernels:
    beside the two-thread worker that thread ran at 0.80 of its speed alone, beside the one-thread
    worker at 0.83 (examples/benchmarks/offload.py, "the launching thread beside the worker"; on 2.5M
    elements per shard neither slowed it): a small gain, and the worker loses nothing by it. Not yet
    measured on a GPU host. So on an accelerator the worker leaves one core to the main thread. On a
    CPU-only machine the main thread's compute wants every core and shares them with the worker
    anyway (the search charges host work in sequence there).
    ``torch.set_num_threads`` in the worker also sets the count threads started later begin with;
    the main thread keeps its own, which is why the count is taken from it, not from the worker.
    """
    return threads if device.type == "cpu" else max(1, threads - 1)


def check_nvme_path_given(specs: Iterable[ChunkSpec], nvme_path: Optional[str]) -> None:
    """Raise ``PlanError`` when the plan places chunks on NVMe and no path says where."""
    count = sum(spec.placement == "nvme" for spec in specs)
    if count and nvme_path is None:
        raise PlanError(f"the plan places {count} chunk(s) on 'nvme' but no nvme_path was given: pass "
                        "ElixirStrategy(nvme_path=<a directory on the NVMe drive>), or place them on 'cpu'")


def _placeholder(dtype: torch.dtype, numel: int) -> torch.Tensor:
    """One value expanded to ``numel``: NaN for floats (a stray read shows), zero otherwise."""
    fill = math.nan if dtype.is_floating_point else 0
    return torch.full((1,), fill, dtype=dtype).expand(numel)


def _round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple
