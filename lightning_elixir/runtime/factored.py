"""Adafactor on shard views: factored second moments from partial sums, whole-parameter norms agreed.

[Note: Adafactor on shards]
Adafactor (``torch.optim.Adafactor``, and ``transformers.optimization.Adafactor``, which T5 and its
kin are fine-tuned with) is not element-wise, but every whole-parameter quantity it reads is a sum,
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
3. Each rank applies its part with the optimizer's step-size schedule, weight decay and update
   clipping (and Hugging Face's first moment, per element).

The two differ in their arithmetic only (torch's clamps and scales by the moments' means, Hugging
Face's adds ``eps`` to the squares and has relative steps and parameter scaling): one ``_Rule`` each.

The row, column and update sums are added up in another order than torch's norms over the whole
tensor (rank by rank, and row pieces first), so the result matches one process up to rounding
(1e-7 relative), as a sum over ranks' gradients does. The moments are saved as torch saves them
(full-shaped, in plain optimizer state dicts) and every checkpoint format, a resume at another world
size and a plan switch carry them as the other whole-tensor state (``state_dict.REPLICATED_STATE``).
Offloaded chunks update here in host memory, and their compute shards are refreshed after; chunks on
NVMe are refused, as for Muon ([Note: Muon on shards] in whole.py), and so is a subclass of either
that overrides ``step``.
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


def _huggingface_adafactor(cls: type) -> Optional[type]:
    """The class of ``transformers.optimization.Adafactor`` among ``cls``'s bases (matched by name: the
    runtime does not import transformers)."""
    return next((base for base in cls.__mro__
                 if base.__name__ == "Adafactor" and base.__module__ == "transformers.optimization"), None)


def is_adafactor(cls: type) -> bool:
    """Whether ``cls`` is torch's or Hugging Face's Adafactor, or a subclass that keeps its ``step``
    (compared unwrapped: torch wraps ``step`` in a profiling hook)."""
    base = Adafactor if Adafactor is not None and issubclass(cls, Adafactor) else _huggingface_adafactor(cls)
    return base is not None and inspect.unwrap(cls.step) is inspect.unwrap(base.step)


def install_adafactor_step(runtime: Any, optimizer: Optimizer) -> None:
    """Give ``optimizer`` (an Adafactor over shard views) the sharded step of the note."""
    refuse_nvme(runtime, optimizer, "Adafactor")
    cls = type(optimizer)
    rule = _TorchRule() if Adafactor is not None and issubclass(cls, Adafactor) else _HuggingFaceRule(cls)
    install_step(optimizer, _AdafactorStep(runtime, optimizer, rule))


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
    """An Adafactor's ``step`` over shard views ([Note: Adafactor on shards]); ``rule`` is torch's or Hugging Face's."""

    def __init__(self, runtime: Any, optimizer: Optimizer, rule: "_Rule") -> None:
        self.runtime, self.optimizer, self.rule = runtime, optimizer, rule

    @torch.no_grad()
    def __call__(self) -> None:
        entries = self._entries()
        dtype = torch.float64 if any(e.view.dtype == torch.float64 for e in entries) else torch.float32  # sums
        sums = torch.zeros(sum(e.size for e in entries) or 1, dtype=dtype, device=self.runtime.device)
        held = [e for e in entries if e.view.numel() and e.view.grad is not None]
        _flags_and_param_squares(held, sums)
        for entry in held:
            if entry.factored:
                _row_and_column_sums(entry, sums)
        collectives.all_reduce_sum(sums, self.runtime.group)
        heads = sums[torch.tensor([e.offset for e in entries] + [e.offset + 1 for e in entries],
                                  device=sums.device, dtype=torch.long)].tolist() if entries else []
        trained = [(e, param_squares) for e, flag, param_squares in zip(entries, heads, heads[len(entries):]) if flag]
        squares = torch.zeros(len(trained) or 1, dtype=dtype, device=self.runtime.device)
        steps = []
        for k, (entry, param_squares) in enumerate(trained):
            state = self.optimizer.state[entry.view]
            rms = math.sqrt(param_squares / entry.numel)
            update, apply = self.rule.update(entry, state, rms, _moment_sums(entry, sums))
            if update is not None:
                squares[k] = update.to(dtype).square().sum().to(squares.device)
            steps.append((update, apply))
        collectives.all_reduce_sum(squares, self.runtime.group)
        for (entry, _), (update, apply), total in zip(trained, steps, squares.tolist()):
            if update is not None:
                apply(update, math.sqrt(total / entry.numel))
        for chunk in chunks_of(self.runtime, self.optimizer):  # no worker updated them ([Note: offloaded updates])
            if chunk.offloaded:
                chunk.refresh_shard()

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


