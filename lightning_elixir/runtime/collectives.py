"""Every collective the runtime issues, as free functions over one process group.

With a world size of 1 (or no initialised process group) each one degenerates to a local copy,
so a single process runs the same code path without ``torch.distributed``.

[Note: bounded waits]
A collective completes only when every rank of the group issues it. When ranks take different
branches within a step (one rank runs a module that holds parameters, another skips it), their
sequences of collectives stop matching and some rank waits for a collective nobody else issues.
Left alone, it waits for the process group's timeout (30 minutes under Lightning), stuck in a
C++ call where Python signal handlers (Lightning's SIGTERM handler, Ctrl-C) never run.

So every wait here is bounded by ``Group.timeout_s``, in two places:

- The collective is issued with ``timeout_s`` as its own timeout. Gloo enforces it on the thread
  that runs the operation and then closes its connections: the operation's thread is free (a
  process whose main thread raised exits at once, instead of waiting in the process group's
  destructor for the stuck operation), the other ranks' pending collectives fail at once with
  "connection closed by peer", and any later collective on the group fails at once too (a
  teardown that gathers does not wait another ``timeout_s`` per chunk).
- The host waits in slices of ``_WAIT_SLICE_S`` up to ``timeout_s``, so signal handlers run in
  between, and a wait for an operation queued behind others is bounded from its own start.

A timed-out or failed wait raises ``RankDivergenceError``, which names the collective, the chunk
and the time waited, on every rank: each rank runs out of time on its own unmatched collective,
or sees the connections another rank's timeout closed. Device (NCCL) collectives keep their
semantics: a wait with a timeout would block the host until the collective ends (no more
enqueuing work ahead of the GPU), so they wait as before, and NCCL's watchdog bounds them with
the process group's timeout (it tears the process down with its own message); errors their
wait raises are translated all the same.

The default must never trip on a legitimate collective. Transfer time is not the risk: a
chunk is at most a few hundred MiB, seconds even over 1 Gb/s Ethernet. The risk is a rank
arriving late: data loading stalls, or work that some ranks do and others do not (rank 0
writing a file in a callback). ``DEFAULT_TIMEOUT_S`` is NCCL's own default timeout for one
collective in torch (10 minutes), which jobs already run under on GPUs.

[Note: reduce-scatter on gloo]
On CPU tensors a reduce-scatter is a direct exchange: each rank sends every peer the peer's part of
its buffer, point to point, receives its own part from each of them, and adds. That moves the
bytes a ring reduce-scatter moves, (N - 1) / N of the buffer per rank. Gloo's own reduce-scatter
takes longer than even its all-reduce of the same buffer (2 ranks, 2 cores: 32.8 vs 15.6 ms at
16 MiB); the exchange takes 10.0 ms there (against 21.6 ms for the all-reduce in the same run). An
all-reduce would send twice the bytes, and a ZeRO step then moves 1.5x what DDP's all-reduce
moves, counting the next forward's all-gather.

Point-to-point messages match by peer and tag, not by the order of collectives, so the tag carries
the group's count of collectives issued so far (``Group.issued``): a rank whose module calls
diverged from the others' has issued a different number of gathers, posts a different tag, and
its exchange waits, then fails as every unmatched collective does ([Note: bounded waits]). With a
single tag, a diverged rank would pair its exchange with a peer's and finish its step on wrong sums.

[Note: silent divergence]
Bounded waits catch ranks whose collectives stop matching. Some divergence completes instead: one
rank runs expert 0 of a mixture-of-experts layer and gathers its chunk while another runs expert 1
and gathers that one; the chunks have the same size, so the all-gathers pair up (NCCL and gloo match
collectives by order, not by content) and each rank computes with a chunk made of slices of two
different chunks. Nothing fails, and the values are wrong. So each group keeps one fingerprint of
the chunks it has all-gathered and one of the chunks it has reduce-scattered, in order, and
``agreed_max`` compares them across ranks inside an all-reduce that happens anyway: the one that
decides which parameters no rank used, before every optimizer step (runtime/grads.py). A
mismatch raises ``RankDivergenceError``: before the update is applied on a CPU; on a GPU, where
every parameter was used on this rank (so there is nothing to decide), the result is read at the
next optimizer step instead, or before a checkpoint is written or the runtime is let go (reading it
at once made the host wait for the device at every step, which DDP does not: [Note: reading the
agreement later] in grads.py). Forward-only loops (validation, test, prediction) have no such
all-reduce; the strategy checks once at the end of each.
"""

