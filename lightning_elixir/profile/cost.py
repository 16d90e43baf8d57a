"""Per-operator cost: FLOPs (torch.utils.flop_counter), bytes moved, and a calibrated roofline time.

[Note: roofline]
An operator that is not a view takes

    op_overhead_s + max(flops / rate(flops), bytes / elementwise_bytes_per_s_at(bytes))

on the measured machine: a fixed cost, then whichever of compute and memory traffic is slower.
FLOPs come from PyTorch's own formula registry; bytes are what the operator reads and writes
(every tensor argument and output, a broadcast dimension counted once). Views move nothing and
cost nothing. ``rate`` is the measured rate of a call of that size: the attention rates for fused
attention kernels (forward and backward apart), the matmul rate for every other operator with a
FLOP formula (mm, addmm, bmm, convolution...). Every rate is interpolated in log space of the work
of one call between a few measured sizes, flat beyond them.

A roofline at peak rates (one large matmul, a large copy) underestimated the example GPT's step
on a 2-core CPU by up to 75% (predicted/measured 0.25-0.91, worst for small models and bfloat16;
examples/benchmarks/profile_accuracy.py). Per-operator measurements of those steps showed four
misses, each now measured (``bench.py``, within the hardware profile's seconds); with them the same
steps predict at ~0.7-1.05 of measured (timings on that shared machine vary 10-30% run to run):

- The framework's own time per operator: dispatch, autograd bookkeeping and the backward engine,
  module calls, the views around each operator, allocation, kernel launch. A tiny training step
  costs ~10-20 us per (non-view) operator on that CPU, against ~1-2 us for a bare tiny
  ``torch.add``: ``op_overhead_s`` is measured on such a step, per operator counted as here. On an
  accelerator part of it overlaps the kernels already queued; adding it in full overstates a large
  model's step by about ``ops * op_overhead_s``, a few percent at most.
- Small matmuls run below the peak (bfloat16 128^3 on that CPU: ~1/3 of 1024^3): ``matmul_points``.
- Attention kernels run well below the matmul rate of their FLOPs (that CPU's bfloat16 flash
  attention backward: 15-100 GFLOP/s against ~400 for matmuls). So they get rates of their own,
  measured on causal attention: PyTorch's formulas count the whole score matrix, so a causal call
  does about half the counted FLOPs, and the rate is what such a call achieves. A non-causal call
  is charged as fast as a causal one of the same size (up to 2x optimistic).
- Elementwise and normalisation operators move bytes at a fraction of the copy bandwidth (GELU,
  layer norm and softmax compute per element; outputs are fresh allocations): on that CPU
  ~12-25 GB/s against 30-45 GB/s for a copy. ``elementwise_points`` is measured on add, GELU, layer
  norm and softmax; it is the memory rate of every operator (for matmuls it rarely binds).

A profile without these measurements (hand-written, or cached by an older version) has
``op_overhead_s`` 0 and no points: the peak roofline, as ``torch.utils._runtime_estimation``
computes it from datasheet peaks.
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
    return OpCost(flops, moved, roofline_s(flops, moved, hardware, flops_kind(func)))


def op_flops(func: torch._ops.OpOverload, args: tuple, kwargs: dict, out: object) -> float:
    """FLOPs of one operator call by PyTorch's formulas (0 for operators without one)."""
    packet = func.overloadpacket
    formula = flop_registry.get(packet) or _EXTRA_FLOP_FORMULAS.get(packet)
    if formula is None:
        return 0.0
    return float(formula(*args, **kwargs, out_val=out))


def flops_kind(func: torch._ops.OpOverload) -> str:
    """Which measured rate ``func``'s FLOPs run at: "attention", "attention_backward" (fused
    attention kernels) or "matmul" (every other operator with a FLOP formula)."""
    name = func.overloadpacket.__name__
    if "attention" not in name:
        return "matmul"
    return "attention_backward" if name.endswith("_backward") else "attention"


def roofline_s(flops: float, moved_bytes: float, hardware: HardwareProfile | None, kind: str = "matmul") -> float:
    """Seconds one (non-view) operator call with this work takes on ``hardware``; ``kind`` as
    ``flops_kind`` says (see [Note: roofline])."""
    if hardware is None:
        return 0.0
    if flops <= 0:
        compute_s = 0.0
    elif kind == "matmul":
        compute_s = flops / hardware.matmul_flops_per_s_at(flops)
    else:
        compute_s = flops / hardware.attention_flops_per_s_at(flops, backward=kind == "attention_backward")
    memory_s = moved_bytes / hardware.elementwise_bytes_per_s_at(moved_bytes) if moved_bytes > 0 else 0.0
    return hardware.op_overhead_s + max(compute_s, memory_s)


def _accessed_bytes(t: torch.Tensor) -> int:
    """Bytes an operator touches in ``t``: a stride-0 (broadcast) dimension counts once."""
    if t.layout != torch.strided:
        return t.numel() * t.element_size()
    numel = 1
    for size, stride in zip(t.shape, t.stride()):
        if stride != 0:
            numel *= size
    return numel * t.element_size()
