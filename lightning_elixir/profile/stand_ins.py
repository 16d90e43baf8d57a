"""What the trainer would provide around a profiled step, made harmless for the trace.

At planning time the module runs outside the trainer's loop: no optimizer is configured and
nothing may really step, ``self.log`` would raise or warn, and the module may be in either mode.
``StepStandIns`` shadows the manual-optimization methods, ``quiet_logging`` makes logging a no-op,
and ``training_mode`` sets train or eval mode as the loop would; each restores the module after.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.nn as nn
from torch.utils._python_dispatch import _disable_current_modes


@contextlib.contextmanager
def quiet_logging(module: nn.Module) -> Iterator[None]:
    """Make ``module.log``/``log_dict`` no-ops on this instance for the duration (restored after).

    With a trainer attached, ``LightningModule.log`` outside the trainer's loop raises; without one
    it warns. Neither is useful while profiling, so the instance gets no-op attributes that shadow
    the methods and are removed afterwards.
    """
    with _shadowed(module, {"log": _no_op, "log_dict": _no_op}):
        yield


@contextlib.contextmanager
def training_mode(module: nn.Module, training: bool = True) -> Iterator[None]:
    """Put every submodule in training (or eval) mode, and restore each one's mode after."""
    modes = [(m, m.training) for m in module.modules()]
    module.train(training)
    try:
        yield
    finally:
        for m, was_training in modes:
            m.training = was_training


