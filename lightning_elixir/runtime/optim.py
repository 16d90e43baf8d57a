"""The sharded optimizer: the user's optimizer over shard views, global clipping, loss scaling.

[Note: shard views]
The user's optimizer object stays the one Lightning and LR schedulers see. Each parameter in its
param groups is replaced, in place, by a flat view of this rank's slice of that parameter's fp32
master shard (empty when the rank owns none of it); the view's ``.grad`` is the matching slice of
the reduced gradient shard. Element-wise optimizers then compute exactly what they would on the
full tensor, group hyperparameters (lr, weight_decay, betas) apply unchanged, and the optimizer's
state dict keeps one entry per original parameter, in the original order.

[Note: shard views held elsewhere]
With more than one rank most parameters lie wholly in other ranks' shards (7 of 8 on 8 ranks), so
most of a rank's views are empty. Stepping an empty view changes no element, yet costs what a full
one costs on the host: torch's optimizers do their per-tensor Python work (state look-up, grouping,
a dozen calls on CPU) for each. So the optimizer's step does not see the (empty) gradient of a view
whose parameter has elements elsewhere (``GradientFlow.hide_elsewhere``, as offloaded chunks' are
hidden), except on the step where its parameter first trains, which makes its state (empty
per-element tensors and the scalars) exactly as on the owners. The view keeps its gradient outside
the step, so zero_grad still tells the reductions to overwrite rather than add (reductions.py).
From then on only the scalars differ: ``step`` counts on the ranks that own elements and stays
where it was here.
Scalars are read across ranks only where the state is written or moved (a sharded save, a full
state dict, a plan switch), and those first give every view held elsewhere the scalars of the rank
that owns its first element (``state_dict.agree_scalar_state``, one object all-gather). A
parameter with no elements at all is stepped as before: no rank owns it.
"""

from __future__ import annotations

import inspect
import logging
import math
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.optim import Optimizer

from lightning_elixir.devices import to_device
from lightning_elixir.runtime import collectives
from lightning_elixir.runtime.state_dict import load_full_optimizer_state_dict
from lightning_elixir.runtime.factored import install_adafactor_step, is_adafactor
from lightning_elixir.runtime.per_parameter import install_per_parameter_step, is_per_parameter
from lightning_elixir.runtime.whole import install_muon_step, is_muon, unhooked_step

log = logging.getLogger(__name__)

ELEMENTWISE_OPTIMIZERS: tuple[type, ...] = (
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad, torch.optim.RMSprop,
    torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam, torch.optim.Adadelta, torch.optim.Rprop,
    torch.optim.ASGD,
)
"""torch's optimizers whose update of each element reads only that element (and scalars: lr, step)."""
OWN_STEPS: tuple[tuple[Callable[[type], bool], Callable[[Any, Optimizer], None]], ...] = (
    (is_muon, install_muon_step), (is_adafactor, install_adafactor_step),
    (is_per_parameter, install_per_parameter_step))
"""Optimizers that read whole parameters, each with a test of the class and the installer of a step of the
runtime's own that runs it exactly on shards: torch's Muon and the Adafactors on shards ([Note: Muon on
shards], [Note: Adafactor on shards]), any class declared per-parameter on whole parameters gathered chunk
by chunk ([Note: per-parameter optimizers])."""
_declared: set[type] = set()
"""Classes declared element-wise with ``elementwise_optimizer``."""


def elementwise_optimizer(cls: type) -> type:
    """Declare an optimizer class element-wise, so that it can run on parameter shards; returns ``cls``.

    Use it as a class decorator on an optimizer whose update of each parameter element reads only
    that element's parameter, gradient and state (and scalars such as lr or the step count): Lion,
    a subclass of SGD that overrides ``step`` to log. Norms, means or shapes of whole parameters
    (LARS, LAMB) are not element-wise: on a shard they would see a slice only. (torch's Muon, and torch's
    and Hugging Face's Adafactor, run a step of the runtime's own: [Note: Muon on shards], [Note:
    Adafactor on shards].)
    Offloaded chunks run extra instances of the class built as ``cls(param_groups)`` ([Note: shadow
    optimizers] in shadow.py), so every constructor argument other than the parameters needs a default.
    """
    if not (isinstance(cls, type) and issubclass(cls, Optimizer)):
        raise TypeError(f"elementwise_optimizer expects a torch.optim.Optimizer subclass, got {cls!r}")
    _declared.add(cls)
    return cls


