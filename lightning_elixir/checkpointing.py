"""Lightning glue for checkpoint files: saving through the Trainer's checkpoint_io, sharded directories.

``ElixirStrategy`` keeps thin overrides; what they do with Lightning's checkpoint_io plugins lives
here. The file work itself (temporary names, renames, leftovers) is in ``checkpoint_io.py``, the
sharded format in ``runtime/sharded.py``.
"""

from __future__ import annotations

import contextlib
import copy
import os
from collections.abc import Mapping
from typing import Any, Optional

import torch

from lightning.fabric.plugins import TorchCheckpointIO
from lightning.pytorch.plugins.io.wrapper import _WrappingCheckpointIO

from lightning_elixir.checkpoint_io import (AtomicCheckpointIO, checkpoint_dir_problem, made_for_a_probe, remove_dir,
                                           replace_dir, temp_name)
from lightning_elixir.runtime.full_file import Records, drain, filled, write_torch_file
from lightning_elixir.runtime.sharded import AVERAGE_IN_STATE_DICT, load_sharded, read_checkpoint, save_sharded
from lightning_elixir.runtime.state_dict import (check_keys, deferred_records, full_optimizer_state_dict,
                                                 load_full_optimizer_state_dict, load_full_state_dict)


SHARDED_DIR = "_elixir_sharded_dir"
"""A checkpoint dict read from a sharded checkpoint: the directory whose shards load after the hooks."""


class CheckpointSaver:
    """Saves a strategy's checkpoints atomically through the Trainer's checkpoint_io chain."""

    def __init__(self) -> None:
        self.atomic_io = AtomicCheckpointIO()
        self._spliced_into: Optional[_WrappingCheckpointIO] = None
        """The wrapping plugin (AsyncCheckpointIO) whose inner plugin is ``atomic_io`` now."""

    def saving_io(self, io: Any) -> Any:
        """``io`` (the strategy's checkpoint_io) with the AtomicCheckpointIO around the plugin that writes.

        A wrapping plugin (AsyncCheckpointIO) gets it as its inner plugin, so that the rename happens
        in the saving thread after the write; the strategy's own ``checkpoint_io`` stays the user's object.
        See [Note: temporary checkpoint names] in checkpoint_io.py."""
        holder = io if isinstance(io, _WrappingCheckpointIO) else None
        while holder is not None and isinstance(holder.checkpoint_io, _WrappingCheckpointIO):
            holder = holder.checkpoint_io
        base = io if holder is None else holder.checkpoint_io
        if base is not self.atomic_io:
            self.unsplice()
            self.atomic_io.checkpoint_io, self.atomic_io.stream_local = base, type(base) is TorchCheckpointIO
            if holder is not None:
                holder._checkpoint_io = self.atomic_io  # the public setter only fills an empty slot
                self._spliced_into = holder
        return self.atomic_io if holder is None else io

    def save(self, io: Any, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any],
             records: Records) -> None:
        """Rank 0's save: streamed when ``io`` writes plain ``torch.save`` files, else through ``io`` with
        the deferred tensors filled in ([Note: streamed full checkpoints] in runtime/full_file.py)."""
        io = self.saving_io(io)
        if io is self.atomic_io and io.can_stream(filepath, storage_options):
            io.save_streamed(filepath, lambda file: write_torch_file(checkpoint, records, file))
            return
        io.save_checkpoint(filled(checkpoint, records), filepath, storage_options=storage_options)

    def remove(self, io: Any, filepath: Any) -> None:
        """Remove a checkpoint: a local sharded directory through a temporary name (``remove_dir``), so a
        kill never leaves a partial checkpoint under its name; anything else through ``io``."""
        path = os.fspath(filepath)
        local = path.removeprefix("file://") if "://" not in path or path.startswith("file://") else None
        if local is not None and os.path.isdir(local):
            remove_dir(local)
        else:
            io.remove_checkpoint(filepath)

    def unsplice(self) -> None:
        """Give the wrapping plugin that holds the AtomicCheckpointIO its own plugin back."""
        wrapper, self._spliced_into = self._spliced_into, None
        if wrapper is not None and wrapper.checkpoint_io is self.atomic_io:
            wrapper._checkpoint_io = self.atomic_io.checkpoint_io

    def prepare_dirs(self, strategy: Any, trainer: Any) -> None:
        """Fail before any work on a checkpoint directory that cannot be written; clear leftovers of killed saves."""
        dirs = [str(c.dirpath) for c in trainer.checkpoint_callbacks if getattr(c, "dirpath", None)]
        problem = None
        if strategy.is_global_zero:  # the only rank that writes
            problem = next((p for p in map(checkpoint_dir_problem, dirs) if p), None)
            for directory in dirs if problem is None else ():
                self.atomic_io.remove_leftovers(directory)
        problem = strategy.broadcast(problem)  # every rank raises, instead of the others waiting on rank 0
        if not problem and getattr(strategy, "state_dict_type", "full") == "sharded" and strategy.world_size > 1:
            problem = unshared_dirs_problem(strategy, dirs)
        if problem:
            raise ValueError(problem)


