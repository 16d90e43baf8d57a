"""What ElixirStrategy refuses before any work, each refusal saying what to do instead.

At construction, every argument that can be checked without the model, the devices or the process
group, so that a mistake fails before launch and profiling; at setup, the Trainer options that cannot
work on sharded parameters, before the module is chunked.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any, Optional, Union

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.callbacks import ModelPruning

from lightning_elixir.profile.types import HardwareProfile
from lightning_elixir.runtime.collectives import DEFAULT_TIMEOUT_S, Group
from lightning_elixir.search.budget import check_memory_limit
from lightning_elixir.search.calibrate import SelfCorrection

START_METHODS = ("popen", "fork", "spawn", "forkserver")
"""How the ranks of one machine start: a script run per rank (as DDP's default), or Lightning's multiprocessing."""


# ---- construction ---------------------------------------------------------------------------------


def check_start_method(start_method: Any) -> str:
    if not isinstance(start_method, str) or start_method not in START_METHODS:
        raise ValueError(f"start_method={start_method!r}: use 'popen' (a script run once per rank; torchrun, "
                         "SLURM), 'fork' (a notebook), 'spawn' or 'forkserver'")
    return start_method


def planning_limit(name: str, limit: Union[int, float, str, None], fixed: Optional[str]) -> Union[int, float, str, None]:
    """A memory limit that only plan="auto" uses: its form checked, refused with a fixed plan (``fixed`` names it)."""
    if limit is None:
        return None
    check_memory_limit(limit, name)
    if fixed:
        raise ValueError(f"{name}={limit!r} is used by plan='auto' to choose a plan and has no effect on {fixed}: "
                         "remove it, or use plan='auto'")
    return limit


def read_hardware_profile(profile: Union[HardwareProfile, str, os.PathLike, None],
                     fixed: Optional[str]) -> Optional[HardwareProfile]:
    """The profile to plan with, read now from its JSON file if given one (a bad file fails now, not after
    launch); refused with a fixed plan (``fixed`` names it)."""
    if profile is None:
        return None
    if fixed:
        raise ValueError(f"hardware_profile is used by plan='auto' to choose a plan and has no effect on "
                         f"{fixed}: remove it, or use plan='auto'")
    if isinstance(profile, (str, os.PathLike)):
        return HardwareProfile.from_json(profile)
    if not isinstance(profile, HardwareProfile):
        raise TypeError(f"hardware_profile must be a HardwareProfile or the path of its JSON file, "
                        f"got {type(profile).__name__}")
    return profile


def check_state_dict_type(state_dict_type: Any) -> str:
    if state_dict_type not in ("full", "sharded"):
        raise ValueError(f"state_dict_type={state_dict_type!r}: use 'full' (one file) or 'sharded' (a directory "
                         "each rank writes its shards to)")
    return state_dict_type


def collective_timeout(process_group_backend: Optional[str], timeout: Optional[timedelta],
                       collective_timeout_s: Optional[float]) -> float:
    """The longest wait for one of Elixir's collectives, once the process group's options are checked:
    ``collective_timeout_s``, else a ``timeout`` the user chose (it must not be cut short), else 600 s."""
    if process_group_backend is not None and (not isinstance(process_group_backend, str)
                                              or not process_group_backend.strip()):
        raise ValueError(f"process_group_backend={process_group_backend!r}: use a torch.distributed backend "
                         "name such as 'nccl' or 'gloo', or None for the device's default")
    if timeout is not None and (not isinstance(timeout, timedelta) or timeout <= timedelta(0)):
        raise ValueError(f"timeout={timeout!r}: use a positive datetime.timedelta, e.g. timedelta(minutes=30)")
    if collective_timeout_s is None:
        chose = timeout is not None and timeout != default_pg_timeout
        collective_timeout_s = timeout.total_seconds() if chose else DEFAULT_TIMEOUT_S
    Group(None, 0, 1, collective_timeout_s)  # validates it
    return collective_timeout_s


def check_flags(**flags: Any) -> None:
    """Options that are True or False, nothing else (a string "false" would read as true)."""
    for flag, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"{flag} must be True or False, got {value!r}")


def check_updates_in_backward(value: Any) -> Optional[bool]:
    if value not in (None, True, False):
        raise TypeError(f"updates_in_backward must be None, True or False, got {value!r}")
    return value


def check_replan(value: Any) -> Union[bool, SelfCorrection]:
    if not isinstance(value, (bool, SelfCorrection)):
        raise TypeError(f"replan must be True, False or a SelfCorrection, got {value!r}")
    return value


# ---- setup ----------------------------------------------------------------------------------------


def refuse_graph_logging(trainer: Any) -> None:
    """Refuse a logger that would trace the model on rank 0 alone (``log_graph=True``)."""
    for logger in trainer.loggers:
        if getattr(logger, "_log_graph", False):
            raise ValueError(f"{type(logger).__name__}(log_graph=True) traces the model on rank 0 alone, where the "
                             "Elixir strategy holds only this rank's shard of each chunk and gathering needs every "
                             "rank: set log_graph=False (log the graph from a run on one device, with "
                             "strategy='auto', if you need it)")


def refuse_unsupported_callbacks(trainer: Any) -> None:
    """Refuse Lightning callbacks that cannot work on sharded parameters, saying what works."""
    for cb in trainer.callbacks:
        name = type(cb).__name__
        if isinstance(cb, ModelPruning):
            raise ValueError(
                f"{name} does not work with the Elixir strategy: it ranks and masks the parameters at epoch ends, "
                "outside the training step, where each rank holds only its shard. Prune in a callback of your own "
                "(its on_train_epoch_end, say) with torch.nn.utils.prune inside `with "
                "trainer.strategy.gathered_params():`, entered on every rank, or prune before fit.")


def apply_layer_sync(layer_sync: Any, module: Any, device: torch.device) -> Any:
    """``Trainer(sync_batchnorm=True)``'s conversion of ``module``, as DDP applies it. torch's SyncBatchNorm is refused
    on the CPU, as DDP refuses it there (its training forward raises), with the module given back."""
    module = layer_sync.apply(module)
    if device.type == "cpu" and any(isinstance(m, torch.nn.SyncBatchNorm) for m in module.modules()):
        layer_sync.revert(module)
        raise ValueError("Trainer(sync_batchnorm=True) converts the BatchNorm layers to torch.nn.SyncBatchNorm, whose "
                         "training forward runs on GPUs only (DDP refuses it on the CPU too): remove "
                         "sync_batchnorm=True for a CPU run, or run on GPUs")
    return module
