"""The stage a trainer runs, the step plan="auto" profiles for it, and one batch of its own data.

[Note: planning per stage]
``trainer.fit`` plans from one batch of the training dataloader through ``training_step`` (forward
and backward); ``validate``, ``test`` and ``predict`` without a prior fit plan from one batch of
their own dataloader through their own step, forward only (no backward accesses, one
micro-batch). A module that has no ``train_dataloader`` can therefore be validated. The batch
comes from a fresh iterator of the stage's dataloader, as the loop will build it (the loop
itself has not set up its data yet); creating that iterator draws from the global generator (the
sampler's shuffle, the workers' base seed), which ``preserved_rng`` puts back.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Optional

from lightning_elixir.profile.fake import StepFn, lightning_step
from lightning_elixir.profile.preserved import preserved_state


@dataclass(frozen=True)
class StageStep:
    """What plan="auto" profiles for one trainer stage ([Note: planning per stage])."""

    stage: str
    """"fit", "validate", "test" or "predict" (``trainer.state.fn``)."""
    loop: str
    """The trainer attribute of the stage's loop, whose ``_data_source`` gives its dataloader."""
    hook: str
    """The LightningModule step the loop runs."""
    backward: bool
    """Whether the step has a backward (only training has)."""


STAGES: Mapping[str, StageStep] = {
    "fit": StageStep("fit", "fit_loop", "training_step", backward=True),
    "validate": StageStep("validate", "validate_loop", "validation_step", backward=False),
    "test": StageStep("test", "test_loop", "test_step", backward=False),
    "predict": StageStep("predict", "predict_loop", "predict_step", backward=False),
}


@dataclass(frozen=True)
class StageBatch:
    """One batch of the running stage's own data, and the step to profile it with."""

    step: StageStep
    batch: Any
    """As the stage's dataloader yields it (a structure of batches for several training loaders)."""
    dataloader_idx: Optional[int]
    """0 when the (evaluation) stage has several dataloaders, as Lightning passes it only then."""

    @property
    def step_fn(self) -> StepFn:
        """``step_fn(module, batch)`` calling the stage's hook as the loop does for batch 0."""
        return lightning_step(self.step.hook, self.dataloader_idx)


def stage_of(trainer: Any) -> StageStep:
    """The StageStep for ``trainer.state.fn`` (fitting when the trainer does not say)."""
    fn = getattr(getattr(trainer, "state", None), "fn", None)
    name = str(getattr(fn, "value", fn) or "fit")
    if name not in STAGES:
        raise ValueError(f"plan='auto' plans for {sorted(STAGES)}, not trainer stage {name!r}")
    return STAGES[name]


def stage_batch(trainer: Any, step: Optional[StageStep] = None) -> StageBatch:
    """One batch of the stage's own dataloader, from a fresh iterator (see [Note: planning per stage]),
    as the step gets it: through the module's (and datamodule's) batch hooks, ``on_before_batch_transfer``,
    ``transfer_batch_to_device`` and ``on_after_batch_transfer``, as the loop calls them.

    A dataloader that is itself an iterator (a generator passed to ``fit``) has no fresh iterator:
    the batch taken from it is put back in front of it, so that the run still trains on it
    ([Note: a batch taken for planning]).

    Args:
        trainer: The Trainer, with its data attached (as in ``Strategy.setup``).
        step: The stage to read; default: the one the trainer runs.

    Raises:
        ValueError: If the stage has no dataloader, or it is empty.
    """
    step = step or stage_of(trainer)
    source = getattr(trainer, step.loop)._data_source
    if source.instance is None or not source.is_defined():
        raise ValueError(f"there is no {source.name}() to take a batch from for the {step.stage} stage")
    loaders = source.dataloader()
    loaders = getattr(loaders, "iterables", loaders)  # a CombinedLoader: the loaders it combines
    put_back: dict[int, Any] = {}
    if step.backward:  # training draws from every loader at once (Lightning's "max_size_cycle")
        batch, dataloader_idx = _apply(loaders, lambda loader: _first(loader, step, put_back)), None
    else:
        flat = _flatten(loaders)
        if not flat:
            raise ValueError(f"{source.name}() returned no dataloader for the {step.stage} stage")
        batch, dataloader_idx = _first(flat[0], step, put_back), 0 if len(flat) > 1 else None
    if put_back and not source.is_module() and source.instance is loaders:
        source.instance = _apply(loaders, lambda loader: put_back.get(id(loader), loader))
    # the loops pass dataloader_idx=0 to the batch hooks in training, and for an evaluation's first loader
    return StageBatch(step, _through_batch_hooks(trainer, batch, 0), dataloader_idx)


def _through_batch_hooks(trainer: Any, batch: Any, dataloader_idx: int) -> Any:
    """``batch`` as the loop hands it to the step: the batch hooks run on it, and it is on the device."""
    module = getattr(trainer, "lightning_module", None)
    strategy = getattr(trainer, "strategy", None)
    if module is None or strategy is None or not hasattr(module, "_on_before_batch_transfer"):
        return batch
    with preserved_state(module):  # a hook that counts or caches must not see the planning batch
        batch = strategy.precision_plugin.convert_input(batch)  # true precisions: in the module's dtype
        batch = module._on_before_batch_transfer(batch, dataloader_idx=dataloader_idx)
        return strategy.batch_to_device(batch, dataloader_idx=dataloader_idx)


def _first(loader: Any, step: StageStep, put_back: Optional[dict[int, Any]] = None) -> Any:
    """The first batch of a fresh iterator of ``loader``.

    [Note: a batch taken for planning]
    Lightning takes any iterable as a dataloader, a generator or another iterator too, and ``iter``
    of an iterator is the iterator itself: the batch planning takes is gone from the run, which
    then trains on one batch less than under DDP, each rank shifted by one. For such a loader,
    ``put_back`` gets an iterator that yields the batch first and then the rest, for the caller to
    put in the loader's place."""
    iterator = iter(loader)
    try:
        batch = next(iterator)
    except StopIteration as err:
        raise ValueError(f"the {step.stage} dataloader is empty; plan='auto' profiles one batch of it") from err
    finally:
        one_shot = iterator is loader
        del iterator  # shuts down its worker processes, if any
    if one_shot and put_back is not None:
        put_back[id(loader)] = itertools.chain([batch], loader)
    return batch


def _apply(loaders: Any, fn: Callable[[Any], Any]) -> Any:
    """``fn`` on every loader of a (possibly nested) list, tuple or dict of loaders."""
    if isinstance(loaders, Mapping):
        return {key: _apply(value, fn) for key, value in loaders.items()}
    if isinstance(loaders, (list, tuple)):
        return type(loaders)(_apply(value, fn) for value in loaders)
    return fn(loaders)


def _flatten(loaders: Any) -> list[Any]:
    """The loaders of a (possibly nested) list, tuple or dict, in order."""
    if isinstance(loaders, Mapping):
        return [x for value in loaders.values() for x in _flatten(value)]
    if isinstance(loaders, (list, tuple)):
        return [x for value in loaders for x in _flatten(value)]
    return [loaders]
