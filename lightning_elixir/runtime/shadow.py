"""Shadow optimizers: the user's optimizer, run on one offloaded chunk at a time.

[Note: shadow optimizers]
An offloaded chunk's update runs on a worker thread, chunk by chunk, while the device chunks are
updated by the user's own ``optimizer.step()`` on the main thread. The worker cannot call the
user's optimizer (it would step every parameter, and its step hooks and LR-scheduler counters
belong to the main loop), so each (optimizer, chunk) pair gets a *shadow*: an instance of the same
class over views of that chunk's host master shard, with

- one param group per user param group that has parameters in the chunk, whose hyperparameters
  (lr, betas, weight_decay, ...) are copied from the user's group when the step is launched, so
  LR schedulers and per-group settings apply exactly as on the device;
- its ``state`` aliased to the user's optimizer state: ``shadow.state[shadow_view]`` *is*
  ``optimizer.state[user_view]``, the same dict, looked up through the user's optimizer on every
  access (``load_state_dict`` replaces that mapping), so the user's optimizer state dict still has
  one entry per original parameter;
- its own view objects (the user's views keep their gradients for code that reads them; during the
  user's ``step()`` the offloaded ones are hidden so that only the shadows update them).

Where the user left the implementation to torch (``foreach`` and ``fused`` both None) and the
device is an accelerator, the shadow uses torch's fused CPU kernel when the class has one (Adam,
AdamW, SGD, Adagrad): the same update, several times faster on the host than the per-tensor loop
torch picks for CPU tensors (the device chunks run torch's accelerator default, itself a
foreach/fused kernel). On a CPU-only machine the device chunks run torch's CPU default, and so do
the shadows: an offloaded plan then computes bit for bit what the all-device plan computes.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Optional

import torch
import torch.nn as nn
from torch.optim import Optimizer

FUSED_ON_CPU: tuple[type, ...] = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.Adagrad)


class AliasedState(dict):
    """``shadow.state``: every lookup goes to the user's optimizer state of the matching user view."""

    def __init__(self, owner: Optimizer, alias: dict[int, nn.Parameter]) -> None:
        super().__init__()
        self.owner = owner
        self.alias = alias
        """id(shadow view) -> the user's view of the same elements."""

    def __getitem__(self, key: Any) -> Any:
        return self.owner.state[self.alias[id(key)]]

    def __contains__(self, key: Any) -> bool:
        return id(key) in self.alias and self.alias[id(key)] in self.owner.state

    def get(self, key: Any, default: Any = None) -> Any:
        return self[key] if key in self else default


class Shadow:
    """One user optimizer's update of one offloaded chunk (see [Note: shadow optimizers])."""

    def __init__(self, optimizer: Optimizer, members: list[tuple[int, nn.Parameter, nn.Parameter]],
                 fused_when_unset: bool) -> None:
        """``members``: (user param group index, user view, shadow view) for each view in the chunk;
        ``fused_when_unset``: use the fused CPU kernel where the user chose no implementation."""
        self.optimizer = optimizer
        self.fused = (fused_when_unset and type(optimizer) in FUSED_ON_CPU  # the fused kernels take real floats only
                      and all(shadow.is_floating_point() for _, _, shadow in members))
        self.group_index = sorted({g for g, _, _ in members})
        self.pairs = [(user, shadow) for _, user, shadow in members]
        groups = []
        for g in self.group_index:
            params = [shadow for gi, _, shadow in members if gi == g]
            groups.append({**host_hyperparameters(optimizer.param_groups[g], type(optimizer)), "params": params})
        self.impl = type(optimizer)(groups)
        self.impl.state = AliasedState(optimizer, {id(shadow): user for _, user, shadow in members})

    @property
    def user_views(self) -> list[nn.Parameter]:
        return [user for user, _ in self.pairs]

    def snapshot(self) -> list[dict[str, Any]]:
        """The user's hyperparameters and gradients now (the worker steps with them later)."""
        kind = type(self.optimizer)
        return [host_hyperparameters(self.optimizer.param_groups[g], kind) for g in self.group_index]

    def step(self, hypers: list[dict[str, Any]], grads: list[Optional[torch.Tensor]]) -> None:
        """Update the chunk's views with the given hyperparameters and gradients (None: skipped)."""
        for group, values in zip(self.impl.param_groups, hypers):
            group.update(values)
            if self.fused and group.get("foreach") is None and group.get("fused") is None:
                group["fused"] = True
        for (_, shadow), grad in zip(self.pairs, grads):
            shadow.grad = grad
        try:
            self.impl.step()
        finally:
            for _, shadow in self.pairs:
                shadow.grad = None


def hyperparameters(group: dict[str, Any]) -> dict[str, Any]:
    """A param group without its parameters."""
    return {k: v for k, v in group.items() if k != "params"}


def host_hyperparameters(group: dict[str, Any], kind: type) -> dict[str, Any]:
    """A param group's hyperparameters for a step of host tensors: an ``lr`` tensor as a float (one on a GPU
    cannot step host tensors), no ``capturable`` (a mode for GPU graphs, refused on the host), and
    ``fused`` only where the class has a fused host kernel."""
    settings = hyperparameters(group)
    if isinstance(settings.get("lr"), torch.Tensor):
        settings["lr"] = float(settings["lr"])
    if settings.get("capturable"):
        settings["capturable"] = False
    if settings.get("fused") and kind not in FUSED_ON_CPU:
        settings["fused"] = None
    return settings


def per_element_keys(optimizer: Optimizer) -> dict[str, torch.dtype]:
    """The optimizer state that has one value per parameter element, by key, with its dtype.

    Found by stepping a throw-away instance of the class, once per param group's settings, on a
    two-element parameter: the keys (``exp_avg``, ``momentum_buffer``, ...) depend on the class
    and its settings (amsgrad, momentum), never on the values.
    """
    keys: dict[str, torch.dtype] = {}
    for group in optimizer.param_groups:
        probe = nn.Parameter(torch.zeros(2))
        probe.grad = torch.zeros(2)
        settings = host_hyperparameters(group, type(optimizer))  # the probe runs on the CPU,
        for key, plain in (("foreach", False), ("fused", None)):  # with torch's reference loop
            if key in settings:
                settings[key] = plain
        instance = type(optimizer)([{**settings, "params": [probe]}])
        instance.step()
        for key, value in instance.state[probe].items():
            if isinstance(value, torch.Tensor) and value.shape == probe.shape:
                keys[key] = value.dtype
    return keys


def views_of(optimizer: Optimizer) -> Iterator[tuple[int, nn.Parameter]]:
    """(param group index, parameter) over the optimizer's param groups."""
    for g, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            yield g, p