from __future__ import annotations

import math
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist

from lightning_elixir.devices import HostCopy, to_device
from lightning_elixir.runtime.hotpath import label

DEFAULT_TIMEOUT_S = 600.0
"""How long one collective may take before the ranks are taken to have diverged ([Note: bounded waits])."""
_WAIT_SLICE_S = 1.0
"""Longest host wait between chances for Python signal handlers to run."""
_MAX_TAG = 2 ** 30
"""Point-to-point tags run over 1.._MAX_TAG (tag 0 is ``gather_to_first``'s)."""
_SIGNATURE_MOD = 16_777_213
"""A prime below 2**24: a signature is an integer that float32 holds exactly."""
_SIGNATURE_MUL = 1_000_003


class RankDivergenceError(RuntimeError):
    """A collective did not complete: the ranks did not issue the same collectives."""


class StepAbandoned(Exception):
    """Another rank gave up the step (it ran out of memory): this rank's waits stop, and the step is
    redone by every rank ([Note: recovering from out of memory] in recovery.py). Not a RuntimeError,
    so that no handler of backend errors takes it for one."""


@dataclass(frozen=True)
class Group:
    """The data-parallel process group the chunks are sharded over."""

    pg: Optional[Any]
    """The torch process group (None: the default group, or no distributed at all)."""
    rank: int
    """This process's rank in the group."""
    world_size: int
    """Number of ranks in the group."""
    timeout_s: Optional[float] = DEFAULT_TIMEOUT_S
    """Longest wait for one collective before ``RankDivergenceError`` ([Note: bounded waits]). None: no
    bound of its own (the process group's timeout applies)."""
    issued: list[int] = field(default_factory=lambda: [0], compare=False, repr=False)
    """How many collectives this group has issued (one cell, shared by copies of the group): the
    tag of a point-to-point exchange ([Note: reduce-scatter on gloo])."""
    signature: list[int] = field(default_factory=lambda: [0, 0], compare=False, repr=False)
    """Fingerprints of the chunks gathered and reduced since the last ``agreed_max`` ([Note: silent
    divergence]); shared by copies of the group, like ``issued``."""
    watch: list[Optional[Callable[[], None]]] = field(default_factory=lambda: [None], compare=False, repr=False)
    """A check run between the slices of a host wait; it raises ``StepAbandoned`` when another rank gave
    up the step (None: nothing to check). One cell, shared by copies of the group."""
    abandoned: list[bool] = field(default_factory=lambda: [False], compare=False, repr=False)
    """Set once the step's collectives on this group are given up: waits return at once (what they
    would have delivered is thrown away) and the runtime moves to a new group."""

    def next_tag(self) -> int:
        """Count one more collective; the tag its point-to-point messages carry."""
        self.issued[0] += 1
        return self.issued[0] % _MAX_TAG + 1

    def note(self, kind: int, chunk: Optional[int]) -> None:
        """Fold one chunk collective (``kind`` 0: all-gather, 1: reduce-scatter) into the signature."""
        if chunk is not None:
            self.signature[kind] = (self.signature[kind] * _SIGNATURE_MUL + chunk + 1) % _SIGNATURE_MOD

    def __post_init__(self) -> None:
        t = self.timeout_s
        if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t < math.inf):
            raise ValueError(f"timeout_s={t!r}: use a positive number of seconds, or None for the process group's "
                             "own timeout")

    @classmethod
    def default(cls, timeout_s: Optional[float] = DEFAULT_TIMEOUT_S) -> "Group":
        """The default (world) group, or a single-process group when distributed is not initialised."""
        if not (dist.is_available() and dist.is_initialized()):
            return cls(None, 0, 1, timeout_s)
        return cls(None, dist.get_rank(), dist.get_world_size(), timeout_s)