def _flags_and_param_squares(held: list[_Entry], sums: torch.Tensor) -> None:
    """Set the flag and add the squared norm of this rank's part of each entry it holds (with a gradient)."""
    if not held:
        return
    sums[torch.tensor([e.offset for e in held], device=sums.device)] = 1.0
    by_device: dict[torch.device, list[_Entry]] = {}
    for entry in held:  # offloaded chunks' views are in host memory
        by_device.setdefault(entry.view.device, []).append(entry)
    for entries in by_device.values():
        norms = torch.stack(torch._foreach_norm([e.view for e in entries])).to(sums.device, sums.dtype)
        sums.index_put_((torch.tensor([e.offset + 1 for e in entries], device=sums.device),), norms.square(),
                        accumulate=True)


def _row_and_column_sums(entry: _Entry, sums: torch.Tensor) -> None:
    """Add this rank's part of a factored entry's squared gradient summed per row and per column."""
    rows_at, cols_at = entry.offset + 2, entry.offset + 2 + entry.rows
    squares = entry.view.grad.to(sums.dtype).square()
    if entry.view.numel() == entry.numel:  # the whole parameter (its matrices of the leading dimensions)
        matrices = squares.view(-1, entry.shape[-2], entry.shape[-1])
        sums[rows_at:cols_at] += matrices.sum(-1).reshape(-1).to(sums.device)
        sums[cols_at:cols_at + entry.cols] += matrices.sum(-2).reshape(-1).to(sums.device)
        return
    rows, r0, matrix = _row_major(entry, squares)
    sums[rows_at + r0:rows_at + r0 + rows.shape[0]] += rows.sum(1).to(sums.device)
    columns = torch.zeros(int(matrix[-1] - matrix[0]) + 1, rows.shape[1], dtype=rows.dtype, device=rows.device)
    columns.index_add_(0, matrix - matrix[0], rows)
    c0 = cols_at + int(matrix[0]) * entry.shape[-1]
    sums[c0:c0 + columns.numel()] += columns.reshape(-1).to(sums.device)


def _moment_sums(entry: _Entry, sums: torch.Tensor) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """A factored entry's whole sums of squared gradient per row and per column, flat; None for a vector."""
    if not entry.factored:
        return None
    at = entry.offset + 2
    return sums[at:at + entry.rows], sums[at + entry.rows:at + entry.rows + entry.cols]


def _row_major(entry: _Entry, flat: torch.Tensor) -> tuple[torch.Tensor, int, torch.Tensor]:
    """``flat`` (values of the view's elements) laid out in the rows of the parameter it covers, zero
    outside it: (rows x C, the first row's index, each row's matrix index among the leading dimensions)."""
    width = entry.shape[-1]
    r0 = entry.first // width
    r1 = (entry.first + flat.numel() - 1) // width + 1
    padded = torch.zeros((r1 - r0) * width, dtype=flat.dtype, device=flat.device)
    lead = entry.first - r0 * width
    padded[lead:lead + flat.numel()] = flat
    return padded.view(r1 - r0, width), r0, torch.arange(r0, r1, device=flat.device) // entry.shape[-2]


def _at_elements(entry: _Entry, numel: int, per_row: torch.Tensor, per_matrix: torch.Tensor,
                 per_column: torch.Tensor, combine: Callable[..., torch.Tensor]) -> torch.Tensor:
    """``combine(row value, matrix value, column value)`` at each of this rank's elements of the entry, from
    whole flat vectors per row (rows), per matrix of the leading dimensions and per column (cols)."""
    width = entry.shape[-1]
    if numel == entry.numel:  # the whole parameter: its matrices, broadcast
        height = entry.shape[-2]
        return combine(per_row.view(-1, height, 1), per_matrix.view(-1, 1, 1), per_column.view(-1, 1, width)).reshape(-1)
    r0 = entry.first // width
    r1 = (entry.first + numel - 1) // width + 1
    matrix = torch.arange(r0, r1, device=per_row.device) // entry.shape[-2]
    out = combine(per_row[r0:r1, None], per_matrix[matrix, None], per_column.view(-1, width)[matrix])
    lead = entry.first - r0 * width
    return out.reshape(-1)[lead:lead + numel]


Apply = Callable[[torch.Tensor, float], None]
"""Applies an entry's update, given the RMS of its whole update."""


class _Rule:
    """One Adafactor's arithmetic: state, the update from the whole sums, and how it is applied."""

    def update(self, entry: _Entry, state: dict, param_rms: float,
               moment_sums: Optional[tuple[torch.Tensor, torch.Tensor]]) -> tuple[Optional[torch.Tensor], Apply]:
        """Advance ``state`` (on every rank, for every trained entry); return this rank's part of the update
        before clipping (None where it holds none of the entry) and what applies it."""
        raise NotImplementedError


