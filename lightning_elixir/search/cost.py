"""Cost model: the predicted seconds of one optimizer step, from the measured HardwareProfile.

[Note: overlap]
Every overlap assumption of the search lives here and in ``timeline``, ``step_cost``,
``exposed_host_s``, ``step_time_s``, ``overlapped_s`` and ``host_floor_s`` below:

1. Forward/backward (``timeline``). One compute stream and one communication stream; collectives
   run one at a time in issue order (NCCL serialises them on its stream).
   - Private chunks are gathered first; the first access waits for them.
   - A demand gather is issued when the previous access has finished computing (its block may
     hold a chunk that access still reads) and the access waits for it: demand gathers are exposed.
   - Prefetches are issued when the access that triggered them starts computing and overlap it (and
     any later compute until their chunk's use).
   - A chunk's reduce-scatter is issued when its last backward access finishes; it overlaps the rest
     of the backward and delays collectives queued after it.
   - Contention. A collective running beside compute hides only to the measured extent
     ``HardwareProfile.comm_overlap`` ([Note: measuring communication overlap] in
     ``profile/bench.py``): the rest, ``(1 - comm_overlap)`` of its time, the compute loses (gloo
     on a CPU runs on the cores the compute needs; NCCL on a GPU takes almost nothing). ``timeline``
     charges it after scheduling, to first order: forward/backward = makespan + (1 - overlap) *
     hidden, where hidden is the communication that ran beside compute. On this schedule compute
     waits only while the communication stream is busy (every collective is issued no later than
     the compute it precedes ends), so the makespan is compute plus exposed communication, and
     hidden = compute + communication - makespan. The rule is exact at both ends (overlap 1: the
     schedule; overlap 0: compute + communication, nothing overlaps), and in between it charges
     what the benchmark measures: compute lost per second of collective running beside it. It
     leaves out that stretched compute issues later collectives later, and that a collective
     beside compute runs slower than alone (on a CPU it does: a prefetch may then arrive late);
     reduce-scatter completion times (which start the copy stream, below) stay on the schedule's
     clock. The lower bound uses the same rule (``overlapped_s``): a step's compute and the least
     traffic any plan must move take at least ``max(compute, network) + (1 - overlap) * min(...)``.
2. Host traffic. The fp32 gradient shard of an offloaded chunk is copied to the host on its own copy
   stream after every reduce-scatter of that chunk (one at a time, in completion order), so it
   overlaps the rest of the backward; the last copies are exposed.
3. Optimizer and host updates (``step_cost``). The device optimizer runs after the backward, so the
   device is ready for the next step at ``next_start = max(forward/backward + device optimizer,
   last gradient copy)``. The host updates of the offloaded chunks run on one worker thread,
   launched at ``max(forward/backward, last gradient copy)`` (the optimizer step is called after the
   backward and the device optimizer is only issued), one chunk after another in the order in which
   the next forward first needs them (``Timeline.update_order``: private chunks first, then by
   first access). Chunk c's update takes the worker
       period_c = cpu optimizer_c + upload_c                           (cpu chunk)
       period_c = max(cpu optimizer_c + upload_c, NVMe read_c + write_c)  (nvme chunk)
   a pipeline in which reading the next record ahead and writing the last one behind overlap the
   update (fill and drain ignored); done_c is the launch plus the periods up to and including c.
   The next step does not wait for all updates: chunk c's first all-gather waits for its own update
   only, and then still takes its gather time. Its update is hidden if it is done by
       deadline_c = next_start + max(first_use_c - gather_c, 0)
   where first_use_c is when the first access that needs c starts in the first micro-batch
   (``Timeline.first_use_s``: 0 for private chunks, gathered at the start; the end of the schedule
   for a chunk no access needs). A stall at one chunk delays everything after it, so a step pays
   the worst one:
       exposed host = max(0, max over offloaded c of (done_c - deadline_c))
       step = next_start + exposed host
   In steady state every update is done before its chunk's first use, so the next step's gradient
   copies and updates never queue behind this step's. First uses stay on the schedule's clock (not
   stretched by contention), which can only make deadlines earlier. Left out: uploads and host
   updates running beside the next step's compute and copies take nothing from them (PCIe and host
   memory bandwidth are shared in truth).
   On a CPU-only machine (``HardwareProfile.device_name == "cpu"``, ``hides_host_work``) the host is
   the device: a host update running beside compute takes the cores the compute needs, so nothing
   hides, and the whole worker time is exposed after ``next_start`` (strictly sequential).
4. Lower bound (``host_floor_s``). With W the worker's time (sum of periods) and D the gradient
   copies of a step: the copy stream runs D before ``next_start``, so every step takes at least D.
   Where host work can hide, the last update ends at launch + W >= forward/backward + W and its
   deadline is at most ``next_start`` + the schedule's end <= ``next_start`` + forward/backward,
   so step >= W (one worker cannot do more than one step's worth of updates per step): the floor is
   max(D, W). Where it cannot, step >= D + W. Updates started in backward (rule 5) can end before
   forward/backward + W, but a worker busy W every step still cannot keep up with shorter steps:
   the floor stands.
5. Updates started in backward ([Note: updates started in backward] in runtime/offload.py). When the
   runtime will start them (``SearchOptions.updates_in_backward``), the update of a chunk in host
   memory starts when its gradient shard of the last micro-batch has landed on the host (its copy
   is done: the runtime starts it when the reduction is retired, a little later); NVMe chunks
   follow at the step's launch as in rule 3. One worker: whenever it is free it
   takes, of the chunks landed by then, the one first in the update order (rule 3's order), as the
   runtime's worker does. Deadlines and the worst wait are rule 3's.
   Where the host is the device nothing changes: the whole worker time stays in sequence.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from lightning_elixir.profile.types import HardwareProfile, ModelProfile
from lightning_elixir.search.layout import Layout, reduce_positions
from lightning_elixir.search.memory import state_bytes
from lightning_elixir.search.options import SearchOptions
from lightning_elixir.search.simulate import SimResult


@dataclass(frozen=True)
class ChunkTimes:
    """Seconds each chunk costs, per operation, on this hardware (index = chunk index)."""

    gather_s: tuple[float, ...]
    """All-gather of the full chunk in the compute dtype."""
    reduce_s: tuple[float, ...]
    """Reduce-scatter of the chunk's gradient."""
    d2h_s: tuple[float, ...]
    """Copy of the gradient shard to the host (offloaded chunks, every micro-batch)."""
    h2d_s: tuple[float, ...]
    """Upload of the updated compute-dtype parameter shard, its conversion on the host included
    (offloaded chunks, every step)."""
    device_optimizer_s: tuple[float, ...]
    """Optimizer update of the shard on the device."""
    cpu_optimizer_s: tuple[float, ...]
    """Optimizer update of the shard on the host, with the fixed cost of a chunk's update."""
    nvme_s: tuple[float, ...]
    """Reading and writing back master and optimizer states of the shard on NVMe."""

    def __post_init__(self) -> None:
        columns = [getattr(self, f) for f in self.__dataclass_fields__]
        if len({len(c) for c in columns}) > 1:
            raise ValueError("ChunkTimes needs one value per chunk in every field")
        if any(v < 0 for c in columns for v in c):
            raise ValueError("ChunkTimes must be >= 0")


