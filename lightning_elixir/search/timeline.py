"""The predicted memory timeline of one optimizer step ([Note: timeline positions] in timeline.py).

Built from the search's own pieces: the plan's layout and access map (layout.py), the cache replay
that counts its gathers (simulate.py) and the bytes per element (memory.py). The step predicted is a
steady one, as every step after the first is: the optimizer state exists and the cache replays the
access order it learned.

[Note: timeline versus MemoryBreakdown]
The timeline counts what the runtime holds at each position, exactly; ``MemoryBreakdown`` bounds the
peak. They differ where the runtime holds less than the bound, or more:

- cache blocks are counted as they are filled: the runtime allocates a block's memory when it
  gathers a chunk into it and frees it on eviction, so a cache of ``n`` blocks holds fewer than
  ``n`` chunks until it fills;
- optimizer state is counted for trained elements only: torch creates none for padding, for frozen
  parameters or for the part of a parameter another rank owns;
- in backward, each trained chunk holds a full-size gradient buffer and a shard-size reduce-scatter
  output from the start of its reduction (its gradients move into the buffer then: [Note:
  gradients land per chunk] in runtime/chunk.py) until the reduction is retired: when the
  ``REDUCE_BUFFERS``-th chunk after it in the reduce order starts ([Note: reductions in flight] in
  runtime/reductions.py), else at the end of backward. ``MemoryBreakdown`` counts ``reduce_buffers``
  full-size buffers instead, which is short of the peak by the outputs of the chunks in flight;
- a resident plan ([Note: resident plans] in runtime/protocol.py) holds every block from the first
  position; with one rank its shards are its blocks and its gradients land in their shards, so it
  holds neither blocks nor gradient buffers. With one rank any plan's device chunks take their
  gradients straight into their shards (no buffer), and an offloaded chunk's buffer is its output;
  ``MemoryBreakdown`` still counts ``reduce_buffers`` buffers there (an over-estimate).
"""

from __future__ import annotations

from typing import Optional, Union

from lightning_elixir.plan import CACHE_ALL, REDUCE_BUFFERS, ElixirPlan, PlanError, slot_offsets, stays_gathered
from lightning_elixir.profile.types import ModelProfile
from lightning_elixir.search.evaluate import plan_layout
from lightning_elixir.search.layout import Layout, access_chunks, reduce_positions
from lightning_elixir.search.memory import StateBytes, fixed_device_bytes, state_bytes
from lightning_elixir.search.options import SearchOptions
from lightning_elixir.search.simulate import aliased, cached_chunks, resolve_cache_blocks
from lightning_elixir.timeline import MemoryTimeline, position_label

def predict_timeline(
    model: ModelProfile,
    plan: Union[ElixirPlan, Layout],
    options: SearchOptions = SearchOptions(),
    budget_bytes: Optional[int] = None,
    *,
    cache_blocks: Union[int, str, None] = None,
    prefetch_depth: Optional[int] = None,
    rank: int = 0,
) -> MemoryTimeline:
    """Predict the device bytes of one rank at every cache acquisition of one optimizer step.

    Args:
        model: the profile the plan runs (its accesses are replayed).
        plan: the plan (as ``evaluate_plan`` reads it), or a layout with its chunks' placements.
        options: world size, micro-batches and bytes per element (optimizer state, gradient, master)
            of the run; ``optimizer_bytes_per_numel`` must describe the real optimizer (0 for SGD
            without momentum) for the optimizer series to be exact.
        budget_bytes: the device budget, carried into the timeline for display.
        cache_blocks: an int, "all", "min" or "min+K"; None takes the plan's ("all" for a layout).
        prefetch_depth: chunks gathered ahead; None takes the plan's (1 for a layout).
        rank: whose shards to count (ranks differ in how much padding their shards hold).

    Returns:
        The predicted timeline, activations from the profile.

    Raises:
        PlanError: when the plan does not match the model or the world size, or the cache is too small.
    """
    layout, options, blocks, depth = _resolve(model, plan, options, cache_blocks, prefetch_depth)
    if not 0 <= rank < layout.world_size:
        raise ValueError(f"rank {rank} is not in a world of {layout.world_size}")
    per = state_bytes(model, options)
    needs = access_chunks(layout, model)
    blocks = resolve_cache_blocks(blocks, needs, len(layout.public))
    m = options.micro_batches
    resident = stays_gathered(blocks, len(layout.public), any(spec.placement != "device" for spec in layout.chunks),
                              layout.world_size)
    alias = aliased(layout, resident)
    if resident:  # every public chunk gathered before the first access ([Note: resident plans])
        cached = (tuple(layout.public),) * (len(needs) * m)
    else:
        cached = cached_chunks(list(needs), len(layout.chunks), blocks, depth, m)
    # (index in the replayed step, index in the micro-batch) of each access that acquires public chunks.
    positions = [(i * len(needs) + p, p) for i in range(m) for p, need in enumerate(needs) if need]
    shards, _, private, _, whole, _, _ = fixed_device_bytes(layout, model, 0, options, alias)
    block = 0 if alias else per.param
    grad_shards, optimizer = _resident_state_bytes(layout, model, per, rank)
    reduce = [0] * (len(model.accesses) + 1) if alias else _reduce_buffer_bytes(layout, model, per)
    live = _live_before(model)
    return MemoryTimeline(
        labels=tuple(_label(model, p) for _, p in positions),
        params_bytes=tuple(shards + private + sum(layout.chunks[c].numel for c in cached[i]) * block
                           for i, _ in positions),
        grads_bytes=tuple(grad_shards + reduce[p] for _, p in positions),
        optimizer_bytes=(optimizer + whole,) * len(positions),
        activation_bytes=tuple(live[p] for _, p in positions),
        budget_bytes=budget_bytes,
        micro_batches=m,
    )


