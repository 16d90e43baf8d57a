"""Measure a machine once, cache the HardwareProfile as JSON, and agree on it across ranks.

    hw = profile_hardware("cuda:0", world_size=dist.get_world_size(),
                          all_gather=lambda o, i: dist.all_gather_into_tensor(o, i),
                          reduce_scatter=lambda o, i: dist.reduce_scatter_tensor(o, i),
                          compute_dtype=torch.bfloat16)

This module uses no process group itself: the caller injects the collectives, bound to its group.

[Note: same collectives on every rank]
A collective that one rank calls and another does not hangs the job. So the sequence here never
depends on rank-local state: (1) with world_size > 1 the ranks first all-gather whether each has a
valid cache, and all measure unless all have one; (2) the measurement runs fixed sizes and
iteration counts; (3) the ranks all-gather their numbers and keep the slowest (lowest speed,
highest latency and operator overhead, least communication overlap), so every rank returns the
same profile and the search makes the same plan.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from lightning_elixir.devices import release_pinned_cache
from lightning_elixir.profile import bench, optimizer_bench
from lightning_elixir.profile.bench import BenchSizes, Collective
from lightning_elixir.profile.types import HardwareProfile, ProfileError

log = logging.getLogger(__name__)

DEFAULT_CACHE_DIR = Path("~/.cache/lightning_elixir")
CACHE_FORMAT = 5
"""Part of the cache file name. Bump it when HardwareProfile gains a measured field: a profile
cached before would load with the field's default (v2: ``comm_overlap``, which defaults to 1.0;
v3: ``op_overhead_s`` and the matmul, attention and elementwise points, which default to no
overhead, every call at the peak matmul rate and bytes at the copy bandwidth), or when what a
field measures changes (v4: the reduce-scatter of CPU tensors became a direct exchange; v5: the host
optimizer is timed as the offload worker runs it, with ``host_update_overhead_s`` and
``upload_bytes_per_s``, [Note: measuring host updates] in optimizer_bench.py)."""
# (size, speed) point fields: the worst case over ranks is the smallest speed at each size.
_POINT_FIELDS = ("all_gather_bytes_per_s", "reduce_scatter_bytes_per_s", "matmul_points", "attention_points",
                 "attention_backward_points", "elementwise_points")
# Fields whose worst case over ranks is their largest value.
_MAX_FIELDS = ("collective_latency_s", "op_overhead_s", "host_update_overhead_s")
# Fields whose worst case over ranks is their smallest value.
_MIN_FIELDS = ("device_memory_bytes", "matmul_flops_per_s", "device_memory_bytes_per_s", "h2d_bytes_per_s",
               "d2h_bytes_per_s", "optimizer_device_numel_per_s", "optimizer_cpu_numel_per_s",
               "nvme_read_bytes_per_s", "nvme_write_bytes_per_s", "comm_overlap", "upload_bytes_per_s")


@dataclass(frozen=True)
class MachineKey:
    """What a cached profile must match to be reused."""

    device_name: str
    """Device name ("cpu" or the accelerator's name)."""
    device_count: int
    """Devices on the node."""
    world_size: int
    """Ranks in the process group."""
    torch_version: str
    """torch.__version__."""
    compute_dtype: str
    """dtype of the compute benchmarks (matmul, attention, elementwise)."""
    nodes: int = 1
    """Machines the ranks are spread over: collectives between machines run at other speeds than within
    one, so 4 ranks on one node and 2 on each of two share no profile (in the file name only: a cache
    directory in a shared home is seen by jobs of either shape)."""

    @classmethod
    def current(cls, device: torch.device, world_size: int, compute_dtype: torch.dtype,
                nodes: int = 1) -> "MachineKey":
        """The key of this process's machine."""
        name, count = _device_name_and_count(device)
        return cls(name, count, world_size, torch.__version__, _dtype_name(compute_dtype), max(1, nodes))

    def file_name(self) -> str:
        """The cache file name for this key (and the cache format)."""
        nodes = f"-nodes{self.nodes}" if self.nodes > 1 else ""  # one machine: the names caches always had
        raw = (f"hardware-v{CACHE_FORMAT}-{self.device_name}-x{self.device_count}-ws{self.world_size}{nodes}"
               f"-torch{self.torch_version}")
        return re.sub(r"[^A-Za-z0-9_.+-]", "_", f"{raw}-{self.compute_dtype}") + ".json"

    def matches(self, profile: HardwareProfile) -> bool:
        """Whether ``profile`` was measured on a machine with this key (``nodes`` is told by the file name)."""
        return (self.device_name, self.device_count, self.world_size, self.torch_version, self.compute_dtype) == (
            profile.device_name, profile.device_count, profile.world_size, profile.torch_version,
            profile.compute_dtype)


def profile_hardware(
    device: torch.device | str = "cpu",
    world_size: int = 1,
    all_gather: Collective | None = None,
    reduce_scatter: Collective | None = None,
    nvme_path: str | os.PathLike | None = None,
    cache_dir: str | os.PathLike | None = None,
    compute_dtype: torch.dtype = torch.float32,
    refresh: bool = False,
    sizes: BenchSizes | None = None,
    nodes: int = 1,
) -> HardwareProfile:
    """Measure (or load from the cache) the speeds the search's cost model needs.

    Every rank of the process group must call this with the same arguments (see
    [Note: same collectives on every rank]); all return the same profile.

    Args:
        device: The device this rank trains on.
        world_size: Ranks in the process group that ``all_gather``/``reduce_scatter`` run on.
        all_gather: ``all_gather(out, inp)`` into a flat ``out`` of ``world_size * inp.numel()``
            elements, e.g. ``lambda o, i: dist.all_gather_into_tensor(o, i, group=g)``. Required
            when ``world_size > 1``; with world size 1 and none given, a local copy is timed.
        reduce_scatter: ``reduce_scatter(out, inp)`` summing ``inp`` over ranks into this rank's
            ``out`` of ``inp.numel() / world_size`` elements. Same rules as ``all_gather``.
        nvme_path: A directory on the NVMe drive offloading would use; None to skip (bandwidths 0).
        cache_dir: Where profiles are cached (default ``~/.cache/lightning_elixir``).
        compute_dtype: The dtype the matmul, attention and elementwise benchmarks run in (the
            training compute dtype).
        refresh: Measure even when a valid cached profile exists.
        sizes: Benchmark sizes (default: per device kind, see ``BenchSizes.for_device``).
        nodes: Machines the ``world_size`` ranks are spread over (part of the cache key).

    Returns:
        The HardwareProfile, identical on every rank.

    Raises:
        ValueError: If ``world_size > 1`` and a collective is missing, or ``nvme_path`` is not a
            directory (checked before any collective runs).
    """
    device = torch.device(device)
    _check_arguments(world_size, all_gather, reduce_scatter, nvme_path)
    sizes = sizes or BenchSizes.for_device(device)
    key = MachineKey.current(device, world_size, compute_dtype, nodes)
    path = Path(cache_dir or DEFAULT_CACHE_DIR).expanduser() / key.file_name()
    cached = None if refresh else load_cached(path, key)
    if not _usable_on_every_rank(cached, all_gather, world_size, device):
        cached = None
    profile = cached or measure_hardware(device, key, sizes, all_gather, reduce_scatter, nvme_path)
    measured_nvme = cached is not None and nvme_path is not None and not cached.nvme_read_bytes_per_s > 0
    if measured_nvme:  # cached without an NVMe path: measure the drive only (no collectives involved)
        read, write = bench.nvme_bytes_per_s(nvme_path, sizes.nvme_bytes)
        profile = dataclasses.replace(profile, nvme_read_bytes_per_s=read, nvme_write_bytes_per_s=write)
    profile = _slowest_rank(profile, all_gather, world_size, device)
    if cached is None or measured_nvme:
        write_cache(path, profile)
    return profile


def _check_arguments(world_size: int, all_gather: Collective | None, reduce_scatter: Collective | None,
                     nvme_path: str | os.PathLike | None) -> None:
    """Raise on arguments that would fail mid-way, while no rank has started a collective."""
    if world_size > 1 and (all_gather is None or reduce_scatter is None):
        raise ValueError("world_size > 1 needs both all_gather and reduce_scatter, bound to the process group "
                         "(e.g. all_gather=lambda o, i: dist.all_gather_into_tensor(o, i))")
    if nvme_path is not None and not Path(nvme_path).is_dir():
        raise ValueError(f"nvme_path {nvme_path} is not a directory; pass a directory on the NVMe drive or None")


def measure_hardware(device: torch.device, key: MachineKey, sizes: BenchSizes, all_gather: Collective | None,
                     reduce_scatter: Collective | None, nvme_path: str | os.PathLike | None) -> HardwareProfile:
    """Run every microbenchmark once (the same collectives on every rank)."""
    log.info("measuring hardware profile for %s", key)
    dtype = getattr(torch, key.compute_dtype)
    overhead_s = bench.op_overhead_s(device, sizes, dtype)
    matmul_points = bench.matmul_points(device, dtype, sizes)
    attention_points, attention_backward_points = bench.attention_points(device, dtype, sizes)
    elementwise_points = bench.elementwise_points(device, dtype, sizes)
    h2d, d2h = bench.host_transfer_bytes_per_s(device, sizes)
    latency_s, gather_points, scatter_points = _collectives(device, key.world_size, sizes, all_gather, reduce_scatter)
    optimizer_device = optimizer_bench.optimizer_numel_per_s(device, sizes.optimizer_numel, sizes.iters)
    host_update = optimizer_bench.host_update_costs(device, dtype, sizes)
    nvme_read, nvme_write = bench.nvme_bytes_per_s(nvme_path, sizes.nvme_bytes) if nvme_path else (0.0, 0.0)
    overlap = bench.comm_overlap(all_gather or bench.local_copy, reduce_scatter or bench.local_copy, key.world_size,
                                 device, dtype, sizes)
    release_pinned_cache(device)
    return HardwareProfile(
        device_name=key.device_name, device_count=key.device_count, world_size=key.world_size,
        torch_version=key.torch_version, device_memory_bytes=_device_memory_bytes(device),
        matmul_flops_per_s=matmul_points[-1][1],  # the largest size: the peak
        device_memory_bytes_per_s=bench.memory_bytes_per_s(device, sizes),
        h2d_bytes_per_s=h2d, d2h_bytes_per_s=d2h,
        all_gather_bytes_per_s=gather_points, reduce_scatter_bytes_per_s=scatter_points,
        optimizer_device_numel_per_s=optimizer_device, optimizer_cpu_numel_per_s=host_update.optimizer_numel_per_s,
        host_update_overhead_s=host_update.overhead_s, upload_bytes_per_s=host_update.upload_bytes_per_s,
        nvme_read_bytes_per_s=nvme_read, nvme_write_bytes_per_s=nvme_write,
        collective_latency_s=latency_s, comm_overlap=overlap, compute_dtype=key.compute_dtype,
        notes=_notes(device, key.world_size, all_gather), op_overhead_s=overhead_s, matmul_points=matmul_points,
        attention_points=attention_points, attention_backward_points=attention_backward_points,
        elementwise_points=elementwise_points,
    )


def load_cached(path: Path, key: MachineKey) -> HardwareProfile | None:
    """The cached profile at ``path`` if it is valid and matches ``key``; None (and a warning) if not."""
    if not path.is_file():
        return None
    try:
        profile = HardwareProfile.from_json(path)
    except (ProfileError, TypeError, ValueError, OSError) as err:
        log.warning("ignoring corrupted hardware profile cache %s (%s); measuring again", path, err)
        return None
    if not key.matches(profile):
        log.warning("ignoring hardware profile cache %s: it was measured for %s, not %s; measuring again",
                    path, profile.cache_key(), key)
        return None
    log.info("reusing cached hardware profile %s", path)
    return profile


def write_cache(path: Path, profile: HardwareProfile) -> None:
    """Write ``profile`` to ``path`` atomically (temp file + rename: ranks may write at once)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=path.name, suffix=".tmp", dir=path.parent)
        with os.fdopen(fd, "w") as f:
            f.write(profile.to_json())
        os.replace(tmp, path)
    except OSError as err:
        log.warning("could not cache the hardware profile at %s (%s); it will be measured again next time", path, err)


def _collectives(device: torch.device, world_size: int, sizes: BenchSizes, all_gather: Collective | None,
                 reduce_scatter: Collective | None) -> tuple[float, tuple, tuple]:
    """(latency, all-gather points, reduce-scatter points); fixed sizes and counts on every rank."""
    all_gather = all_gather or bench.local_copy
    reduce_scatter = reduce_scatter or bench.local_copy
    tiny = 4 * world_size
    latency_s = min(bench.collective_s(all_gather, tiny, tiny // world_size, device, sizes.iters),
                    bench.collective_s(reduce_scatter, tiny // world_size, tiny, device, sizes.iters))
    gather, scatter = [], []
    for nbytes in sizes.collective_bytes:
        nbytes -= nbytes % tiny
        gather_s = bench.collective_s(all_gather, nbytes, nbytes // world_size, device, sizes.iters)
        scatter_s = bench.collective_s(reduce_scatter, nbytes // world_size, nbytes, device, sizes.iters)
        gather.append((nbytes, nbytes / _transfer_s(gather_s, latency_s)))
        scatter.append((nbytes, nbytes / _transfer_s(scatter_s, latency_s)))
    return latency_s, tuple(gather), tuple(scatter)


def _transfer_s(total_s: float, latency_s: float) -> float:
    """The bandwidth-bound part of a collective's time (never below half of it: timing noise)."""
    return max(total_s - latency_s, total_s / 2)


def _usable_on_every_rank(cached: HardwareProfile | None, all_gather: Collective | None, world_size: int,
                          device: torch.device) -> bool:
    """Whether every rank has a cached profile, all with the same number of points in each point
    field (so that ``_slowest_rank``'s vectors have the same length on every rank)."""
    if world_size == 1:
        return cached is not None
    points = [float(len(getattr(cached, name))) if cached else -1.0 for name in _POINT_FIELDS]
    every = torch.empty(world_size * len(points), dtype=torch.float64, device=device)
    all_gather(every, torch.tensor(points, dtype=torch.float64, device=device))
    every = every.view(world_size, -1)
    return bool(every.min().item() >= 0 and (every == every[0]).all().item())


def _slowest_rank(profile: HardwareProfile, all_gather: Collective | None, world_size: int,
                  device: torch.device) -> HardwareProfile:
    """The profile with every speed and the overlap the lowest, and the latency and the operator
    overhead the highest, over ranks."""
    if world_size == 1:
        return profile
    # Costs are negated so that "min over ranks" is the worst case for every entry.
    mine = [float(getattr(profile, name)) for name in _MIN_FIELDS]
    mine += [-getattr(profile, name) for name in _MAX_FIELDS]
    mine += [rate for name in _POINT_FIELDS for _, rate in getattr(profile, name)]
    every = torch.empty(world_size * len(mine), dtype=torch.float64, device=device)
    all_gather(every, torch.tensor(mine, dtype=torch.float64, device=device))
    worst = every.view(world_size, -1).min(dim=0).values.tolist()
    return _with_values(profile, worst)


def _with_values(profile: HardwareProfile, values: list[float]) -> HardwareProfile:
    """``profile`` with the values of ``_slowest_rank``'s vector put back in their fields."""
    rest = iter(values)
    changes: dict[str, object] = {name: next(rest) for name in _MIN_FIELDS}
    changes["device_memory_bytes"] = int(changes["device_memory_bytes"])
    changes.update({name: -next(rest) for name in _MAX_FIELDS})
    for name in _POINT_FIELDS:  # each rank's points are at the same sizes (fixed by BenchSizes)
        changes[name] = tuple((size, next(rest)) for size, _ in getattr(profile, name))
    return dataclasses.replace(profile, **changes)


def _notes(device: torch.device, world_size: int, all_gather: Collective | None) -> tuple[str, ...]:
    """What was measured differently from what the field names say."""
    notes = [f"cpu threads: {torch.get_num_threads()}"]
    if device.type == "cpu":
        notes.append("no accelerator: h2d/d2h are a host memory copy, the device is the CPU")
    if world_size == 1 and all_gather is None:
        notes.append("world size 1 without collectives: all-gather/reduce-scatter are a local copy")
    return tuple(notes)


def _device_name_and_count(device: torch.device) -> tuple[str, int]:
    """The device's name and how many of its kind the node has."""
    if device.type == "cpu":
        return "cpu", 1
    module = torch.get_device_module(device)
    return module.get_device_name(device), module.device_count()


def _device_memory_bytes(device: torch.device) -> int:
    """Total memory of one device (physical memory for the CPU)."""
    if device.type == "cpu":
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return torch.get_device_module(device).get_device_properties(device).total_memory


def _dtype_name(dtype: torch.dtype) -> str:
    """"float32" for torch.float32."""
    return str(dtype).removeprefix("torch.")
