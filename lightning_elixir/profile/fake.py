"""Fake stand-ins for a module's state and batch, and the contexts a profiled step runs in.

Fake tensors (``torch._subclasses.FakeTensorMode``) carry shape, dtype, device and strides but no
data: a 20B-parameter model's fake parameters cost a few hundred bytes each. The module itself is
not copied: ``torch.func.functional_call`` swaps the fake tensors in for the duration of the call
and puts the originals back, so real or meta parameters both work and nothing real is duplicated.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.nn as nn
from lightning_utilities.core.apply_func import apply_to_collection
from torch._subclasses.fake_tensor import FakeTensorMode

from lightning_elixir.profile.types import ProfileError


def fake_parameters(module: nn.Module, mode: FakeTensorMode, device: torch.device,
                    param_dtype: torch.dtype | None) -> dict[str, nn.Parameter]:
    """One fake Parameter per distinct parameter of ``module``, keyed by canonical name."""
    return {name: _fake_param(p, mode, device, param_dtype) for name, p in module.named_parameters()}


def fake_state(module: nn.Module, params: Mapping[str, nn.Parameter], mode: FakeTensorMode,
               device: torch.device) -> dict[str, torch.Tensor]:
    """Every parameter and buffer name of ``module`` (tied names too) -> its fake stand-in."""
    by_id = {id(p): params[name] for name, p in module.named_parameters()}
    state: dict[str, torch.Tensor] = {name: by_id[id(p)] for name, p in module.named_parameters(remove_duplicate=False)}
    buffers: dict[int, torch.Tensor] = {}
    for name, buf in module.named_buffers(remove_duplicate=False):
        if id(buf) not in buffers:
            buffers[id(buf)] = _fake_like(buf, mode, device, buf.dtype)
        state[name] = buffers[id(buf)]
    return state


def fake_batch(batch: Any, mode: FakeTensorMode, device: torch.device) -> Any:
    """``batch`` with every tensor replaced by a fake one of the same shape and dtype on ``device``."""
    return apply_to_collection(batch, torch.Tensor, lambda t: _fake_like(t, mode, device, t.dtype))


def default_device(module: nn.Module) -> torch.device:
    """Where the module's real tensors live; the CPU when all of them are on ``meta``."""
    for tensor in [*module.parameters(), *module.buffers()]:
        if tensor.device.type != "meta":
            return tensor.device
    return torch.device("cpu")


def default_step(module: nn.Module) -> Any:
    """The step that turns ``(module, batch)`` into a loss, for a LightningModule or a plain module."""
    if not hasattr(module, "training_step"):
        return _module_step
    if not getattr(module, "automatic_optimization", True):
        raise ProfileError(
            "this LightningModule uses manual optimization, so its training_step runs the backward "
            "and optimizer itself; pass step_fn=lambda module, batch: <loss> to profile_model"
        )
    return _lightning_step


@contextlib.contextmanager
def quiet_logging(module: nn.Module) -> Iterator[None]:
    """Make ``module.log``/``log_dict`` no-ops on this instance for the duration (restored after).

    With a trainer attached, ``LightningModule.log`` outside the trainer's loop raises; without one
    it warns. Neither is useful while profiling, so the instance gets no-op attributes that shadow
    the methods and are removed afterwards.
    """
    if not hasattr(module, "training_step"):
        yield
        return
    saved = {name: module.__dict__[name] for name in ("log", "log_dict") if name in module.__dict__}
    module.log = _no_op
    module.log_dict = _no_op
    try:
        yield
    finally:
        del module.log, module.log_dict
        for name, value in saved.items():
            setattr(module, name, value)


@contextlib.contextmanager
def training_mode(module: nn.Module) -> Iterator[None]:
    """Put every submodule in training mode, and restore each one's mode after."""
    modes = [(m, m.training) for m in module.modules()]
    module.train()
    try:
        yield
    finally:
        for m, training in modes:
            m.training = training


class StepModule(nn.Module):
    """Wraps a module and a step so ``functional_call`` can run forward, loss and backward at once.

    Backward must run while the fake tensors are swapped in: activation checkpointing re-runs the
    forward during backward.
    """

    def __init__(self, module: nn.Module, run: Any) -> None:
        super().__init__()
        self.module = module
        self.run = run

    def forward(self, batch: Any) -> torch.Tensor:
        return self.run(self.module, batch)


def _fake_param(p: nn.Parameter, mode: FakeTensorMode, device: torch.device,
                param_dtype: torch.dtype | None) -> nn.Parameter:
    """A fake Parameter like ``p``, in ``param_dtype`` when that is given and ``p`` is floating."""
    dtype = param_dtype if param_dtype is not None and p.is_floating_point() else p.dtype
    with mode:
        return nn.Parameter(_fake_like(p, mode, device, dtype), requires_grad=p.requires_grad)


def _fake_like(t: torch.Tensor, mode: FakeTensorMode, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A fake tensor with ``t``'s shape and strides (no data is read or allocated)."""
    with mode:
        fake = torch.empty_strided(t.shape, t.stride(), dtype=dtype, device=device)
    if t.requires_grad and fake.is_floating_point() and not isinstance(t, nn.Parameter):
        fake.requires_grad_(True)
    return fake


def _lightning_step(module: nn.Module, batch: Any) -> torch.Tensor:
    """``training_step(batch, 0)``'s loss (a tensor, or the "loss" entry of a dict)."""
    out = module.training_step(batch, 0)
    loss = out.get("loss") if isinstance(out, Mapping) else out
    if not isinstance(loss, torch.Tensor):
        raise ProfileError("training_step returned no loss tensor for the profiling batch; "
                           "return a tensor or a dict with 'loss', or pass step_fn")
    return loss


def _module_step(module: nn.Module, batch: Any) -> torch.Tensor:
    """A plain module's loss: the sum of its output (batch unpacked when it is a tuple or list)."""
    out = module(*batch) if isinstance(batch, (tuple, list)) else module(batch)
    if not isinstance(out, torch.Tensor):
        raise ProfileError("the module returned no tensor; pass step_fn=lambda module, batch: <loss>")
    return out if out.dim() == 0 else out.sum()


def _no_op(*_args: Any, **_kwargs: Any) -> None:
    """Stands in for ``LightningModule.log`` while profiling."""