def _resolve(model: ModelProfile, plan: Union[ElixirPlan, Layout], options: SearchOptions,
             cache_blocks: Union[int, str, None], prefetch_depth: Optional[int]
             ) -> tuple[Layout, SearchOptions, Union[int, str], int]:
    """The layout, options, cache blocks and prefetch depth of a plan or layout."""
    if isinstance(plan, ElixirPlan):
        layout, options = plan_layout(plan, model, options)
        blocks = plan.cache_blocks if cache_blocks is None else cache_blocks
        depth = plan.prefetch_depth if prefetch_depth is None else prefetch_depth
    else:
        if plan.world_size != options.world_size:
            raise PlanError(f"the layout was built for world size {plan.world_size}, not {options.world_size}")
        layout, blocks = plan, CACHE_ALL if cache_blocks is None else cache_blocks
        depth = 1 if prefetch_depth is None else prefetch_depth
    if depth < 0:
        raise ValueError(f"prefetch_depth must be >= 0, got {depth}")
    return layout, options, blocks, depth


def _resident_state_bytes(layout: Layout, model: ModelProfile, per: StateBytes, rank: int) -> tuple[int, int]:
    """(gradient shards, masters + optimizer state) that the device-placed chunks hold all step."""
    trained = _trained_shard_numels(layout, model, rank)
    grads = optimizer = 0
    for spec, trained_numel in zip(layout.chunks, trained):
        if spec.placement != "device":
            continue
        shard = spec.numel // layout.world_size
        grads += shard * per.grad
        optimizer += shard * per.master + trained_numel * per.optimizer
    return grads, optimizer


def _trained_shard_numels(layout: Layout, model: ModelProfile, rank: int) -> list[int]:
    """Per chunk, the elements of trainable parameters inside ``rank``'s shard (what optimizer state covers)."""
    info = {p.name: p for p in model.params}
    out = []
    for spec in layout.chunks:
        shard = spec.numel // layout.world_size
        begin, end = rank * shard, (rank + 1) * shard
        numels = [info[name].numel for name in spec.params]
        out.append(sum(max(0, min(end, offset + numel) - max(begin, offset))
                       for name, offset, numel in zip(spec.params, slot_offsets(numels), numels)
                       if info[name].requires_grad))
    return out


def _reduce_buffer_bytes(layout: Layout, model: ModelProfile, per: StateBytes) -> list[int]:
    """Per access of a micro-batch, the gradient buffers held when it starts ([Note: timeline versus
    MemoryBreakdown]): each trained chunk's full buffer and its reduce-scatter output, from the start of
    its reduction until the reduction is retired (with one rank: an offloaded chunk's buffer, which is
    its output too, and none for a chunk on the device)."""
    reduced = reduce_positions(layout, model)
    held = [0] * (len(model.accesses) + 1)
    if not model.accesses:  # a step that never runs the model: no access holds anything
        return held
    one = layout.world_size == 1
    for c, retired in _retire_positions(layout, reduced).items():
        spec = layout.chunks[c]
        full = 0 if one and spec.placement == "device" else spec.numel * per.reduce
        output = 0 if one else spec.numel // layout.world_size * per.reduce
        held[reduced[c] + 1] += full + output
        if retired is not None:
            held[retired + 1] -= full + output
    for p in range(1, len(held)):
        held[p] += held[p - 1]
    return held


def _retire_positions(layout: Layout, reduced: tuple[Optional[int], ...]) -> dict[int, Optional[int]]:
    """Per trained chunk, the access after which its reduction is retired (None: at the end of backward).

    The runtime reduces in ``reduce_positions``' order and retires the oldest reduction once
    ``REDUCE_BUFFERS`` later ones have started: when the one that many places after it starts.
    """
    order = [c for c in (*reversed(layout.public), *layout.private) if reduced[c] is not None]
    later = order[REDUCE_BUFFERS:] + [None] * min(REDUCE_BUFFERS, len(order))
    return {c: None if after is None else reduced[after] for c, after in zip(order, later)}


def _live_before(model: ModelProfile) -> list[int]:
    """Per access, the profile's activation bytes alive when it starts (those after the access before)."""
    return [0] + [a.live_bytes for a in model.accesses[:-1]]


def _label(model: ModelProfile, position: int) -> str:
    """The label of one access, as the runtime labels its acquisition."""
    access = model.accesses[position]
    return position_label(access.phase, access.module)
