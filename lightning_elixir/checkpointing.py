"""Lightning glue for checkpoint files: saving through the Trainer's checkpoint_io, sharded directories.

``ElixirStrategy`` keeps thin overrides; what they do with Lightning's checkpoint_io plugins lives
here. The file work itself (temporary names, renames, leftovers) is in ``checkpoint_io.py``, the
sharded format in ``runtime/sharded.py``.
"""

from __future__ import annotations

import os
from typing import Any, Optional

from lightning.fabric.plugins import TorchCheckpointIO
from lightning.pytorch.plugins.io.wrapper import _WrappingCheckpointIO

from lightning_elixir.checkpoint_io import AtomicCheckpointIO, checkpoint_dir_problem, remove_dir, replace_dir, temp_name
from lightning_elixir.runtime.full_file import Records, drain, filled, write_torch_file
from lightning_elixir.runtime.sharded import save_sharded
from lightning_elixir.runtime.state_dict import deferred_records


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
        if problem:
            raise ValueError(problem)


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
    tmp = strategy.broadcast(os.path.join(parent, temp_name()))
    extra = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
    save_sharded(strategy.runtime, strategy.optimizers, tmp, extra)
    strategy.barrier()
    if strategy.is_global_zero:
        replace_dir(tmp, path.removeprefix("file://"))
    strategy.barrier()
