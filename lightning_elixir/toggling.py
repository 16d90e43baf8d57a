"""Lightning's ``toggle_optimizer`` over the module's parameters, not the optimizers' shard views.

[Note: toggling optimizers]
``LightningModule.toggle_optimizer(opt)`` freezes the parameters of every other optimizer by setting
``requires_grad=False`` on the tensors in their param groups, so that a GAN's generator loss computes
no discriminator gradients; ``untoggle_optimizer`` restores the flags. Under this strategy the param
groups hold shard views ([Note: shard views] in runtime/optim.py), not the module's parameters: the
flags would change on the views only, every parameter would still get a gradient, and a
discriminator stepped after the generator would add the generator loss's gradients to its own. So
while the strategy runs the module, both methods act on the parameters the views stand for, with
Lightning's semantics (toggle saves each parameter's flag, untoggle restores those of the other
optimizers' parameters), and the runtime follows the new flags at once rather than at the next
iteration, since the forward that follows already runs with them. A module that overrides either
method keeps its own; teardown removes them.
"""

from __future__ import annotations

import types
from collections.abc import Iterator
from typing import Any

import torch.nn as nn
from lightning.pytorch import LightningModule
from lightning.pytorch.core.optimizer import LightningOptimizer
from torch.optim import Optimizer

_METHODS = ("toggle_optimizer", "untoggle_optimizer")


def install_toggling(module: LightningModule) -> None:
    """Give ``module`` the toggles below where it has Lightning's own."""
    for name, method in zip(_METHODS, (toggle_optimizer, untoggle_optimizer)):
        if getattr(type(module), name) is getattr(LightningModule, name):
            module.__dict__[name] = types.MethodType(method, module)


def remove_toggling(module: Any) -> None:
    """Give ``module`` Lightning's toggles back."""
    for name in _METHODS:
        if module is not None:
            module.__dict__.pop(name, None)


def _params(module: LightningModule, optimizer: Any) -> Iterator[nn.Parameter]:
    """The module's parameters behind ``optimizer``'s shard views."""
    views = module.trainer.strategy.runtime.view_index()
    inner = optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
    for group in inner.param_groups:
        for view in group["params"]:
            yield views[id(view)][1].param


def toggle_optimizer(self: LightningModule, optimizer: Any) -> None:
    """``LightningModule.toggle_optimizer`` on the parameters the views stand for."""
    state: dict[nn.Parameter, bool] = {}
    for opt in self.trainer.optimizers:
        for param in _params(self, opt):
            if param not in state:
                state[param] = param.requires_grad
                param.requires_grad = False
    for param in _params(self, optimizer):
        param.requires_grad = state[param]
    self._param_requires_grad_state = state
    self.trainer.strategy.runtime.follow_requires_grad()


def untoggle_optimizer(self: LightningModule, optimizer: Any) -> None:
    """``LightningModule.untoggle_optimizer`` on the parameters the views stand for."""
    inner: Optimizer = optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
    for opt in self.trainer.optimizers:
        if opt is not inner:
            for param in _params(self, opt):
                if param in self._param_requires_grad_state:
                    param.requires_grad = self._param_requires_grad_state[param]
    self._param_requires_grad_state = {}
    self.trainer.strategy.runtime.follow_requires_grad()