@dataclass(frozen=True)
class Timeline:
    """The forward/backward part of a step (all micro-batches), before the optimizer."""

    end_s: float
    """When compute and every collective have finished, on the schedule (before contention)."""
    reduce_done: tuple[tuple[float, int], ...]
    """(completion time, chunk) of every reduce-scatter, in completion order."""
    compute_s: float
    """Pure compute seconds."""
    all_gather_s: float
    """Seconds of all-gathers (busy time of the communication stream)."""
    reduce_scatter_s: float
    """Seconds of reduce-scatters."""
    contention_s: float
    """Compute seconds lost to the collectives that run beside it: ``(1 - comm_overlap)`` of the
    communication the schedule hides (see [Note: overlap]); not in ``end_s``."""
    first_use_s: tuple[float, ...]
    """Per chunk, when the first access that needs it starts in the first micro-batch, on the
    schedule's clock: 0 for private chunks (gathered at the start), ``end_s`` for a chunk no access
    needs."""
    update_order: tuple[int, ...]
    """Chunks in the order the host worker updates them: private first, then by first use (ties:
    lower index)."""

    def __post_init__(self) -> None:
        if min(self.end_s, self.compute_s, self.all_gather_s, self.reduce_scatter_s, self.contention_s) < 0:
            raise ValueError("a timeline's times must be >= 0")
        if any(not 0.0 <= t <= self.end_s for t in self.first_use_s):
            raise ValueError("a chunk's first use must lie within the schedule")
        if sorted(self.update_order) != list(range(len(self.first_use_s))):
            raise ValueError("update_order must list every chunk once")

    @property
    def forward_backward_s(self) -> float:
        """The forward/backward's predicted seconds: the schedule stretched by contention."""
        return self.end_s + self.contention_s


