"""The way back to the device of an offloaded chunk's updated shard.

[Note: uploads of updated shards]
On the CPU the shard is copied in place. On a GPU the offload worker neither uses the device's
default stream nor waits for it: that stream holds the main thread's queued compute, and waiting for
it made each chunk's update last until the device had drained the next forward, which waits for that
very update. Instead the master is converted to the compute dtype on the host (on every core, into
one pinned staging buffer: half the bytes of fp32 cross the bus), the copy runs on a stream of its
own after a ``ready`` event recorded when the update was launched (every read of the shard queued
before it, such as an all-gather in flight), and the worker waits for that copy only. Directions
differ from the gradient copies, so both use the bus at once. The next gather reads the shard after
``Chunk.settle``, when the copy is complete.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from lightning_elixir.runtime.chunk import Chunk


class Uploads:
    """Updated shards back to ``device`` on a stream of their own (the shard copied in place where
    ``device`` is None or not a GPU)."""

    def __init__(self, device: Optional[torch.device]) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device) if device is not None and device.type == "cuda" else None
        self._staging: Optional[torch.Tensor] = None

    def ready(self) -> Any:
        """An event after the work the launching thread has queued on the device (None without a stream)."""
        if self.stream is None:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def upload(self, chunk: Chunk, ready: Any) -> None:
        """Copy ``chunk``'s updated master into its compute-dtype shard on the device, after ``ready``;
        return when it is there."""
        if self.stream is None or chunk.master is chunk.shard:
            chunk.refresh_shard()
            return
        source = chunk.master
        if source.dtype != chunk.shard.dtype or not source.is_pinned():
            source = self._staged(chunk.shard.dtype, chunk.shard_numel)
            source.copy_(chunk.master)
        self.stream.wait_event(ready)
        with torch.cuda.stream(self.stream):
            chunk.shard.copy_(source, non_blocking=True)
            done = torch.cuda.Event(blocking=True)  # waited for by yielding the core, not spinning on it
            done.record(self.stream)
        done.synchronize()  # the staging buffer is reused by the next chunk

    @property
    def host_bytes(self) -> int:
        """Pinned host memory of the staging buffer."""
        return self._staging.nbytes if self._staging is not None else 0

    def _staged(self, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """The first ``numel`` elements of the pinned staging buffer, as ``dtype`` (grown when needed)."""
        nbytes = numel * dtype.itemsize
        if self._staging is None or self._staging.numel() < nbytes:
            self._staging = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        return self._staging[:nbytes].view(dtype)