def unshared_dirs_problem(strategy: Any, dirs: list[str]) -> Optional[str]:
    """Why a sharded checkpoint cannot be written to ``dirs``: a local directory that some rank does not see as
    rank 0 does (each node of a cluster without a shared file system has its own). Every rank writes its own
    files into the checkpoint directory and rank 0 completes it, so a rank whose files land on another disk
    would leave a directory marked complete without them. Every rank calls this."""
    local = [d.removeprefix("file://") for d in dirs if "://" not in d or d.startswith("file://")]
    if not local:
        return None
    name = strategy.broadcast(temp_name())  # a leftover name: a killed run's probe is swept like a partial save
    with contextlib.ExitStack() as made:
        if strategy.is_global_zero:
            for directory in local:
                made.enter_context(made_for_a_probe(directory))
                with open(os.path.join(directory, name), "wb"):
                    pass
        strategy.barrier()
        sees = all(os.path.exists(os.path.join(directory, name)) for directory in local)
        # also a point that every rank reaches only after looking, so the probe can go
        every = strategy.all_gather(torch.tensor([int(sees)], device=strategy.root_device)).reshape(-1).tolist()
        if strategy.is_global_zero:
            for directory in local:
                with contextlib.suppress(OSError):
                    os.remove(os.path.join(directory, name))
    blind = [rank for rank, seen in enumerate(every) if not seen]
    if not blind:
        return None
    return (f"state_dict_type='sharded' needs a checkpoint directory that every rank sees (a shared file system): "
            f"rank(s) {blind} do not see the files rank 0 writes in {local}, so their shards would be missing from "
            "every checkpoint. Put ModelCheckpoint(dirpath=...) or Trainer(default_root_dir=...) on a file system "
            "shared by all nodes, or use state_dict_type='full' (rank 0 writes one file, as DDP does)")


def save_full_checkpoint(strategy: Any, checkpoint: dict[str, Any], filepath: Any,
                         storage_options: Optional[Any]) -> None:
    """Every rank gathers the checkpoint's deferred tensors chunk by chunk; rank 0 writes them.

    Every rank runs every gather even when rank 0's write fails part way (its error is raised after),
    so that the others are not left waiting in a collective."""
    runtime = strategy.runtime
    records = iter(deferred_records(runtime, strategy.optimizers, checkpoint)
                   if runtime is not None else ())
    try:
        if strategy.is_global_zero:  # as under DDP: rank 0 writes the full checkpoint
            strategy._saver.save(strategy.checkpoint_io, checkpoint, filepath, storage_options, records)
    finally:
        drain(records)


def save_sharded_checkpoint(strategy: Any, checkpoint: dict[str, Any], filepath: Any) -> None:
    """Every rank writes its shards into a temporary directory, which rank 0 then renames into place.

    A killed save leaves only the temporary directory (removed by the next run, like a temporary
    file of a full save); DCP's ``.metadata``, written last, marks a directory complete."""
    path = os.fspath(filepath)
    if "://" in path and not path.startswith("file://"):
        raise ValueError(f"state_dict_type='sharded' writes a local directory, not {path!r}; use "
                         "state_dict_type='full' for remote checkpoint paths")
    parent = os.path.dirname(os.path.abspath(path.removeprefix("file://")))
    os.makedirs(parent, exist_ok=True)
    _check_unedited(checkpoint)
    tmp = strategy.broadcast(os.path.join(parent, temp_name()))
    extra = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
    # Lightning leaves "optimizer_states" out of a weights-only checkpoint (ModelCheckpoint(save_weights_only=True),
    # trainer.save_checkpoint(weights_only=True)): save the model only, as DDP's file holds it.
    weights_only = "optimizer_states" not in checkpoint
    save_sharded(strategy.runtime, strategy.optimizers, tmp, extra, weights_only=weights_only)
    strategy.barrier()
    if strategy.is_global_zero:
        replace_dir(tmp, path.removeprefix("file://"))
    strategy.barrier()