@contextlib.contextmanager
def conversions_on_fakes() -> Iterator[None]:
    """Let the step convert its own modules (``self.classifier.to(self.dtype)`` in a router's forward).

    The trace runs the module with fake tensors in place of its parameters, and ``nn.Module._apply``
    swaps a fake parameter for its converted copy with ``torch.utils.swap_tensors``, which refuses
    tensors the trace still references ("Couldn't swap Linear.weight"). While the trace runs, a
    conversion that swap refuses is done by assignment instead: a parameter the conversion returns
    unchanged stays the same object (the trace keeps recognising it), a converted one is registered
    in its place. The parameters are put back after the trace either way.
    """
    original = nn.Module._apply

    def apply(self: nn.Module, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> nn.Module:
        try:
            return original(self, fn, recurse)
        except RuntimeError as err:
            if "Couldn't swap" not in str(err):
                raise
        if recurse:
            for child in self.children():
                apply(child, fn)
        with torch.no_grad():
            for key, param in self._parameters.items():
                converted = fn(param) if param is not None else None
                if converted is not None and converted is not param:
                    self._parameters[key] = nn.Parameter(converted, requires_grad=param.requires_grad)
            for key, buf in self._buffers.items():
                if buf is not None:
                    self._buffers[key] = fn(buf)
        return self

    nn.Module._apply = apply  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module._apply = original  # type: ignore[method-assign]


class StepStandIns:
    """Harmless stand-ins for a LightningModule's trainer-facing methods while its step is traced.

    At planning time no optimizer is configured yet, and nothing may really step. While installed
    (instance attributes that shadow the methods, as ``quiet_logging`` does):

    - ``optimizers()`` / ``lr_schedulers()`` return wrappers whose ``step`` and ``zero_grad`` do
      nothing (``step(closure)`` runs the closure) and whose other attributes (``param_groups``)
      are those of the objects ``configure_optimizers()`` returns; it is called once, on the first
      request, with the trace paused, unless those objects were made already (``configured``: the
      strategy configures them before planning, and the user's hook runs once per fit). Several
      optimizers unpack as usual (``g_opt, d_opt = ...``).
    - ``manual_backward(loss, ...)`` calls ``backward`` (the traced backward) and counts the calls.
    - ``toggle_optimizer``, ``untoggle_optimizer``, ``toggled_optimizer`` and ``clip_gradients`` do
      nothing: they change which gradients exist, not which modules run (the access order).
    """

    def __init__(self, module: nn.Module, backward: Callable[..., None],
                 configured: tuple[list[Any], list[Any]] | None = None) -> None:
        self.module = module
        self.backward = backward
        self.backward_calls = 0
        self._configured: tuple[list[_StandInOptimizer], list[_StandInScheduler]] | None = None
        if configured is not None:
            self._configured = self._stand_ins(*configured)

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """Shadow the module's methods with the stand-ins for the duration (LightningModules only)."""
        stand_ins = {
            "optimizers": self.optimizers, "lr_schedulers": self.lr_schedulers,
            "manual_backward": self.manual_backward, "toggle_optimizer": _no_op, "untoggle_optimizer": _no_op,
            "toggled_optimizer": _null_context, "clip_gradients": _no_op,
        }
        with _shadowed(self.module, stand_ins):
            yield

    def optimizers(self, use_pl_optimizer: bool = True) -> Any:
        """Like ``LightningModule.optimizers``: one optimizer, or a list of several."""
        return _one_or_list(self._configure()[0])

    def lr_schedulers(self) -> Any:
        """Like ``LightningModule.lr_schedulers``: None, one scheduler, or a list of several."""
        return _one_or_list(self._configure()[1])

    def manual_backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        """The traced backward of ``loss``."""
        self.backward_calls += 1
        self.backward(loss, *args, **kwargs)

    def _configure(self) -> tuple[list[_StandInOptimizer], list[_StandInScheduler]]:
        """Stand-ins for what ``configure_optimizers()`` returns (called once; at least one optimizer)."""
        if self._configured is None:
            configure = getattr(self.module, "configure_optimizers", None)
            with _disable_current_modes():  # the user's setup code is not part of the step
                out = configure() if configure is not None else None
            optimizers: list[Any] = []
            schedulers: list[Any] = []
            _collect_optimizers(out, optimizers, schedulers)
            self._configured = self._stand_ins(optimizers, schedulers)
        return self._configured

    @staticmethod
    def _stand_ins(optimizers: list[Any], schedulers: list[Any]) -> tuple[list[_StandInOptimizer], list[_StandInScheduler]]:
        return ([_StandInOptimizer(opt) for opt in optimizers] or [_StandInOptimizer(None)],
                [_StandInScheduler(s) for s in schedulers])


@contextlib.contextmanager
def _shadowed(module: nn.Module, attributes: Mapping[str, Any]) -> Iterator[None]:
    """Set instance attributes on ``module`` (shadowing its methods), and restore the previous ones.

    Only on a LightningModule (one with ``training_step``): a plain module has none of the
    trainer-facing methods these stand in for, so it is left alone.
    """
    if not hasattr(module, "training_step"):
        yield
        return
    saved = {name: module.__dict__[name] for name in attributes if name in module.__dict__}
    for name, value in attributes.items():
        module.__dict__[name] = value  # not setattr: nn.Module would register a Module or Parameter value
    try:
        yield
    finally:
        for name in attributes:
            module.__dict__.pop(name, None)
        module.__dict__.update(saved)


class _StandInOptimizer:
    """What ``self.optimizers()`` returns while tracing: stepping does nothing, reading works."""

    def __init__(self, optimizer: Any) -> None:
        self.optimizer = optimizer
        self.param_groups = optimizer.param_groups if optimizer is not None else []

    def step(self, closure: Callable[[], Any] | None = None, **_kwargs: Any) -> Any:
        """Run the closure (it usually holds the forward and ``manual_backward``), update nothing."""
        return closure() if closure is not None else None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing: the trace's gradients are fake and released when the trace ends."""

    def toggle_model(self, *_args: Any, **_kwargs: Any) -> contextlib.AbstractContextManager:
        """Nothing to toggle (see ``StepStandIns``)."""
        return contextlib.nullcontext()

    def __getattr__(self, name: str) -> Any:
        optimizer = self.__dict__.get("optimizer")  # not self.optimizer: no recursion before __init__ sets it
        if optimizer is None:
            raise AttributeError(f"configure_optimizers returned no optimizer, so it has no {name!r}")
        return getattr(optimizer, name)


class _StandInScheduler:
    """What ``self.lr_schedulers()`` returns while tracing: stepping does nothing, reading works."""

    def __init__(self, scheduler: Any) -> None:
        self.scheduler = scheduler

    def step(self, *_args: Any, **_kwargs: Any) -> None:
        """Nothing: the learning rate must not move at planning time."""

    def __getattr__(self, name: str) -> Any:
        if "scheduler" not in self.__dict__:  # not yet set (copying): no recursion
            raise AttributeError(name)
        return getattr(self.__dict__["scheduler"], name)


def _one_or_list(items: list[Any]) -> Any:
    """As Lightning hands out optimizers and schedulers: None, the only one, or a list of several."""
    if not items:
        return None
    return items[0] if len(items) == 1 else list(items)


def _collect_optimizers(out: Any, optimizers: list[Any], schedulers: list[Any]) -> None:
    """Optimizers and schedulers, in order, from any of ``configure_optimizers``' return formats.

    Formats: an optimizer; a list or tuple of optimizers (and dicts); ``([optimizers],
    [schedulers])``; a dict with "optimizer" and "lr_scheduler" (a scheduler, or a dict with
    "scheduler"). Anything with ``step`` and an ``optimizer`` attribute counts as a scheduler.
    """
    if isinstance(out, torch.optim.Optimizer):
        optimizers.append(out)
    elif isinstance(out, Mapping):
        if "scheduler" in out:
            schedulers.append(out["scheduler"])
            return
        for value in out.values():
            _collect_optimizers(value, optimizers, schedulers)
    elif isinstance(out, (list, tuple)):
        for item in out:
            _collect_optimizers(item, optimizers, schedulers)
    elif out is not None and hasattr(out, "step") and hasattr(out, "optimizer"):
        schedulers.append(out)


def _no_op(*_args: Any, **_kwargs: Any) -> None:
    """Stands in for ``LightningModule.log`` (and other trainer calls) while profiling."""


def _null_context(*_args: Any, **_kwargs: Any) -> contextlib.AbstractContextManager:
    """Stands in for ``LightningModule.toggled_optimizer`` while profiling."""
    return contextlib.nullcontext()
