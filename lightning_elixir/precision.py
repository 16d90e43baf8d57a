"""ElixirPrecision: Lightning's precision plugin for chunked parameters and sharded gradients."""

from __future__ import annotations

import contextlib
from collections.abc import Generator
from typing import Any, Callable, Optional, Union

import torch
from lightning.fabric.plugins.precision.utils import _convert_fp_tensor
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.trainer import call
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_elixir.runtime.optim import DynamicLossScaler, clip_grad_norm_, clip_grad_value_
from lightning_elixir.runtime.policy import PRECISION_FLAGS, PrecisionPolicy


class ElixirPrecision(Precision):
    """Mixed and true precision for Elixir: low-precision chunks, fp32 masters, global overflow checks.

    Args:
        precision: "32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true" or "64-true".
        device_type: the autocast device ("cpu" or "cuda"); the strategy sets it from its root device.
    """

    def __init__(self, precision: str = "32-true", device_type: str = "cpu") -> None:
        self.policy = PrecisionPolicy.from_flag(str(precision))
        self.precision = str(precision)
        self.device_type = device_type
        self.compute_dtype = self.policy.compute_dtype
        self.master_dtype = self.policy.master_dtype
        self.autocast_dtype = self.policy.autocast_dtype
        self.scaler = DynamicLossScaler() if self.precision == "16-mixed" else None
        self.runtime: Any = None  # set by the strategy once the model is chunked

    @override
    def convert_module(self, module: Module) -> Module:
        if self.policy.true_precision:
            return module.to(self.compute_dtype)
        return module

    @override
    def convert_input(self, data: Any) -> Any:
        """True precisions: floating-point batch tensors in the model's dtype, as Lightning's Half/DoublePrecision."""
        if not self.policy.true_precision:
            return data
        return apply_to_collection(data, function=_convert_fp_tensor, dtype=Tensor, dst_type=self.compute_dtype)

    @contextlib.contextmanager
    def _default_dtype(self) -> Generator[None, None, None]:
        if not self.policy.true_precision:
            yield
            return
        previous = torch.get_default_dtype()
        torch.set_default_dtype(self.compute_dtype)
        try:
            yield
        finally:
            torch.set_default_dtype(previous)

    @override
    def tensor_init_context(self) -> contextlib.AbstractContextManager:
        return self._default_dtype()

    @override
    def module_init_context(self) -> contextlib.AbstractContextManager:
        return self._default_dtype()

    @override
    @contextlib.contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        if self.autocast_dtype is None:  # true precisions: tensors created in forward take the model's dtype
            with self._default_dtype():
                yield
            return
        with torch.autocast(self.device_type, dtype=self.autocast_dtype, cache_enabled=False):
            yield

    @override
    def pre_backward(self, tensor: Tensor, module: Any) -> Tensor:
        if self.scaler is not None:
            tensor = self.scaler.scale_loss(tensor)
        return super().pre_backward(tensor, module)

    @override
    def post_backward(self, tensor: Tensor, module: Any) -> Tensor:
        with self.runtime.gathered():  # on_after_backward hooks may read parameters and gradients
            return super().post_backward(tensor, module)

    @override
    def optimizer_step(self, optimizer: Any, model: Any, closure: Callable[[], Any], **kwargs: Any) -> Any:
        with self.runtime.step_region():  # the hooks between training_step and backward (on_before_zero_grad,
            closure_result = closure()    # on_before_backward) run on every rank: reads there gather on demand
        if closure_result is None and getattr(model, "automatic_optimization", True):
            return closure_result  # training_step returned None: no backward ran, nothing to step
        overflow = self.scaler is not None and self.scaler.unscale_and_check(self.runtime)
        self._after_closure(model, optimizer)  # hooks and clipping see unscaled gradients
        if overflow:  # every rank agreed: skip this step everywhere
            self.runtime.after_step(stepped=False)
            return closure_result
        with self.runtime.stepping(optimizer):
            output = optimizer.step(**kwargs)
        return output

    @override
    def _after_closure(self, model: Any, optimizer: Any) -> None:
        trainer = model.trainer
        # Hooks such as grad_norm(self) or a hand-written clip_grad_norm_ read (and may scale) full
        # gradients: they are gathered on read and written back to the shards before clipping.
        with self.runtime.gathered():
            call._call_callback_hooks(trainer, "on_before_optimizer_step", optimizer)
            call._call_lightning_module_hook(trainer, "on_before_optimizer_step", optimizer)
        self._clip_gradients(model, optimizer, trainer.gradient_clip_val,
                             gradient_clip_algorithm=trainer.gradient_clip_algorithm)

    @override
    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: Union[int, float]) -> None:
        clip_grad_norm_(self.runtime, float(clip_val), optimizer=_unwrapped(optimizer))

    @override
    def clip_grad_by_value(self, optimizer: Optimizer, clip_val: Union[int, float]) -> None:
        clip_grad_value_(self.runtime, float(clip_val), optimizer=_unwrapped(optimizer))

    @override
    def state_dict(self) -> dict[str, Any]:
        return self.scaler.state_dict() if self.scaler is not None else {}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.scaler is not None and state_dict:
            self.scaler.load_state_dict(state_dict)

    # [Note: the loss scale across strategies]
    # Lightning's fp16 plugin (DDP, one device) keeps its torch.amp.GradScaler's state under "MixedPrecision",
    # ours under "ElixirPrecision"; each would ignore the other's, and a resume across strategies would start
    # the scale over at 2**16 (and skip steps finding it again). So a checkpoint we save also holds the scale
    # as a GradScaler state, and one we load without ours takes it from there.

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if self.scaler is not None:
            s = self.scaler
            checkpoint.setdefault("MixedPrecision", {
                "scale": float(s.scale), "growth_factor": float(s.growth_factor),
                "backoff_factor": float(s.backoff_factor), "growth_interval": int(s.growth_interval),
                "_growth_tracker": int(s._good_steps)})

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        other = checkpoint.get("MixedPrecision")
        if self.scaler is not None and type(self).__qualname__ not in checkpoint and other:
            self.scaler.load_state_dict({"scale": other["scale"], "good_steps": other.get("_growth_tracker", 0)})


def from_lightning_plugin(plugin: Optional[Precision]) -> ElixirPrecision:
    """Translate the precision plugin Lightning picked from ``Trainer(precision=...)`` into ours."""
    if plugin is None or isinstance(plugin, ElixirPrecision):
        return plugin or ElixirPrecision()
    flag = str(getattr(plugin, "precision", "32-true"))
    if flag not in PRECISION_FLAGS:
        raise ValueError(f"Trainer(precision={flag!r}) is not supported by the Elixir strategy; "
                         f"use one of {sorted(PRECISION_FLAGS)}")
    return ElixirPrecision(flag)


def _unwrapped(optimizer: Any) -> Optimizer:
    """The torch optimizer behind what ``self.optimizers()`` returns."""
    return optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
