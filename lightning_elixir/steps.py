"""The strategy's steps: the region every rank runs, memory counted, updates started in backward, recovery.

``ElixirStrategy.training_step``, ``backward`` and ``optimizer_step`` hand their work to ``TrainingSteps``,
which wraps Lightning's own step in what Elixir adds around it:

- the step region ([Note: reading outside the hooks] in runtime/access.py): every rank runs the step, so
  a read outside the module hooks gathers on demand; an evaluation step ends the iteration at its end,
  a training step at the optimizer step;
- under an emulated device budget, the step's memory counted ([Note: emulated device memory]);
- around a backward, offloaded chunks allowed to start their updates in it when nothing between it and
  the step can change them ([Note: updates started in backward] in runtime/offload.py);
- with out-of-memory recovery, the retry loops ([Note: recovering from out of memory] in recovery.py):
  a step that ran out of memory is given up on every rank and redone under a smaller plan.
"""

from __future__ import annotations

import contextlib
from collections.abc import Generator
from contextlib import contextmanager
from typing import Any, Callable, Optional

from lightning.pytorch.loops.optimization.automatic import ClosureResult
from lightning.pytorch.trainer import call
from torch import Tensor

from lightning_elixir.autoplan import updates_start_in_backward
from lightning_elixir.recovery import recoverable_error
from lightning_elixir.runtime import emulated