def _step_not_element_wise(cls: type) -> Optional[str]:
    """None when ``cls`` runs on shards; else why not, for the error.

    A class is element-wise when it is one of torch's element-wise optimizers or was declared so, or
    when it inherits ``step`` from such a class unchanged (a subclass that only sets defaults). A
    subclass that overrides ``step`` may compute per-parameter norms: it has to be declared.
    ``Optimizer.__init__`` wraps each class's ``step`` in a profiling hook (``functools.wraps``), so
    functions are compared unwrapped."""
    for base in cls.__mro__:
        if base in _declared or base in ELEMENTWISE_OPTIMIZERS:
            if inspect.unwrap(cls.step) is inspect.unwrap(base.step):
                return None
            return (f"{cls.__name__} overrides {base.__name__}.step, so it may not be element-wise: "
                    "per-parameter norms or shapes would be computed on this rank's shard only")
    return f"{cls.__name__} is not element-wise, so it cannot run on parameter shards"


def shard_optimizer(runtime, optimizer: Optimizer) -> Optimizer:
    """Swap ``optimizer``'s parameters for this rank's shard views, in place; return it.

    Lightning's stand-in for ``configure_optimizers`` returning None (``_MockOptimizer``, which
    holds a dummy tensor of its own and never steps) is returned unchanged: there is nothing to
    shard, and the model trains forward and backward without updates, as under DDP.
    """
    cls = type(optimizer)  # matched by name: runtime/ does not import Lightning (either package)
    if cls.__name__ == "_MockOptimizer" and cls.__module__ in ("lightning.pytorch.core.optimizer",
                                                               "pytorch_lightning.core.optimizer"):
        return optimizer
    own_step = _own_step(cls)
    problem = None if own_step else _step_not_element_wise(cls)
    if problem is not None:
        names = ", ".join(sorted(t.__name__ for t in ELEMENTWISE_OPTIMIZERS))
        raise TypeError(f"{problem}. Use one of torch's element-wise optimizers ({names}), Muon or Adafactor, or "
                        "declare the class: with @lightning_elixir.elementwise_optimizer if each element's update "
                        "reads only that element and scalars (as Lion's does), with "
                        "@lightning_elixir.per_parameter_optimizer if each parameter's update reads only that "
                        "parameter, its gradient and its state (LARS, LAMB without a global gradient norm, Shampoo)")
    if getattr(optimizer, "_optimizer_step_pre_hooks", None) or getattr(optimizer, "_optimizer_step_post_hooks", None):
        log.warning("%s has step hooks (register_step_pre_hook / register_step_post_hook): under the Elixir strategy "
                    "they see this rank's flat shard views in its param_groups, not the parameters, so shapes, "
                    "norms and rows there are this shard's. Act on the module's parameters (in "
                    "on_before_optimizer_step, or inside trainer.strategy.gathered_params()) instead.", cls.__name__)
    initial = None
    if any(optimizer.state.values()):
        if any(_stepped(state) for state in optimizer.state.values()):
            raise ValueError("the optimizer already has state; create it in configure_optimizers (before any step) "
                             "and load optimizer state through the strategy's checkpoint loading")
        initial = optimizer.state_dict()  # made by the constructor (Adagrad's sums), full-size
        optimizer.state.clear()
    for group in optimizer.param_groups:
        group["params"] = [runtime.view_param(p) for p in group["params"]]
    _shard_added_groups(runtime, optimizer)
    runtime.optimizers.append(optimizer)
    if own_step:
        own_step(runtime, optimizer)
    else:
        runtime.offload.attach(optimizer, runtime.view_index())
    if initial is not None:  # each view gets its slice, as a full state dict is loaded on resume
        load_full_optimizer_state_dict(runtime, optimizer, initial)
    return optimizer


def _own_step(cls: type) -> Optional[Callable[[Any, Optimizer], None]]:
    """The installer of the runtime's own step for optimizer class ``cls`` (None: the class's step runs)."""
    return next((install for test, install in OWN_STEPS if test(cls)), None)