@dataclass(frozen=True)
class CostBreakdown:
    """Predicted seconds of one optimizer step, by component (busy time, not exposed time)."""

    compute_s: float
    """Forward and backward compute of every micro-batch."""
    all_gather_s: float
    """All-gathers of chunks (private and public)."""
    reduce_scatter_s: float
    """Reduce-scatters of gradients."""
    forward_backward_s: float
    """Forward and backward with communication overlapped, contention included (see [Note: overlap])."""
    contention_s: float
    """Compute time lost to the collectives overlapped with it (part of ``forward_backward_s``)."""
    d2h_s: float
    """Gradient-shard copies to the host."""
    copy_done_s: float
    """When the last gradient-shard copy finishes (0 without offload)."""
    device_optimizer_s: float
    """Optimizer on the device-placed shards."""
    cpu_optimizer_s: float
    """Optimizer on the host for offloaded shards."""
    nvme_s: float
    """NVMe reads and writes of offloaded states."""
    h2d_s: float
    """Uploads of updated parameter shards."""
    host_work_s: float
    """The host worker's busy time: every offloaded chunk's update, upload and NVMe paging."""
    exposed_host_s: float
    """Host work the next step waits for (the rest hides; see [Note: overlap])."""
    step_s: float
    """The predicted step time."""

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if not value >= 0.0:
                raise ValueError(f"CostBreakdown.{name} must be >= 0, got {value}")

    @property
    def exposed_copy_s(self) -> float:
        """Gradient copies still running when the device optimizer is done."""
        return max(self.copy_done_s - self.forward_backward_s - self.device_optimizer_s, 0.0)

    @property
    def exposed_communication_s(self) -> float:
        """Forward/backward time not spent computing (contention included)."""
        return self.forward_backward_s - self.compute_s


@dataclass(frozen=True)
class PlacementCost:
    """Seconds a placement of every chunk's state adds to a step, apart from the copy stream."""

    offloaded: tuple[bool, ...]
    """Per chunk: its state is off the device."""
    d2h_s: float
    """Gradient-shard copies of one step (every micro-batch)."""
    device_optimizer_s: float
    """Optimizer on device-placed shards."""
    cpu_optimizer_s: float
    """Optimizer on the host for offloaded shards."""
    nvme_s: float
    """NVMe paging of NVMe-placed shards."""
    h2d_s: float
    """Uploads of updated parameter shards."""
    worker_s: tuple[float, ...]
    """Per chunk: the host worker's time on its update (0 on the device; see [Note: overlap])."""
    in_host_memory: tuple[bool, ...]
    """Per chunk: its state is in host memory (placed "cpu"), so its update may start in backward
    (rule 5 of [Note: overlap])."""

    def __post_init__(self) -> None:
        if min(self.d2h_s, self.device_optimizer_s, self.cpu_optimizer_s, self.nvme_s, self.h2d_s) < 0:
            raise ValueError("a placement's times must be >= 0")
        if len(self.worker_s) != len(self.offloaded) or min(self.worker_s, default=0.0) < 0:
            raise ValueError("a placement needs one worker time >= 0 per chunk")
        if len(self.in_host_memory) != len(self.offloaded):
            raise ValueError("a placement's in_host_memory needs one flag per chunk")

    @property
    def host_work_s(self) -> float:
        """The host worker's busy time per step."""
        return sum(self.worker_s)