class TrainingSteps:
    """One strategy's steps (its runtime, recovery, module and trainer are read when needed).

    Args:
        strategy: the ElixirStrategy.
    """

    def __init__(self, strategy: Any) -> None:
        self.strategy = strategy
        self._args: tuple[tuple, dict] = ((), {})
        """The running training step's arguments: a backward that ran out of memory redoes its forward."""
        self._counted_step: Optional[int] = None
        self._starts_in_backward: Optional[bool] = None
        """``updates_will_start_in_backward()`` for the stage set up last (the configuration does not change within it)."""

    def new_stage(self) -> None:
        """A stage is set up: its trainer decides anew whether updates start in backward."""
        self._starts_in_backward = None

    @contextmanager
    def region(self, evaluating: bool) -> Generator[None, None, None]:
        """One step of the loop: every rank runs it, so reads outside the hooks gather on demand."""
        runtime = self.strategy.runtime
        assert runtime is not None
        with runtime.step_region():
            runtime.begin_iteration()
            yield
        if evaluating:
            runtime.end_iteration()

    def training_step(self, step: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """Lightning's ``training_step`` (``step``) in the step region, redone where it runs out of memory."""
        strategy = self.strategy
        if strategy.recovery is None:
            with self.region(evaluating=False), self._counting():
                return step(*args, **kwargs)
        self._args = (args, kwargs)
        while True:
            runtime = strategy.runtime
            assert runtime is not None
            strategy.recovery.begin(runtime, strategy.lightning_module.trainer._results)
            steps = runtime.steps + runtime.skipped_steps
            try:
                with self.region(evaluating=False), self._counting():
                    return step(*args, **kwargs)
            except Exception as err:
                if not recoverable_error(err):
                    raise
                stepped = (runtime.updating or runtime.offload.started_early
                           or runtime.steps + runtime.skipped_steps != steps)
                self._recover(err, "training_step", "an optimizer already stepped in this training_step (manual "
                                                    "optimization), and its update cannot be undone" if stepped else None)

    def backward(self, backward: Callable[..., Tensor], closure_loss: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        """Lightning's ``backward`` of ``closure_loss``; where it runs out of memory (automatic optimization),
        the micro-batch's forward is redone (it recovers on its own) and its loss goes backward instead."""
        strategy = self.strategy
        if strategy.recovery is None or not strategy.lightning_module.automatic_optimization:
            with self._backward_region():  # under manual optimization the training_step recovers
                return backward(closure_loss, *args, **kwargs)
        trainer = strategy.lightning_module.trainer
        while True:
            try:
                with self._backward_region():
                    return backward(closure_loss, *args, **kwargs)
            except Exception as err:
                if not recoverable_error(err):
                    raise
                with contextlib.suppress(RuntimeError):
                    closure_loss.detach_()  # the failed backward's graph (and its activations) goes
                del closure_loss
                self._recover(err, "backward", self._update_begun())
                step_args, step_kwargs = self._args  # as the closure does
                output = call._call_strategy_hook(trainer, "training_step", *step_args, **step_kwargs)
                closure_loss = ClosureResult.from_training_step_output(output, trainer.accumulate_grad_batches).closure_loss

    def optimizer_step(self, step: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Lightning's ``optimizer_step``; what the closure's training_step and backward did not recover (automatic
        optimization) redoes the whole closure."""
        strategy = self.strategy
        if strategy.recovery is None or not strategy.lightning_module.automatic_optimization:
            return step(*args, **kwargs)
        while True:
            try:
                return step(*args, **kwargs)
            except Exception as err:
                if not recoverable_error(err):
                    raise
                self._recover(err, "optimizer step", self._update_begun())

    def updates_will_start_in_backward(self) -> bool:
        """Whether offloaded updates start in the backward that ends an accumulation, as far as the
        configuration tells before fit (``autoplan.updates_start_in_backward``); asked once per stage,
        not at every backward."""
        if self._starts_in_backward is None:
            strategy = self.strategy
            module = strategy.lightning_module
            self._starts_in_backward = updates_start_in_backward(
                module, strategy.updates_in_backward, strategy.root_device.type != "cpu",
                getattr(strategy.precision_plugin, "scaler", None) is not None, module.trainer.gradient_clip_val,
                module.trainer.callbacks)
        return self._starts_in_backward

    @contextmanager
    def _backward_region(self) -> Generator[None, None, None]:
        """Around the strategy's backward: every rank runs it, on_before_backward hooks included, so reads
        there gather on demand (as in the step); memory is counted; offloaded updates may start."""
        runtime = self.strategy.runtime
        assert runtime is not None
        with runtime.step_region(), self._counting(), self._updates_may_start():
            yield

    @contextmanager
    def _updates_may_start(self) -> Generator[None, None, None]:
        """Around a backward: let offloaded chunks start their updates in it when nothing between it and
        the step can change them ([Note: updates started in backward] in runtime/offload.py)."""
        runtime = self.strategy.runtime
        if runtime is None or not runtime.offload.chunks:
            yield
            return
        protocol = runtime.protocol  # holds_graphs: this backward goes through a graph torch.autograd.grad made
        runtime.offload.early = (self.updates_will_start_in_backward() and runtime.scaler is None
                                 and not protocol.accumulating and not protocol.holds_graphs)
        try:
            yield
        finally:
            runtime.offload.early = False

    @contextmanager
    def _counting(self) -> Generator[None, None, None]:
        """Inside an emulated device budget ([Note: emulated device memory]), count the step's memory."""
        memory = emulated.active()
        runtime = self.strategy.runtime
        if memory is None or runtime is None or memory.counting_now:  # a backward inside a training_step
            yield
            return
        step = runtime.steps + runtime.skipped_steps + 1
        if step != self._counted_step:
            self._counted_step = step
            memory.begin_step(step, self.strategy.global_rank, runtime.device_bytes_between_steps())
        with memory.counting():
            yield

    def _update_begun(self) -> Optional[str]:
        """Why the step cannot be redone: an update began (in the step, or an offloaded one in backward)."""
        runtime = self.strategy.runtime
        if runtime is not None and (runtime.updating or runtime.offload.started_early):
            return "the optimizer's update had begun and may be partly applied"
        return None

    def _recover(self, err: BaseException, where: str, why_not: Optional[str]) -> None:
        """Every rank: give up the step, shrink the plan, put the micro-batch's state back ([Note: recovering
        from out of memory]); log it as a self-correction is logged."""
        strategy = self.strategy
        assert strategy.recovery is not None
        trainer = strategy.lightning_module.trainer
        self._counted_step = None
        strategy.recovery.recover(err, strategy, trainer.global_step + 1, where, redoable=why_not)
        strategy.monitor(trainer).log_recovery(trainer, strategy.recovery.attempts[-1], strategy.describe_running())