def _stepped(state: dict) -> bool:
    """Whether a parameter's optimizer state has seen a step (else its constructor made it)."""
    step = state.get("step", 0)
    return bool(step.item() if isinstance(step, torch.Tensor) else step)


def _shard_added_groups(runtime, optimizer: Optimizer) -> None:
    """``optimizer.add_param_group`` later in training (a layer unfrozen and given to the optimizer)
    takes the module's parameters and adds their shard views, as the constructor's groups were. After a
    switch of plans the optimizer is sharded again: the new wrapper wraps what the old one wrapped, which
    would otherwise keep the old runtime alive and hand it the new runtime's views."""
    add = optimizer.add_param_group
    add = getattr(add, "_elixir_wrapped", add)

    def add_param_group(param_group: dict) -> None:
        params = param_group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        views = [runtime.view_param(p) for p in params]
        add({**param_group, "params": views})
        own_step = _own_step(type(optimizer))
        if own_step:
            own_step(runtime, optimizer)  # checks the new groups' chunks
        elif any(runtime.where(p)[0].offloaded for p in params):  # their updates run on the host, as the rest's
            runtime.offload.reattach(optimizer, runtime.view_index())

    add_param_group._elixir_wrapped = add  # type: ignore[attr-defined]
    optimizer.add_param_group = add_param_group  # type: ignore[method-assign]


@dataclass(frozen=True)
class StateFootprint:
    """The optimizer state and step buffers of each trained element, in parameter-sized values, for
    planning (``state_footprint``)."""

    sharded: float
    """State of the parameter's own shape (Adam's moments): sharded with the chunks, placed with them."""
    whole: float = 0.0
    """State of other shapes (a preconditioner, a factored moment's rows and columns): every rank holds all
    of it, on the device ([Note: per-parameter optimizers] in per_parameter.py)."""
    gathered: float = 0.0
    """What the step gathers for one chunk at a time, per element of the chunk: a per-parameter optimizer's
    masters, gradients and per-element state; Muon's update ([Note: Muon on shards] in whole.py)."""


def state_footprint(optimizers: list[Optimizer]) -> Optional[StateFootprint]:
    """How many values of optimizer state each trained element holds, averaged over ``optimizers``'
    trainable parameters (Adam: 2 sharded, SGD with momentum: 1, SGD without: 0, Adafactor: a few per
    row and column of a matrix, one per element of a vector; Shampoo: its preconditioners, whole), and
    what the step gathers; None when some class could not be measured.

    Measured, not looked up: each param group's class is built anew with that group's hyperparameters
    over a parameter of each shape the group trains, stepped once on fake tensors (no memory, no
    arithmetic), and its tensor state counted, so a preconditioner per side of a tall matrix is priced as
    that matrix holds it. A step that needs values (torch's Adafactor reads its step count) is measured on
    a real 64 x 64 matrix for the group's matrices and a vector for the rest, stepped on the CPU."""
    total = sharded = whole = gathered = 0.0
    for optimizer in optimizers:
        cls = type(optimizer)
        for group in optimizer.param_groups:
            hyperparameters = {k: v for k, v in group.items() if k != "params"}
            numels: dict[tuple[int, ...], int] = {}
            for p in group["params"]:
                if p.requires_grad:
                    numels[tuple(p.shape)] = numels.get(tuple(p.shape), 0) + p.numel()
            stand_ins: dict[tuple[int, ...], Optional[tuple[float, float]]] = {}
            for shape, numel in numels.items():
                measured = _measured_on_fake(cls, hyperparameters, shape)
                if measured is None:
                    stand_in = (64, 64) if len(shape) > 1 else (4096,)
                    if stand_in not in stand_ins:
                        stand_ins[stand_in] = _measured_states(cls, hyperparameters, stand_in)
                    measured = stand_ins[stand_in]
                if measured is None:
                    return None
                own, other = measured
                total, sharded, whole = total + numel, sharded + own * numel, whole + other * numel
                if is_per_parameter(cls):
                    gathered = max(gathered, 2.0 + own)  # masters, gradients, per-element state
                elif is_muon(cls):
                    gathered = max(gathered, 1.0)  # the update
    if not total:
        return StateFootprint(0.0)
    return StateFootprint(sharded / total, whole / total, gathered)


