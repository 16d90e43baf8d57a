"""Cache simulation: replay the profiled access sequence against a cache of chunk-sized blocks.

Eviction and prefetch decisions come from schedule.py ([Note: one cache policy]), which the
runtime's cache uses too; the uncached chunks waiting for prefetch are kept in a heap ordered as
``AccessOrder.upcoming`` orders them (next use, then index), for speed on long sequences.
The runtime follows exactly these rules, so the gather counts here are what it will do:

- A step is ``micro_batches`` replays of the access sequence. The cache starts empty (the optimizer
  step makes every gathered chunk stale) and persists between micro-batches; next uses, and so
  eviction and prefetch, look no further than the end of the current micro-batch (the runtime
  replays the order it recorded for one forward and backward).
- Private chunks are gathered once at the start of the step and stay gathered; they take no block.
- A resident plan ([Note: resident plans] in runtime/protocol.py: every public chunk has a block and
  nothing is offloaded) gathers every chunk once per step, all issued together: the first access
  that needs public chunks waits for its own, the rest arrive behind it. With one rank its shards
  are its blocks ([Note: a world of one] in runtime/chunk.py) and nothing is gathered at all.
- An access that needs no public chunk (a module holding only private parameters, a use of a
  private parameter outside its owner) leaves the cache alone: the runtime's cache sees no
  acquisition there, so nothing is gathered, evicted or prefetched.
- At an access, its public chunks are pinned and gathered (ascending chunk index) if not cached.
  With no free block, the unpinned cached chunk whose next use is furthest is evicted (Belady);
  a chunk with no next use is furthest. Ties: the lower chunk index is evicted.
- Then, with prefetch depth d > 0, the next d distinct chunks that are not cached, in order of next
  use (ties: ascending index), are gathered ahead: into a free block, or by evicting the furthest
  unpinned chunk only when its next use is later than the prefetched chunk's. The first prefetch
  that cannot be placed ends the look-ahead.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Union

from lightning_elixir.plan import (CACHE_ALL, CACHE_MIN, ElixirPlan, PlanError, min_plus_blocks, spare_blocks,
                                   stays_gathered)
from lightning_elixir.schedule import NEVER, furthest, prefetch_may_evict
from lightning_elixir.profile.types import ModelProfile
from lightning_elixir.search.layout import Layout, access_chunks, layout_from_plan
from lightning_elixir.search.options import dtype_bytes



@dataclass(frozen=True)
class SimResult:
    """Gathers of one optimizer step under a cache size and prefetch depth."""

    gathers: int
    """All-gathers per step: public (demand and prefetch) plus one per private chunk."""
    gathered_bytes: int
    """Bytes those all-gathers produce (full chunks in the compute dtype)."""
    sequence: tuple[int, ...]
    """Chunk indices in gather order over the step: private chunks first, then at each access its
    demand gathers followed by its prefetches."""
    demand: tuple[tuple[int, ...], ...]
    """Per access position (micro-batches concatenated): chunks gathered because it needed them."""
    prefetched: tuple[tuple[int, ...], ...]
    """Per access position: chunks gathered ahead after serving it."""
    cache_blocks: int
    """Blocks simulated."""
    prefetch_depth: int
    """Prefetch depth simulated."""
    micro_batches: int
    """Replays of the access sequence in the step."""

    def __post_init__(self) -> None:
        if len(self.demand) != len(self.prefetched):
            raise ValueError("demand and prefetched must have one entry per access position")

    @property
    def demand_misses(self) -> int:
        """Public gathers an access had to wait for (not prefetched)."""
        return sum(len(d) for d in self.demand)

    @property
    def prefetches(self) -> int:
        """Public gathers issued ahead of use."""
        return sum(len(p) for p in self.prefetched)


def min_cache_blocks(needs: tuple[tuple[int, ...], ...]) -> int:
    """The fewest blocks that serve every access: the most public chunks one access needs (>= 1)."""
    return max((len(n) for n in needs), default=0) or 1


def resolve_cache_blocks(cache_blocks: Union[int, str], needs: tuple[tuple[int, ...], ...], n_public: int) -> int:
    """An int block count from an int, "all", "min" or "min+K", checked to serve every access.

    More blocks than public chunks are as good as one per chunk; like the runtime, count no more.
    """
    if cache_blocks == CACHE_ALL:
        return max(n_public, 1)
    spare = spare_blocks(cache_blocks)
    if spare is not None:
        return min_plus_blocks(spare, min_cache_blocks(needs), n_public)
    if not isinstance(cache_blocks, int) or isinstance(cache_blocks, bool):
        raise PlanError(f"cache_blocks must be an int, {CACHE_ALL!r}, {CACHE_MIN!r} or 'min+K', got {cache_blocks!r}")
    fewest = min_cache_blocks(needs)
    if cache_blocks < fewest:
        raise PlanError(f"{cache_blocks} cache blocks cannot serve an access that needs {fewest} chunks")
    return min(cache_blocks, max(n_public, 1))


def _next_uses(needs: list[tuple[int, ...]], n_chunks: int) -> tuple[list[tuple[int, ...]], list[int]]:
    """Per position, each needed chunk's next use after it; and each chunk's first use."""
    upcoming = [NEVER] * n_chunks
    after: list[tuple[int, ...]] = [()] * len(needs)
    for p in range(len(needs) - 1, -1, -1):
        after[p] = tuple(upcoming[c] for c in needs[p])
        for c in needs[p]:
            upcoming[c] = p
    return after, upcoming


class _Cache:
    """Cached chunks and their next uses while the sequence is replayed."""

    def __init__(self, blocks: int) -> None:
        self.blocks = blocks
        self.cached: set[int] = set()
        self.next_use: list[int] = []
        self.waiting: list[tuple[int, int]] = []

    def start(self, first_use: list[int]) -> None:
        """A micro-batch begins: next uses restart at each chunk's first use in it."""
        self.next_use = list(first_use)
        # Uncached chunks by next use, for prefetch; stale entries are skipped when popped.
        self.waiting = [(u, c) for c, u in enumerate(first_use) if u < NEVER and c not in self.cached]
        heapq.heapify(self.waiting)

    def victim(self, pinned: tuple[int, ...]) -> int | None:
        """The unpinned cached chunk used furthest in the future (ties: lower index)."""
        return furthest((c for c in self.cached if c not in pinned), self.next_use.__getitem__)

    def evict(self, c: int) -> None:
        """Drop ``c`` from the cache; it waits to be gathered again."""
        self.cached.discard(c)
        if self.next_use[c] < NEVER:
            heapq.heappush(self.waiting, (self.next_use[c], c))

    def demand(self, need: tuple[int, ...]) -> tuple[int, ...]:
        """Gather the chunks an access needs; returns those that were not cached."""
        missed = []
        for c in need:
            if c in self.cached:
                continue
            if len(self.cached) >= self.blocks:
                self.evict(self.victim(need))
            self.cached.add(c)
            missed.append(c)
        return tuple(missed)

    def prefetch(self, depth: int, pinned: tuple[int, ...]) -> tuple[int, ...]:
        """Gather up to ``depth`` upcoming uncached chunks without evicting anything needed sooner."""
        taken: list[int] = []
        while len(taken) < depth and self.waiting:
            use, c = heapq.heappop(self.waiting)
            if c in self.cached or self.next_use[c] != use:
                continue
            if len(self.cached) >= self.blocks:
                v = self.victim(pinned)
                if v is None or not prefetch_may_evict(self.next_use[v], use):
                    heapq.heappush(self.waiting, (use, c))
                    break
                self.evict(v)
            self.cached.add(c)
            taken.append(c)
        return tuple(taken)


