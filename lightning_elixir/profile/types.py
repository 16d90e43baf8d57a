"""The profile contract: what the profiler measures and the search consumes.

Frozen dataclasses with a JSON round-trip. No ``torch.distributed`` and no device calls here.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import math
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from lightning_elixir.plan import load_json_object

PHASES = ("forward", "backward", "recompute")


class ProfileError(ValueError):
    """A profile is malformed (bad JSON, unknown keys, inconsistent fields)."""


def _from_dict(cls: type, data: dict[str, Any]) -> Any:
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ProfileError(f"unknown {cls.__name__} key(s) {unknown}; known keys are {sorted(known)}")
    return cls(**data)


def _load_json(text_or_path: str | os.PathLike) -> dict[str, Any]:
    return load_json_object(text_or_path, "profile", ProfileError)


@dataclass(frozen=True)
class ParamInfo:
    """One parameter of the model."""

    name: str
    """Name as in ``named_parameters()`` (duplicates removed: a tied weight appears once)."""
    numel: int
    """Number of elements."""
    shape: tuple[int, ...]
    """Shape."""
    dtype: str
    """dtype of the parameter as stored in the module, e.g. "float32"."""
    requires_grad: bool
    """Whether the parameter is trained."""
    owner: str
    """Qualified name of the module that registers it ("" for the root)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(self.shape))
        if self.numel < 0:
            raise ProfileError(f"parameter {self.name} has negative numel")


@dataclass(frozen=True)
class Access:
    """One step of the access sequence: a leaf module call (or op) and the parameters it touches."""

    phase: str
    """"forward", "backward" or "recompute" (forward re-run under activation checkpointing)."""
    module: str
    """Qualified name of the module (or a "module:op" label) doing the computation."""
    params: tuple[str, ...]
    """Parameters this access reads (forward) or differentiates through (backward)."""
    live_bytes: int
    """Activation and temporary bytes alive right after this access (parameters excluded)."""
    compute_s: float = 0.0
    """Estimated compute time of this access in seconds (from FLOPs and bytes moved)."""
    flops: float = 0.0
    """Floating-point operations of this access."""
    peak_bytes: int = 0
    """Peak activation and temporary bytes from the start of this access to the start of the next."""
    moved_bytes: int = 0
    """Bytes the operators of this access read and write (views excluded)."""
    op: str = ""
    """The operator of an op-level access ("aten.t"): a parameter used outside its owner's forward,
    inside a module without direct parameters. Empty for module-level accesses, which are the ones
    the runtime's module hooks see; an op-level access has ``module`` "module:op"."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "params", tuple(self.params))
        if self.phase not in PHASES:
            raise ProfileError(f"unknown phase {self.phase!r}; use one of {PHASES}")


@dataclass(frozen=True)
class ModelProfile:
    """What one training step of a model does, recorded without allocating its weights."""

    params: tuple[ParamInfo, ...]
    """Every parameter, in first-use order (unused parameters last, in registration order)."""
    accesses: tuple[Access, ...]
    """The full access sequence through forward and backward (and recomputation)."""
    shared_params: tuple[str, ...]
    """Parameters used by more than one module or outside their owner (tied weights)."""
    forward_peak_bytes: int
    """Peak live activation/temporary bytes during forward."""
    backward_peak_bytes: int
    """Peak live activation/temporary bytes during backward."""
    compute_dtype: str = "float32"
    """The dtype the step computes in ("float32", "bfloat16", "float16")."""
    forward_compute_s: float = 0.0
    """Estimated compute time of the forward in seconds."""
    backward_compute_s: float = 0.0
    """Estimated compute time of the backward (including recomputation) in seconds."""
    conditional_params: tuple[str, ...] = ()
    """Parameters of modules whose calls depend on tensor values; also in ``shared_params``, so they get
    private chunks ([Note: value-dependent module calls] in model.py)."""
    recomputes: bool = False
    """Whether the step re-runs forward operators in its backward (activation checkpointing), also where no
    unit's forward hook sees it: a module that checkpoints inside its own forward, as Hugging Face layers
    do after ``gradient_checkpointing_enable()``, shows no "recompute" access."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "params", tuple(self.params))
        object.__setattr__(self, "accesses", tuple(self.accesses))
        object.__setattr__(self, "shared_params", tuple(self.shared_params))
        object.__setattr__(self, "conditional_params", tuple(self.conditional_params))
        names = {p.name for p in self.params}
        unknown = {n for a in self.accesses for n in a.params} - names
        if unknown:
            raise ProfileError(f"accesses name unknown parameters: {sorted(unknown)[:5]}")

    def with_private(self, names: Iterable[str]) -> "ModelProfile":
        """This profile with ``names`` also listed as shared: the search gives them private chunks."""
        extra = tuple(n for n in dict.fromkeys(names) if n not in self.shared_params)
        return dataclasses.replace(self, shared_params=self.shared_params + extra) if extra else self

    @property
    def total_numel(self) -> int:
        """Total parameter elements."""
        return sum(p.numel for p in self.params)

    @property
    def activation_peak_bytes(self) -> int:
        """Peak live activation bytes over the whole step."""
        return max(self.forward_peak_bytes, self.backward_peak_bytes)

    @property
    def compute_s(self) -> float:
        """Estimated compute time of one step in seconds."""
        return self.forward_compute_s + self.backward_compute_s

    def to_json(self, path: str | os.PathLike | None = None) -> str:
        """Serialise to JSON, and write it to ``path`` when given."""
        text = json.dumps(dataclasses.asdict(self))
        if path is not None:
            with open(path, "w") as f:
                f.write(text)
        return text

    @classmethod
    def from_json(cls, text_or_path: str | os.PathLike) -> "ModelProfile":
        """Load from a JSON string or file."""
        data = _load_json(text_or_path)
        data["params"] = tuple(_from_dict(ParamInfo, p) for p in data.get("params", ()))
        data["accesses"] = tuple(_from_dict(Access, a) for a in data.get("accesses", ()))
        return _from_dict(cls, data)


