"""Adafactor on shard views: factored second moments from partial sums, whole-parameter norms agreed.

[Note: Adafactor on shards]
``torch.optim.Adafactor`` is not element-wise, but every whole-parameter quantity it reads is a sum,
and sums split over shards: so it runs exactly on this rank's shard of each parameter, with two
all-reduces a step (not a gather of any parameter or gradient). For a parameter of shape (..., R, C)
it keeps a second moment per row (R values, the mean of the squared gradient over the row's columns)
and one per column, and for a vector one per element; its step reads three norms of whole tensors:
the parameter's (its RMS scales the learning rate), the squared gradient's per row and per column
(the factored moments), and the update's (the update is scaled down when its RMS exceeds ``d``).

1. Each rank sums, over the elements of its views, the squared parameter, and the squared gradient
   per row and per column of each factored parameter (a view is a flat run of the parameter's
   elements, so its rows are whole but for the first and the last), beside a flag for each view
   that has a gradient; one all-reduce of the lot. Every rank then holds each parameter's whole row
   and column sums, and updates every factored moment alike: those moments (a few values per row
   and column) are held whole and in full by every rank, as small scalar state is; the per-element
   moment of a vector is sharded like Adam's.
2. Each rank computes the update of its elements (the moment estimate at each element is its row's
   moment times its column's over the rows' mean, as torch's outer product gives) and its sum of
   squares per parameter; a second all-reduce of those.
3. Each rank applies its part with torch's step-size schedule, weight decay and update clipping.

The row, column and update sums are added up in another order than torch's norms over the whole
tensor (rank by rank, and row pieces first), so the result matches one process up to rounding
(1e-7 relative), as a sum over ranks' gradients does. The moments are saved as torch saves them
(full-shaped, in plain optimizer state dicts) and every checkpoint format, a resume at another world
size and a plan switch carry them as the other whole-tensor state (``state_dict.REPLICATED_STATE``).
Offloaded chunks update here in host memory, and their compute shards are refreshed after; chunks on
NVMe are refused, as for Muon ([Note: Muon on shards] in whole.py), and so is a subclass of
Adafactor that overrides ``step``.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch.optim import Optimizer
from torch.optim.optimizer import _get_scalar_dtype

from lightning_elixir.runtime import collectives
from lightning_elixir.runtime.whole import chunks_of, install_step, refuse_nvme

Adafactor: Optional[type] = getattr(torch.optim, "Adafactor", None)  # torch 2.5 and later


def is_adafactor(cls: type) -> bool:
    """Whether ``cls`` is torch's Adafactor or a subclass that keeps its ``step`` (compared unwrapped)."""
    return (Adafactor is not None and issubclass(cls, Adafactor)
            and inspect.unwrap(cls.step) is inspect.unwrap(Adafactor.step))


def install_adafactor_step(runtime: Any, optimizer: Optimizer) -> None:
    """Give ``optimizer`` (an Adafactor over shard views) the sharded step of the note."""
    refuse_nvme(runtime, optimizer, "Adafactor")
    install_step(optimizer, _AdafactorStep(runtime, optimizer))


@dataclass
class _Entry:
    """One parameter of the optimizer: its group, shard view and where it lies."""

    group: dict
    view: torch.Tensor
    chunk: Any
    shape: torch.Size
    first: int
    """The view's first element within the flattened parameter."""
    offset: int
    """Where the entry's sums begin in the all-reduced vector: the flag, the parameter's squares, then
    (factored) the rows' and the columns' squared gradients."""

    @property
    def factored(self) -> bool:
        return len(self.shape) > 1

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def rows(self) -> int:
        """Rows of the factored moment, over every leading dimension: numel // C."""
        return self.numel // self.shape[-1]

    @property
    def cols(self) -> int:
        """Columns of the factored moment, one set per matrix of the leading dimensions: numel // R."""
        return self.numel // self.shape[-2]

    @property
    def size(self) -> int:
        return 2 + (self.rows + self.cols if self.factored else 0)


