"""Fake stand-ins for a module's state and batch, and the step a profiled trace runs.

Fake tensors (``torch._subclasses.FakeTensorMode``) carry shape, dtype, device and strides but no
data: a 20B-parameter model's fake parameters cost a few hundred bytes each. The module itself is
not copied: ``torch.func.functional_call`` swaps the fake tensors in for the duration of the call
and puts the originals back, so real or meta parameters both work and nothing real is duplicated.

The step is the user's own code (``training_step`` and friends), so the trace also has to survive
what such code does besides computing: read values on the host (``loss.item()``, ``if
torch.isnan(loss)``), index with boolean masks, update torchmetrics metrics or append to lists on
``self``, drive its own optimizers (manual optimization), and log. The contexts that make each of
these harmless live next to this module: ``assumed.py`` ([Note: assumed values]),
``preserved.py`` (``preserved_state``, and ``preserved_rng``, which keeps the trace from consuming
random numbers) and ``stand_ins.py`` (``StepStandIns``, ``quiet_logging``, ``training_mode``).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn as nn
from lightning_utilities.core.apply_func import apply_to_collection
from torch._subclasses.fake_tensor import FakeTensorMode

from lightning_elixir.profile.types import ProfileError

StepFn = Callable[[nn.Module, Any], Any]


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


def default_step(module: nn.Module) -> StepFn:
    """The step that turns ``(module, batch)`` into a loss, for a LightningModule or a plain module.

    A LightningModule's is its ``training_step``, in automatic or manual optimization alike (with
    manual optimization the step calls ``self.manual_backward`` itself; see ``StepStandIns`` in
    stand_ins.py).
    """
    return lightning_step("training_step") if hasattr(module, "training_step") else _module_step


def lightning_step(hook: str = "training_step", dataloader_idx: int | None = None) -> StepFn:
    """A step that calls the LightningModule hook ``hook`` as Lightning's loops do for batch 0.

    Args:
        hook: "training_step", "validation_step", "test_step" or "predict_step".
        dataloader_idx: Passed as the third argument when the stage has several dataloaders
            (Lightning passes it only then).

    Returns:
        ``step(module, batch) -> whatever the hook returns``.
    """

    def step(module: nn.Module, batch: Any) -> Any:
        fn = getattr(module, hook)
        args: list[Any] = [batch]
        if _takes_batch_idx(fn):
            args.append(0)
        if dataloader_idx is not None:
            args.append(dataloader_idx)
        return fn(*args)

    return step


def loss_of(out: Any) -> torch.Tensor:
    """The loss in a step's output: the tensor itself, or the "loss" entry of a dict."""
    loss = out.get("loss") if isinstance(out, Mapping) else out
    if not isinstance(loss, torch.Tensor):
        raise ProfileError(f"the step returned no loss tensor for the profiling batch (got {type(out).__name__}) "
                           "and called no manual_backward; return a loss tensor or a dict with 'loss', or pass "
                           "step_fn=lambda module, batch: <loss>")
    return loss


def _takes_batch_idx(fn: Callable[..., Any]) -> bool:
    """Whether Lightning would pass ``batch_idx`` to this hook (its rule: a second argument)."""
    fn = getattr(fn, "__wrapped__", fn)
    spec = inspect.getfullargspec(fn)
    args = spec.args[1:]  # without self, as Lightning counts
    return "batch_idx" in args or spec.varargs is not None or len(args) >= 2


def _fake_param(p: nn.Parameter, mode: FakeTensorMode, device: torch.device,
                param_dtype: torch.dtype | None) -> nn.Parameter:
    """A fake Parameter like ``p``, in ``param_dtype`` when that is given and ``p`` is fp32 (a parameter of
    another dtype keeps it in the run: [Note: parameters of other dtypes] in runtime/policy.py)."""
    dtype = param_dtype if param_dtype is not None and p.dtype == torch.float32 else p.dtype
    with mode:
        return nn.Parameter(_fake_like(p, mode, device, dtype), requires_grad=p.requires_grad)


def _fake_like(t: torch.Tensor, mode: FakeTensorMode, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A fake tensor with ``t``'s shape and strides (no data is read or allocated)."""
    with mode:
        fake = torch.empty_strided(t.shape, t.stride(), dtype=dtype, device=device)
    if t.requires_grad and fake.is_floating_point() and not isinstance(t, nn.Parameter):
        fake.requires_grad_(True)
    return fake


class StepModule(nn.Module):
    """Wraps a module and a step so ``functional_call`` can run forward, loss and backward at once.

    Backward must run while the fake tensors are swapped in: activation checkpointing re-runs the
    forward during backward.
    """

    def __init__(self, module: nn.Module, run: Any) -> None:
        super().__init__()
        self.module = module
        self.run = run

    def forward(self, batch: Any) -> Any:
        return self.run(self.module, batch)


def _module_step(module: nn.Module, batch: Any) -> torch.Tensor:
    """A plain module's loss: the sum of its output (batch unpacked when it is a tuple or list)."""
    out = module(*batch) if isinstance(batch, (tuple, list)) else module(batch)
    if not isinstance(out, torch.Tensor):
        raise ProfileError("the module returned no tensor; pass step_fn=lambda module, batch: <loss>")
    return out if out.dim() == 0 else out.sum()
