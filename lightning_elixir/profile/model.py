"""Profile one training step of a model on fake tensors: access order, activation memory, compute.

    profile = profile_model(lightning_module, batch, compute_dtype=torch.bfloat16, hardware=hw)

The step (forward, loss, backward) runs once under ``FakeTensorMode`` with the parameters, buffers
and batch swapped for fake tensors, so a model of any size profiles in little host memory. What it
records is described in ``tracer.py`` ([Note: access granularity]) and ``memory.py``
([Note: what counts as activation memory]).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode

from lightning_elixir.profile.fake import (
    StepModule,
    default_device,
    default_step,
    fake_batch,
    fake_parameters,
    fake_state,
    quiet_logging,
    training_mode,
)
from lightning_elixir.profile.params import ParamTable
from lightning_elixir.profile.tracer import StepTracer
from lightning_elixir.profile.types import Access, HardwareProfile, ModelProfile, ProfileError

log = logging.getLogger(__name__)

StepFn = Callable[[nn.Module, Any], torch.Tensor]
COMPUTE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def profile_model(
    module: nn.Module,
    batch: Any,
    step_fn: StepFn | None = None,
    compute_dtype: torch.dtype = torch.float32,
    hardware: HardwareProfile | None = None,
    device: torch.device | str | None = None,
    param_dtype: torch.dtype | None = None,
) -> ModelProfile:
    """Run one training step of ``module`` on fake tensors and record what it does.

    Args:
        module: A LightningModule or plain ``nn.Module``, with real or ``meta`` parameters. It is not
            modified: fake tensors are swapped in for the call and the originals put back.
        batch: One batch, as the dataloader yields it (real or ``meta`` tensors; only shapes and
            dtypes are used).
        step_fn: ``step_fn(module, batch) -> loss``. Default: a LightningModule's
            ``training_step(batch, 0)`` (its ``self.log`` calls become no-ops), or the sum of a plain
            module's output.
        compute_dtype: ``torch.float32``, or ``torch.bfloat16``/``torch.float16`` to run the forward
            under autocast in that dtype, as the ``*-mixed`` precisions do.
        hardware: Measured speeds that turn FLOPs and bytes into seconds. Without one every
            ``compute_s`` is 0 (FLOPs and bytes are still recorded).
        device: The device the step will run on. Default: where the module's tensors are (the CPU
            when they are on ``meta``).
        param_dtype: Run with floating-point parameters in this dtype (e.g. the low-precision copy
            that the runtime's chunks hold). Default: as stored in the module.

    Returns:
        The ModelProfile of one step.

    Raises:
        ProfileError: If the step cannot be traced (no loss, manual optimization without
            ``step_fn``, or an operator that needs real data).
    """
    device = torch.device(device) if device is not None else default_device(module)
    _check_arguments(compute_dtype, device, hardware)
    step_fn = step_fn or default_step(module)
    table = ParamTable.from_module(module)
    tracer = StepTracer(table, hardware)
    start_s = time.perf_counter()
    _trace(module, batch, step_fn, tracer, compute_dtype, device, param_dtype)
    profile = _assemble(table, tracer, tracer.finish(), compute_dtype)
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


def _trace(module: nn.Module, batch: Any, step_fn: StepFn, tracer: StepTracer, compute_dtype: torch.dtype,
           device: torch.device, param_dtype: torch.dtype | None) -> None:
    """Run the step once on fake tensors with ``tracer`` attached."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    params = fake_parameters(module, mode, device, param_dtype)
    state = {f"module.{name}": t for name, t in fake_state(module, params, mode, device).items()}
    inputs = fake_batch(batch, mode, device)
    wrapper = StepModule(module, _runner(step_fn, tracer, compute_dtype, device))
    with training_mode(module), quiet_logging(module), tracer.attached(module, params):
        with mode, tracer.op_mode():
            try:
                torch.func.functional_call(wrapper, state, (inputs,), tie_weights=True)
            except torch._subclasses.fake_tensor.DataDependentOutputException as err:
                raise ProfileError(f"the step needs real tensor values ({err}); profiling runs on fake "
                                   "tensors, so keep data-dependent control flow out of training_step "
                                   "or pass a step_fn without it") from err


def _runner(step_fn: StepFn, tracer: StepTracer, compute_dtype: torch.dtype, device: torch.device) -> StepFn:
    """Forward and loss under autocast, then backward, telling the tracer where backward starts."""
    autocast = compute_dtype != torch.float32

    def run(module: nn.Module, batch: Any) -> torch.Tensor:
        with torch.autocast(device.type, dtype=compute_dtype, enabled=autocast):
            loss = step_fn(module, batch)
        if not isinstance(loss, torch.Tensor) or not loss.requires_grad:
            raise ProfileError(f"step_fn must return a loss tensor that requires grad, got {type(loss).__name__}")
        tracer.begin_backward()
        loss.backward()
        return loss.detach()

    return run


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
    )


def _dtype_name(dtype: torch.dtype) -> str:
    """"bfloat16" for torch.bfloat16."""
    return str(dtype).removeprefix("torch.")