# torch 2.13 renamed the *_base / *_into_tensor collectives; keep working on both sides of it.
_PG = dist.ProcessGroup
_ALL_GATHER = getattr(_PG, "all_gather_single", None) or _PG._allgather_base
_REDUCE_SCATTER = getattr(_PG, "reduce_scatter_single", None) or _PG._reduce_scatter_base


class _Done:
    """A finished work handle, for the single-process path."""

    def wait(self) -> None:
        return None


class Pending:
    """A collective in flight. ``wait()`` is bounded by the group's timeout and raises
    ``RankDivergenceError`` when the collective does not complete."""

    def __init__(self, work: Any, group: Group, what: str, on_host: bool,
                 then: Optional[Callable[[], Any]] = None) -> None:
        self.work = work
        self.group = group
        self.what = what
        """The collective in words, for errors: 'the all-gather of chunk 3 (4096 elements, 16.0 KiB)'."""
        self.on_host = on_host
        """A host-synchronous collective (CPU tensors: gloo), whose wait may block the host."""
        self.then = then
        """Run once, after the first successful wait (the slice copy of a reduce-scatter done as an all-reduce)."""

    def wait(self) -> None:
        if self.group.abandoned[0]:
            return  # given up with its step: its result is thrown away
        start = time.monotonic()
        try:
            if self.on_host and self.group.timeout_s is not None:
                self._wait_bounded(start + self.group.timeout_s)
            else:
                self.work.wait()
        except RankDivergenceError:
            raise
        except RuntimeError as err:  # the backend's own timeout, or a peer that left
            raise RankDivergenceError(_message(self, time.monotonic() - start, err)) from err
        if self.then is not None:
            then, self.then = self.then, None
            then()

    def _wait_bounded(self, deadline: float) -> None:
        """Wait in slices until done or ``deadline``; signal handlers (and the group's watch) run between slices."""
        watch = self.group.watch[0]
        while True:
            # A timedelta under 1 ms reaches torch as 0 ms, which means "no timeout". Not shorter slices for
            # the watch's sake: a gloo point-to-point wait that times out closes its connection.
            slice_s = max(min(_WAIT_SLICE_S, deadline - time.monotonic()), 0.01)
            try:
                self.work.wait(timeout=timedelta(seconds=slice_s))
                return
            except RuntimeError:
                if self.work.is_completed():  # the collective itself failed (or finished just now)
                    self.work.wait()
                    return
                if time.monotonic() >= deadline:
                    raise RankDivergenceError(_message(self, self.group.timeout_s, None)) from None
                if watch is not None:
                    watch()


def _message(pending: Pending, waited_s: float, err: Optional[BaseException]) -> str:
    """What went wrong, why, and what to do ([Note: bounded waits])."""
    group = pending.group
    if err is None:
        what = f"{pending.what} did not complete within {waited_s:.1f} s"
    else:
        what = f"{pending.what} failed after {waited_s:.1f} s ({str(err).strip()})"
    limit = "unset" if group.timeout_s is None else f"{group.timeout_s:g} s"
    return (f"rank {group.rank}: {what}. The ranks did not issue the same collectives in this step (unless another "
            "rank failed first with an error of its own, which is then the cause): most often control flow that "
            "depends on each rank's data differs between ranks (one rank ran a module that holds parameters, "
            "another skipped it), or code reads parameters on some ranks only. Give the parameters of a module that "
            "runs on some ranks only private chunks (ElixirStrategy(private_params=[...])), which stay gathered "
            "through the step, or make that control flow agree across ranks (decide branches from values every "
            "rank shares, or run every module on every rank and mask its output). If a collective is legitimately "
            f"slower (a rank delayed by work the others do not do), raise collective_timeout_s (now {limit}).")


