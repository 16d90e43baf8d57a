"""Device work shared by the profile and the runtime: what a thread other than the one that owns a
device must do before it issues work there, host values to and from a GPU without the host waiting
for the device, and host tensors up to the device on a stream of their own (``HostToDevice``).

[Note: a worker thread's current device]
A new thread's current CUDA device is device 0, whatever device the thread that started it uses.
A stream context restores, on exit, the stream that was current before it: device 0's, which
makes device 0 current, and the first CUDA call there creates a context on GPU 0 (about half a GiB)
in the process of every rank: memory outside each rank's budget, all of it on one GPU. So a worker
that issues CUDA work (uploads, streams, pinned buffers) makes its device current first, and that
device is resolved to its index by the thread that owns it (``torch.cuda.set_device`` refuses a
device without one).
"""

from __future__ import annotations

import gc
from typing import Any, Optional

import torch


def indexed(device: torch.device) -> torch.device:
    """``device`` with its index: the calling thread's current one where it has none (GPUs only)."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def use_device(device: torch.device) -> None:
    """Make ``device`` (an indexed one, see ``indexed``) current in the calling thread; nothing on the CPU."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


def start_worker(device: torch.device, threads: int) -> None:
    """A worker thread's initializer: its intra-op threads and its current device."""
    torch.set_num_threads(threads)
    use_device(device)


def release_pinned_cache(device: torch.device) -> None:
    """Give the system back the pinned host memory no tensor uses any more (benchmarks' buffers, an old
    plan's slabs): torch's pinned allocator keeps every block it ever handed out, for reuse by blocks
    of the same rounded size, and offloaded state needs that memory."""
    if device.type == "cuda":
        gc.collect()  # tensors in reference cycles, so that their blocks are free to give back
        empty = getattr(torch._C, "_host_emptyCache", None)  # not in every build
        if empty is not None:
            empty()


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host ``tensor`` on ``device``, copied without the host waiting for the device.

    [Note: copies that wait for the device]
    A copy between pageable host memory and a GPU (``.to(device)`` of a host tensor,
    ``torch.tensor(values, device=...)``, ``.tolist()``) waits until the device has run everything
    queued before it: a step that makes one loses the host's lead over the device, and the device
    idles while the host queues the next kernels. From pinned memory with ``non_blocking`` the copy
    is queued like a kernel (the allocator keeps the pinned block until it has run); a result read on
    the host is copied into pinned memory behind an event, and waited for when it is read, by which
    time the device has usually long finished it.
    """
    if device.type != "cuda" or tensor.device.type != "cpu":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


class HostCopy:
    """A device tensor's values on the host, copied behind the device's queued work and read when needed
    ([Note: copies that wait for the device])."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self._event = None
        if tensor.device.type == "cuda":
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            host.copy_(tensor, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record(torch.cuda.current_stream(tensor.device))  # the stream the copy went on
            tensor = host
        self._tensor = tensor

    def tolist(self) -> list:
        """The values (waiting for the copy, on a GPU, if it has not run yet)."""
        if self._event is not None:
            self._event.synchronize()
        return self._tensor.tolist()


class HostToDevice:
    """Host tensors copied into device tensors on a stream of their own, the host waiting for that copy
    only (the shards an offloaded update leaves: [Note: uploads of updated shards] in runtime/upload.py).
    A source of another dtype, or not pinned, is converted into one pinned staging buffer first. Where
    ``device`` is None or not a GPU the copy is a plain one."""

    def __init__(self, device: Optional[torch.device]) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device) if device is not None and device.type == "cuda" else None
        self._staging: Optional[torch.Tensor] = None

    def ready(self) -> Any:
        """An event after the work the calling thread has queued on the device (None without a stream)."""
        if self.stream is None:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def copy(self, source: torch.Tensor, target: torch.Tensor, ready: Any = None) -> None:
        """Copy host ``source`` into device ``target`` (in its dtype) once ``ready`` (an event from
        ``ready()``, or None) has passed; return when it is there."""
        if self.stream is None:
            target.copy_(source)
            return
        if source.dtype != target.dtype or not source.is_pinned():
            staged = self._staged(target.dtype, target.numel())
            staged.copy_(source)
            source = staged
        if ready is not None:
            self.stream.wait_event(ready)
        with torch.cuda.stream(self.stream):
            target.copy_(source, non_blocking=True)
            done = torch.cuda.Event(blocking=True)  # waited for by yielding the core, not spinning on it
            done.record(self.stream)
        done.synchronize()  # the staging buffer is reused by the next copy

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
