"""Lightning's weight-averaging callbacks on sharded parameters: EMA and SWA kept sharded.

[Note: sharded weight averaging]
``EMAWeightAveraging`` (any ``WeightAveraging``) and ``StochasticWeightAveraging`` keep a full copy
of the module (``AveragedModel``, a deep copy) and read and write the module's parameters after
the optimizer step, outside the training step, where each rank holds only its shard. Lightning
refuses them for FSDP and DeepSpeed. Under this strategy they work unchanged: when fit sets up,
the strategy gives each such callback a ``ShardedAverage`` in place of its copy, and its methods
that touch parameters run on shards:

- The average is a companion of the masters ([Note: companion shards] in runtime/runtime.py):
  this rank's shard of every chunk, where the chunk's master lives (the host for offloaded
  chunks), or on the callback's ``device``. The deep copy the callback made goes.
- An update applies the callback's own averaging function (``avg_fn``/``multi_avg_fn``, EMA's or
  SWA's) to each chunk's average shard and master shard. The functions are elementwise, so every
  element gets what it gets under DDP. Buffers, which every rank holds whole, are averaged (or
  copied, ``use_buffers=False``) whole, as ``AveragedModel`` does.
- Swapping for validation and copying the average in at the end exchange the shards with the
  masters and renew what is gathered, like loading a state dict.
- Checkpoints hold the average as Lightning's callbacks lay it out: for ``WeightAveraging`` the
  averaged weights under ``state_dict`` and the trained ones under ``current_model_state``; for
  SWA the average model's state inside the callback's state. In a full checkpoint the averaged
  parameters are gathered while the file is written (deferred tensors); in a sharded one each rank
  writes its shards, resharded on load like the masters.
- A plan switch (self-correction) carries the average with the masters.
"""

from __future__ import annotations

import itertools
import logging
from typing import Any, Callable, Optional

import torch
from lightning.pytorch.callbacks import StochasticWeightAveraging
from torch.optim.swa_utils import get_swa_avg_fn, get_swa_multi_avg_fn
from torch.utils._foreach_utils import _get_foreach_kernels_supported_devices

from lightning_elixir.runtime.full_file import DeferredTensor
from lightning_elixir.runtime.sharded import AVERAGE_IN_STATE_DICT
from lightning_elixir.runtime.state_dict import load_full_state_dict, load_own_pieces

try:  # Lightning >= 2.6
    from lightning.pytorch.callbacks import WeightAveraging
except ImportError:  # pragma: no cover - older Lightning has SWA only
    WeightAveraging = None  # type: ignore[assignment,misc]

log = logging.getLogger(__name__)

_PATCHED = ("_swap_models", "_copy_average_to_current", "on_save_checkpoint", "on_load_checkpoint",
            "update_parameters", "transfer_weights")