def _replay(needs: list[tuple[int, ...]], n_chunks: int, blocks: int, depth: int,
            micro_batches: int) -> Iterator[tuple[tuple[int, ...], tuple[int, ...], _Cache]]:
    """Per access position of the step: its demand gathers, its prefetches and the cache after both."""
    after, first_use = _next_uses(needs, n_chunks)
    cache = _Cache(blocks)
    for _ in range(micro_batches):
        cache.start(first_use)
        for p, need in enumerate(needs):
            if not need:  # no acquisition: the runtime does not prefetch here either
                yield (), (), cache
                continue
            missed = cache.demand(need)
            for c, nxt in zip(need, after[p]):
                cache.next_use[c] = nxt
            yield missed, cache.prefetch(depth, need) if depth else (), cache


def replay(needs: list[tuple[int, ...]], n_chunks: int, blocks: int, depth: int,
           micro_batches: int = 1) -> tuple[tuple, tuple]:
    """Replay ``needs`` (public chunks per access of one micro-batch) for every micro-batch of a step.

    Returns:
        Per access position (micro-batches concatenated): the demand gathers and the prefetches.
    """
    demand, prefetched = [], []
    for missed, ahead, _ in _replay(needs, n_chunks, blocks, depth, micro_batches):
        demand.append(missed)
        prefetched.append(ahead)
    return tuple(demand), tuple(prefetched)


