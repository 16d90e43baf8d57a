"""Chunk layouts: which parameters share a chunk, the chunk sizes worth trying, and what they waste.

Parameters are packed in first-use order (the order of ``ModelProfile.params``) so that one module's
parameters, and its neighbours', share chunks: a gather then serves consecutive accesses. Shared
parameters (tied weights) get a private chunk of their own that stays gathered all step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

from lightning_elixir.plan import (
    ALIGN_NUMEL,
    ChunkSpec,
    ElixirPlan,
    PlanError,
    chunk_used_numel,
    default_chunk_numel,
    pack_chunks,
    round_up,
    shard_aligned,
)
from lightning_elixir.profile.types import ModelProfile
from lightning_elixir.search.options import SearchOptions

_POOL_WORK = 3_000_000
"""Parameter visits allowed for measuring the padding of candidate chunk sizes."""


@dataclass(frozen=True)
class Layout:
    """Chunks of a model for one world size: public chunks first (first-use order), then private."""

    chunks: tuple[ChunkSpec, ...]
    """The chunks, as the plan will carry them."""
    world_size: int
    """Ranks each chunk is sharded over; every chunk numel is a multiple of it."""
    chunk_numel: int
    """Capacity of a public chunk (0 when the model has no public parameter)."""
    param_numel: int
    """Elements of the parameters packed (padding excluded)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "chunks", tuple(self.chunks))
        if self.world_size < 1:
            raise PlanError(f"world_size must be >= 1, got {self.world_size}")
        for spec in self.chunks:
            if spec.numel % self.world_size:
                raise PlanError(f"chunk numel {spec.numel} is not a multiple of world_size {self.world_size}")

    @cached_property
    def public(self) -> tuple[int, ...]:
        """Indices of the public chunks, in layout order."""
        return tuple(i for i, spec in enumerate(self.chunks) if not spec.private)

    @cached_property
    def private(self) -> tuple[int, ...]:
        """Indices of the private (always gathered) chunks."""
        return tuple(i for i, spec in enumerate(self.chunks) if spec.private)

    @cached_property
    def chunk_of(self) -> dict[str, int]:
        """Chunk index of every parameter name."""
        return {name: i for i, spec in enumerate(self.chunks) for name in spec.params}

    @property
    def total_numel(self) -> int:
        """Elements of all chunks, padding included."""
        return sum(spec.numel for spec in self.chunks)

    @property
    def padding_numel(self) -> int:
        """Elements lost to padding (chunk tails and world-size rounding)."""
        return self.total_numel - self.param_numel

    @property
    def waste_fraction(self) -> float:
        """Padding as a fraction of all chunk elements."""
        return self.padding_numel / self.total_numel if self.total_numel else 0.0

    @property
    def largest_chunk_numel(self) -> int:
        """The largest chunk, public or private (sizes the gradient reduce buffers)."""
        return max((spec.numel for spec in self.chunks), default=0)


def private_names(model: ModelProfile) -> tuple[str, ...]:
    """Parameters that get a private chunk: shared ones that exist and hold elements."""
    numel = {p.name: p.numel for p in model.params}
    return tuple(n for n in model.shared_params if numel.get(n, 0) > 0)


def build_layout(model: ModelProfile, chunk_numel: int, world_size: int) -> Layout:
    """Pack the model's parameters in first-use order into chunks of ``chunk_numel`` elements.

    Args:
        model: the profile; its ``params`` order is the first-use order.
        chunk_numel: public chunk capacity (rounded up to a multiple of ``world_size``).
        world_size: ranks each chunk is sharded over.

    Returns:
        The layout: public chunks in first-use order, then one private chunk per shared parameter.
    """
    order = [(p.name, p.numel) for p in model.params]
    chunks = pack_chunks(order, chunk_numel, world_size, private_names(model))
    public_numel = max((c.numel for c in chunks if not c.private), default=0)
    return Layout(chunks, world_size, public_numel, model.total_numel)