class ShardedAverage:
    """The averaged weights of one callback, sharded like the masters ([Note: sharded weight averaging]).

    Args:
        strategy: the ElixirStrategy (its runtime may be replaced by a plan switch: read each time).
        name: the companion's name in the runtime.
        prefix: what the averaged parameters' keys start with in ``state_dict()`` (``"module."`` as
            ``AveragedModel``'s; ``""`` for SWA's copy of the LightningModule).
        avg_fn, multi_avg_fn, use_buffers: as ``torch.optim.swa_utils.AveragedModel``'s.
        device: where the shards live (default: where each chunk's master lives).
    """

    def __init__(self, strategy: Any, name: str, prefix: str, avg_fn: Optional[Callable] = None,
                 multi_avg_fn: Optional[Callable] = None, use_buffers: bool = False,
                 device: Optional[torch.device] = None) -> None:
        self.strategy, self.name, self.prefix = strategy, name, prefix
        self.avg_fn, self.multi_avg_fn, self.use_buffers = avg_fn, multi_avg_fn, use_buffers
        runtime = strategy.runtime
        runtime.add_companion(name, device)
        self.buffers = {k: b.detach().clone() for k, b in runtime.module.named_buffers()}
        self.n_averaged = torch.tensor(0, dtype=torch.long)

    # ---- the callbacks' uses ----------------------------------------------------------------------

    @property
    def runtime(self) -> Any:
        return self.strategy.runtime

    def to(self, *args: Any, **kwargs: Any) -> ShardedAverage:
        """SWA moves its copy to the device when averaging starts: the shards already are where they belong."""
        return self

    def update_parameters(self, module: Any = None) -> None:
        """``AveragedModel.update_parameters``: average this step's weights in (the first update copies)."""
        self.average(self.n_averaged, self.avg_fn, self.multi_avg_fn, buffers=self.use_buffers)
        if not self.use_buffers:
            for key, buffer in self._module_buffers().items():
                self.buffers[key].copy_(buffer)
        self.n_averaged += 1

    def average(self, n_averaged: torch.Tensor, avg_fn: Optional[Callable], multi_avg_fn: Optional[Callable],
                buffers: bool) -> None:
        """Average the masters (and, with ``buffers``, the module's buffers) into the shards: a copy
        when ``n_averaged`` is 0, else ``multi_avg_fn`` or ``avg_fn`` as ``AveragedModel`` applies them."""
        runtime = self.runtime
        runtime.offload.settle()
        own = self._module_buffers() if buffers else {}
        pairs = [(self.buffers[k], b) for k, b in own.items()]
        with torch.no_grad():
            for chunk, shard in zip(runtime.chunks, runtime.companions[self.name]):
                with runtime.offload.resident(chunk):
                    _apply(n_averaged, avg_fn, multi_avg_fn, [(shard, chunk.master.to(shard.device))])
            _apply(n_averaged, avg_fn, multi_avg_fn, pairs)

    def swap(self) -> None:
        """Exchange the averaged and the trained weights and buffers, for validation."""
        self._exchange(swap=True, buffers=True)

    def copy_to_module(self, buffers: bool = True) -> None:
        """Make the averaged weights (and ``buffers``) the module's, as at the end of training."""
        self._exchange(swap=False, buffers=buffers)

    def _exchange(self, swap: bool, buffers: bool) -> None:
        runtime = self.runtime
        runtime.offload.settle()
        runtime.release_all()  # what is gathered holds the old values; written back first
        with torch.no_grad():
            for chunk, shard in zip(runtime.chunks, runtime.companions[self.name]):
                with runtime.offload.resident(chunk, write=True):
                    _exchange(chunk.master, shard, swap)
                    chunk.refresh_shard()
            for key, buffer in self._module_buffers().items() if buffers else ():
                _exchange(buffer, self.buffers[key], swap)

    def _module_buffers(self) -> dict[str, torch.Tensor]:
        return {k: b for k, b in self.runtime.module.named_buffers() if k in self.buffers}

    # ---- checkpoints ------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """``AveragedModel.state_dict()``'s keys: averaged parameters (deferred tensors in a full
        checkpoint; in a sharded one each rank writes its shards instead), buffers, ``n_averaged``."""
        out: dict[str, Any] = {}
        if self.strategy.state_dict_type != "sharded":
            made: dict[int, DeferredTensor] = {}  # tied parameters share one, as they share a tensor
            names = self.runtime.module.state_dict(keep_vars=True)
            chunked = self.runtime.param_ids()
            for key, value in names.items():
                if id(value) in chunked:
                    if id(value) not in made:
                        chunk, slot = self.runtime.where(value)
                        made[id(value)] = DeferredTensor(("companion", self.name, id(value)), slot.shape,
                                                         chunk.master.dtype)
                    out[self.prefix + key] = made[id(value)]
        for key, buffer in self.buffers.items():
            out[self.prefix + key] = buffer.detach().cpu().clone()
        if self.prefix:  # AveragedModel's own buffer; SWA counts in the callback
            out["n_averaged"] = self.n_averaged.clone()
        return out

    def load_state_dict(self, state: dict[str, Any], strict: bool = True) -> None:
        """Load what ``state_dict()`` (or ``AveragedModel.state_dict()``) holds: full tensors of the
        averaged parameters, when present, are cut into this rank's shards."""
        runtime = self.runtime
        if "n_averaged" in state:
            self.n_averaged.copy_(state["n_averaged"])
        own = {key[len(self.prefix):]: value for key, value in state.items() if key.startswith(self.prefix)}
        for key, value in own.items():
            if key in self.buffers and isinstance(value, torch.Tensor):
                self.buffers[key].copy_(value)
        module_state = runtime.module.state_dict(keep_vars=True)
        source = {id(v): own[k] for k, v in module_state.items()
                  if k in own and isinstance(own[k], torch.Tensor) and id(v) in runtime.param_ids()}
        if not source:
            return  # a sharded checkpoint: the shards were loaded with the masters
        runtime.offload.settle()
        with torch.no_grad():
            for chunk, shard in zip(runtime.chunks, runtime.companions[self.name]):
                load_own_pieces(chunk, shard, source)

    def reset_from_module(self) -> None:
        """Start the average from the module's current weights (a checkpoint without an average)."""
        self.n_averaged.zero_()
        runtime = self.runtime
        with torch.no_grad():
            for chunk, shard in zip(runtime.chunks, runtime.companions[self.name]):
                with runtime.offload.resident(chunk):
                    shard.copy_(chunk.master)
            for key, buffer in self._module_buffers().items():
                self.buffers[key].copy_(buffer)