def access_compute_s(model: ModelProfile) -> tuple[float, ...]:
    """Compute seconds per access; spread the phase totals evenly when accesses carry none."""
    per_access = tuple(a.compute_s for a in model.accesses)
    if sum(per_access) > 0 or not model.accesses:
        return per_access
    forward = [a.phase == "forward" for a in model.accesses]
    n_fwd, n_bwd = sum(forward), len(forward) - sum(forward)
    fwd_s = model.forward_compute_s / n_fwd if n_fwd else 0.0
    bwd_s = model.backward_compute_s / n_bwd if n_bwd else 0.0
    return tuple(fwd_s if f else bwd_s for f in forward)


def chunk_times(layout: Layout, model: ModelProfile, hardware: HardwareProfile, options: SearchOptions) -> ChunkTimes:
    """Per-chunk seconds of every operation the step performs on it."""
    per = state_bytes(model, options)
    nvme_bytes_per_s = (hardware.nvme_read_bytes_per_s, hardware.nvme_write_bytes_per_s)
    out: dict[str, list[float]] = {name: [] for name in ChunkTimes.__dataclass_fields__}
    for spec in layout.chunks:
        shard = spec.numel // layout.world_size
        paged = shard * per.nvme("nvme")
        out["gather_s"].append(hardware.all_gather_s(spec.numel * per.param))
        out["reduce_s"].append(hardware.reduce_scatter_s(spec.numel * per.reduce))
        out["d2h_s"].append(shard * per.grad / hardware.d2h_bytes_per_s)
        out["h2d_s"].append(shard * per.param / (hardware.upload_bytes_per_s or hardware.h2d_bytes_per_s))
        out["device_optimizer_s"].append(shard / hardware.optimizer_device_numel_per_s)
        out["cpu_optimizer_s"].append(hardware.host_update_overhead_s + shard / hardware.optimizer_cpu_numel_per_s)
        out["nvme_s"].append(sum(paged / bw if bw > 0 else float("inf") for bw in nvme_bytes_per_s))
    return ChunkTimes(**{name: tuple(values) for name, values in out.items()})


def reduce_schedule(layout: Layout, model: ModelProfile, micro_batches: int) -> tuple[tuple[int, ...], ...]:
    """Per access position of the step, the chunks reduce-scattered after it."""
    n = len(model.accesses)
    at: list[list[int]] = [[] for _ in range(n)]
    for chunk, position in enumerate(reduce_positions(layout, model)):
        if n and position is not None:
            at[position].append(chunk)
    return tuple(tuple(chunks) for chunks in at) * micro_batches


def timeline(
    layout: Layout,
    needs: tuple[tuple[int, ...], ...],
    sim: SimResult,
    compute_s: tuple[float, ...],
    reduced: tuple[tuple[int, ...], ...],
    times: ChunkTimes,
    comm_overlap: float,
) -> Timeline:
    """Overlap compute and collectives of the forward/backward passes (rules in [Note: overlap]).

    ``needs``, ``compute_s`` and ``reduced`` are per access position of the whole step (micro-batches
    concatenated), as in ``sim``. ``comm_overlap`` is ``HardwareProfile.comm_overlap``.
    """
    g, r = times.gather_s, times.reduce_s
    # The private chunks the step gathers come first in its sequence (none where the shards are the blocks).
    comm_free = compute_free = sum(g[c] for c in sim.sequence[:len(layout.private)] if layout.chunks[c].private)
    ready = [0.0] * len(layout.chunks)
    first_use: list[float | None] = [0.0 if spec.private else None for spec in layout.chunks]
    done = []
    for p, need in enumerate(needs):
        for c in sim.demand[p]:
            comm_free = max(comm_free, compute_free) + g[c]
            ready[c] = comm_free
        begin = max([compute_free] + [ready[c] for c in need])
        for c in need:
            if first_use[c] is None:
                first_use[c] = begin
        for c in sim.prefetched[p]:
            comm_free = max(comm_free, begin) + g[c]
            ready[c] = comm_free
        compute_free = begin + compute_s[p]
        for c in reduced[p]:
            comm_free = max(comm_free, compute_free) + r[c]
            done.append((comm_free, c))
    end_s, busy_s = max(compute_free, comm_free), sum(compute_s)
    gathers_s = sum(g[c] for c in sim.sequence)
    reduces_s = sum(r[c] for _, c in done)
    hidden_s = max(busy_s + gathers_s + reduces_s - end_s, 0.0)  # 0 up to rounding at least
    first = tuple(end_s if t is None else t for t in first_use)
    order = sorted(range(len(first)), key=lambda c: (not layout.chunks[c].private, first[c], c))
    return Timeline(end_s, tuple(done), busy_s, gathers_s, reduces_s, (1.0 - comm_overlap) * hidden_s,
                    first, tuple(order))


