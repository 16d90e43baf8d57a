"""The precision policy: every dtype decision of a run in one frozen object."""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Iterable
from types import MappingProxyType
from typing import Optional

import torch
import torch.nn as nn


@dataclass(frozen=True)
class PrecisionPolicy:
    """Which dtype each tensor of the runtime has, for one Lightning precision flag."""

    compute_dtype: torch.dtype = torch.float32
    """dtype of gathered parameters: what the model computes with."""
    master_dtype: torch.dtype = torch.float32
    """dtype of the master shards the optimizer updates (and of its state)."""
    autocast_dtype: Optional[torch.dtype] = None
    """dtype of ``torch.autocast`` around forward, or None for no autocast."""
    reduce_in_fp32: bool = True
    """Reduce-scatter gradients in fp32 when the masters are fp32 (exact), else in compute dtype."""

    @classmethod
    def from_flag(cls, flag: str) -> "PrecisionPolicy":
        """The policy of a Lightning precision flag such as "bf16-mixed"."""
        if flag not in PRECISION_FLAGS:
            raise ValueError(f"precision={flag!r} is not supported by Elixir; use one of {sorted(PRECISION_FLAGS)}")
        return PRECISION_FLAGS[flag]

    @property
    def reduce_dtype(self) -> torch.dtype:
        """dtype of the gradient buffers that are reduce-scattered."""
        exact = self.reduce_in_fp32 and self.master_dtype == torch.float32
        return torch.float32 if exact else self.compute_dtype

    @property
    def true_precision(self) -> bool:
        """bf16-true / 16-true / 64-true: no fp32 master, the model is stored and computes in its dtype."""
        return self.autocast_dtype is None and self.compute_dtype != torch.float32

    def keeps_full_precision(self, module: nn.Module) -> bool:
        """Whether ``module``'s own parameters compute in the master dtype instead.

        Modules that keep floating-point buffers in another dtype (BatchNorm's fp32 running
        statistics under bf16-mixed) need parameters of the buffers' dtype: their kernels do not
        mix dtypes, and autocast leaves them alone. FSDP keeps BatchNorm in full precision for the
        same reason.
        """
        if self.compute_dtype == self.master_dtype:
            return False
        return any(b is not None and b.is_floating_point() and b.dtype != self.compute_dtype
                   for b in module._buffers.values())

    def own_dtype_params(self, module: nn.Module) -> dict[str, torch.dtype]:
        """Parameters that keep a dtype of their own, by name.

        [Note: parameters of other dtypes]
        The policy converts fp32 parameters (and those already in its compute or master dtype): they
        compute in the compute dtype and train in the master dtype. Any other parameter keeps its dtype,
        as it does under DDP: an integer index table or a bf16 lookup table that stays frozen, a float64
        layer, a complex one. Such a parameter computes, trains and is reduced in its own dtype, in a chunk
        of that dtype only: packed by the runtime into one private chunk per dtype (the search gives each
        a private chunk of its own); a layout given by the user may hold it in any chunk whose parameters
        all have its dtype."""
        return own_dtype_params(module, (self.compute_dtype, self.master_dtype))

    def full_precision_params(self, module: nn.Module) -> set[str]:
        """Names of the parameters that compute in the master dtype (see keeps_full_precision)."""
        ids = {id(p) for m in module.modules() if self.keeps_full_precision(m)
               for p in m._parameters.values() if p is not None}
        return {name for name, p in module.named_parameters() if id(p) in ids}


def own_dtype_params(module: nn.Module, converted: Iterable[torch.dtype]) -> dict[str, torch.dtype]:
    """The parameters of ``module`` that keep their own dtype, by name: those neither fp32 nor in ``converted``
    ([Note: parameters of other dtypes])."""
    standard = {torch.float32, *converted}
    return {name: p.dtype for name, p in module.named_parameters() if p.dtype not in standard}


PRECISION_FLAGS = MappingProxyType({
    "32-true": PrecisionPolicy(),
    "32": PrecisionPolicy(),
    "bf16-mixed": PrecisionPolicy(torch.bfloat16, torch.float32, torch.bfloat16),
    "16-mixed": PrecisionPolicy(torch.float16, torch.float32, torch.float16),
    "bf16-true": PrecisionPolicy(torch.bfloat16, torch.bfloat16),
    "16-true": PrecisionPolicy(torch.float16, torch.float16),
    "64-true": PrecisionPolicy(torch.float64, torch.float64),
    "64": PrecisionPolicy(torch.float64, torch.float64),
})
"""The Lightning precision flags Elixir runs, and their policies."""
