"""The way back to the device of an offloaded chunk's updated shard.

[Note: uploads of updated shards]
On the CPU the shard is copied in place. On a GPU the offload worker neither uses the device's
default stream nor waits for it: that stream holds the main thread's queued compute, and waiting for
it made each chunk's update last until the device had drained the next forward, which waits for that
very update. Instead the master is converted to the compute dtype on the host (on every core, into
one pinned staging buffer: half the bytes of fp32 cross the bus), the copy runs on a stream of its
own after a ``ready`` event recorded when the update was launched (every read of the shard queued
on the launching stream before it; no all-gather of the shard is then in flight on the collectives'
stream: ``ElixirRuntime.before_step`` waits for any, and a gather waits for the chunk's update), and
the worker waits for that copy only. Directions
differ from the gradient copies, so both use the bus at once. The next gather reads the shard after
``Chunk.settle``, when the copy is complete.
"""

from __future__ import annotations

from typing import Any

from lightning_elixir.devices import HostToDevice
from lightning_elixir.runtime.chunk import Chunk


class Uploads(HostToDevice):
    """Updated shards back to ``device`` on a stream of their own (the shard copied in place where
    ``device`` is None or not a GPU)."""

    def upload(self, chunk: Chunk, ready: Any) -> None:
        """Copy ``chunk``'s updated master into its compute-dtype shard on the device, after ``ready``;
        return when it is there."""
        if chunk.master is not chunk.shard:
            self.copy(chunk.master, chunk.shard, ready)