def _apply(n_averaged: torch.Tensor, avg_fn: Optional[Callable], multi_avg_fn: Optional[Callable],
           pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """One ``AveragedModel.update_parameters`` over (average, current) pairs of one device and dtype each."""
    if not pairs:
        return
    if int(n_averaged) == 0:
        for averaged, current in pairs:
            averaged.copy_(current)
        return
    groups: dict[tuple[torch.device, torch.dtype], list[tuple[torch.Tensor, torch.Tensor]]] = {}
    for averaged, current in pairs:
        groups.setdefault((averaged.device, averaged.dtype), []).append((averaged, current.to(averaged.device)))
    for (device, _), members in groups.items():
        averaged, current = [a for a, _ in members], [c for _, c in members]
        n = n_averaged.to(device)
        if multi_avg_fn is not None:
            multi_avg_fn(averaged, current, n)
        elif avg_fn is not None:
            for a, c in members:
                a.copy_(avg_fn(a, c, n))
        elif device.type in _get_foreach_kernels_supported_devices():
            get_swa_multi_avg_fn()(averaged, current, n)
        else:
            swa = get_swa_avg_fn()
            for a, c in members:
                a.copy_(swa(a, c, n))


def _exchange(live: torch.Tensor, kept: torch.Tensor, swap: bool) -> None:
    """``live`` takes ``kept``'s values; with ``swap`` ``kept`` takes ``live``'s."""
    if swap:
        old = live.detach().clone()
        live.copy_(kept)
        kept.copy_(old)
    else:
        live.copy_(kept)


# ---- the callbacks ----------------------------------------------------------------------------------

def averaging_callbacks(trainer: Any) -> list[Any]:
    """The trainer's weight-averaging callbacks this module runs sharded."""
    kinds = tuple(k for k in (WeightAveraging, StochasticWeightAveraging) if k is not None)
    return [cb for cb in trainer.callbacks if isinstance(cb, kinds)]


def install_averages(strategy: Any, trainer: Any) -> list[Any]:
    """Give every weight-averaging callback of ``trainer`` a sharded average ([Note: sharded weight
    averaging]); returns the callbacks, for ``remove_averages``."""
    callbacks = averaging_callbacks(trainer)
    for i, cb in enumerate(callbacks):
        name = f"average{i}"
        if isinstance(cb, StochasticWeightAveraging):
            _install_swa(strategy, cb, name)
        else:
            _install_weight_averaging(strategy, cb, name)
    return callbacks


def remove_averages(callbacks: list[Any]) -> None:
    """The callbacks' own methods back; the average goes with the runtime (the module holds it if
    training ended: ``on_train_end`` copied it in)."""
    for cb in callbacks:
        for attr in _PATCHED:
            cb.__dict__.pop(attr, None)
        if isinstance(cb._average_model, ShardedAverage):
            cb._average_model = None


def _device(cb: Any) -> Optional[torch.device]:
    device = getattr(cb, "_device", None)
    return torch.device(device) if device is not None else None


def _install_weight_averaging(strategy: Any, cb: Any, name: str) -> None:
    copy = cb._average_model
    if copy is None:
        return  # not set up for fit
    average = ShardedAverage(strategy, name, "module.", avg_fn=copy.avg_fn, multi_avg_fn=copy.multi_avg_fn,
                             use_buffers=copy.use_buffers, device=_device(cb))
    cb._average_model = average  # the callback's deep copy goes
    cb._swap_models = lambda pl_module: average.swap()
    cb._copy_average_to_current = lambda pl_module: average.copy_to_module()

    def on_save_checkpoint(trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        state = average.state_dict()
        checkpoint["current_model_state"] = checkpoint["state_dict"]
        checkpoint["state_dict"] = {k[len("module."):]: v for k, v in state.items() if k.startswith("module.")}
        checkpoint["averaging_state"] = {k: v for k, v in state.items() if not k.startswith("module.")}
        if strategy.state_dict_type == "sharded":  # the shards go with the masters; the buffers with the rest
            checkpoint["averaging_state"].update({k: v for k, v in state.items() if k.startswith("module.")})
            checkpoint[AVERAGE_IN_STATE_DICT] = average.name

    def on_load_checkpoint(trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        if "current_model_state" in checkpoint and "averaging_state" in checkpoint:
            average.load_state_dict({**{"module." + k: v for k, v in checkpoint["state_dict"].items()},
                                     **checkpoint["averaging_state"]})
            if checkpoint["current_model_state"]:  # a full checkpoint: the model got the average first
                load_full_state_dict(strategy.runtime, checkpoint["current_model_state"])
        else:
            log.warning("The checkpoint was not created with weight averaging: the average starts from the "
                        "loaded weights.")
            average.reset_from_module()

    cb.on_save_checkpoint = on_save_checkpoint
    cb.on_load_checkpoint = on_load_checkpoint


def _install_swa(strategy: Any, cb: StochasticWeightAveraging, name: str) -> None:
    average = ShardedAverage(strategy, name, "", device=_device(cb))
    cb._average_model = average  # the callback's deep copy goes

    def update_parameters(average_model: Any, model: Any, n_averaged: torch.Tensor, avg_fn: Callable) -> None:
        average_model.average(n_averaged, avg_fn, None, buffers=False)
        n_averaged += 1

    cb.update_parameters = update_parameters
    # SWA's transfer copies the parameters only: the module keeps its buffers (BatchNorm statistics,
    # which SWA then recomputes with a pass over the data)
    cb.transfer_weights = lambda src, dst: src.copy_to_module(buffers=False)
