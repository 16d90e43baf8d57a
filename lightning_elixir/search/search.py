"""The search: chunk size x cache blocks x prefetch depth x placement, best predicted step time.

For every chunk size (``candidate_chunk_numels``) the layout, the access-to-chunk map, the per-chunk
times and the placement ladder are built once. For every cache size on the grid, the rungs of the
ladder that fit the budget are known from memory alone; for every prefetch depth the cache is
simulated once, the forward/backward is overlapped once, and every fitting rung is costed. The
candidate set does not depend on the budget, so a larger budget can only add candidates: its plan is
never predicted slower. Ties are broken by fewer bytes gathered, fewer chunks offloaded, lower
peak, then deeper prefetch, smaller chunk size and cache: the result is deterministic.

Offloading is not only a last resort. Where host work hides behind the next forward ([Note:
overlap] in cost.py), an offloaded chunk can cost no time, and the device memory it frees buys
cache blocks (fewer re-gathers); its update also leaves the device optimizer. So the search may
offload under a budget that all-device plans fit, when that is predicted clearly faster
(``SearchOptions.min_offload_gain``); at equal predicted time and gathers it keeps the state on the device.

[Note: offloading for speed]
A plan that offloads more chunks than another wins only when it is predicted faster by
``min_offload_gain`` (10%) of its step. What offloading costs beyond the model's terms is not small
on a GPU: the host update runs on a Python worker thread beside the hook-driven main thread, and its
pinned copies share the bus with the offloaded chunks' gradients. Measured on one H200 (GPT-2 medium,
bf16-mixed, batch 8 x 1024, BENCHMARKS.md), an 80 GB budget that everything fits: the auto plan
offloaded (6 of 38 chunks after its self-correction; with the estimated H200 profile the search
offloads 5 of 74 for a predicted gain of 0.4%), and the step took 409 ms where the all-device ZeRO-2
plan took 91 ms. The ranking is otherwise unchanged: among the candidates within the gain of the fastest,
the one offloading the fewest chunks wins, by the usual key.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass

from lightning_elixir.plan import CACHE_ALL, CACHE_MIN, ElixirPlan, stays_gathered
from lightning_elixir.profile.types import HardwareProfile, ModelProfile
from lightning_elixir.search.cost import (ChunkTimes, CostBreakdown, PlacementCost, Timeline, access_compute_s,
                                          chunk_times, hides_host_work, host_floor_s, network_floor_s, overlapped_s,
                                          placement_cost, reduce_schedule, step_cost, timeline)
from lightning_elixir.search.errors import no_plan_fits, nvme_usable
from lightning_elixir.search.layout import Layout, access_chunks, build_layout, candidate_chunk_numels
from lightning_elixir.search.memory import device_bytes, fixed_device_bytes, margin_bytes, memory_breakdown, state_bytes
from lightning_elixir.search.options import SearchOptions, dtype_bytes
from lightning_elixir.search.placement import Rung, placement_ladder
from lightning_elixir.search.report import Candidate, LayoutSummary, SearchReport, format_bytes, format_ms
from lightning_elixir.search.simulate import SimResult, min_cache_blocks, simulate


@dataclass(frozen=True)
class _Space:
    """Everything about one chunk size that the cache size and placement do not change."""

    layout: Layout
    """The chunks."""
    needs: tuple[tuple[int, ...], ...]
    """Public chunks per access of one micro-batch."""
    reduced: tuple[tuple[int, ...], ...]
    """Chunks reduce-scattered after each access position of the step."""
    times: ChunkTimes
    """Seconds of every operation on every chunk."""
    ladder: tuple[Rung, ...]
    """Placements, from everything on the device to as much offloaded as allowed."""
    rung_costs: tuple[PlacementCost, ...]
    """What each rung of the ladder adds to a step."""
    blocks: tuple[int, ...]
    """Cache sizes to try."""
    fewest_blocks: int
    """The fewest blocks that serve every access."""

    def __post_init__(self) -> None:
        if len(self.ladder) != len(self.rung_costs) or not self.ladder or not self.blocks:
            raise ValueError("a search space needs a non-empty ladder, one cost per rung and a block grid")

    @property
    def reduced_numel(self) -> int:
        """Elements reduce-scattered per step (every trained chunk, every micro-batch)."""
        return sum(self.layout.chunks[c].numel for at in self.reduced for c in at)

    @property
    def reduces(self) -> int:
        """Reduce-scatters per step."""
        return sum(len(at) for at in self.reduced)


@dataclass(frozen=True)
class _Evaluated:
    """A candidate with what is needed to turn it into a plan and a report."""

    candidate: Candidate
    """What the report shows."""
    space: _Space
    """The chunk size it belongs to."""
    rung: Rung
    """Its placement."""
    cost: CostBreakdown
    """Its predicted cost."""
    key: tuple
    """Rank: predicted time (to the nanosecond), then the tie-breaks of the module docstring."""
    costed: int = 1
    """Placements costed to find it (for the report's count)."""

    def __post_init__(self) -> None:
        if self.costed < 1:
            raise ValueError("an evaluated candidate was costed at least once")


def search(
    model: ModelProfile,
    hardware: HardwareProfile,
    budget_bytes: int,
    options: SearchOptions = SearchOptions(),
) -> tuple[ElixirPlan, SearchReport]:
    """Find the plan with the best predicted step time whose predicted device peak fits the budget.

    Args:
        model: the profiled model (parameters in first-use order, access sequence, activations).
        hardware: measured bandwidths and speeds of this machine and process group.
        budget_bytes: device memory one rank may use.
        options: world size, micro-batches, optimizer state sizes, allowed placements, margins.

    Returns:
        The plan (explicit chunks with placements, ``name="auto"``) and the report of the search.

    Raises:
        NoPlanFitsError: when not even the most frugal plan fits; says what would help.
    """
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes <= 0:
        raise ValueError(f"budget_bytes must be a positive int, got {budget_bytes!r}")
    nvme_ok = nvme_usable(hardware, options)
    compute_s = access_compute_s(model) * options.micro_batches
    spaces = [_space(model, hardware, options, size, nvme_ok) for size in candidate_chunk_numels(model, options)]
    found = list(_candidates(spaces, model, hardware, budget_bytes, options, compute_s))
    if not found:
        raise no_plan_fits(model, hardware, budget_bytes, options)
    ranked = _prefer_fewer_offloaded(sorted(found, key=lambda e: e.key), options.min_offload_gain)
    plan = _plan(ranked[0], options)
    report = _report(ranked, spaces, model, hardware, budget_bytes, options)
    return plan, report


def _prefer_fewer_offloaded(ranked: list[_Evaluated], min_gain: float) -> list[_Evaluated]:
    """``ranked`` with the winner moved to the front: among the candidates predicted within ``min_gain``
    of the fastest, the one that offloads the fewest chunks ([Note: offloading for speed])."""
    fastest = ranked[0].cost.step_s
    close = [e for e in ranked if e.cost.step_s <= fastest * (1.0 + min_gain)]
    winner = min(close, key=lambda e: (e.candidate.offloaded, e.key))
    return [winner] + [e for e in ranked if e is not winner]


def _space(model: ModelProfile, hardware: HardwareProfile, options: SearchOptions, chunk_numel: int,
           nvme_ok: bool) -> _Space:
    """Precompute one chunk size's layout, access map, chunk times, ladder and cache-block grid."""
    layout = build_layout(model, chunk_numel, options.world_size)
    needs = access_chunks(layout, model)
    reduced = reduce_schedule(layout, model, options.micro_batches)
    times = chunk_times(layout, model, hardware, options)
    ladder = placement_ladder(layout, model, options, nvme_ok)
    rung_costs = tuple(placement_cost(times, r.placements, options.micro_batches) for r in ladder)
    fewest = min_cache_blocks(needs)
    blocks = block_grid(fewest, len(layout.public), options.cache_block_points)
    return _Space(layout, needs, reduced, times, ladder, rung_costs, blocks, fewest)


def block_grid(fewest: int, public_chunks: int, points: int) -> tuple[int, ...]:
    """Cache sizes to try: all of them if few, else dense near both ends (ZeRO-3 and ZeRO-2 sides)."""
    if public_chunks == 0:
        return (0,)
    span = public_chunks - fewest
    if span + 1 <= points:
        return tuple(range(fewest, public_chunks + 1))
    half = max(points // 2, 2)
    steps = {round(span ** (i / (half - 1))) for i in range(half)} | {0}
    return tuple(sorted({fewest + s for s in steps} | {public_chunks - s for s in steps}))


def _candidates(spaces: list[_Space], model: ModelProfile, hardware: HardwareProfile, budget_bytes: int,
                options: SearchOptions, compute_s: tuple[float, ...]) -> Iterator[_Evaluated]:
    """Every fitting (chunk size, cache blocks, prefetch depth), each with its best fitting rung.

    A cache with a block per public chunk runs the rungs that offload nothing as a resident plan
    ([Note: resident plans] in runtime/protocol.py): simulated as one, and with one rank without
    blocks or gradient buffers beyond the shards. With one rank any cache runs those rungs so, so
    they are costed once, with the full cache."""
    compute_bytes = dtype_bytes(model.compute_dtype)
    comm_overlap, host_hides = hardware.comm_overlap, hides_host_work(hardware)
    for space in spaces:
        for blocks in space.blocks:
            fixed = {resident: device_bytes(fixed_device_bytes(space.layout, model, blocks, options,
                                                               aliased=resident and space.layout.world_size == 1))
                     for resident in (False, True)}
            first = _first_fitting_rung(space, blocks, fixed, budget_bytes, options)
            if first is None:
                continue
            needs = space.needs * options.micro_batches
            for depth in options.prefetch_depths:
                costed = []
                for resident in (True, False):
                    if resident and blocks < len(space.layout.public):
                        continue  # one rank: the plan with a block per public chunk, costed there
                    rungs = [r for r in range(first, len(space.ladder)) if _resident(space, blocks, r) == resident]
                    if not rungs:
                        continue
                    sim = simulate(space.layout, space.needs, blocks, depth, options.micro_batches, compute_bytes,
                                   resident)
                    tl = timeline(space.layout, needs, sim, compute_s, space.reduced, space.times, comm_overlap)
                    costed += [_evaluate(space, sim, tl, r, fixed[resident], options, host_hides) for r in rungs]
                costed.sort(key=lambda e: e.key)
                preferred = _prefer_fewer_offloaded(costed, options.min_offload_gain)[0]
                if preferred is costed[0]:
                    yield dataclasses.replace(preferred, costed=len(costed))
                else:  # both: the fastest prediction overall is what the gain is measured against
                    yield dataclasses.replace(costed[0], costed=len(costed) - 1)
                    yield preferred


def _resident(space: _Space, blocks: int, rung: int) -> bool:
    """Whether ``blocks`` with rung ``rung``'s placement keeps every chunk gathered."""
    return stays_gathered(blocks, len(space.layout.public), space.ladder[rung].offloaded > 0,
                          space.layout.world_size)


def _first_fitting_rung(space: _Space, blocks: int, fixed_bytes: dict[bool, int], budget_bytes: int,
                        options: SearchOptions) -> int | None:
    """Index of the first rung whose device peak fits the budget, if any."""
    for i, rung in enumerate(space.ladder):
        subtotal = fixed_bytes[_resident(space, blocks, i)] + rung.device_state_bytes
        if subtotal + margin_bytes(subtotal, options) <= budget_bytes:
            return i
    return None


def _evaluate(space: _Space, sim: SimResult, tl: Timeline, index: int, fixed_bytes: int,
              options: SearchOptions, host_hides: bool) -> _Evaluated:
    """Cost rung ``index`` of one simulated cache and wrap it as a ranked candidate."""
    rung = space.ladder[index]
    cost = step_cost(tl, space.times, space.rung_costs[index], host_hides, options.updates_in_backward)
    subtotal = fixed_bytes + rung.device_state_bytes
    layout = space.layout
    candidate = Candidate(
        chunk_numel=layout.chunk_numel, cache_blocks=sim.cache_blocks,
        all_gathered=sim.cache_blocks >= len(layout.public), prefetch_depth=sim.prefetch_depth,
        cpu_chunks=rung.cpu_chunks, nvme_chunks=rung.nvme_chunks, chunks=len(layout.chunks),
        gathers=sim.gathers, gathered_bytes=sim.gathered_bytes, step_s=cost.step_s,
        peak_bytes=subtotal + margin_bytes(subtotal, options),
    )
    # Ties in predicted time go to the deeper prefetch: the model does not slow a collective that runs
    # beside compute, so it sees no gain past the first prefetch; measured on CPU/gloo, depth 2 beat
    # depth 1 by 70-86 ms a step where the model predicted a tie (examples/benchmarks/search_quality.py).
    key = (round(cost.step_s * 1e9), candidate.gathered_bytes, candidate.offloaded, candidate.nvme_chunks,
           candidate.peak_bytes, -candidate.prefetch_depth, candidate.chunk_numel, candidate.cache_blocks)
    return _Evaluated(candidate, space, rung, cost, key)


def _plan(best: _Evaluated, options: SearchOptions) -> ElixirPlan:
    """The winner as a plan with an explicit layout and per-chunk placement.

    The fewest blocks are written as "min": the runtime then grows the cache by a block rather
    than fail if, in backward, a module's chunks are still pinned when the next module's arrive.
    """
    layout, cand = best.space.layout, best.candidate
    chunks = tuple(dataclasses.replace(spec, placement=p) for spec, p in zip(layout.chunks, best.rung.placements))
    blocks = cand.cache_blocks if cand.cache_blocks > best.space.fewest_blocks else CACHE_MIN
    return ElixirPlan(
        chunk_numel=layout.chunk_numel or None,
        cache_blocks=CACHE_ALL if cand.all_gathered else blocks,
        prefetch_depth=cand.prefetch_depth,
        chunks=chunks,
        world_size=options.world_size,
        reduce_in_fp32=options.reduce_in_fp32,
        name="auto",
    )


def _report(ranked: list[_Evaluated], spaces: list[_Space], model: ModelProfile, hardware: HardwareProfile,
            budget_bytes: int, options: SearchOptions) -> SearchReport:
    """The report: top candidates, the winner's breakdowns, layouts tried and the lower bound."""
    best = ranked[0]
    memory = memory_breakdown(best.space.layout, model, best.candidate.cache_blocks, best.rung.placements, options)
    assert memory.peak_bytes == best.candidate.peak_bytes, "memory model disagrees with the search"
    bound_s, reason = _lower_bound(ranked, model, hardware, budget_bytes, options)
    layouts = tuple(_layout_summary(s.layout) for s in spaces)
    top = tuple(e.candidate for e in ranked[: options.report_top])
    evaluated = sum(e.costed for e in ranked)
    return SearchReport(budget_bytes, options.world_size, options.micro_batches, top, best.cost, memory,
                        layouts, bound_s, reason, evaluated,
                        _placement_reason(best, min(ranked, key=lambda e: e.key), model, budget_bytes, options),
                        options.min_offload_gain, options.updates_in_backward)


def _placement_reason(best: _Evaluated, fastest: _Evaluated, model: ModelProfile, budget_bytes: int,
                      options: SearchOptions) -> str:
    """Why the winner's state sits where it does: what keeping it all on the device would need, and
    why any of it is on NVMe."""
    reason, rung = _offload_reason(best, fastest, model, budget_bytes, options), best.rung
    if not rung.nvme_chunks:
        return reason
    if not options.allow_cpu:
        return f"{reason}; the CPU is not allowed (allow_cpu=False), so {rung.nvme_chunks} go to NVMe"
    return (f"{reason}; host memory ({format_bytes(options.host_memory_bytes or 0)}) holds {rung.cpu_chunks} "
            f"on the CPU, so {rung.nvme_chunks} go to NVMe")


def _offload_reason(best: _Evaluated, fastest: _Evaluated, model: ModelProfile, budget_bytes: int,
                    options: SearchOptions) -> str:
    """Why the winner offloads what it does: what keeping it all on the device would need."""
    space, rung, blocks = best.space, best.rung, best.candidate.cache_blocks
    if not rung.offloaded:
        if len(space.ladder) == 1:
            return "all state on the device (offload is not allowed, or host memory cannot take a chunk)"
        if fastest.rung.offloaded:
            gain = 1.0 - fastest.cost.step_s / best.cost.step_s
            return (f"all state on the device: offloading {fastest.rung.offloaded} chunk(s) is predicted only "
                    f"{gain:.1%} faster, under the {options.min_offload_gain:.0%} it must gain")
        return "all state on the device: offloading is not predicted faster"
    device_state = space.ladder[0].device_state_bytes
    freed = format_bytes(device_state - rung.device_state_bytes)
    need = _all_device_peak(space, model, blocks, options)
    if need <= budget_bytes:
        saved_s = space.rung_costs[0].device_optimizer_s - best.cost.device_optimizer_s
        return (f"all-device state fits too ({format_bytes(need)}), but offloading {freed} is predicted faster: "
                f"the device optimizer is {format_ms(saved_s)} shorter")
    fitting = [b for b in space.blocks if _all_device_peak(space, model, b, options) <= budget_bytes]
    if not fitting:
        least = _all_device_peak(space, model, space.blocks[0], options)
        return (f"all-device state needs {format_bytes(least)} even with {space.blocks[0]} cache block(s) "
                f"(over the budget by {format_bytes(least - budget_bytes)})")
    return (f"all-device state with {blocks} cache blocks needs {format_bytes(need)} (over the budget by "
            f"{format_bytes(need - budget_bytes)}); offloading frees {freed} for {blocks - max(fitting)} more "
            f"cache block(s)")


def _all_device_peak(space: _Space, model: ModelProfile, blocks: int, options: SearchOptions) -> int:
    """The device peak of this chunk size with ``blocks`` cache blocks and every chunk's state on the device."""
    aliased = space.layout.world_size == 1 and _resident(space, blocks, 0)
    subtotal = (device_bytes(fixed_device_bytes(space.layout, model, blocks, options, aliased))
                + space.ladder[0].device_state_bytes)
    return subtotal + margin_bytes(subtotal, options)


def _lower_bound(ranked: list[_Evaluated], model: ModelProfile, hardware: HardwareProfile, budget_bytes: int,
                 options: SearchOptions) -> tuple[float, str]:
    """The largest of compute, the least network traffic any fitting candidate has (with the compute
    it cannot hide behind) and the least host work."""
    reduce_bytes = state_bytes(model, options).reduce
    network = min(network_floor_s(e.candidate.gathered_bytes, e.space.reduced_numel * reduce_bytes,
                                  e.candidate.gathers + e.space.reduces, hardware) for e in ranked)
    host_hides = hides_host_work(hardware)
    host = min(_least_host_floor_s(e, model, budget_bytes, options, host_hides) for e in ranked)
    compute = ranked[0].cost.compute_s
    # The least traffic hides behind compute only as far as comm_overlap lets it (at 1: their max).
    bounds = {"compute": compute, "network": overlapped_s(compute, network, hardware.comm_overlap), "host": host}
    reason = max(bounds, key=lambda k: (bounds[k], k == "compute"))
    return bounds[reason], reason


def _least_host_floor_s(e: _Evaluated, model: ModelProfile, budget_bytes: int, options: SearchOptions,
                        host_hides: bool) -> float:
    """Host floor of the least-offloaded rung that fits, for this candidate's layout and cache (every
    fitting rung above it offloads more, so its floor is no lower)."""
    blocks, layout = e.candidate.cache_blocks, e.space.layout
    fixed = {resident: device_bytes(fixed_device_bytes(layout, model, blocks, options,
                                                       resident and layout.world_size == 1))
             for resident in (False, True)}
    first = _first_fitting_rung(e.space, blocks, fixed, budget_bytes, options)
    return host_floor_s(e.space.rung_costs[first], host_hides)


def _layout_summary(layout: Layout) -> LayoutSummary:
    """The padding of one layout."""
    return LayoutSummary(layout.chunk_numel, len(layout.public), len(layout.private), layout.padding_numel,
                         layout.waste_fraction)