def _describe(kind: str, tensor: torch.Tensor, chunk: Optional[int]) -> str:
    """'the all-gather of chunk 3 (4096 elements, 16.0 KiB)'."""
    subject = f"the {kind}" + ("" if chunk is None else f" of chunk {chunk}")
    return f"{subject} ({tensor.numel()} elements, {_size_text(tensor.numel() * tensor.element_size())})"


def _size_text(nbytes: int) -> str:
    for unit, scale in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"


def _issue(work: Any, group: Group, what: str, tensor: torch.Tensor, async_op: bool,
           then: Optional[Callable[[], Any]] = None) -> Optional[Pending]:
    """Wrap a backend work handle; wait for it at once unless ``async_op``.

    A backend that ran a synchronous collective in order on the current stream returns no handle (NCCL
    since torch 2.7, for ``asyncOp=False``): there is nothing to wait for, as torch's own wrappers know.
    """
    if work is None:
        if then is not None:
            then()
        return _Done() if async_op else None
    pending = Pending(work, group, what, on_host=tensor.device.type == "cpu", then=then)
    if async_op:
        return pending
    pending.wait()
    return None


def _options(opts: Any, group: Group, async_op: bool) -> Any:
    """Fill the fields every collective's options share: async and the per-operation timeout."""
    opts.asyncOp = async_op
    if group.timeout_s is not None:
        opts.timeout = timedelta(seconds=group.timeout_s)
    return opts


def _pg(group: Group) -> Any:
    return dist.group.WORLD if group.pg is None else group.pg


