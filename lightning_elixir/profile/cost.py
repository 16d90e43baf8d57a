"""Per-operator cost: FLOPs (torch.utils.flop_counter), bytes moved, and a roofline time.

[Note: roofline]
An operator takes max(flops / matmul_flops_per_s, bytes / device_memory_bytes_per_s): it is
bound by whichever of compute and memory traffic is slower on the measured machine. FLOPs come
from PyTorch's own formula registry; bytes are what the operator reads and writes (every tensor
argument and output, a broadcast dimension counted once). View operators move nothing. The same
model as ``torch.utils._runtime_estimation``, but calibrated by a measured HardwareProfile rather
than datasheet peaks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop, sdpa_flop

from lightning_elixir.profile.types import HardwareProfile

_aten = torch.ops.aten

# CPU attention kernels the registry does not list; same formulas as the CUDA kernels.
_EXTRA_FLOP_FORMULAS = {
    _aten._scaled_dot_product_flash_attention_for_cpu: sdpa_flop,
    _aten._scaled_dot_product_flash_attention_for_cpu_backward: sdpa_backward_flop,
}


@dataclass(frozen=True)
class OpCost:
    """The cost of one operator call."""

    flops: float
    """Floating-point operations."""
    moved_bytes: int
    """Bytes read and written."""
    time_s: float
    """Roofline time on the given hardware (0 without one)."""


def op_cost(func: torch._ops.OpOverload, args: tuple, kwargs: dict, out: object,
            tensors: list[torch.Tensor], hardware: HardwareProfile | None) -> OpCost:
    """Cost of ``func(*args, **kwargs) -> out``; ``tensors`` are its tensor inputs and outputs."""
    if func.is_view:
        return OpCost(0.0, 0, 0.0)
    flops = op_flops(func, args, kwargs, out)
    moved = sum(_accessed_bytes(t) for t in tensors)
    return OpCost(flops, moved, roofline_s(flops, moved, hardware))


def op_flops(func: torch._ops.OpOverload, args: tuple, kwargs: dict, out: object) -> float:
    """FLOPs of one operator call by PyTorch's formulas (0 for operators without one)."""
    packet = func.overloadpacket
    formula = flop_registry.get(packet) or _EXTRA_FLOP_FORMULAS.get(packet)
    if formula is None:
        return 0.0
    return float(formula(*args, **kwargs, out_val=out))


def roofline_s(flops: float, moved_bytes: float, hardware: HardwareProfile | None) -> float:
    """Seconds an operator with this work takes on ``hardware`` (see [Note: roofline])."""
    if hardware is None:
        return 0.0
    return max(flops / hardware.matmul_flops_per_s, moved_bytes / hardware.device_memory_bytes_per_s)


def _accessed_bytes(t: torch.Tensor) -> int:
    """Bytes an operator touches in ``t``: a stride-0 (broadcast) dimension counts once."""
    if t.layout != torch.strided:
        return t.numel() * t.element_size()
    numel = 1
    for size, stride in zip(t.shape, t.stride()):
        if stride != 0:
            numel *= size
    return numel * t.element_size()