def _check_unedited(checkpoint: dict[str, Any]) -> None:
    """A sharded save writes the model and optimizer state from each rank's shards, under the model's own
    names, and gives ``on_save_checkpoint`` hooks them empty: refuse what the hooks put there rather than
    drop it (a weight-averaging callback's layout is the strategy's own, [Note: sharded weight averaging])."""
    if AVERAGE_IN_STATE_DICT in checkpoint:
        return
    if checkpoint.get("state_dict") or any(checkpoint.get("optimizer_states") or ()):
        raise ValueError("on_save_checkpoint put entries in checkpoint['state_dict'] or ['optimizer_states'], which "
                         "state_dict_type='sharded' writes from each rank's shards under the model's own names (the "
                         "hooks see them empty): edit the state when loading (on_load_checkpoint sees every key), "
                         "or save with state_dict_type='full'")


class StoredInShards:
    """A model entry of a sharded checkpoint, in ``checkpoint["state_dict"]`` while Lightning's
    ``on_load_checkpoint`` hooks run ([Note: loading a sharded checkpoint after the hooks]): its shape
    and dtype, no values. Replace it with a tensor to load that instead, or delete it to keep the
    model's own value (with ``strict_loading=False``), as with a full checkpoint."""

    __slots__ = ("key", "shape", "dtype")

    def __init__(self, key: str, shape: tuple[int, ...], dtype: Any) -> None:
        self.key, self.shape, self.dtype = key, torch.Size(shape), dtype

    def size(self, dim: Optional[int] = None) -> Any:
        return self.shape if dim is None else self.shape[dim]

    def __repr__(self) -> str:
        return f"StoredInShards({self.key!r}, shape={tuple(self.shape)}, dtype={self.dtype})"


class OptimizerStateInShards(dict):
    """``checkpoint["optimizer_states"][k]["state"]`` of a sharded checkpoint while the hooks run: empty, as
    the per-element state is read from the shards after them (into this rank's views)."""


def sharded_checkpoint_for_hooks(path: str, fitting: bool) -> dict[str, Any]:
    """What Lightning's hooks see of the sharded checkpoint in ``path`` before it is loaded: every ``state_dict``
    key with its shape and dtype, and each optimizer's param groups (hyperparameters they may change; restored
    only to fit, as Lightning does), with the directory to load from after them under ``SHARDED_DIR``. The
    directory is checked whole now, before any hook runs."""
    meta, stored = read_checkpoint(path)
    shapes, entries = meta["shapes"], stored.state_dict_metadata
    state_dict: dict[str, Any] = {}
    for key, name in meta["keys"]:
        entry = entries.get(f"model.{name or key}")
        if entry is None:  # a module's extra state (get_extra_state), stored in the meta file: given as it is
            state_dict[key] = meta["objects"][key]
            continue
        shape = shapes.get(name, tuple(getattr(entry, "size", ())))
        state_dict[key] = StoredInShards(key, shape, entry.properties.dtype)
    if meta.get("weights_only"):  # no optimizer state, so that a resume fails with Lightning's own error, as with DDP's
        return {**meta["extra"], "state_dict": state_dict, SHARDED_DIR: path}
    optimizer_states = [{"state": OptimizerStateInShards(), "param_groups": copy.deepcopy(o["param_groups"])}
                        for o in meta["optimizers"]] if fitting else []
    return {**meta["extra"], "state_dict": state_dict, "optimizer_states": optimizer_states, SHARDED_DIR: path}


def load_model(runtime: Any, checkpoint: Mapping[str, Any], strict: bool) -> None:
    """Load the model from a checkpoint as it stands after Lightning's hooks: a full file's state dict, or
    what ``sharded_checkpoint_for_hooks`` read."""
    if checkpoint.get(SHARDED_DIR):
        load_sharded_model(runtime, checkpoint, checkpoint[SHARDED_DIR], strict)
    else:
        load_full_state_dict(runtime, checkpoint["state_dict"], strict=strict)


