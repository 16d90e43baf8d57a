"""Evaluation and predict loops that run different numbers of steps on different ranks.

Under DDP an evaluation or predict step issues no collective, so ranks may run different numbers of
them. A plan that gathers chunks per module issues collectives in every forward, and the rank with
more steps would wait for gathers no one joins until ``collective_timeout_s``. ``UnevenSteps`` gives
those gathers partners: a rank with fewer steps runs its last step again, outputs dropped. Plans that
keep every chunk gathered (and one rank) need none of it and skip it.
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager
from typing import Any, Optional

import torch

from lightning_elixir.profile.preserved import preserved_state
from lightning_elixir.runtime.collectives import agreed_max


@contextmanager
def _logging_dropped(module: Any) -> Generator[None, None, None]:
    """``self.log`` and ``self.log_dict`` do nothing inside (a step repeated only to pair collectives)."""
    module.log = module.log_dict = lambda *args, **kwargs: None
    try:
        yield
    finally:
        del module.log, module.log_dict


def _gathers_per_module(runtime: Any) -> bool:
    return runtime is not None and not runtime.resident and runtime.group.world_size > 1


class UnevenSteps:
    """Evens out one strategy's evaluation and predict steps over the ranks.

    Args:
        strategy: the ElixirStrategy (its runtime, module, trainer and device are read when needed, and
            its ``TrainingSteps.region(evaluating=True)`` runs a repeated step).
    """

    def __init__(self, strategy: Any) -> None:
        self.strategy = strategy
        self._eval = False
        """Whether this validation/test loop's steps announce themselves."""
        self._last_eval: Optional[tuple[str, tuple, dict]] = None
        self._last_predict: Optional[tuple[tuple, dict]] = None
        self._predict_behind = 0
        """Predict steps this rank runs fewer than another."""

    def _most(self, value: float) -> float:
        """The largest ``value`` over the ranks."""
        agreed = agreed_max(torch.full((1,), value, device=self.strategy.root_device), self.strategy.runtime.group)
        return float(agreed[0])

    # ---- validation and test ----------------------------------------------------------------------

    def begin_eval(self) -> None:
        """[Note: uneven evaluation batches]
        Validation and test loops may run different numbers of steps on different ranks: an iterable
        dataset split by rank (``split_dataset_by_node``, webdataset shards), a sampler of the user's, or
        ``use_distributed_sampler=False``. Their lengths may be unknown (an iterable dataset without
        ``__len__``), so each step is announced: before it, every rank still stepping all-reduces a 1,
        and a rank whose loop has ended all-reduces 0s, running its last step again (outputs, logging
        and module state dropped) for as long as another rank still steps. A rank catches up right
        after its last step (the loop's fetcher knows it is the last), before the epoch-end hooks,
        whose collectives (``sync_dist=True``, metrics' ``compute``) must pair with the other ranks'
        (and at ``on_*_end``, for a step that did not know it was the last). One small all-reduce per
        step, only for plans that gather per module on several ranks."""
        self._last_eval = None
        self._eval = _gathers_per_module(self.strategy.runtime)

    def before_eval_step(self, hook: str, args: tuple, kwargs: dict) -> None:
        if self._eval:
            self._most(1.0)
            self._last_eval = (hook, args, kwargs)

    def after_eval_step(self) -> None:
        if not self._eval:
            return
        loop = getattr(self.strategy.lightning_module.trainer, "_evaluation_loop", None)
        if loop is not None and loop.batch_progress.is_last_batch:
            self.catch_up_eval()

    def catch_up_eval(self) -> None:
        """Repeat this rank's last evaluation step while another rank still steps."""
        if not self._eval:
            return
        self._eval = False
        module = self.strategy.lightning_module
        while self._most(0.0) > 0:
            if self._last_eval is None:
                raise ValueError(f"rank {self.strategy.global_rank} has no evaluation batch while other ranks do: "
                                 "with a plan that gathers chunks per module every rank must run the model, so give "
                                 "each rank at least one batch")
            hook, args, kwargs = self._last_eval
            with self.strategy._steps.region(evaluating=True), torch.no_grad(), preserved_state(module), \
                    _logging_dropped(module):
                getattr(module, hook)(*args, **kwargs)
        self._last_eval = None

    # ---- predict ----------------------------------------------------------------------------------

    def begin_predict(self) -> None:
        """[Note: uneven predict batches]
        Lightning's predict sampler does not pad the data (it would repeat samples in the predictions), so
        ranks may run different numbers of predict steps. The ranks agree on the most steps any runs, and
        a rank with fewer runs the difference again on its last batch at the end (``on_predict_end``), its
        outputs dropped: the extra gathers of the others then have partners. A rank with no batch at
        all has nothing to run them on, and says so. An iterable dataset of unknown length is left to
        the user (its steps are theirs to keep equal)."""
        self._last_predict, self._predict_behind = None, 0
        if not _gathers_per_module(self.strategy.runtime):
            return
        mine = float(sum(self.strategy.lightning_module.trainer.num_predict_batches))
        if mine == float("inf"):
            return
        most = int(self._most(mine))
        if mine == 0 and most > 0:
            raise ValueError(f"rank {self.strategy.global_rank} has no predict batch while others have up to {most}: "
                             "with a plan that gathers chunks per module every rank must run the model, so give "
                             "predict at least one batch per rank (more samples, or a smaller batch size)")
        self._predict_behind = most - int(mine)

    def before_predict_step(self, args: tuple, kwargs: dict) -> None:
        self._last_predict = (args, kwargs)

    def catch_up_predict(self) -> None:
        """Run the steps this rank is behind on its last batch, outputs dropped."""
        behind, self._predict_behind = self._predict_behind, 0
        if behind and self._last_predict is not None:
            args, kwargs = self._last_predict
            for _ in range(behind):
                with self.strategy._steps.region(evaluating=True), torch.no_grad():
                    self.strategy.lightning_module.predict_step(*args, **kwargs)