class _AdafactorStep:
    """``Adafactor.step`` over shard views ([Note: Adafactor on shards])."""

    def __init__(self, runtime: Any, optimizer: Optimizer) -> None:
        self.runtime, self.optimizer = runtime, optimizer

    @torch.no_grad()
    def __call__(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        entries = self._entries()
        dtype = torch.float64 if any(e.view.dtype == torch.float64 for e in entries) else torch.float32  # sums
        sums = torch.zeros(sum(e.size for e in entries) or 1, dtype=dtype, device=self.runtime.device)
        for entry in entries:
            self._partial_sums(entry, sums)
        collectives.all_reduce_sum(sums, self.runtime.group)
        heads = sums[torch.tensor([e.offset for e in entries] + [e.offset + 1 for e in entries],
                                  device=sums.device, dtype=torch.long)].tolist() if entries else []
        trained = [(e, param_squares) for e, flag, param_squares in zip(entries, heads, heads[len(entries):]) if flag]
        updates = torch.zeros(len(trained) or 1, dtype=dtype, device=self.runtime.device)
        steps = []
        for k, (entry, param_squares) in enumerate(trained):
            update, alpha = self._update(entry, param_squares, sums)
            if update is not None:
                updates[k] = update.to(dtype).square().sum().to(updates.device)
            steps.append((update, alpha))
        collectives.all_reduce_sum(updates, self.runtime.group)
        for (entry, _), (update, alpha), squares in zip(trained, steps, updates.tolist()):
            if update is not None:
                denom = max(1.0, math.sqrt(squares) / (math.sqrt(entry.numel) * entry.group["d"]))
                entry.view.add_(update, alpha=-alpha / denom)
        for chunk in chunks_of(self.runtime, self.optimizer):  # no worker updated them ([Note: offloaded updates])
            if chunk.offloaded:
                chunk.refresh_shard()
        return loss

    def _entries(self) -> list[_Entry]:
        index, out, offset = self.runtime.view_index(), [], 0
        for group in self.optimizer.param_groups:
            for view in group["params"]:
                chunk, slot = index[id(view)]
                begin, _ = chunk.shard_range(slot)
                entry = _Entry(group, view, chunk, slot.shape, chunk.shard_begin + begin - slot.offset, offset)
                out.append(entry)
                offset += entry.size
        return out

    def _partial_sums(self, entry: _Entry, sums: torch.Tensor) -> None:
        """This rank's part of the entry's flag, squared parameter and (factored) row and column sums."""
        view, grad = entry.view, entry.view.grad
        if view.numel() == 0 or grad is None:
            return
        at = entry.offset
        head = torch.stack([torch.ones((), dtype=sums.dtype, device=view.device), view.to(sums.dtype).square().sum()])
        sums[at:at + 2] += head.to(sums.device)
        if not entry.factored:
            return
        rows, r0, b0, _ = self._row_major(entry, grad.to(sums.dtype).square())
        r1 = r0 + rows.shape[0]
        sums[at + 2 + r0:at + 2 + r1] += rows.sum(1).to(sums.device)
        columns = torch.zeros(int(b0[-1] - b0[0]) + 1, rows.shape[1], dtype=rows.dtype, device=rows.device)
        columns.index_add_(0, b0 - b0[0], rows)
        c0 = at + 2 + entry.rows + int(b0[0]) * entry.shape[-1]
        sums[c0:c0 + columns.numel()] += columns.reshape(-1).to(sums.device)

    @staticmethod
    def _row_major(entry: _Entry, flat: torch.Tensor) -> tuple[torch.Tensor, int, torch.Tensor, torch.Tensor]:
        """``flat`` (the view's elements) laid out in the rows of the parameter it covers, zero outside it:
        (rows x C, the first row's index, each row's matrix index, ``flat``)."""
        width = entry.shape[-1]
        r0 = entry.first // width
        r1 = (entry.first + flat.numel() - 1) // width + 1
        padded = torch.zeros((r1 - r0) * width, dtype=flat.dtype, device=flat.device)
        lead = entry.first - r0 * width
        padded[lead:lead + flat.numel()] = flat
        matrix = torch.arange(r0, r1, device=flat.device) // entry.shape[-2]
        return padded.view(r1 - r0, width), r0, matrix, flat

    def _update(self, entry: _Entry, param_squares: float, sums: torch.Tensor) -> tuple[Optional[torch.Tensor], float]:
        """Advance the entry's state; return its unclipped update (None where this rank holds none of it)
        and its step size, and apply weight decay, as torch's single-tensor step does."""
        group, view = entry.group, entry.view
        state = self.optimizer.state[view]
        if not state:
            state["step"] = torch.tensor(0.0, dtype=_get_scalar_dtype())
            if entry.factored:
                state["row_var"] = torch.zeros((*entry.shape[:-1], 1), dtype=view.dtype, device=view.device)
                state["col_var"] = torch.zeros((*entry.shape[:-2], 1, entry.shape[-1]), dtype=view.dtype,
                                               device=view.device)
            else:
                state["variance"] = torch.zeros_like(view)
        lr = float(group["lr"])
        eps1, eps2 = group["eps"]
        eps1 = torch.finfo(view.dtype).eps if eps1 is None else eps1
        state["step"] += 1
        step = state["step"].item()
        one_minus_beta2 = step ** group["beta2_decay"]
        alpha = max(eps2, math.sqrt(param_squares) / math.sqrt(entry.numel)) * min(lr, 1 / step ** 0.5)
        if group["weight_decay"] != 0:
            view.mul_(1 - lr * group["weight_decay"])
        grad = view.grad
        if entry.factored:
            at = entry.offset + 2
            row_var, col_var = state["row_var"], state["col_var"]
            row_sums = sums[at:at + entry.rows].view(row_var.shape)
            row_var.lerp_((row_sums / entry.shape[-1]).to(row_var.device, row_var.dtype), one_minus_beta2)
            col_sums = sums[at + entry.rows:at + entry.rows + entry.cols].view(col_var.shape)
            col_var.lerp_((col_sums / entry.shape[-2]).to(col_var.device, col_var.dtype), one_minus_beta2)
            if view.numel() == 0 or grad is None:
                return None, alpha
            grad = -grad if group["maximize"] else grad
            rows, r0, matrix, _ = self._row_major(entry, grad)
            row_mean = row_var.reshape(-1, entry.shape[-2]).mean(dim=1).clamp_(min=eps1)
            estimate = (row_var.reshape(-1)[r0:r0 + rows.shape[0], None]
                        * col_var.reshape(-1, entry.shape[-1])[matrix]).div_(row_mean[matrix, None])
            lead = entry.first - r0 * entry.shape[-1]
            estimate = estimate.reshape(-1)[lead:lead + view.numel()]
        else:
            if view.numel() == 0 or grad is None:
                return None, alpha
            grad = -grad if group["maximize"] else grad
            state["variance"].lerp_(grad * grad, one_minus_beta2)
            estimate = state["variance"].clone()
        return estimate.clamp_(min=eps1 * eps1).rsqrt_().mul_(grad), alpha