def cached_chunks(needs: list[tuple[int, ...]], n_chunks: int, blocks: int, depth: int,
                  micro_batches: int = 1) -> tuple[tuple[int, ...], ...]:
    """Per access position of ``replay``'s step: the public chunks gathered once its demand gathers
    and prefetches are issued (ascending)."""
    return tuple(tuple(sorted(cache.cached)) for _, _, cache in _replay(needs, n_chunks, blocks, depth, micro_batches))


def aliased(layout: Layout, resident: bool) -> bool:
    """Whether the shards are the gathered blocks: one rank, a resident plan ([Note: a world of one])."""
    return resident and layout.world_size == 1


def resident_replay(needs: list[tuple[int, ...]], n_public: int, micro_batches: int,
                    gathers: bool = True) -> tuple[tuple, tuple]:
    """``replay`` for a resident plan: every public chunk is gathered at the step's first access that
    needs one (its own chunks as demand, the rest behind them), nothing after; with ``gathers`` False
    (one rank: the shards are the blocks) nothing at all."""
    positions = len(needs) * micro_batches
    demand: list[tuple[int, ...]] = [()] * positions
    prefetched: list[tuple[int, ...]] = [()] * positions
    first = next((p for p, need in enumerate(needs) if need), None)
    if gathers and first is not None:
        demand[first] = tuple(needs[first])
        prefetched[first] = tuple(c for c in range(n_public) if c not in needs[first])
    return tuple(demand), tuple(prefetched)


def simulate(
    layout: Layout,
    needs: tuple[tuple[int, ...], ...],
    blocks: int,
    depth: int,
    micro_batches: int,
    compute_bytes: int,
    resident: bool = False,
) -> SimResult:
    """Simulate one step of ``micro_batches`` replays of ``needs`` (see ``access_chunks``); ``resident``:
    the plan keeps every chunk gathered (``plan.stays_gathered``: a block per public chunk, whatever
    ``blocks`` says, as the runtime's cache holds)."""
    if resident:
        blocks = len(layout.public)
        demand, prefetched = resident_replay(list(needs), len(layout.public), micro_batches,
                                             gathers=not aliased(layout, resident))
    else:
        demand, prefetched = replay(list(needs), len(layout.chunks), blocks, depth, micro_batches)
    sequence = [] if aliased(layout, resident) else list(layout.private)
    for d, f in zip(demand, prefetched):
        sequence.extend(d)
        sequence.extend(f)
    gathered_bytes = sum(layout.chunks[c].numel for c in sequence) * compute_bytes
    return SimResult(len(sequence), gathered_bytes, tuple(sequence), demand, prefetched, blocks, depth, micro_batches)


def simulate_gathers(
    plan_or_layout: Union[ElixirPlan, Layout],
    model: ModelProfile,
    cache_blocks: Union[int, str, None] = None,
    prefetch_depth: int | None = None,
    micro_batches: int = 1,
) -> SimResult:
    """Count the all-gathers one optimizer step performs under a plan (or layout).

    Args:
        plan_or_layout: an ``ElixirPlan`` (explicit chunks, or packed from ``chunk_numel``) or a ``Layout``.
        model: the profile whose access sequence is replayed.
        cache_blocks: an int, "all" or "min"; None takes the plan's (a layout's default is "all").
        prefetch_depth: chunks gathered ahead; None takes the plan's (a layout's default is 1).
        micro_batches: replays of the access sequence per optimizer step.

    Returns:
        The gather count, bytes and sequence of one step.
    """
    plan = plan_or_layout if isinstance(plan_or_layout, ElixirPlan) else None
    layout = layout_from_plan(plan, model) if plan is not None else plan_or_layout
    if cache_blocks is None:
        cache_blocks = plan.cache_blocks if plan is not None else CACHE_ALL
    if prefetch_depth is None:
        prefetch_depth = plan.prefetch_depth if plan is not None else 1
    if micro_batches < 1 or prefetch_depth < 0:
        raise ValueError(f"need micro_batches >= 1 and prefetch_depth >= 0, got {micro_batches}, {prefetch_depth}")
    needs = access_chunks(layout, model)
    blocks = resolve_cache_blocks(cache_blocks, needs, len(layout.public))
    resident = stays_gathered(blocks, len(layout.public), any(spec.placement != "device" for spec in layout.chunks),
                              layout.world_size)
    return simulate(layout, needs, blocks, prefetch_depth, micro_batches, dtype_bytes(model.compute_dtype), resident)
