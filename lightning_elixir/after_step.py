"""Code after the optimizer step in a module's own ``optimizer_step`` hook.

[Note: code after the step in optimizer_step]
A module that overrides ``optimizer_step`` may act on the weights once the step is taken, after
``super().optimizer_step(...)`` or ``optimizer.step(closure=...)`` returns: WGAN's critic clipping, a
max-norm or non-negativity constraint, a projection. Under DDP that is a plain in-place write. Here
the step leaves each rank with its shard only, and a read outside the step raises
``OutsideStepError`` ([Note: reading outside the hooks] in runtime/access.py), because a gather on
demand needs every rank to read. Lightning runs the hook on every rank, so the code after the step
is run by all of them together: while a wrapped hook runs, the strategy's step returns into a
gathered region (reads gather on demand, in-place writes and ``.data`` assignments are kept),
closed before the hook steps again (a second optimizer) and when it returns. Only the module's own
override is wrapped, while the strategy runs it; teardown gives the module its method back.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Optional

from lightning.pytorch import LightningModule


class AfterStepRegion:
    """The gathered region from the end of the optimizer step to the end of the module's ``optimizer_step``."""

    def __init__(self) -> None:
        self._in_hook = 0
        self._open: Optional[contextlib.ExitStack] = None

    def install(self, module: LightningModule) -> None:
        """Wrap ``module``'s own ``optimizer_step`` (Lightning's has no code after the step)."""
        if type(module).optimizer_step is LightningModule.optimizer_step or "optimizer_step" in module.__dict__:
            return
        hook = module.optimizer_step

        @functools.wraps(hook)
        def optimizer_step(*args: Any, **kwargs: Any) -> Any:
            self._in_hook += 1
            try:
                return hook(*args, **kwargs)
            finally:
                self._in_hook -= 1
                if not self._in_hook:
                    self.close()

        optimizer_step.__elixir_after_step__ = True  # type: ignore[attr-defined]
        module.__dict__["optimizer_step"] = optimizer_step

    def remove(self, module: Any) -> None:
        self.close()
        if module is not None and getattr(module.__dict__.get("optimizer_step"), "__elixir_after_step__", False):
            del module.__dict__["optimizer_step"]

    def open(self, runtime: Any) -> None:
        """The step just ended: inside the module's hook, what follows reads and writes gathered weights."""
        if self._in_hook and runtime is not None and self._open is None:
            stack = contextlib.ExitStack()
            stack.enter_context(runtime.gathered())
            self._open = stack

    def close(self) -> None:
        """Keep what was written after the step (written back to the shards) and let the chunks go."""
        stack, self._open = self._open, None
        if stack is not None:
            stack.close()
