"""Hooks that every rank runs, with the module's weights readable and writable inside.

[Note: hooks every rank runs]
A momentum encoder (BYOL, MoCo, DINO), a mean teacher or a hand-written EMA updates one set of weights
from another in ``on_train_batch_end``; a module logs a weight's norm at the end of an epoch; a
callback copies weights at the start of training. Under DDP these are plain reads and in-place writes.
Here, between steps each rank holds its shard of the weights only, and a read outside the step
raises ``OutsideStepError`` ([Note: reading outside the hooks] in runtime/access.py), because a
gather on demand needs every rank to read the same weights at the same point.

Lightning runs the training loop's hooks (and the stages' and epochs' start and end hooks, and
``on_save_checkpoint``) on every rank, in the same order: so while a user's override of one of them
runs, the strategy holds a gathered region open (``gathered_params()``), in which a read gathers its
chunk on demand and in-place writes and ``.data`` assignments are kept, as in the hooks around
backward. Every rank runs the same code there, as the step's code does; code that reads weights on
some ranks only must say so (``gathered_params(params=...)``, which gathers them up front), as in the
step. Overrides only: a hook nobody overrode costs nothing, and one that reads nothing costs the
opening and closing of an empty region.

Wrapped: the module's own overrides, and those of callbacks that are not Lightning's or this
package's (Lightning's own read no weights there, and the weight averaging callbacks run sharded:
[Note: sharded weight averaging] in averaging.py). Not wrapped: the evaluation loops' per-batch
hooks, which may run a different number of times on each rank (uneven.py evens out the steps, not
the hooks). The wrappers are instance attributes, removed at teardown.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from lightning.pytorch import Callback, LightningModule

HOOKS = (
    "on_fit_start", "on_train_start", "on_train_end", "on_train_epoch_start", "on_train_epoch_end",
    "on_train_batch_start", "on_train_batch_end",
    "on_validation_start", "on_validation_end", "on_validation_epoch_start", "on_validation_epoch_end",
    "on_test_start", "on_test_end", "on_test_epoch_start", "on_test_epoch_end",
    "on_predict_start", "on_predict_end", "on_predict_epoch_start", "on_predict_epoch_end",
    "on_save_checkpoint",
)
"""The hooks Lightning runs on every rank, at the same point, outside the step's regions."""

_MARK = "__elixir_rank_hook__"
_OURS = ("lightning.", "pytorch_lightning.", "lightning_elixir.")


def install_rank_hooks(strategy: Any, trainer: Any) -> None:
    """Run the user's overrides of ``HOOKS`` (module and callbacks) inside ``strategy.gathered_params()``."""
    module = strategy.lightning_module
    if module is not None:
        _wrap(module, LightningModule, strategy)
    for callback in getattr(trainer, "callbacks", ()):
        if not type(callback).__module__.startswith(_OURS):
            _wrap(callback, Callback, strategy)


def remove_rank_hooks(strategy: Any, trainer: Any) -> None:
    """Give the module and the callbacks their hooks back."""
    targets = [strategy.lightning_module, *getattr(trainer, "callbacks", ())]
    for target in targets:
        owned = getattr(target, "__dict__", {})
        for hook in HOOKS:
            if getattr(owned.get(hook), _MARK, False):
                del owned[hook]


def _wrap(target: Any, base: type, strategy: Any) -> None:
    for hook in HOOKS:
        if hook in target.__dict__ or getattr(type(target), hook, None) is getattr(base, hook, None):
            continue  # set on the instance (by the user, or wrapped already), or not overridden
        target.__dict__[hook] = _in_region(getattr(target, hook), strategy)


def _in_region(hook: Callable[..., Any], strategy: Any) -> Callable[..., Any]:
    @functools.wraps(hook)
    def run(*args: Any, **kwargs: Any) -> Any:
        with strategy.gathered_params():
            return hook(*args, **kwargs)

    setattr(run, _MARK, True)
    return run
