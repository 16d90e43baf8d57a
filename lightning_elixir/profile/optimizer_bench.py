"""How fast optimizer updates run: on the device, and on the host as the offload worker runs them.

[Note: measuring host updates] below says why the host's update is not timed as one AdamW call.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from lightning_elixir.devices import HostToDevice, indexed, start_worker
from lightning_elixir.profile.bench import BenchSizes, synchronize, time_s


def optimizer_numel_per_s(device: torch.device, numel: int, iters: int) -> float:
    """AdamW update speed in elements per second (fused kernel where available, else foreach)."""
    params = [torch.zeros(numel // 8, device=device, requires_grad=True) for _ in range(8)]
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer = _adamw(params)
    return (numel // 8) * 8 / time_s(optimizer.step, device, iters)


@dataclass(frozen=True)
class HostUpdateCosts:
    """What an offloaded chunk's update costs the offload worker (``host_update_costs``)."""

    overhead_s: float
    """Fixed seconds per chunk, whatever its size: the optimizer's call, the launch and wait of the upload."""
    optimizer_numel_per_s: float
    """AdamW on the fp32 shard, in elements per second."""
    upload_bytes_per_s: float
    """The updated shard back on the device, in bytes of the compute dtype per second: the conversion
    on the host into pinned memory and the copy (on the CPU, the conversion alone)."""


_SMALL_UPDATE_NUMEL = 4096


def host_update_costs(device: torch.device, compute_dtype: torch.dtype, sizes: BenchSizes) -> HostUpdateCosts:
    """Time offloaded chunks' updates as the offload worker runs them ([Note: measuring host updates]).

    [Note: measuring host updates]
    The first GPU runs of offloading plans fitted the host updates 2.4-3.8x slower than the profile
    had measured them: an AdamW on 64 MiB of state, timed alone on the main thread, which the host's
    caches hold and nothing competes with. The worker updates chunks whose state is far beyond the
    caches, in a thread of its own (with that thread's share of the cores), while the main thread
    launches the device's work, and then converts the shard to the compute dtype and copies it to
    the device ([Note: uploads of updated shards] in runtime/upload.py). So this benchmark runs that:
    ``sizes.host_update_chunks`` chunks of ``host_update_numel`` fp32 shard elements, each with its own
    AdamW (fused where the host supports it, as the worker's shadows are on an accelerator), updated
    in turn in a worker thread with the worker's intra-op threads, each followed by its upload, while
    the main thread (on an accelerator only) launches tiny kernels as a training step's Python does. It times the same at 4096 elements
    per chunk; the fixed cost per chunk is what the small chunks take beyond their size's share.
    """
    small = _host_updates_s(device, compute_dtype, _SMALL_UPDATE_NUMEL, sizes)
    large = _host_updates_s(device, compute_dtype, sizes.host_update_numel, sizes)
    extra = sizes.host_update_numel - _SMALL_UPDATE_NUMEL
    step_s = max(large[0] - small[0], 1e-9)
    upload_s = max(large[1] - small[1], 1e-9)
    optimizer_numel_per_s = extra / step_s
    upload_bytes_per_s = extra * compute_dtype.itemsize / upload_s
    size_share_s = _SMALL_UPDATE_NUMEL * (1 / optimizer_numel_per_s + compute_dtype.itemsize / upload_bytes_per_s)
    return HostUpdateCosts(max(sum(small) - size_share_s, 0.0), optimizer_numel_per_s, upload_bytes_per_s)


def _host_updates_s(device: torch.device, compute_dtype: torch.dtype, numel: int,
                    sizes: BenchSizes) -> tuple[float, float]:
    """(AdamW, upload) seconds per chunk of ``numel`` elements, as ``host_update_costs`` runs them."""
    accelerator = device.type != "cpu"
    pinned = accelerator and compute_dtype == torch.float32  # as the runtime pins masters (chunk.py)
    masters = [torch.zeros(numel, pin_memory=pinned) for _ in range(sizes.host_update_chunks)]
    params = [torch.nn.Parameter(m) for m in masters]
    for p in params:
        p.grad = torch.full_like(p, 1e-3)
    optimizers = [_adamw([p]) if accelerator else torch.optim.AdamW([p]) for p in params]
    shards = [torch.empty(numel, dtype=compute_dtype, device=device) for _ in params]
    upload = HostToDevice(device).copy  # the offload worker's uploads (runtime/upload.py)

    def updates(rounds: int) -> tuple[float, float]:
        step_s = upload_s = 0.0
        for _ in range(rounds):
            for optimizer, master, shard in zip(optimizers, masters, shards):
                start = time.perf_counter()
                optimizer.step()
                middle = time.perf_counter()
                upload(master, shard)
                step_s += middle - start
                upload_s += time.perf_counter() - middle
        count = rounds * len(optimizers)
        return step_s / count, upload_s / count

    threads = torch.get_num_threads()  # the worker's count ([Note: a core for the thread that feeds the device])
    threads = max(1, threads - 1) if accelerator else threads
    with ThreadPoolExecutor(1, thread_name_prefix="elixir-bench-update", initializer=start_worker,
                            initargs=(indexed(device), threads)) as worker:
        worker.submit(updates, 1).result()  # warm-up: the optimizer state is created
        timed = worker.submit(updates, sizes.iters)
        if accelerator:
            _launch_until(timed, device)
        return timed.result()


def _launch_until(future: Future, device: torch.device) -> None:
    """Launch tiny kernels on ``device`` until ``future`` is done, as a training step's Python does."""
    x = torch.zeros(16, device=device)
    while not future.done():
        for _ in range(64):
            x.add_(1.0)
        synchronize(device)


def _adamw(params: list[torch.Tensor]) -> torch.optim.Optimizer:
    """AdamW with the fused kernel when this build supports it for the device, else foreach."""
    try:
        optimizer = torch.optim.AdamW(params, fused=True)
        optimizer.step()
        return optimizer
    except RuntimeError:
        return torch.optim.AdamW(params, foreach=True)
