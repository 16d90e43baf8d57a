"""The rCache: a bounded set of gathered public chunks, furthest-next-use eviction and prefetch.

[Note: learned access order]
Eviction and prefetch follow [Note: one cache policy] (schedule.py), as the search's simulation does.
The order in which modules use chunks is recorded on the first iteration of each kind (a forward
with grad, i.e. a training micro-batch, or a forward without) and replayed afterwards: eviction
picks the unpinned chunk whose next use is furthest (Belady), and prefetch gathers the next
chunks of the sequence ahead of use. Before an order is known, or once an iteration strays from
it (data-dependent control flow), eviction falls back to least-recently-used and prefetch stops
until the next iteration, whose order is then recorded afresh. Every rank runs the same model on
the same kind of iteration, so every rank issues the same collectives in the same order.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence
from typing import Optional

from lightning_elixir.runtime.chunk import Chunk
from lightning_elixir.schedule import AccessOrder, furthest, prefetch_may_evict
from lightning_elixir.runtime.states import ChunkState

log = logging.getLogger(__name__)


class CacheTooSmallError(RuntimeError):
    """More chunks are needed at once than the cache has blocks."""


class ChunkCache:
    """Gathers public chunks into at most ``capacity`` blocks."""

    def __init__(self, chunks: Sequence[Chunk], capacity: Optional[int], grow: bool, prefetch_depth: int) -> None:
        self.chunks = {c.index: c for c in chunks}
        self.capacity = len(chunks) if capacity is None else capacity
        self.grow = grow
        self.prefetch_depth = prefetch_depth
        self.gathered: OrderedDict[int, Chunk] = OrderedDict()  # LRU order, most recent last
        self._orders: dict[object, AccessOrder] = {}
        self._order: Optional[AccessOrder] = None
        self._recording: list[tuple[int, ...]] = []
        self._key: object = None
        self._cursor = -1
        self.gathers = 0
        self.peak_gathered = 0

    # ---- iterations -------------------------------------------------------------------------

    def begin_iteration(self, key: object) -> None:
        """A new forward starts: keep the order just recorded and replay the one for ``key``."""
        self._store_recording()
        self._key = key
        self._order = self._orders.get(key)
        self._recording = []
        self._cursor = -1

    def _store_recording(self) -> None:
        if self._recording and self._order is None:
            self._orders[self._key] = AccessOrder(self._recording)

    # ---- use --------------------------------------------------------------------------------

    def acquire(self, ids: tuple[int, ...]) -> None:
        """Make sure every chunk in ``ids`` is gathered, pin them, then prefetch ahead."""
        self._advance(ids)
        for c in ids:
            self._ensure_gathered(self.chunks[c], protect=ids)
            self.gathered.move_to_end(c)
        for c in ids:
            self.chunks[c].pin()
        self._prefetch()

    def acquire_extra(self, chunk_id: int) -> None:
        """Gather and pin one chunk for a read outside the hooks, past the capacity if all are pinned.

        Not recorded in the access order and no prefetch: such reads are few and not part of the
        module sequence the order predicts.
        """
        chunk = self.chunks[chunk_id]
        if chunk.state is ChunkState.GATHERING:
            chunk.finish_gather()
        if chunk.state is ChunkState.FREE:
            victim = self._victim(protect=(chunk_id,)) if len(self.gathered) >= self.capacity else None
            if victim is not None:
                self._evict(victim)
            self._gather(chunk, async_op=False)
            chunk.finish_gather()
        self.gathered.move_to_end(chunk_id)
        chunk.pin()

    def shrink(self) -> None:
        """Evict unpinned chunks while more are gathered than the capacity (after extra acquisitions)."""
        while len(self.gathered) > self.capacity:
            victim = self._victim(protect=())
            if victim is None:
                return
            self._evict(victim)

    def release_pins(self, ids: tuple[int, ...]) -> None:
        for c in ids:
            self.chunks[c].unpin()

    def _advance(self, ids: tuple[int, ...]) -> None:
        self._recording.append(ids)
        self._cursor += 1
        order = self._order
        if order is None:
            return
        if self._cursor >= len(order.sequence) or order.sequence[self._cursor] != ids:
            log.debug("access order changed at position %d; re-recording", self._cursor)
            self._order = None  # stray: record this iteration as the new order for its key
            self._orders.pop(self._key, None)

    def _ensure_gathered(self, chunk: Chunk, protect: tuple[int, ...]) -> None:
        if chunk.state is ChunkState.GATHERING:
            chunk.finish_gather()
        if chunk.state is not ChunkState.FREE:
            return
        self._make_room(protect)
        self._gather(chunk, async_op=False)
        chunk.finish_gather()

    def _gather(self, chunk: Chunk, async_op: bool) -> None:
        chunk.start_gather(async_op)
        self.gathered[chunk.index] = chunk
        self.gathers += 1
        self.peak_gathered = max(self.peak_gathered, len(self.gathered))

    def _make_room(self, protect: tuple[int, ...]) -> None:
        while len(self.gathered) >= self.capacity:
            victim = self._victim(protect)
            if victim is None:
                self._grow_or_raise(protect)
                return
            self._evict(victim)

    def _grow_or_raise(self, protect: tuple[int, ...]) -> None:
        """No gathered chunk can go (pinned, or acquired with ``protect``): grow, or say how many are needed."""
        if not self.grow:
            # Needed at once: the chunks still pinned (modules running or awaiting their gradients)
            # and every chunk of this acquisition, gathered or not.
            needed = sorted({c.index for c in self.gathered.values() if c.pins} | set(protect))
            raise CacheTooSmallError(
                f"the plan's cache_blocks={self.capacity} is too small: {len(needed)} chunks {needed} are needed at "
                f"once; set cache_blocks to at least {len(needed)}, or use cache_blocks='min' (the "
                f"fewest blocks, grown as needed), cache_blocks='all' (ZeRO-2: every chunk stays gathered) or "
                f"plan='auto'")
        self.capacity += 1
        log.debug("cache grows to %d blocks", self.capacity)

    def _victim(self, protect: tuple[int, ...]) -> Optional[Chunk]:
        candidates = [c for c in self.gathered.values() if c.pins == 0 and c.index not in protect]
        if not candidates:
            return None
        if self._order is None:
            return candidates[0]  # least recently used
        order, cursor = self._order, self._cursor
        return self.chunks[furthest((c.index for c in candidates), lambda c: order.next_use(c, cursor))]

    def _evict(self, chunk: Chunk) -> None:
        if chunk.state is ChunkState.GATHERING:
            chunk.finish_gather()
        chunk.release()
        del self.gathered[chunk.index]

    # ---- prefetch ---------------------------------------------------------------------------

    def _prefetch(self) -> None:
        if self._order is None or self.prefetch_depth == 0:
            return
        for chunk_id, use in self._upcoming():
            if len(self.gathered) >= self.capacity:
                victim = self._victim(protect=())
                if victim is None or not prefetch_may_evict(self._order.next_use(victim.index, self._cursor), use):
                    return
                self._evict(victim)
            self._gather(self.chunks[chunk_id], async_op=True)

    def _upcoming(self) -> list[tuple[int, int]]:
        """The next ``prefetch_depth`` distinct chunks of the order that are not gathered, with their use."""
        return self._order.upcoming(self._cursor, self.prefetch_depth,
                                    lambda c: self.chunks[c].state is ChunkState.FREE)

    # ---- resident plans ([Note: resident plans] in protocol.py) -------------------------------

    def gather_all(self) -> None:
        """Start gathering every public chunk that is not gathered; each is waited for at its first use."""
        for chunk in self.chunks.values():
            if chunk.state is ChunkState.FREE:
                self._gather(chunk, async_op=True)

    def regather_all(self) -> None:
        """Start gathering fresh shards into every gathered block (after the optimizer step)."""
        for chunk in self.chunks.values():
            if chunk.state is ChunkState.GATHERING:  # never used since its last gather
                chunk.finish_gather()
            if chunk.state is ChunkState.HOLD:
                chunk.regather()
                self.gathers += 1

    # ---- step boundary ----------------------------------------------------------------------

    def invalidate(self) -> None:
        """After the optimizer step every gathered chunk is stale: free them all."""
        for chunk in list(self.gathered.values()):
            assert chunk.pins == 0, f"chunk {chunk.index} is still pinned at the step boundary"
            self._evict(chunk)

    def unpin_all(self) -> None:
        """Drop every pin (end of backward: modules whose post-backward never fired)."""
        for chunk in self.gathered.values():
            while chunk.pins:
                chunk.unpin()