def layout_from_plan(plan: ElixirPlan, model: ModelProfile) -> Layout:
    """The layout of a plan with explicit chunks, checked to cover exactly the model's parameters."""
    if not plan.chunks:
        # As the runtime packs it, except in the profile's first-use order, not registration order.
        private = set(private_names(model))
        default = default_chunk_numel([p.numel for p in model.params if p.name not in private], plan.world_size or 1)
        world_size = plan.world_size or 1
        return build_layout(model, shard_aligned(plan.chunk_numel or default, world_size), world_size)
    covered = {name for spec in plan.chunks for name in spec.params}
    names = {p.name for p in model.params}
    if covered != names:
        missing, extra = sorted(names - covered)[:5], sorted(covered - names)[:5]
        raise PlanError(f"plan chunks do not match the model: missing {missing}, unknown {extra}")
    public_numel = max((c.numel for c in plan.chunks if not c.private), default=0)
    return Layout(plan.chunks, plan.world_size, public_numel, model.total_numel)


def candidate_chunk_numels(model: ModelProfile, options: SearchOptions) -> tuple[int, ...]:
    """Chunk capacities to try: one per geometric band from the smallest useful size up, each the
    size in its band that wastes the least padding.

    The smallest is the largest public parameter (no parameter may straddle chunks), at least
    ``min_chunk_numel`` unless the whole model is smaller; the largest is ``max_chunk_factor``
    times that, capped where a single chunk holds every public parameter. The bands keep the
    trade-off between few large collectives and little memory per cache block in view; within a
    band, the sizes tried are a fine geometric grid plus the sums of runs of consecutive
    parameters (a chunk that ends exactly full wastes nothing), as Elixir scanned [S, 3S].
    """
    private = set(private_names(model))
    numels = [p.numel for p in model.params if p.name not in private]
    unit = options.world_size * options.shard_align_numel
    total = round_up(max(chunk_used_numel(numels), 1), unit)
    smallest = round_up(max(max(numels, default=1), min(options.min_chunk_numel, total), 1), unit)
    largest = max(min(round_up(math.ceil(smallest * options.max_chunk_factor), unit), total), smallest)
    steps = options.chunk_size_steps
    edges = [smallest * (largest / smallest) ** (i / steps) for i in range(steps)] + [largest + 1]
    pool = _size_pool(numels, smallest, largest, unit, steps)
    best = []
    for low, high in zip(edges, edges[1:]):
        band = [size for size in pool if low <= size < high]
        if band:
            best.append(min(band, key=lambda size: (_packed_numel(numels, size), size)))
    return tuple(sorted(set(best)))