def _measured_on_fake(cls: type, hyperparameters: dict[str, Any],
                      shape: tuple[int, ...]) -> Optional[tuple[float, float]]:
    """``_measured_states`` at the parameter's own shape on fake tensors (no memory, no arithmetic); None
    where the step needs values (``.item()`` of its state, as torch's Adafactor takes) or fails so."""
    if not shape:  # a scalar parameter: the vector stand-in measures it as well
        return None
    try:
        with FakeTensorMode(allow_non_fake_inputs=True):
            return _measured_states(cls, hyperparameters, shape, quiet=True)
    except Exception:  # noqa: BLE001 (a step that needs values: measured on the stand-in instead)
        return None


def _measured_states(cls: type, hyperparameters: dict[str, Any], shape: tuple[int, ...],
                     quiet: bool = False) -> Optional[tuple[float, float]]:
    """State values per element of one step of ``cls`` with ``hyperparameters`` on a parameter of ``shape``,
    as (of the parameter's shape, of other shapes); None if it cannot run so (``quiet``: raise instead)."""
    probe = nn.Parameter(torch.linspace(-1.0, 1.0, math.prod(shape)).view(shape))
    probe.grad = torch.linspace(0.5, -0.5, probe.numel()).view(shape)
    hyperparameters = {k: v for k, v in hyperparameters.items() if k not in ("fused", "capturable")}
    groups = [{"params": [probe], **hyperparameters}]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                optimizer = cls(groups)
            except TypeError:  # a learning rate without a default: given again, as the constructor asks
                if "lr" not in hyperparameters:
                    raise
                optimizer = cls(groups, lr=hyperparameters["lr"])
            unhooked_step(type(optimizer))(optimizer)  # no step hook of the user's sees the probe
    except Exception as err:  # noqa: BLE001 (a class that needs other arguments or a GPU: not measured)
        if quiet:
            raise
        log.debug("could not measure the state of %s", cls.__name__, exc_info=err)
        return None
    held = [v for v in optimizer.state[probe].values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    size = probe.numel() * probe.element_size()
    own = sum(v.numel() * v.element_size() for v in held if v.shape == probe.shape)
    other = sum(v.numel() * v.element_size() for v in held if v.shape != probe.shape)
    return own / size, other / size


def clip_grad_norm_(runtime, max_norm: float, norm_type: float = 2.0, optimizer: Optional[Optimizer] = None) -> torch.Tensor:
    """Clip the global gradient norm over all ranks' shards of ``optimizer``'s parameters (all parameters
    without one); return the norm before clipping."""
    shards = clipped_grads(runtime, optimizer)
    total = _global_norm(runtime, shards, float(norm_type))
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    coefs = {coef.device: coef}  # offloaded shards are on the host: the coefficient goes there once
    for g in shards:
        if g.device not in coefs:
            coefs[g.device] = coef.to(g.device)
        g.mul_(coefs[g.device].to(g.dtype))
    return total


def _global_norm(runtime, shards: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    """The norm over every rank's shards; the offloaded shards' part is summed on the host and crosses
    to the device once ([Note: copies that wait for the device] in devices.py)."""
    infinite = math.isinf(norm_type)
    sums: dict[torch.device, torch.Tensor] = {}  # per device, added in the shards' order
    for g in shards:
        if g.numel():
            part = _norm_part(g, norm_type, infinite)
            held = sums.get(g.device)
            sums[g.device] = part if held is None else torch.maximum(held, part) if infinite else held + part
    local = torch.zeros(1, dtype=torch.float32, device=runtime.device)
    for part in sums.values():
        part = to_device(part.reshape(1), local.device)
        local = torch.maximum(local, part) if infinite else local + part
    if infinite:
        return collectives.all_reduce_max(local, runtime.group)[0]
    return collectives.all_reduce_sum(local, runtime.group)[0].pow(1.0 / norm_type)


def _norm_part(g: torch.Tensor, norm_type: float, infinite: bool) -> torch.Tensor:
    """One shard's part of the global norm, in float32: its largest magnitude, or its sum of |g|^p.

    On an accelerator one reduction kernel (``vector_norm``) reads the shard once, where abs, pow and sum
    read it five times over in all; on the CPU the separate passes stay: torch's CPU ``vector_norm`` of a
    large float32 tensor is less exact (0.2% low over 20M elements, where the sum of squares is within
    1e-7 of float64)."""
    if infinite:
        return g.abs().max().float()
    if g.device.type == "cpu":
        return (g.abs().float() if g.is_complex() else g.float().abs()).pow(norm_type).sum()  # complex: magnitudes
    if g.dtype == torch.float64 or g.is_complex():  # vector_norm's dtype may not narrow, nor make a complex input real
        return torch.linalg.vector_norm(g, norm_type).pow(norm_type).float()
    return torch.linalg.vector_norm(g, norm_type, dtype=torch.float32).pow(norm_type)


def clip_grad_value_(runtime, clip_value: float, optimizer: Optional[Optimizer] = None) -> None:
    """Clamp every gradient element of ``optimizer``'s parameters (all parameters without one) to
    [-clip_value, clip_value] (element-wise, so local is global)."""
    for g in clipped_grads(runtime, optimizer):
        g.clamp_(-clip_value, clip_value)


def clipped_grads(runtime, optimizer: Optional[Optimizer]) -> list[torch.Tensor]:
    """The gradients that clipping for ``optimizer`` acts on: those of its parameters, as torch's clipping
    of ``optimizer``'s parameters does (two optimizers, or one over some of the trainable parameters, clip
    apart). Whole gradient shards, fewer and larger tensors, where it holds every trainable parameter
    (their other elements are padding and frozen parameters' gaps, all zero) and every parameter another
    optimizer holds: one frozen by ``toggle_optimizer`` keeps the gradient of its own optimizer's step."""
    shards = runtime.grad_shards()
    if optimizer is None:
        return shards
    views = [view for group in optimizer.param_groups for view in group["params"]]
    mine, view_of = {id(view) for view in views}, runtime.table.views
    if (all(id(view_of.get(id(p))) in mine for p in runtime.protocol.trainable.params)
            and all(id(view) in mine for view in view_of.values())):
        return shards
    return [view.grad for view in views if view.grad is not None]


def grads_finite(runtime) -> bool:
    """Whether every rank's gradient shards are finite: one answer, agreed by all ranks."""
    bad = torch.zeros(1, dtype=torch.float32, device=runtime.device)
    for g in runtime.grad_shards():
        bad = torch.maximum(bad, (~torch.isfinite(g)).any().float().reshape(1).to(bad.device))
    return collectives.all_reduce_max(bad, runtime.group).item() == 0


@dataclass
class DynamicLossScaler:
    """fp16 loss scaling whose overflow decision is the same on every rank."""

    scale: float = 2.0 ** 16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    _good_steps: int = 0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale

    def unscale_and_check(self, runtime) -> bool:
        """Divide the gradient shards by the scale; return True when the step must be skipped."""
        inv = 1.0 / self.scale
        for g in runtime.grad_shards():
            g.mul_(inv)
        overflow = not grads_finite(runtime)
        self._update(overflow)
        return overflow

    def _update(self, overflow: bool) -> None:
        if overflow:
            self.scale *= self.backoff_factor
            self._good_steps = 0
            log.info("gradient overflow: skipping the optimizer step, loss scale now %g", self.scale)
            return
        self._good_steps += 1
        if self._good_steps >= self.growth_interval:
            self.scale *= self.growth_factor
            self._good_steps = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self._good_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self._good_steps = int(state["good_steps"])


def optimizer_step(runtime, optimizer: Optimizer, clip_norm: float | None = None, clip_value: float | None = None) -> bool:
    """Unscale and check (fp16), clip, step and refresh the shards. Returns whether it stepped."""
    if runtime.scaler is not None and runtime.scaler.unscale_and_check(runtime):
        runtime.after_step(stepped=False)
        return False
    if clip_norm is not None:
        clip_grad_norm_(runtime, clip_norm, optimizer=optimizer)
    if clip_value is not None:
        clip_grad_value_(runtime, clip_value, optimizer=optimizer)
    with runtime.stepping(optimizer):
        optimizer.step()
    return True