class _TorchRule(_Rule):
    """``torch.optim.Adafactor``'s single-tensor step."""

    def update(self, entry, state, param_rms, moment_sums):
        group, view = entry.group, entry.view
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
        alpha = max(eps2, param_rms) * min(lr, 1 / step ** 0.5)
        if group["weight_decay"] != 0:
            view.mul_(1 - lr * group["weight_decay"])

        def apply(update: torch.Tensor, update_rms: float) -> None:
            view.add_(update, alpha=-alpha / max(1.0, update_rms / group["d"]))

        grad = view.grad
        if grad is not None and group["maximize"]:
            grad = -grad
        if moment_sums is not None:
            row_var, col_var = state["row_var"], state["col_var"]
            rows, cols = moment_sums
            row_var.lerp_((rows / entry.shape[-1]).view(row_var.shape).to(row_var.device, row_var.dtype),
                          one_minus_beta2)
            col_var.lerp_((cols / entry.shape[-2]).view(col_var.shape).to(col_var.device, col_var.dtype),
                          one_minus_beta2)
            if view.numel() == 0 or grad is None:
                return None, apply
            row_mean = row_var.reshape(-1, entry.shape[-2]).mean(dim=1).clamp_(min=eps1)
            estimate = _at_elements(entry, view.numel(), row_var.reshape(-1), row_mean, col_var.reshape(-1),
                                    lambda row, mean, col: (row * col).div_(mean))
        else:
            if view.numel() == 0 or grad is None:
                return None, apply
            state["variance"].lerp_(grad * grad, one_minus_beta2)
            estimate = state["variance"].clone()
        return estimate.clamp_(min=eps1 * eps1).rsqrt_().mul_(grad), apply


class _HuggingFaceRule(_Rule):
    """``transformers.optimization.Adafactor``'s step (relative steps, parameter scaling, ``beta1``); its
    ``RMS`` state is kept as a number (torch's is a tensor), which its ``_get_lr`` reads alike."""

    def __init__(self, optimizer_class: type) -> None:
        self.optimizer_class = optimizer_class  # whose _get_lr (a subclass may override it) gives the step size

    def update(self, entry, state, param_rms, moment_sums):
        group, view = entry.group, entry.view
        if not state:
            state["step"] = 0
            if group["beta1"] is not None:
                state["exp_avg"] = torch.zeros_like(view)
            if entry.factored:
                state["exp_avg_sq_row"] = torch.zeros(entry.shape[:-1], dtype=view.dtype, device=view.device)
                state["exp_avg_sq_col"] = torch.zeros((*entry.shape[:-2], entry.shape[-1]), dtype=view.dtype,
                                                      device=view.device)
            else:
                state["exp_avg_sq"] = torch.zeros_like(view)
            state["RMS"] = 0
        state["step"] += 1
        state["RMS"] = param_rms
        lr = self.optimizer_class._get_lr(group, state)
        beta2t = 1.0 - math.pow(state["step"], group["decay_rate"])
        eps1 = group["eps"][0]

        def apply(update: torch.Tensor, update_rms: float) -> None:
            update.div_(max(update_rms / group["clip_threshold"], 1.0)).mul_(lr)
            if group["beta1"] is not None:
                update = state["exp_avg"].mul_(group["beta1"]).add_(update, alpha=1 - group["beta1"])
            if group["weight_decay"] != 0:
                view.add_(view, alpha=-group["weight_decay"] * lr)
            view.add_(-update)

        grad = view.grad
        if moment_sums is not None:
            row, col = state["exp_avg_sq_row"], state["exp_avg_sq_col"]
            rows, cols = moment_sums
            row.mul_(beta2t).add_((rows / entry.shape[-1] + eps1).view(row.shape).to(row.device, row.dtype),
                                  alpha=1.0 - beta2t)
            col.mul_(beta2t).add_((cols / entry.shape[-2] + eps1).view(col.shape).to(col.device, col.dtype),
                                  alpha=1.0 - beta2t)
            if view.numel() == 0 or grad is None:
                return None, apply
            row_mean = row.reshape(-1, entry.shape[-2]).mean(dim=1)
            factor = _at_elements(entry, view.numel(), row.reshape(-1), row_mean, col.reshape(-1),
                                  lambda r, mean, c: (r / mean).rsqrt_() * c.rsqrt())
            return factor.mul_(grad), apply
        if view.numel() == 0 or grad is None:
            return None, apply
        state["exp_avg_sq"].mul_(beta2t).add_(grad ** 2 + eps1, alpha=1.0 - beta2t)
        return state["exp_avg_sq"].rsqrt().mul_(grad), apply