def _wire(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """``t`` as every backend takes it, sharing its memory: a complex tensor as its real and imaginary parts
    (a sum of those is the complex sum), a bool one as bytes (chunks of parameters that keep their own dtype,
    [Note: parameters of other dtypes] in policy.py)."""
    if t is None:
        return None
    if t.is_complex():
        return torch.view_as_real(t).view(-1)
    if t.dtype == torch.bool:
        return t.view(torch.uint8)
    return t


def all_gather(out: torch.Tensor, shard: torch.Tensor, group: Group, async_op: bool = False,
               chunk: Optional[int] = None) -> Any:
    """Gather every rank's ``shard`` into ``out`` (rank order). Returns a work handle if async.

    ``chunk``: the index of the chunk gathered, named in errors.
    """
    with label("Elixir::all_gather"):
        out, shard = _wire(out), _wire(shard)
        if group.world_size == 1:
            out.copy_(shard)
            return _Done() if async_op else None
        group.next_tag()
        group.note(0, chunk)
        work = _ALL_GATHER(_pg(group), out, shard, _options(dist.distributed_c10d.AllgatherOptions(), group, async_op))
        return _issue(work, group, _describe("all-gather", out, chunk), out, async_op)


def gather_to_first(out: Optional[torch.Tensor], shard: torch.Tensor, group: Group, chunk: Optional[int] = None,
                    collective: Optional[bool] = None) -> None:
    """Gather every rank's ``shard`` into ``out`` on rank 0 (rank order); ``out`` is None on the others.

    On the CPU point to point, so that only rank 0 holds the gathered tensor: gloo's gather and
    all-gather first gather into a flat buffer of their own (a second full copy on every receiving
    rank). On a GPU the gather collective, straight into views of ``out``: NCCL makes a communicator
    of its own (with its buffers, on rank 0's device) for every pair of ranks that exchange point to
    point. ``collective`` overrides the choice (tests)."""
    with label("Elixir::gather"):
        out, shard = _wire(out), _wire(shard)
        if group.world_size == 1:
            if shard.data_ptr() != out.data_ptr():
                out.copy_(shard)
            return
        what = _describe("gather to rank 0", shard, chunk)
        group.next_tag()
        if shard.device.type == "cuda" if collective is None else collective:
            n = shard.numel()
            outputs = [[out[r * n:(r + 1) * n] for r in range(group.world_size)]] if group.rank == 0 else []
            opts = _options(dist.distributed_c10d.GatherOptions(), group, async_op=False)
            opts.rootRank = 0  # a rank of the group, as the process group's own methods take
            _issue(_pg(group).gather(outputs, [shard], opts), group, what, shard, async_op=False)
            return
        if group.rank != 0:
            _issue(_pg(group).send([shard], 0, 0), group, what, shard, async_op=False)
            return
        n = shard.numel()
        if shard.data_ptr() != out.data_ptr():  # else the caller filled it in place
            out[:n].copy_(shard)
        pending = [_issue(_pg(group).recv([out[r * n:(r + 1) * n]], r, 0), group, what, shard, async_op=True)
                   for r in range(1, group.world_size)]
        for work in pending:
            work.wait()


def reduce_scatter(out: torch.Tensor, full: torch.Tensor, group: Group, async_op: bool = False,
                   chunk: Optional[int] = None, received: Optional[torch.Tensor] = None) -> Any:
    """Sum ``full`` over ranks and leave this rank's slice in ``out``.

    ``full`` is scratch: on CPU tensors it is summed in place ([Note: reduce-scatter on gloo]), and
    the peers' parts arrive in ``received`` (``(world_size - 1) * out.numel()`` elements of
    ``full``'s dtype; None: a new buffer), which the caller keeps until the reduction is waited for.
    """
    with label("Elixir::reduce_scatter"):
        out, full, received = _wire(out), _wire(full), _wire(received)
        if group.world_size == 1:
            if out is not full:
                out.copy_(full)
            return _Done() if async_op else None
        what = _describe("reduce-scatter of gradients", full, chunk)
        tag = group.next_tag()
        group.note(1, chunk)
        if full.device.type == "cpu":
            return _exchange(out, full, group, tag, what, async_op, received)
        opts = _options(dist.distributed_c10d.ReduceScatterOptions(), group, async_op)
        opts.reduceOp = dist.ReduceOp.SUM
        work = _REDUCE_SCATTER(_pg(group), out, full, opts)
        return _issue(work, group, what, out, async_op)


def _exchange(out: torch.Tensor, full: torch.Tensor, group: Group, tag: int, what: str, async_op: bool,
              received: Optional[torch.Tensor]) -> Any:
    """The reduce-scatter of CPU tensors: parts exchanged point to point, then added ([Note:
    reduce-scatter on gloo]). This rank's part of ``full`` is summed in place."""
    pg, n, rank = _pg(group), out.numel(), group.rank
    peers = [r for r in range(group.world_size) if r != rank]
    if received is None:
        received = torch.empty(len(peers) * n, dtype=full.dtype)
    received = received.view(len(peers), n)
    works = [pg.send([full[r * n:(r + 1) * n]], r, tag) for r in peers]
    works += [pg.recv([received[i]], r, tag) for i, r in enumerate(peers)]
    mine = full[rank * n:(rank + 1) * n]

    def add() -> None:
        for part in received:
            mine.add_(part)
        if out.data_ptr() != mine.data_ptr():  # else read in place
            out.copy_(mine)

    return _issue(_AllOf(works), group, what, out, async_op, then=add)


class _AllOf:
    """Several work handles waited for as one (the messages of one exchange)."""

    def __init__(self, works: list[Any]) -> None:
        self.works = works

    def wait(self, timeout: Optional[timedelta] = None) -> bool:
        for work in self.works:
            if timeout is None:
                work.wait()
            else:
                work.wait(timeout=timeout)
        return True

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self.works)


def _all_reduce(tensor: torch.Tensor, group: Group, op: Any, name: str) -> torch.Tensor:
    if group.world_size > 1:
        group.next_tag()
        opts = _options(dist.distributed_c10d.AllreduceOptions(), group, async_op=False)
        opts.reduceOp = op
        work = _pg(group).allreduce([_wire(tensor)], opts)
        _issue(work, group, _describe(name, tensor, None), tensor, async_op=False)
    return tensor


def all_reduce_sum(tensor: torch.Tensor, group: Group) -> torch.Tensor:
    """Sum ``tensor`` over ranks in place."""
    return _all_reduce(tensor, group, dist.ReduceOp.SUM, "all-reduce (sum)")