def load_optimizers(runtime: Any, optimizers: list[Any], checkpoint: Mapping[str, Any]) -> None:
    """Load the optimizers' state from a checkpoint as it stands after Lightning's hooks."""
    states = checkpoint.get("optimizer_states", [])
    if len(states) != len(optimizers):
        raise ValueError(f"the checkpoint has {len(states)} optimizer states but {len(optimizers)} optimizers "
                         "are configured")
    if checkpoint.get(SHARDED_DIR):
        load_sharded_optimizers(runtime, optimizers, states, checkpoint[SHARDED_DIR])
        return
    for optimizer, state in zip(optimizers, states):
        if optimizer.param_groups:  # Lightning's stand-in for "no optimizer" has nothing to load
            load_full_optimizer_state_dict(runtime, optimizer, state)


def optimizer_state_after_fit(finished: Any, optimizer: Any) -> dict[str, Any]:
    """``trainer.save_checkpoint`` after fit: ``optimizer``'s state gathered from the shards of the finished fit's
    runtime (on rank 0, which writes the file), every rank calling it as Lightning does."""
    if finished is None or not any(o is optimizer for o in finished.optimizers):
        return optimizer.state_dict()  # not sharded by this strategy
    if finished.offload.nvme:
        raise ValueError("the optimizer state of chunks on NVMe was removed with their files when fit ended: save "
                         "a checkpoint with it during fit (ModelCheckpoint, or trainer.save_checkpoint in "
                         "on_train_end), or save the weights only (trainer.save_checkpoint(path, weights_only=True))")
    return full_optimizer_state_dict(finished, optimizer)


def load_sharded_model(runtime: Any, checkpoint: dict[str, Any], path: str, strict: bool) -> None:
    """Load the model from a sharded checkpoint as ``checkpoint["state_dict"]`` stands after Lightning's hooks.

    [Note: loading a sharded checkpoint after the hooks]
    A full checkpoint's ``on_load_checkpoint`` hooks may change ``checkpoint["state_dict"]`` before the
    model loads it (a new head's weights put in, a head of another shape deleted for ``strict_loading=False``)
    and the optimizers' ``param_groups`` before they load them (a new learning rate). A sharded checkpoint
    gives the hooks the same dict (``sharded_checkpoint_for_hooks``): every key, its value a ``StoredInShards``
    (shape and dtype), and each optimizer's param groups, and reads the shards only after them: the keys
    still stored load from the shards, tensors the hooks put in load as from a full file, keys they deleted
    keep the model's own values (or raise under strict loading, as ``load_state_dict`` does), and the
    optimizers' state loads with the param groups as the hooks left them. Replacing an optimizer's per-element
    ``state`` itself is refused: it is read from the shards into this rank's views.
    """
    state_dict = checkpoint["state_dict"]
    model_keys = set(runtime.module.state_dict(keep_vars=True))
    if strict:
        check_keys(model_keys, state_dict)
    stored = {k for k, v in state_dict.items() if isinstance(v, StoredInShards) and k in model_keys}
    load_sharded(runtime, [], path, only=stored)
    given = {k: v for k, v in state_dict.items() if not isinstance(v, StoredInShards)}
    if given:
        load_full_state_dict(runtime, given, strict=False)


def load_sharded_optimizers(runtime: Any, optimizers: list[Any], states: list[dict[str, Any]], path: str) -> None:
    """Load the optimizers' state from a sharded checkpoint with the param groups the hooks left
    ([Note: loading a sharded checkpoint after the hooks])."""
    for k, state in enumerate(states):
        if not isinstance(state.get("state"), OptimizerStateInShards) or state["state"]:
            raise ValueError(f"on_load_checkpoint replaced checkpoint['optimizer_states'][{k}]['state'], which a "
                             "sharded checkpoint reads from its shards into this rank's views: change the param "
                             "groups' hyperparameters there, or save with state_dict_type='full' to edit the state")
    load_sharded(runtime, optimizers, path, model=False, param_groups=[state["param_groups"] for state in states])
