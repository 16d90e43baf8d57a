"""Timed microbenchmarks of one machine: matmul, memory copy, host transfer, optimizer, NVMe.

Each function returns a speed (per second) and allocates only what it measures, freed on return.
Sizes are fixed per device kind so every rank runs the same work (the collective benchmark runs
a deterministic sequence of collectives: see [Note: same collectives on every rank] in
``hardware.py``). Together they take a few seconds on a GPU and about a second on a CPU.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

Collective = Callable[[torch.Tensor, torch.Tensor], object]
"""``fn(out, inp)``: an all-gather or reduce-scatter bound to a process group by the caller."""

_MiB = 1 << 20


@dataclass(frozen=True)
class BenchSizes:
    """How big each microbenchmark is: small on a CPU, large enough to saturate an accelerator."""

    matmul_dim: int
    """Side of the square matmul."""
    copy_bytes: int
    """Bytes copied for memory and host-transfer bandwidth."""
    optimizer_numel: int
    """Parameter elements the AdamW benchmark updates."""
    collective_bytes: tuple[int, ...]
    """Full message sizes of the collective benchmark, ascending."""
    nvme_bytes: int
    """Bytes written and read back for NVMe bandwidth."""
    iters: int
    """Timed repetitions of each benchmark (after one warm-up)."""

    @classmethod
    def for_device(cls, device: torch.device) -> "BenchSizes":
        """Default sizes for ``device``'s kind."""
        if device.type == "cpu":
            return cls(1024, 64 * _MiB, 4 * _MiB, (256 * 1024, _MiB, 4 * _MiB), 64 * _MiB, 3)
        return cls(8192, 1024 * _MiB, 64 * _MiB, (2 * _MiB, 8 * _MiB, 32 * _MiB, 128 * _MiB), 512 * _MiB, 10)


def synchronize(device: torch.device) -> None:
    """Wait for ``device``'s queued work (nothing to wait for on the CPU)."""
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


def time_s(fn: Callable[[], object], device: torch.device, iters: int) -> float:
    """Mean seconds of ``fn`` over ``iters`` calls, after one warm-up call."""
    fn()
    synchronize(device)
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    synchronize(device)
    return (time.perf_counter() - start) / iters


def matmul_flops_per_s(device: torch.device, dtype: torch.dtype, sizes: BenchSizes) -> float:
    """Dense square matmul throughput in ``dtype``."""
    n = sizes.matmul_dim
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    return 2 * n**3 / time_s(lambda: torch.mm(a, b), device, sizes.iters)


def memory_bytes_per_s(device: torch.device, sizes: BenchSizes) -> float:
    """Device memory bandwidth: bytes read plus bytes written per second by a copy."""
    src = torch.empty(sizes.copy_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * sizes.copy_bytes / time_s(lambda: dst.copy_(src), device, sizes.iters)


def host_transfer_bytes_per_s(device: torch.device, sizes: BenchSizes) -> tuple[float, float]:
    """(host-to-device, device-to-host) bandwidth through pinned host memory.

    On the CPU there is no transfer: this times a host copy (one direction's bytes per second).
    """
    nbytes = sizes.copy_bytes
    if device.type == "cpu":
        src, dst = torch.empty(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
        copy_bytes_per_s = nbytes / time_s(lambda: dst.copy_(src), device, sizes.iters)
        return copy_bytes_per_s, copy_bytes_per_s
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    h2d = nbytes / time_s(lambda: dev.copy_(host, non_blocking=True), device, sizes.iters)
    d2h = nbytes / time_s(lambda: host.copy_(dev, non_blocking=True), device, sizes.iters)
    return h2d, d2h


def collective_s(fn: Collective, out_bytes: int, in_bytes: int, device: torch.device, iters: int) -> float:
    """Mean seconds of ``fn(out, inp)`` on float32 buffers of the given sizes (multiples of 4)."""
    out = torch.empty(out_bytes // 4, dtype=torch.float32, device=device)
    inp = torch.ones(in_bytes // 4, dtype=torch.float32, device=device)
    return time_s(lambda: fn(out, inp), device, iters)


def local_copy(out: torch.Tensor, inp: torch.Tensor) -> None:
    """The world-size-1 stand-in for a collective: copy the input into (the start of) the output."""
    out[: inp.numel()].copy_(inp)


def optimizer_numel_per_s(device: torch.device, numel: int, iters: int) -> float:
    """AdamW update speed in elements per second (fused kernel where available, else foreach)."""
    params = [torch.zeros(numel // 8, device=device, requires_grad=True) for _ in range(8)]
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer = _adamw(params)
    return (numel // 8) * 8 / time_s(optimizer.step, device, iters)


def nvme_bytes_per_s(path: str | os.PathLike, nbytes: int) -> tuple[float, float]:
    """(read, write) bandwidth of a file under ``path``, bypassing the page cache for the read."""
    block = os.urandom(8 * _MiB)
    fd, name = tempfile.mkstemp(prefix="elixir-bench-", dir=path)
    try:
        write_s = _timed(lambda: _write_file(fd, block, nbytes))
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        read_s = _timed(lambda: _read_file(fd, len(block)))
    finally:
        os.close(fd)
        os.unlink(name)
    return nbytes / read_s, nbytes / write_s


def _adamw(params: list[torch.Tensor]) -> torch.optim.Optimizer:
    """AdamW with the fused kernel when this build supports it for the device, else foreach."""
    try:
        optimizer = torch.optim.AdamW(params, fused=True)
        optimizer.step()
        return optimizer
    except RuntimeError:
        return torch.optim.AdamW(params, foreach=True)


def _timed(fn: Callable[[], object]) -> float:
    """Seconds one call of ``fn`` takes (at least a nanosecond)."""
    start = time.perf_counter()
    fn()
    return max(time.perf_counter() - start, 1e-9)


def _write_file(fd: int, block: bytes, nbytes: int) -> None:
    """Write ``nbytes`` of ``block`` repeats and flush them to the device."""
    for _ in range(nbytes // len(block)):
        os.write(fd, block)
    os.fsync(fd)


def _read_file(fd: int, block_bytes: int) -> None:
    """Read the file back from the start."""
    os.lseek(fd, 0, os.SEEK_SET)
    while os.read(fd, block_bytes):
        pass