def landed_s(reduce_done: tuple[tuple[float, int], ...], d2h_s: tuple[float, ...],
             offloaded: tuple[bool, ...]) -> dict[int, float]:
    """Per offloaded chunk, when the copy stream has moved its gradient shard of the step's last
    micro-batch to the host (copies one at a time, in reduction order)."""
    free, landed = 0.0, {}
    for t, c in reduce_done:
        if offloaded[c]:
            free = max(free, t) + d2h_s[c]
            landed[c] = free
    return landed


def hides_host_work(hardware: HardwareProfile) -> bool:
    """Whether host work can run beside the device's compute: not where the host is the device."""
    return hardware.device_name != "cpu"


def step_time_s(forward_backward_s: float, copy_done: float, device_optimizer_s: float,
                exposed_host_s: float) -> float:
    """The step's end from its parts: the device optimizer after the backward, the last gradient copy,
    then the host work the next step waits for (see [Note: overlap])."""
    return max(forward_backward_s + device_optimizer_s, copy_done) + exposed_host_s


def worker_s(times: ChunkTimes, c: int, placement: str) -> float:
    """The host worker's time on chunk ``c``'s update at ``placement`` (rule 3 of [Note: overlap])."""
    if placement == "device":
        return 0.0
    update_s = times.cpu_optimizer_s[c] + times.h2d_s[c]
    return max(update_s, times.nvme_s[c]) if placement == "nvme" else update_s


def placement_cost(times: ChunkTimes, placements: tuple[str, ...], micro_batches: int) -> PlacementCost:
    """Sum the per-chunk times of a placement."""
    offloaded = [p != "device" for p in placements]
    return PlacementCost(
        offloaded=tuple(offloaded),
        d2h_s=_masked_sum(times.d2h_s, offloaded) * micro_batches,
        device_optimizer_s=_masked_sum(times.device_optimizer_s, [not o for o in offloaded]),
        cpu_optimizer_s=_masked_sum(times.cpu_optimizer_s, offloaded),
        nvme_s=_masked_sum(times.nvme_s, [p == "nvme" for p in placements]),
        h2d_s=_masked_sum(times.h2d_s, offloaded),
        worker_s=tuple(worker_s(times, c, p) for c, p in enumerate(placements)),
        in_host_memory=tuple(p == "cpu" for p in placements),
    )


def exposed_host_s(tl: Timeline, gather_s: tuple[float, ...], placement: PlacementCost, launch_s: float,
                   next_start_s: float, started: tuple[tuple[float, int], ...] = ()) -> float:
    """The worst wait of the next step for a host update launched at ``launch_s`` (rule 3 of
    [Note: overlap]); ``next_start_s`` is when the device is ready for the next step. ``started``:
    (start, chunk) of the updates started in backward, in the order they start (rule 5); the others
    follow them at ``launch_s``."""
    offloaded, work_s, first_use_s = placement.offloaded, placement.worker_s, tl.first_use_s
    # Times relative to next_start_s, so that small updates late in a long step keep their digits.
    order = {c: i for i, c in enumerate(tl.update_order)}
    landed = sorted((t - next_start_s, order[c], c) for t, c in started)
    early = {c for _, _, c in landed}
    runs = _best_landed_first(landed, work_s)
    free_s = runs[-1][0] if runs else float("-inf")
    for c in tl.update_order:
        if offloaded[c] and c not in early:
            free_s = max(free_s, launch_s - next_start_s) + work_s[c]
            runs.append((free_s, c))
    return max([0.0] + [done_s - max(first_use_s[c] - gather_s[c], 0.0) for done_s, c in runs])