def _size_pool(numels: list[int], smallest: int, largest: int, unit: int, steps: int) -> list[int]:
    """Sizes whose padding is measured: a fine grid plus exact-fill sizes, thinned so that measuring
    them all (one greedy packing each) stays within a few million parameter visits."""
    room = max(steps, _POOL_WORK // max(len(numels), 1))
    grid = _fine_grid(smallest, largest, unit, min(16 * steps, room))
    runs = sorted(_run_sums(numels, smallest, largest, unit) - grid)
    spare = room - len(grid)
    if len(runs) > spare:
        runs = runs[:: math.ceil(len(runs) / spare)] if spare > 0 else []
    return sorted(grid | set(runs))


def _fine_grid(smallest: int, largest: int, unit: int, points: int) -> set[int]:
    """Geometrically spaced sizes from ``smallest`` to ``largest``, multiples of ``unit``."""
    ratio = largest / smallest
    return {min(round_up(math.ceil(smallest * ratio ** (i / max(points - 1, 1))), unit), largest)
            for i in range(points)}


def _run_sums(numels: list[int], smallest: int, largest: int, unit: int, limit: int = 4096,
              work: int = 200_000) -> set[int]:
    """Chunk sizes that consecutive parameters fill exactly (alignment gaps included), within
    [smallest, largest], rounded to ``unit``: at most ``limit`` of them, after at most ``work`` steps."""
    sums: set[int] = set()
    for i in range(len(numels)):
        acc = -1
        for j in range(i, len(numels)):
            acc = numels[j] if acc < 0 else round_up(acc, ALIGN_NUMEL) + numels[j]
            if acc > largest:
                break
            if acc >= smallest:
                sums.add(round_up(acc, unit))
        work -= j - i + 1
        if len(sums) >= limit or work <= 0:
            break
    return {s for s in sums if s <= largest}


def _packed_numel(numels: list[int], capacity: int) -> int:
    """Total elements of the chunks ``pack_chunks`` makes at ``capacity`` (padding included)."""
    chunks, used = 0, -1
    for numel in numels:
        start = round_up(used, ALIGN_NUMEL) if used >= 0 else 0
        if used < 0 or start + numel > capacity:
            chunks, start = chunks + 1, 0
        used = start + numel
    return chunks * capacity


def access_chunks(layout: Layout, model: ModelProfile) -> tuple[tuple[int, ...], ...]:
    """Per access, the public chunks it holds pinned, ascending (private chunks are always gathered).

    Those are the chunks of its parameters. A recomputation (activation checkpointing) that needs
    any also holds those of the backward access it runs inside: that module's backward pinned its
    chunks before it asked for the recomputed activations, and keeps them until its gradients exist.
    """
    chunk_of = layout.chunk_of
    private = set(layout.private)
    out = []
    backward: set[int] = set()
    for access in model.accesses:
        try:
            ids = {chunk_of[name] for name in access.params} - private
        except KeyError as err:
            raise PlanError(f"access {access.module} uses parameter {err.args[0]} that no chunk holds") from None
        if access.phase == "backward":
            backward = ids
        elif access.phase == "recompute" and ids:
            ids = ids | backward
        out.append(tuple(sorted(ids)))
    return tuple(out)


def grad_positions(model: ModelProfile) -> dict[str, int]:
    """Per trainable parameter, the access after which its gradient has accumulated.

    Autograd sums every use of a parameter before its accumulate-grad hook fires, so that is its last
    backward access, or the recomputation right after it (activation checkpointing: the module's
    backward runs once its block is recomputed). A trainable parameter that no backward access
    touches gets its (zero) gradient at the end of the micro-batch.
    """
    accesses = model.accesses
    last = max(len(accesses) - 1, 0)
    done = list(range(len(accesses)))
    for position in range(len(accesses) - 2, -1, -1):
        if accesses[position + 1].phase == "recompute":
            done[position] = done[position + 1]
    arrived = {p.name: last for p in model.params if p.requires_grad}
    touched: dict[str, int] = {}
    for position, access in enumerate(accesses):
        if access.phase == "backward":
            touched.update((name, done[position]) for name in access.params if name in arrived)
    return arrived | touched


def reduce_positions(layout: Layout, model: ModelProfile) -> tuple[int | None, ...]:
    """Per chunk, the access after which it is reduce-scattered (None: nothing in it is trained).

    The runtime reduces in a fixed order, public chunks last-to-first then private chunks, each as
    soon as every trainable parameter in it has its gradient (``grad_positions``) and the one before
    it in that order has gone.
    """
    chunk_of = layout.chunk_of
    complete: list[int | None] = [None] * len(layout.chunks)
    for name, position in grad_positions(model).items():
        c = chunk_of[name]
        complete[c] = max(position, complete[c] or 0)
    positions: list[int | None] = [None] * len(layout.chunks)
    previous = 0
    for c in tuple(reversed(layout.public)) + layout.private:
        if complete[c] is not None:
            previous = max(previous, complete[c])
            positions[c] = previous
    return tuple(positions)


def offload_order(layout: Layout, model: ModelProfile) -> tuple[int, ...]:
    """Chunks in the order their sharded state should leave the device.

    Earliest-reduced first: their gradient shard's device-to-host copy then hides behind the most
    remaining backward compute. Ties: lower chunk index first.
    """
    positions = [len(model.accesses) if p is None else p for p in reduce_positions(layout, model)]
    return tuple(sorted(range(len(layout.chunks)), key=lambda i: (positions[i], i)))