@dataclass(frozen=True)
class HardwareProfile:
    """Measured speeds of one machine and process group. Bandwidths are bytes per second."""

    device_name: str
    """e.g. "NVIDIA H200" or "cpu"."""
    device_count: int
    """Devices on the node."""
    world_size: int
    """Ranks in the process group the collectives were measured on."""
    torch_version: str
    """torch.__version__ at measurement time."""
    device_memory_bytes: int
    """Total memory of one device."""
    matmul_flops_per_s: float
    """Dense matmul throughput in the compute dtype: the peak, measured at the largest benchmark size
    (``matmul_points`` has the rate of smaller matmuls)."""
    device_memory_bytes_per_s: float
    """Device memory bandwidth (copy)."""
    h2d_bytes_per_s: float
    """Host-to-device bandwidth from pinned memory."""
    d2h_bytes_per_s: float
    """Device-to-host bandwidth into pinned memory."""
    all_gather_bytes_per_s: tuple[tuple[int, float], ...]
    """(message bytes per rank's full output, algorithm bandwidth) points, ascending in bytes."""
    reduce_scatter_bytes_per_s: tuple[tuple[int, float], ...]
    """(message bytes of the full input, algorithm bandwidth) points, ascending in bytes."""
    optimizer_device_numel_per_s: float
    """AdamW update speed on the device in elements per second."""
    optimizer_cpu_numel_per_s: float
    """AdamW update speed on the host in elements per second, as the offload worker runs it: in its
    own thread, on state beyond the host's caches, beside the thread launching the device's work
    ([Note: measuring host updates] in optimizer_bench.py)."""
    nvme_read_bytes_per_s: float = 0.0
    """Read bandwidth at the NVMe path (0: not measured / no path)."""
    nvme_write_bytes_per_s: float = 0.0
    """Write bandwidth at the NVMe path (0: not measured / no path)."""
    collective_latency_s: float = 0.0
    """Fixed cost of launching one collective."""
    comm_overlap: float = 1.0
    """Fraction of a collective's duration that can hide behind compute running at the same time;
    the compute loses the rest. 1.0: communication has its own engine and takes nothing from compute
    (NCCL on a GPU); 0.0: it takes the same cores compute needs (gloo on a busy CPU), so overlapping
    it saves nothing. 1.0 unless measured (a hand-written profile keeps the GPU assumption)."""
    compute_dtype: str = "float32"
    """The dtype ``matmul_flops_per_s`` and the matmul, attention and elementwise points were measured in."""
    notes: tuple[str, ...] = ()
    """What was not measured as named, e.g. "h2d: no accelerator, measured a host copy"."""
    op_overhead_s: float = 0.0
    """Fixed seconds every (non-view) operator of a training step costs however little it computes:
    dispatch, autograd bookkeeping, module calls, views, allocation, kernel launch. Measured as the
    time of a tiny training step per operator. 0: not measured."""
    matmul_points: tuple[tuple[float, float], ...] = ()
    """(FLOPs of one matmul call, achieved FLOP/s) at a few square sizes, ascending in FLOPs: small
    matmuls run below the peak. Empty: only the peak ``matmul_flops_per_s`` is known (see
    ``matmul_flops_per_s_at``)."""
    attention_points: tuple[tuple[float, float], ...] = ()
    """(FLOPs of one attention forward call, achieved FLOP/s) of causal scaled dot product attention
    at a few sizes, ascending in FLOPs. Empty: attention runs at the matmul rate."""
    attention_backward_points: tuple[tuple[float, float], ...] = ()
    """The same for the attention backward call. Empty: it runs at the matmul rate."""
    elementwise_points: tuple[tuple[float, float], ...] = ()
    """(Bytes one call reads and writes, achieved bytes/s) of out-of-place elementwise and
    normalisation operators (add, GELU, layer norm, softmax) at a few sizes, ascending in bytes.
    Empty: operators move bytes at ``device_memory_bytes_per_s``."""
    host_update_overhead_s: float = 0.0
    """Fixed seconds of one offloaded chunk's update on the host, whatever its size (the optimizer's
    call, the upload's launch and wait). 0: not measured."""
    upload_bytes_per_s: float = 0.0
    """Speed of an updated shard's way back to the device, in bytes of the compute dtype per second:
    the conversion on the host into pinned memory and the copy. 0: not measured (``h2d_bytes_per_s``)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "notes", tuple(self.notes))
        for name in _RATE_POINT_FIELDS:
            object.__setattr__(self, name, _rate_points(name, getattr(self, name)))
        for name in ("op_overhead_s", "host_update_overhead_s", "upload_bytes_per_s"):
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):
                raise ProfileError(f"{name} must be a finite number >= 0, got {value}")
        for name in ("all_gather_bytes_per_s", "reduce_scatter_bytes_per_s"):
            points = tuple(sorted((int(b), float(bw)) for b, bw in getattr(self, name)))
            if not points or any(bw <= 0 for _, bw in points):
                raise ProfileError(f"{name} needs at least one (bytes, positive bandwidth) point")
            object.__setattr__(self, name, points)
        for name in ("matmul_flops_per_s", "device_memory_bytes_per_s", "h2d_bytes_per_s", "d2h_bytes_per_s",
                     "optimizer_device_numel_per_s", "optimizer_cpu_numel_per_s"):
            if not getattr(self, name) > 0:
                raise ProfileError(f"{name} must be positive")
        if not 0.0 <= self.comm_overlap <= 1.0:
            raise ProfileError(f"comm_overlap is a fraction in [0, 1], got {self.comm_overlap}")

    def matmul_flops_per_s_at(self, flops: float) -> float:
        """Matmul throughput for one call doing ``flops``: interpolated between ``matmul_points`` in
        log space of the flops, flat beyond the smallest and largest; ``matmul_flops_per_s`` when
        there are no points."""
        if not self.matmul_points:
            return self.matmul_flops_per_s
        return _interpolate(self.matmul_points, flops, log=True)

    def attention_flops_per_s_at(self, flops: float, backward: bool = False) -> float:
        """Attention throughput for one forward (or backward) call doing ``flops``, like
        ``matmul_flops_per_s_at`` over the attention points; the matmul rate when there are none."""
        points = self.attention_backward_points if backward else self.attention_points
        if not points:
            return self.matmul_flops_per_s_at(flops)
        return _interpolate(points, flops, log=True)

    def elementwise_bytes_per_s_at(self, nbytes: float) -> float:
        """Bytes per second of an operator call reading and writing ``nbytes``: interpolated like
        ``matmul_flops_per_s_at`` over ``elementwise_points``; ``device_memory_bytes_per_s`` when
        there are none."""
        if not self.elementwise_points:
            return self.device_memory_bytes_per_s
        return _interpolate(self.elementwise_points, nbytes, log=True)

    def all_gather_s(self, nbytes: int) -> float:
        """Predicted seconds to all-gather a chunk of ``nbytes`` (full size)."""
        return self.collective_latency_s + nbytes / _interpolate(self.all_gather_bytes_per_s, nbytes)

    def reduce_scatter_s(self, nbytes: int) -> float:
        """Predicted seconds to reduce-scatter a chunk of ``nbytes`` (full size)."""
        return self.collective_latency_s + nbytes / _interpolate(self.reduce_scatter_bytes_per_s, nbytes)

    def cache_key(self) -> str:
        """The key a cached profile is stored under."""
        return f"{self.device_name}-x{self.device_count}-ws{self.world_size}-torch{self.torch_version}"

    def to_json(self, path: str | os.PathLike | None = None) -> str:
        """Serialise to JSON, and write it to ``path`` when given."""
        text = json.dumps(dataclasses.asdict(self), indent=2)
        if path is not None:
            with open(path, "w") as f:
                f.write(text)
        return text

    @classmethod
    def from_json(cls, text_or_path: str | os.PathLike) -> "HardwareProfile":
        """Load from a JSON string or file."""
        data = _load_json(text_or_path)
        for name in ("all_gather_bytes_per_s", "reduce_scatter_bytes_per_s", *_RATE_POINT_FIELDS):
            data[name] = tuple(tuple(p) for p in data.get(name, ()))
        return _from_dict(cls, data)


def _interpolate(points: tuple[tuple[float, float], ...], x: float, log: bool = False) -> float:
    """The value at ``x``: linear between the points (in ``log(x)`` with ``log``), flat beyond them."""
    xs = [p for p, _ in points]
    i = bisect.bisect_left(xs, x)
    if i == 0:
        return points[0][1]
    if i == len(points):
        return points[-1][1]
    (x0, y0), (x1, y1) = points[i - 1], points[i]
    where = math.log(x / x0) / math.log(x1 / x0) if log else (x - x0) / (x1 - x0)
    return y0 + (y1 - y0) * where


_RATE_POINT_FIELDS = ("matmul_points", "attention_points", "attention_backward_points", "elementwise_points")
"""HardwareProfile's (work of one call, work per second) fields: empty, or positive pairs with
distinct work."""


def _rate_points(name: str, points: Any) -> tuple[tuple[float, float], ...]:
    """``points`` as (float, float) pairs ascending in work; ProfileError unless all are positive
    and finite with distinct work."""
    try:
        points = tuple(sorted((float(w), float(r)) for w, r in points))
    except (TypeError, ValueError) as err:
        raise ProfileError(f"{name} must be (work, work per second) pairs ({err})") from None
    if not all(w > 0 and r > 0 and math.isfinite(w) and math.isfinite(r) for w, r in points):
        raise ProfileError(f"{name} needs positive (work, work per second) pairs, got {points}")
    if len({w for w, _ in points}) < len(points):
        raise ProfileError(f"{name} has two rates for the same work: {points}")
    return points
