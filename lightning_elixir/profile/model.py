"""Profile one training step of a model on fake tensors: access order, activation memory, compute.

    profile = profile_model(lightning_module, batch, compute_dtype=torch.bfloat16, hardware=hw)

The step (forward, loss, backward) runs once under ``FakeTensorMode`` with the parameters, buffers
and batch swapped for fake tensors, so a model of any size profiles in little host memory. What it
records is described in ``tracer.py`` ([Note: access granularity]) and ``memory.py``
([Note: what counts as activation memory]). The step is the user's code: host reads of values get
assumed answers ([Note: assumed values] in assumed.py), manual optimization runs against stand-ins,
and the module's state and the global random generators are put back afterwards, so profiling
changes nothing the run sees. ``backward=False`` profiles a forward-only step (validation, test,
prediction) under ``torch.no_grad`` in eval mode.

[Note: value-dependent module calls]
Under ZeRO-3 a module's chunks are gathered when it runs, and every rank must issue the same
gathers. A module whose call depends on each rank's data breaks that: a mixture-of-experts layer
that skips the experts no token chose, a loop whose length comes from ``.item()``. When the
trace had to assume values, the step is traced a second time with the opposite assumptions
(masks select nothing, unknown booleans read True: ``AssumedValues(opposite=True)``), and a
module that holds parameters and runs a different number of times in the two traces is taken to
be value-dependent. Its parameters are listed in ``conditional_params`` and among the
``shared_params``, so the search gives them private chunks: gathered at the start of the step
on every rank and reduced in a fixed order, which no rank's control flow changes. A second trace
that fails (the step cannot run with nothing selected) finds nothing; the runtime's check then
names the problem should ranks diverge ([Note: silent divergence] in runtime/collectives.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException, FakeTensorMode

from lightning_elixir.profile.assumed import AssumedValues, host_conversions
from lightning_elixir.profile.fake import (
    StepFn,
    StepModule,
    default_device,
    default_step,
    fake_batch,
    fake_parameters,
    fake_state,
    loss_of,
)
from lightning_elixir.profile.params import ParamTable
from lightning_elixir.profile.preserved import preserved_rng, preserved_state
from lightning_elixir.profile.stand_ins import StepStandIns, conversions_on_fakes, quiet_logging, training_mode
from lightning_elixir.profile.tracer import StepTracer
from lightning_elixir.profile.types import Access, HardwareProfile, ModelProfile, ProfileError

log = logging.getLogger(__name__)

COMPUTE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def profile_model(
    module: nn.Module,
    batch: Any,
    step_fn: StepFn | None = None,
    compute_dtype: torch.dtype = torch.float32,
    hardware: HardwareProfile | None = None,
    device: torch.device | str | None = None,
    param_dtype: torch.dtype | None = None,
    backward: bool = True,
    configured: tuple[list[Any], list[Any]] | None = None,
    conditional_params: tuple[str, ...] | None = None,
) -> ModelProfile:
    """Run one step of ``module`` on fake tensors and record what it does.

    Args:
        module: A LightningModule or plain ``nn.Module``, with real or ``meta`` parameters. It is not
            modified: fake tensors are swapped in for the call and the originals put back, and every
            attribute the step changes (metric states, lists it appends to) is restored.
        batch: One batch, as the dataloader yields it (real or ``meta`` tensors; only shapes and
            dtypes are used).
        step_fn: ``step_fn(module, batch) -> loss`` (or any output when ``backward`` is False).
            Default: a LightningModule's ``training_step(batch, 0)`` (``self.log`` is a no-op; with
            manual optimization its ``self.manual_backward`` calls are the traced backward and its
            optimizers are stand-ins that do not step), or the sum of a plain module's output.
        compute_dtype: ``torch.float32``, or ``torch.bfloat16``/``torch.float16`` to run the forward
            under autocast in that dtype, as the ``*-mixed`` precisions do; ``torch.float64`` for a
            module in double precision (no autocast; pass ``param_dtype=torch.float64`` too).
        hardware: Measured speeds that turn FLOPs and bytes into seconds. Without one every
            ``compute_s`` is 0 (FLOPs and bytes are still recorded).
        device: The device the step will run on. Default: where the module's tensors are (the CPU
            when they are on ``meta``).
        param_dtype: Run with floating-point parameters in this dtype (e.g. the low-precision copy
            that the runtime's chunks hold). Default: as stored in the module.
        backward: False profiles a forward-only step (validation, test, prediction): in eval mode
            under ``torch.no_grad``, whatever it returns. The profile then has no backward accesses.
        configured: The optimizers and LR schedulers ``configure_optimizers`` returned, when already
            made: a manually optimizing step's ``self.optimizers()`` stands in for those. Default: the
            stand-ins call ``configure_optimizers`` once per trace, when the step asks for them.
        conditional_params: The parameters of value-dependent modules, when a trace of the same step
            already found them (``ModelProfile.conditional_params``; the planner's recomputation
            variants run the same module calls): the second trace that would find them is skipped.

    Returns:
        The ModelProfile of one step.

    Raises:
        ProfileError: If the step cannot be traced (no loss and no ``manual_backward``, or an
            operator whose result depends on values the trace cannot assume, see [Note: assumed
            values] in assumed.py). Other exceptions the step raises on fake tensors propagate.
    """
    device = torch.device(device) if device is not None else default_device(module)
    _check_arguments(compute_dtype, device, hardware)
    step_fn = step_fn or default_step(module)
    table = ParamTable.from_module(module)
    tracer = StepTracer(table, hardware)
    start_s = time.perf_counter()
    settings = _Settings(compute_dtype, device, param_dtype, backward, configured)
    try:
        assumed = _trace(module, batch, step_fn, tracer, settings)
    except _FailedOnAssumption as failed:
        tracer = StepTracer(table, hardware)
        _trace_opposite_or_raise(module, batch, step_fn, tracer, settings, failed)
        assumed = False  # one trace ran: nothing to compare it with
    profile = _assemble(table, tracer, tracer.finish(), compute_dtype)
    if conditional_params is not None:
        profile = _with_conditional(profile, conditional_params)
    elif assumed:
        modules = _value_dependent(module, batch, step_fn, table, settings, profile)
        if modules:
            log.info("modules whose calls depend on tensor values (%s) get private chunks: every rank gathers them "
                     "for the whole step, so ranks may skip them", ", ".join(modules))
        profile = _with_conditional(profile, tuple(dict.fromkeys(n for m in modules for n in table.units.get(m, ()))))
    log.debug("profiled %d parameters, %d accesses in %.2f s", len(profile.params), len(profile.accesses),
              time.perf_counter() - start_s)
    return profile


def _check_arguments(compute_dtype: torch.dtype, device: torch.device, hardware: HardwareProfile | None) -> None:
    """Fail fast on arguments the trace cannot honour; warn on a hardware profile of another dtype."""
    if compute_dtype not in COMPUTE_DTYPES:
        raise ProfileError(f"compute_dtype must be one of {COMPUTE_DTYPES}, got {compute_dtype}")
    if hardware is not None and hardware.compute_dtype != _dtype_name(compute_dtype):
        log.warning("the hardware profile's matmul speed was measured in %s, the step computes in %s: "
                    "compute estimates will be off", hardware.compute_dtype, _dtype_name(compute_dtype))
    _check_device(device)


def _check_device(device: torch.device) -> None:
    """Fail fast on a device this torch build cannot run autograd for, even with fake tensors."""
    if device.type == "cpu":
        return
    accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    if accelerator is None or accelerator.type != device.type:
        raise ProfileError(f"this machine has no {device.type} device, and autograd needs one even for fake "
                           f"tensors; profile with device='cpu' (the access order and activation bytes are the "
                           f"same up to kernel-specific buffers) or on the training machine")


@dataclass(frozen=True)
class _Settings:
    """How the step runs: autocast dtype, device, parameter dtype, with or without backward."""

    compute_dtype: torch.dtype
    device: torch.device
    param_dtype: torch.dtype | None
    backward: bool
    configured: tuple[list[Any], list[Any]] | None = None
    """What ``configure_optimizers`` returned, already made (``StepStandIns``)."""


class _FailedOnAssumption(Exception):
    """The step raised after the trace had assumed values (its ``__cause__``)."""


def _trace_opposite_or_raise(module: nn.Module, batch: Any, step_fn: StepFn, tracer: StepTracer,
                             settings: _Settings, failed: _FailedOnAssumption) -> None:
    """Trace the step with the opposite assumptions after it failed on the first; raise the first failure
    if this one fails too.

    [Note: checks of the data]
    A step may check its data: ``assert (ids >= 0).all().item()`` (ProphetNet's shift of the labels), or
    ``if not torch.isfinite(x).all(): raise``. On fake tensors the answer is assumed, and the first trace
    reads unknown booleans as False, so such a check fails there, and the plan fell back to the
    default. Read as True the check passes: that trace is the profile. With one trace only, nothing
    tells which modules' calls depend on values; the runtime's check names any that do
    ([Note: silent divergence] in runtime/collectives.py).
    """
    try:
        _trace(module, batch, step_fn, tracer, settings, opposite=True)
    except Exception:  # noqa: BLE001 - the first failure is the one to report
        raise failed.__cause__ from None
    log.debug("the step failed on assumed values (%r); traced with the opposite assumptions", failed.__cause__)


def _value_dependent(module: nn.Module, batch: Any, step_fn: StepFn, table: ParamTable, settings: _Settings,
                     profile: ModelProfile) -> list[str]:
    """Modules whose forward calls depend on assumed values ([Note: value-dependent module calls])."""
    tracer = StepTracer(table)
    try:
        _trace(module, batch, step_fn, tracer, settings, opposite=True)
    except Exception as err:  # noqa: BLE001 - the step may not run with nothing selected; then nothing is found
        log.debug("the trace with opposite assumptions failed (%s): no value-dependent modules found", err)
        return []
    first, second = _forward_calls(profile.accesses), _forward_calls(tracer.finish())
    return sorted(name for name in first.keys() | second.keys() if first.get(name, 0) != second.get(name, 0))


def _forward_calls(accesses: Iterable[Access]) -> Counter:
    """How many times each module that holds parameters ran forward (op-level accesses aside)."""
    return Counter(a.module for a in accesses if a.phase == "forward" and not a.op)


def _with_conditional(profile: ModelProfile, names: tuple[str, ...]) -> ModelProfile:
    """The profile with the parameters of value-dependent modules, ``names``, listed (and given private chunks)."""
    if not names:
        return profile
    return dataclasses.replace(profile.with_private(names), conditional_params=names)


def _trace(module: nn.Module, batch: Any, step_fn: StepFn, tracer: StepTracer, settings: _Settings,
           opposite: bool = False) -> bool:
    """Run the step once on fake tensors with ``tracer`` attached; leave the module and RNG as they were.
    Returns whether any answer was assumed; ``opposite``: assume the other way ([Note: value-dependent
    module calls])."""
    with preserved_rng(cuda=settings.device.type == "cuda"), preserved_state(module):
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        params = fake_parameters(module, mode, settings.device, settings.param_dtype)
        state = {f"module.{name}": t for name, t in fake_state(module, params, mode, settings.device).items()}
        inputs = fake_batch(batch, mode, settings.device)
        stand_ins = StepStandIns(module, lambda loss, *args, **kwargs: _backward(tracer, loss, *args, **kwargs),
                                 settings.configured)
        wrapper = StepModule(module, _runner(step_fn, tracer, settings, stand_ins))
        with _step_contexts(module, mode, tracer, params, stand_ins, settings.backward, opposite) as values:
            try:
                torch.func.functional_call(wrapper, state, (inputs,), tie_weights=True)
            except DataDependentOutputException as err:
                raise ProfileError(f"the step reads tensor values in a way the trace cannot assume ({err}); "
                                   "profiling runs on fake tensors, so keep that out of the step or pass a "
                                   "step_fn without it") from err
            except DynamicOutputShapeException as err:
                raise ProfileError(f"the step calls {err.func}, whose output shape depends on tensor values the "
                                   "trace cannot bound; pass a step_fn without it") from err
            except ProfileError:  # the trace's own verdict (a loop that never ends on assumed values)
                raise
            except Exception as err:
                if values.assumed and not opposite:  # [Note: checks of the data]
                    raise _FailedOnAssumption() from err
                raise
    return values.assumed


@contextlib.contextmanager
def _step_contexts(module: nn.Module, mode: FakeTensorMode, tracer: StepTracer, params: dict[str, nn.Parameter],
                   stand_ins: StepStandIns, backward: bool, opposite: bool = False) -> Iterator[AssumedValues]:
    """Module modes, stand-ins and hooks, then the dispatch modes (the last entered sees operators first)."""
    with training_mode(module, training=backward), quiet_logging(module), stand_ins.installed(), conversions_on_fakes():
        with tracer.attached(module, params), mode, tracer.op_mode():
            values = AssumedValues(mode, opposite)
            with values, host_conversions(values):
                yield values


def _runner(step_fn: StepFn, tracer: StepTracer, settings: _Settings, stand_ins: StepStandIns) -> StepFn:
    """Forward and loss under autocast, then backward (unless the step ran its own, or none is wanted)."""
    autocast = settings.compute_dtype in (torch.bfloat16, torch.float16)  # not float64 ("64-true")

    def run(module: nn.Module, batch: Any) -> None:
        grad = contextlib.nullcontext() if settings.backward else torch.no_grad()
        with grad, torch.autocast(settings.device.type, dtype=settings.compute_dtype, enabled=autocast):
            out = step_fn(module, batch)
        if settings.backward and stand_ins.backward_calls == 0:  # manual optimization ran its own backward
            _backward(tracer, loss_of(out))

    return run


def _backward(tracer: StepTracer, loss: Any, *args: Any, **kwargs: Any) -> None:
    """``loss.backward()``, telling the tracer where backward starts and ends."""
    if not isinstance(loss, torch.Tensor) or not loss.requires_grad:
        raise ProfileError(f"the step must return (or pass to manual_backward) a loss tensor that requires grad, "
                           f"got {type(loss).__name__}")
    tracer.begin_backward()
    loss.backward(*args, **kwargs)
    tracer.end_backward()


def _assemble(table: ParamTable, tracer: StepTracer, accesses: list[Access], compute_dtype: torch.dtype) -> ModelProfile:
    """Order the parameters by first use and build the frozen profile."""
    used = dict.fromkeys(name for access in accesses for name in access.params)
    order = [*used, *(info.name for info in table.infos if info.name not in used)]
    infos = {info.name: info for info in table.infos}
    totals = tracer.totals
    return ModelProfile(
        params=tuple(infos[name] for name in order),
        accesses=tuple(accesses),
        shared_params=tuple(name for name in order if name in tracer.shared),
        forward_peak_bytes=totals.peak_bytes["forward"],
        backward_peak_bytes=totals.peak_bytes["backward"],
        compute_dtype=_dtype_name(compute_dtype),
        forward_compute_s=totals.compute_s["forward"],
        backward_compute_s=totals.compute_s["backward"],
        recomputes=totals.recomputed_ops > 0,
    )


def _dtype_name(dtype: torch.dtype) -> str:
    """"bfloat16" for torch.bfloat16."""
    return str(dtype).removeprefix("torch.")
