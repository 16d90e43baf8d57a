"""Lightning's ``BaseFinetuning`` callbacks over the module's parameters, not the optimizers' shard views.

[Note: finetuning callbacks]
``BackboneFinetuning`` and other ``BaseFinetuning`` callbacks freeze a backbone before training and,
at a chosen epoch, unfreeze it and give its parameters to the optimizer as a new param group. They
find parameters in the optimizer by comparing them with the tensors of its param groups, and they
keep the groups they added by parameter name (mapping tensors to names through
``named_parameters()``) so that a resumed run can rebuild them. Under this strategy the param groups
hold shard views ([Note: shard views] in runtime/optim.py): no view is a module parameter, so the
name look-up fails and the comparison (``torch.equal`` of a flat shard with a parameter) answers by
chance. So each such callback gets, on its instance, the three places where it meets the optimizer
translated between parameters and views (the view ``runtime.view_param`` makes once for each
parameter, whichever plan runs):

- ``filter_on_optimizer``, and ``unfreeze_and_add_param_group`` that calls it, find a parameter in
  the optimizer when its view is there (identity, which is what the comparison means);
  ``optimizer.add_param_group`` then takes the parameters and adds their views
  (``_shard_added_groups`` in runtime/optim.py);
- ``_apply_mapping_to_param_groups`` maps a view to its parameter's name when the groups are stored,
  and a name to the parameter's view when they are restored;
- restoring: Lightning restores the callback's state in ``on_fit_start``, but this strategy loads the
  checkpoint after setup (``restore_checkpoint_after_setup``), when ``on_fit_start`` has run, so the
  callback's ``load_state_dict`` rebuilds the stored groups at once, before the optimizer state that
  holds their moments is loaded into them. The parameters of the groups the callback added train
  again, as they did when the checkpoint was saved (Lightning's own restore leaves them frozen by
  ``freeze_before_training``, so a resumed run under another strategy trains the head only).

The plan is made, and the runtime built, as if every parameter trained (``planned_trainable``): the
callback froze the backbone in its ``setup``, before planning, and will unfreeze it, after which a
plan that counted no gradients or optimizer state for it could run out of memory. Until then the
frozen parameters' share of the plan is spare room. (A parameter the module itself keeps frozen for
good is counted too: the callback does not say which parameters it will unfreeze.)

A callback that calls ``BaseFinetuning.unfreeze_and_add_param_group`` through the class, not
``self``, gets Lightning's comparison; ``add_param_group`` still skips parameters the optimizer
already holds. Teardown gives each callback its own methods back.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any, Optional

import torch.nn as nn
from lightning.pytorch.callbacks import BaseFinetuning
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.optim import Optimizer

_METHODS = ("filter_on_optimizer", "unfreeze_and_add_param_group", "_apply_mapping_to_param_groups",
            "load_state_dict")


def install_finetuning(strategy: Any, trainer: Any) -> None:
    """Give every ``BaseFinetuning`` callback of ``trainer`` the translations above."""
    for cb in trainer.callbacks:
        if isinstance(cb, BaseFinetuning) and "filter_on_optimizer" not in cb.__dict__:
            _Translation(strategy, trainer, cb).install()


@contextmanager
def planned_trainable(module: nn.Module, trainer: Any) -> Iterator[None]:
    """With a ``BaseFinetuning`` callback: every parameter of ``module`` trainable inside (see the note)."""
    frozen = []
    if any(isinstance(cb, BaseFinetuning) for cb in trainer.callbacks):
        frozen = [p for p in module.parameters()
                  if not p.requires_grad and (p.is_floating_point() or p.is_complex())]  # an index table stays
    for param in frozen:
        param.requires_grad_(True)
    try:
        yield
    finally:
        for param in frozen:
            param.requires_grad_(False)


def remove_finetuning(trainer: Any) -> None:
    """Give the callbacks their own methods back."""
    for cb in getattr(trainer, "callbacks", []):
        if isinstance(cb, BaseFinetuning):
            for name in _METHODS:
                cb.__dict__.pop(name, None)


class _Translation:
    """One callback's methods where it meets the optimizer, in terms of shard views."""

    def __init__(self, strategy: Any, trainer: Any, callback: BaseFinetuning) -> None:
        self.strategy, self.trainer, self.callback = strategy, trainer, callback
        self.load_callback_state = callback.load_state_dict  # the class's, bound

    def install(self) -> None:
        for name in _METHODS:
            self.callback.__dict__[name] = getattr(self, name)

    def _view(self, param: nn.Parameter) -> nn.Parameter:
        return self.strategy.runtime.view_param(param)

    def filter_on_optimizer(self, optimizer: Optimizer, params: Iterable) -> list:
        """``BaseFinetuning.filter_on_optimizer``: the parameters whose views ``optimizer`` does not hold."""
        held = {id(view) for group in optimizer.param_groups for view in group["params"]}
        params = list(params)
        out = [p for p in params if id(self._view(p)) not in held]
        if len(out) < len(params):
            rank_zero_warn("The provided params to be frozen already exist within another group of this optimizer."
                           " Those parameters will be skipped.\nHINT: Did you init your optimizer in "
                           f"`configure_optimizer` as such:\n {type(optimizer)}(filter(lambda p: p.requires_grad, "
                           "self.parameters()), ...) ")
        return out

    def unfreeze_and_add_param_group(self, modules: Any, optimizer: Optimizer, lr: Optional[float] = None,
                                     initial_denom_lr: float = 10.0, train_bn: bool = True) -> None:
        """``BaseFinetuning.unfreeze_and_add_param_group``, with the filter above."""
        BaseFinetuning.make_trainable(modules)
        params_lr = optimizer.param_groups[0]["lr"] if lr is None else float(lr)
        denom_lr = initial_denom_lr if lr is None else 1.0
        params = BaseFinetuning.filter_params(modules, train_bn=train_bn, requires_grad=True)
        params = self.filter_on_optimizer(optimizer, params)
        if params:
            optimizer.add_param_group({"params": params, "lr": params_lr / denom_lr})

    def _apply_mapping_to_param_groups(self, param_groups: list[dict[str, Any]], mapping: dict) -> list[dict[str, Any]]:
        """Views to names (``mapping``: parameter to name) when storing; names to views (``mapping``: name
        to parameter) when restoring."""
        views = self.strategy.runtime.view_index()
        out = []
        for group in param_groups:
            state = {k: v for k, v in group.items() if k != "params"}
            state["params"] = [self._view(mapping[p]) if isinstance(p, str) else mapping[views[id(p)][1].param]
                               for p in group["params"]]
            out.append(state)
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """The callback's own, then its stored groups rebuilt now (see the note)."""
        self.load_callback_state(state_dict)
        cb = self.callback
        if not (cb._restarting and cb._internal_optimizer_metadata):
            return
        runtime = self.strategy.runtime
        named = dict(self.trainer.lightning_module.named_parameters())
        for index, optimizer in enumerate(self.trainer.optimizers):
            stored = cb._internal_optimizer_metadata.get(index)
            if stored is None:
                continue
            for group in stored[len(optimizer.param_groups):]:  # beyond configure_optimizers': added ones
                for name in group["params"]:
                    named[name].requires_grad_(True)  # before its view is made, which copies the flag
            optimizer.param_groups = self._apply_mapping_to_param_groups(stored, named)
            runtime.offload.reattach(optimizer, runtime.view_index())
        runtime.follow_requires_grad()
        cb._restarting = False