def all_reduce_max(tensor: torch.Tensor, group: Group) -> torch.Tensor:
    """Take the elementwise max of ``tensor`` over ranks in place."""
    return _all_reduce(tensor, group, dist.ReduceOp.MAX, "all-reduce (max)")


def agreed_max(values: torch.Tensor, group: Group) -> list[float]:
    """The elementwise max over ranks of a 1-D float32 ``values``, as a list, in the same all-reduce
    checking that every rank gathered and reduced the same chunks since the last check ([Note:
    silent divergence]); raises ``RankDivergenceError`` otherwise. Resets the signature."""
    return Agreement.start(values, group).values()


@dataclass
class Agreement:
    """An ``agreed_max`` whose all-reduce is issued now and whose result is read (and checked) by
    ``values``: on a GPU, reading it at once makes the host wait for the device ([Note: copies that wait
    for the device] in devices.py), so it is copied to the host behind the all-reduce and read later."""

    out: HostCopy
    """The reduced values, then the signature's (maximum, negated minimum) per kind."""
    count: int
    """How many of ``out`` are the caller's values."""
    group: Group

    @classmethod
    def start(cls, values: torch.Tensor, group: Group) -> "Agreement":
        """Issue the all-reduce of ``values`` and the group's signature; reset the signature."""
        signature = [float(s) for s in group.signature for s in (s, -s)]
        group.signature[:] = [0, 0]
        if group.world_size == 1:
            return cls(HostCopy(values), values.numel(), group)
        extra = to_device(torch.tensor(signature, dtype=torch.float32), values.device)
        return cls(HostCopy(all_reduce_max(torch.cat([values.float(), extra]), group)), values.numel(), group)

    def values(self) -> list[float]:
        """The maximum over ranks of the values; raises ``RankDivergenceError`` where the ranks' signatures differ."""
        out, n = self.out.tolist(), self.count
        for kind, (high, neg_low) in enumerate(zip(out[n::2], out[n + 1::2])):
            if high != -neg_low:
                raise RankDivergenceError(_diverged_message(self.group, ("all-gathers", "reduce-scatters")[kind]))
        return out[:n]


def fingerprint(value: Any) -> float:
    """``repr(value)`` hashed into the integers float32 holds exactly, as the signatures are: a value to
    compare across ranks in ``agreed_max`` (its own and its negation, so the maximum gives both ends)."""
    return float(zlib.crc32(repr(value).encode()) % _SIGNATURE_MOD)


def _diverged_message(group: Group, what: str) -> str:
    return (f"rank {group.rank}: the ranks issued their chunk {what} for different chunks since the last check, so "
            "each rank received other ranks' slices of a different chunk and computed with wrong values (no "
            "optimizer step has used them). A module that holds parameters ran on some ranks only: a "
            "mixture-of-experts layer that skips the experts no token chose, code under `if self.global_rank == "
            "0`, a branch on each rank's data. Give that module's parameters private chunks "
            "(ElixirStrategy(private_params=[...]); the strategy finds such modules itself when their call "
            "depends on tensor values): they stay gathered through the step and every rank reduces them, "
            "so ranks may skip them. Or run the module on every rank and mask its output.")


def all_gather_objects(obj: Any, group: Group) -> list[Any]:
    """Every rank's picklable ``obj``, in rank order."""
    if group.world_size == 1:
        return [obj]
    out: list[Any] = [None] * group.world_size
    dist.all_gather_object(out, obj, group=group.pg)
    return out


def broadcast(tensor: torch.Tensor, group: Group, src: int = 0) -> torch.Tensor:
    """Overwrite ``tensor`` with rank ``src``'s copy (``src`` is a rank of the group)."""
    if group.world_size > 1:
        group.next_tag()
        opts = _options(dist.distributed_c10d.BroadcastOptions(), group, async_op=False)
        opts.rootRank = src  # the process group's own methods take ranks of the group
        opts.rootTensor = 0
        work = _pg(group).broadcast([_wire(tensor)], opts)
        _issue(work, group, _describe(f"broadcast from rank {src}", tensor, None), tensor, async_op=False)
    return tensor