def _best_landed_first(landed: list[tuple[float, int, int]], work_s: tuple[float, ...]) -> list[tuple[float, int]]:
    """(done, chunk) of the updates started in backward, in the order the one worker runs them: when it
    is free, the landed chunk first in the update order ([Note: updates started in backward]);
    ``landed`` is (landing time, place in the update order, chunk), sorted by time."""
    runs: list[tuple[float, int]] = []
    ready: list[tuple[int, int]] = []
    free_s, i = float("-inf"), 0
    while i < len(landed) or ready:
        if not ready:
            free_s = max(free_s, landed[i][0])
        while i < len(landed) and landed[i][0] <= free_s:
            heapq.heappush(ready, landed[i][1:])
            i += 1
        _, c = heapq.heappop(ready)
        free_s += work_s[c]
        runs.append((free_s, c))
    return runs


def step_cost(tl: Timeline, times: ChunkTimes, placement: PlacementCost, host_hides: bool,
              updates_in_backward: bool = False) -> CostBreakdown:
    """The cost of a step whose forward/backward is ``tl`` and whose state is placed as given.

    ``host_hides`` is ``hides_host_work(hardware)``: False charges all host work in sequence.
    ``updates_in_backward``: the updates of chunks in host memory start as their gradients land
    (rule 5 of [Note: overlap]).
    """
    p = placement
    landed = landed_s(tl.reduce_done, times.d2h_s, p.offloaded) if any(p.offloaded) else {}
    copy_done = max(landed.values(), default=0.0)
    fwd_bwd_s = tl.forward_backward_s
    next_start_s = max(fwd_bwd_s + p.device_optimizer_s, copy_done)
    if not any(p.offloaded):
        exposed_s = 0.0
    elif host_hides:
        started = tuple(sorted((t, c) for c, t in landed.items() if p.in_host_memory[c]))
        exposed_s = exposed_host_s(tl, times.gather_s, p, max(fwd_bwd_s, copy_done), next_start_s,
                                   started if updates_in_backward else ())
    else:
        exposed_s = p.host_work_s
    return CostBreakdown(
        compute_s=tl.compute_s, all_gather_s=tl.all_gather_s, reduce_scatter_s=tl.reduce_scatter_s,
        forward_backward_s=fwd_bwd_s, contention_s=tl.contention_s, d2h_s=p.d2h_s, copy_done_s=copy_done,
        device_optimizer_s=p.device_optimizer_s, cpu_optimizer_s=p.cpu_optimizer_s, nvme_s=p.nvme_s,
        h2d_s=p.h2d_s, host_work_s=p.host_work_s, exposed_host_s=exposed_s,
        step_s=step_time_s(fwd_bwd_s, copy_done, p.device_optimizer_s, exposed_s),
    )


def _masked_sum(values: tuple[float, ...], mask: list[bool]) -> float:
    """Sum of ``values`` where ``mask`` is true."""
    return sum(v for v, m in zip(values, mask) if m)


def network_floor_s(gathered_bytes: int, reduced_bytes: int, collectives: int, hardware: HardwareProfile) -> float:
    """Seconds a step's collectives take at least: each pays the launch latency, and the bytes move
    at the best measured bandwidths."""
    all_gather = max(bw for _, bw in hardware.all_gather_bytes_per_s)
    reduce_scatter = max(bw for _, bw in hardware.reduce_scatter_bytes_per_s)
    latency_s = collectives * hardware.collective_latency_s
    return latency_s + gathered_bytes / all_gather + reduced_bytes / reduce_scatter


def overlapped_s(compute_s: float, comm_s: float, comm_overlap: float) -> float:
    """Seconds compute and communication take together when ``comm_overlap`` of the shorter hides
    behind the longer (see [Note: overlap]): the longer, plus what of the shorter does not hide."""
    return max(compute_s, comm_s) + (1.0 - comm_overlap) * min(compute_s, comm_s)


def host_floor_s(placement: PlacementCost, host_hides: bool) -> float:
    """Seconds of host work a placement forces every step to take at least (rule 4 of
    [Note: overlap]): the gradient copies D and the worker's time W, at measured speeds.

    Where host work can hide, each needs a stream of its own for at least its time every step:
    max(D, W). Where it cannot (the host is the device), they run in sequence: D + W.
    """
    d, w = placement.d2h_s, placement.host_work_s
    return max(d, w) if host_hides else d + w
