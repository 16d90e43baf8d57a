"""Sharded checkpoints: every rank writes and reads only its own pieces, in torch.distributed.checkpoint format.

[Note: sharded checkpoint format]
A checkpoint is a torch.distributed.checkpoint (DCP) directory:

    <dir>/__<rank>_0.distcp   each rank's pieces of the masters and per-element optimizer state
    <dir>/elixir_meta.pt      rank 0: names, shapes, optimizer param groups and scalar state, ``extra``
    <dir>/.metadata           DCP's index of every piece, written last (the completeness marker)

Every parameter, and every per-element optimizer state of it (``exp_avg``), is stored under its
original name as one flat tensor of the parameter's numel: ``model.<name>`` and
``optim.<i>.state.<param index>.<key>``. A rank owns the contiguous piece of it that falls in its
shard of the chunk, so each tensor is a ``ShardedTensor`` whose shard metadata lists every rank's
piece; a rank that owns none of a parameter contributes no shard. Every rank computes that
metadata from the layout it already knows, so building the tensors needs no collective.
Tied parameters appear once (their first name); the meta file maps every ``state_dict()`` key to
the stored name. Buffers are rank 0's, stored whole. A runtime's companions (averaged weights,
[Note: companion shards] in runtime.py) are stored like the masters, as ``companion.<name>.<param>``.

Loading builds the same keys for the current layout, which may differ in world size, chunk size,
cache and placement, and lets ``dcp.load`` read each local piece from whichever saved pieces
overlap it: resharding is DCP's.

The meta file is written by rank 0 after every rank has written its pieces and just before
``.metadata`` (both inside DCP's final step), and a save first removes a stale ``.metadata``.
A directory without ``.metadata`` is therefore an unfinished save and is refused. The directory
must be visible to every rank (as DCP requires).
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterator, Sequence, Set as AbstractSet
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardedTensorMetadata, TensorProperties
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.optim import Optimizer

from lightning_elixir.runtime.chunk import Chunk, Slot
from lightning_elixir.runtime.state_dict import (agree_scalar_state, extra_state_modules, is_per_element,
                                                 note_replicated, optimizer_views, replicated_keys)

META_FILE = "elixir_meta.pt"
DCP_METADATA = ".metadata"
FORMAT = "lightning_elixir.sharded/1"
AVERAGE_IN_STATE_DICT = "elixir_average_in_state_dict"
"""``extra`` key: the companion that a full checkpoint holds as its ``state_dict`` (a weight-averaging
callback's average; the masters go under ``current_model_state``). Conversion to a full file lays it out so."""

PathLike = Union[str, os.PathLike]


class ShardedCheckpointError(RuntimeError):
    """A directory that is not a complete sharded checkpoint, or one that does not fit the model."""


# ---- layout ---------------------------------------------------------------------------------------

def rank_pieces(offset: int, numel: int, shard_numel: int) -> list[tuple[int, int, int]]:
    """(rank, begin, end) of every non-empty piece of a parameter at ``[offset, offset + numel)`` of a
    chunk split into shards of ``shard_numel``; begin and end count the parameter's flat elements."""
    if numel == 0:
        return []
    first, last = offset // shard_numel, (offset + numel - 1) // shard_numel
    return [(r, max(offset, r * shard_numel) - offset, min(offset + numel, (r + 1) * shard_numel) - offset)
            for r in range(first, last + 1)]


def _flat(runtime, chunk: Chunk, slot: Slot, local: torch.Tensor) -> torch.Tensor:
    """The parameter-sized flat tensor of which ``local`` is this rank's piece (a ShardedTensor over ranks)."""
    group = runtime.group
    pieces = rank_pieces(slot.offset, slot.numel, chunk.shard_numel)
    if group.world_size == 1 or not pieces:
        return local
    device = local.device
    ranks = dist.get_process_group_ranks(group.pg) if group.pg is not None else list(range(group.world_size))
    metas = [ShardMetadata([b], [e - b], f"rank:{ranks[r]}/{device}") for r, b, e in pieces]
    mine = [(m, b, e) for (r, b, e), m in zip(pieces, metas) if r == group.rank]
    assert all(e - b == local.numel() for _, b, e in mine), f"{slot.name}: piece does not match the shard"
    properties = TensorProperties(dtype=local.dtype, pin_memory=bool(mine) and local.is_pinned())
    # Built from metadata every rank computes alike: no collective per tensor (init_from_local_shards
    # would all-gather the shard metadata of each one).
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        [Shard(local, m) for m, _, _ in mine], ShardedTensorMetadata(metas, torch.Size([slot.numel]), properties),
        process_group=group.pg)


def _own_piece(chunk: Chunk, slot: Slot, shard_tensor: torch.Tensor) -> torch.Tensor:
    begin, end = chunk.shard_range(slot)
    return shard_tensor[begin:end]


def _is_nvme(chunk: Chunk) -> bool:
    return chunk.placement == "nvme"


# ---- save -------------------------------------------------------------------------------------------

def save_sharded(runtime, optimizers: Sequence[Optimizer], path: PathLike, extra: Optional[dict] = None,
                 weights_only: bool = False) -> None:
    """Write a sharded checkpoint of the model, its buffers and ``optimizers``; every rank calls it.

    Each rank writes its own pieces, in parallel; device and host masters are written from where
    they are. NVMe-placed chunks are paged in one at a time and their pieces copied to host memory
    until the write is done (DCP writes one state dict at once).

    Args:
        runtime: the ``ElixirRuntime`` whose masters are saved.
        optimizers: optimizers set up by ``shard_optimizer`` on this runtime.
        path: the checkpoint directory (created; a checkpoint in it is replaced).
        extra: picklable metadata kept as is (Lightning's epoch, loops, callbacks, hyperparameters).
        weights_only: the model only (``optimizers`` are not saved): loading and ``convert`` then give no
            optimizer states, as Lightning's weights-only checkpoint has none.
    """
    path = os.fspath(path)
    optimizers = () if weights_only else optimizers
    runtime.offload.settle()
    for optimizer in optimizers:
        agree_scalar_state(runtime, optimizer)
    states = [optimizer.state_dict() for optimizer in optimizers]  # live per-parameter dicts (NVMe binds into them)
    entries = [optimizer_views(runtime, optimizer) for optimizer in optimizers]
    tensors: dict[str, Any] = {}
    whole = [[replicated_keys(optimizer, i) for i in range(len(views))] for optimizer, views in zip(optimizers, entries)]
    for chunk in runtime.chunks:
        with runtime.offload.resident(chunk):
            tensors.update(_chunk_tensors(runtime, chunk, states, entries, whole))
    if runtime.group.rank == 0:
        tensors.update({f"model.{k}": v.detach() for k, v in _buffers(runtime).items()})
    meta = _describe(runtime, states, entries, whole, extra or {})
    if weights_only:
        meta["weights_only"] = True
    os.makedirs(path, exist_ok=True)
    with _quiet_dcp():
        dcp.save(tensors, storage_writer=_Writer(path, meta), process_group=runtime.group.pg,
                 no_dist=not _distributed())


def _chunk_tensors(runtime, chunk: Chunk, states: list[dict], entries: list[list],
                   whole: list[list[AbstractSet[str]]]) -> dict[str, torch.Tensor]:
    """This rank's pieces of one chunk's masters and per-element optimizer state, under their keys
    (``whole``: per optimizer and parameter, the state keys held whole, ``replicated_keys``)."""
    copy = _is_nvme(chunk)  # the page goes back when the chunk leaves memory
    out = {}
    for slot in chunk.slots:
        piece = _own_piece(chunk, slot, chunk.master).detach()
        out[f"model.{slot.name}"] = _flat(runtime, chunk, slot, piece.clone() if copy else piece)
        for name, shards in runtime.companions.items():
            piece = _own_piece(chunk, slot, shards[chunk.index]).detach()
            out[f"companion.{name}.{slot.name}"] = _flat(runtime, chunk, slot, piece)
    for k, (state, views) in enumerate(zip(states, entries)):
        for i, (owner, slot, view) in enumerate(views):
            if owner is not chunk or i not in state["state"]:
                continue
            for key, value in state["state"][i].items():
                if is_per_element(key, value, view.shape, whole[k][i]):
                    value = value.detach()
                    out[f"optim.{k}.state.{i}.{key}"] = _flat(runtime, chunk, slot, value.clone() if copy else value)
    return out


def _buffers(runtime) -> dict[str, torch.Tensor]:
    """The module's state-dict tensors that are not chunked parameters, nor a module's extra state."""
    chunked, extra = runtime.param_ids(), extra_state_modules(runtime.module)
    return {k: v for k, v in runtime.module.state_dict(keep_vars=True).items()
            if isinstance(v, torch.Tensor) and id(v) not in chunked and k not in extra}


def _describe(runtime, states: list[dict], entries: list[list], whole: list[list[AbstractSet[str]]],
              extra: dict) -> dict[str, Any]:
    """What the meta file holds: everything but the tensors DCP stores."""
    names = {id(s.param): s.name for c in runtime.chunks for s in c.slots}
    own = runtime.module.state_dict(keep_vars=True)
    extra_state = extra_state_modules(runtime.module)  # [Note: extra state] in state_dict.py: stored as objects
    optimizers = []
    for state, views, held_whole in zip(states, entries, whole):
        flat, values = {}, {}
        for i, per_param in state["state"].items():
            view = views[i][2]
            flat[i] = sorted(k for k, v in per_param.items() if is_per_element(k, v, view.shape, held_whole[i]))
            values[i] = {k: _cpu_copy(v) for k, v in per_param.items() if k not in flat[i]}
        optimizers.append({"params": [slot.name for _, slot, _ in views], "param_groups": state["param_groups"],
                           "flat": flat, "values": values})
    return {
        "format": FORMAT,
        "world_size": runtime.group.world_size,
        "shapes": {s.name: tuple(s.shape) for c in runtime.chunks for s in c.slots},
        "keys": [(k, names.get(id(v))) for k, v in own.items()],
        "objects": {k: _cpu_copy(v) for k, v in own.items() if not isinstance(v, torch.Tensor) or k in extra_state},
        "optimizers": optimizers,
        "extra": extra,
    }


def _cpu_copy(value: Any) -> Any:
    return value.detach().cpu().clone() if isinstance(value, torch.Tensor) else value


class _Writer(FileSystemWriter):
    """DCP's file writer, plus the meta file written by the coordinator right before ``.metadata``."""

    def __init__(self, path: str, meta: dict[str, Any]) -> None:
        super().__init__(path, overwrite=True)  # said, not assumed: torch plans to change the default
        self._meta = meta
        self._dir = path

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        super().set_up_storage_writer(is_coordinator, *args, **kwargs)
        marker = os.path.join(self._dir, DCP_METADATA)
        if is_coordinator and os.path.exists(marker):  # an overwrite that dies half-way must not look complete
            os.remove(marker)

    def finish(self, metadata: Metadata, results: list) -> None:
        # Every rank's files must be here before .metadata marks the directory complete: a rank whose
        # directory is another disk (a node without the shared file system) wrote them elsewhere.
        written = sorted({wr.storage_data.relative_path for per_rank in results for wr in per_rank})
        missing = [name for name in written if not os.path.exists(os.path.join(self._dir, name))]
        if missing:
            raise ShardedCheckpointError(
                f"{self._dir}: {', '.join(missing)}, written by other ranks, are not in the directory rank 0 "
                "sees: a sharded checkpoint needs a directory shared by every rank (a shared file system); "
                "use state_dict_type='full' otherwise")
        target = os.path.join(self._dir, META_FILE)
        torch.save(self._meta, target + ".tmp")
        os.replace(target + ".tmp", target)
        super().finish(metadata, results)


# ---- checks -----------------------------------------------------------------------------------------

def read_checkpoint(path: PathLike) -> tuple[dict[str, Any], Metadata]:
    """The meta file and DCP's index of a complete sharded checkpoint; raise if it is not one."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise ShardedCheckpointError(f"{path} is not a directory; a sharded checkpoint is the directory "
                                     "save_sharded wrote")
    if not os.path.exists(os.path.join(path, DCP_METADATA)):
        raise ShardedCheckpointError(
            f"{path} has no {DCP_METADATA}: the save that wrote it did not finish ({DCP_METADATA} is written last, "
            "once every rank has written its files), so it is not a checkpoint; resume from an earlier one")
    try:
        stored = FileSystemReader(path).read_metadata()
    except Exception as err:
        raise ShardedCheckpointError(f"{path}/{DCP_METADATA} cannot be read ({err}); the checkpoint is "
                                     "damaged") from err
    _check_files(path, stored)
    if not os.path.exists(os.path.join(path, META_FILE)):
        raise ShardedCheckpointError(f"{path} is a torch.distributed.checkpoint directory without {META_FILE}; "
                                     "it was not written by save_sharded")
    meta = torch.load(os.path.join(path, META_FILE), weights_only=False)
    if meta.get("format") != FORMAT:
        raise ShardedCheckpointError(f"{path}: unknown format {meta.get('format')!r} (this version reads {FORMAT})")
    return meta, stored


def _check_files(path: str, stored: Metadata) -> None:
    """Every data file the index names exists and is long enough (a lost or truncated rank file)."""
    needed: dict[str, int] = {}
    for info in stored.storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    missing = sorted(name for name in needed if not os.path.exists(os.path.join(path, name)))
    if missing:
        raise ShardedCheckpointError(f"{path} is missing {', '.join(missing)}: every rank's file of the save must be "
                                     "present (copy the whole directory)")
    short = sorted(name for name, size in needed.items() if os.path.getsize(os.path.join(path, name)) < size)
    if short:
        raise ShardedCheckpointError(f"{path}: {', '.join(short)} is shorter than its index says (truncated copy?)")


def _check_model(runtime, meta: dict[str, Any], only: Optional[set[str]] = None) -> None:
    """The model has the checkpoint's state-dict keys and parameter shapes (``only``: those of these keys,
    which the checkpoint has)."""
    keys, saved = set(runtime.module.state_dict(keep_vars=True)), {k for k, _ in meta["keys"]}
    missing, unexpected = sorted(keys - saved), sorted(saved - keys)
    if only is not None:
        missing, unexpected = sorted(only - saved), []
    if missing or unexpected:
        raise ShardedCheckpointError(f"checkpoint does not match the model: missing keys {missing[:5]}, "
                                     f"unexpected keys {unexpected[:5]}")
    names = stored_names(meta, only)
    shapes = {s.name: tuple(s.shape) for c in runtime.chunks for s in c.slots if s.name in names}
    wrong = [f"{n}: {meta['shapes'].get(n)} != {s}" for n, s in shapes.items() if meta["shapes"].get(n) != s]
    if wrong:
        raise ShardedCheckpointError(f"checkpoint shapes differ from the model's: {wrong[:5]}")


def stored_names(meta: dict[str, Any], keys: Optional[set[str]] = None) -> set[str]:
    """The names the checkpoint stores the state-dict ``keys`` under (all of them when None): a parameter's
    first name (tied ones are stored once), a buffer's key."""
    return {stored or key for key, stored in meta["keys"] if keys is None or key in keys}


def _check_optimizers(optimizers: Sequence[Optimizer], entries: list[list], meta: dict[str, Any]) -> None:
    """Every optimizer holds the parameters, in the order, of the one saved at its position."""
    if optimizers and len(optimizers) != len(meta["optimizers"]):
        raise ShardedCheckpointError(f"checkpoint has {len(meta['optimizers'])} optimizer(s), "
                                     f"{len(optimizers)} were given")
    for k, (views, saved) in enumerate(zip(entries, meta["optimizers"])):
        names = [slot.name for _, slot, _ in views]
        if names != saved["params"]:
            raise ShardedCheckpointError(f"optimizer {k} holds other parameters (or another order) than the "
                                         "checkpoint's; build the optimizers as for the run that saved it")


# ---- load -------------------------------------------------------------------------------------------

def load_sharded(runtime, optimizers: Sequence[Optimizer], path: PathLike, *, model: bool = True,
                 only: Optional[set[str]] = None, param_groups: Optional[Sequence[Optional[list]]] = None
                 ) -> dict[str, Any]:
    """Load a sharded checkpoint into ``runtime`` and ``optimizers``; every rank calls it.

    The saving run may have had another world size, chunk size, cache or placement. The checkpoint
    is checked (complete, every file present, same names and shapes) before anything is written;
    a file that is damaged inside fails the load half-way, and the model must be loaded again.

    Args:
        runtime: the ``ElixirRuntime`` whose masters, shards and buffers are loaded.
        optimizers: the optimizers, as for the saving run (set up by ``shard_optimizer``), or none
            to load the model only.
        path: the checkpoint directory.
        model: load the model (its masters, buffers, companions and extra state); False: the optimizers only.
        only: the state-dict keys of the model to load (None: all; a Lightning hook may have removed some).
        param_groups: per optimizer, the param groups to load with its state instead of the saved ones
            (a Lightning hook may have changed their hyperparameters), or None for the saved ones.

    Returns:
        The ``extra`` dict given to ``save_sharded``.
    """
    path = os.fspath(path)
    meta, stored = read_checkpoint(path)
    if model:
        _check_model(runtime, meta, only)
    entries = [optimizer_views(runtime, optimizer) for optimizer in optimizers]
    _check_optimizers(optimizers, entries, meta)
    runtime.offload.settle()
    runtime.release_all()
    targets, staged = {}, {}
    if model:
        targets, staged = _model_targets(runtime, stored_names(meta, only))
        targets.update(_companion_targets(runtime, stored))
    state_targets = [_state_targets(runtime, views, saved, stored, k)  # zip: none when no optimizers are given
                     for k, (views, saved) in enumerate(zip(entries, meta["optimizers"]))]
    for per_optimizer in state_targets:
        targets.update({name: target for name, _, _, _, target in per_optimizer})
    if targets:
        with _quiet_dcp():
            dcp.load(targets, storage_reader=FileSystemReader(path), process_group=runtime.group.pg,
                     no_dist=not _distributed())
    groups = list(param_groups) if param_groups is not None else [None] * len(optimizers)
    for optimizer, saved, per_optimizer, chosen in zip(optimizers, meta["optimizers"], state_targets, groups):
        _load_optimizer(optimizer, saved, per_optimizer, chosen)
    _finish_chunks(runtime, staged)
    if model:
        _load_objects(runtime, {k: v for k, v in meta["objects"].items() if only is None or k in only})
    return meta["extra"]


def _model_targets(runtime, names: set[str]) -> tuple[dict[str, Any], dict[int, list[tuple[Slot, torch.Tensor]]]]:
    """Where DCP reads each piece of the parameters and buffers stored as ``names``: the master itself, or
    (NVMe) a staging tensor; a buffer whole."""
    targets: dict[str, Any] = {}
    staged: dict[int, list[tuple[Slot, torch.Tensor]]] = {}
    for chunk in runtime.chunks:
        for slot in chunk.slots:
            if slot.name not in names:
                continue
            if _is_nvme(chunk):  # the master is paged in only around its use
                begin, end = chunk.shard_range(slot)
                local = torch.empty(end - begin, dtype=chunk.master.dtype)
                staged.setdefault(chunk.index, []).append((slot, local))
            else:
                local = _own_piece(chunk, slot, chunk.master)
            targets[f"model.{slot.name}"] = _flat(runtime, chunk, slot, local)
    targets.update({f"model.{k}": v.detach() for k, v in _buffers(runtime).items() if k in names})
    return targets, staged


def _companion_targets(runtime, stored: Metadata) -> dict[str, Any]:
    """Where DCP reads the pieces of the runtime's companions that the checkpoint holds (straight into them)."""
    targets = {}
    for name, shards in runtime.companions.items():
        for chunk in runtime.chunks:
            for slot in chunk.slots:
                key = f"companion.{name}.{slot.name}"
                if key in stored.state_dict_metadata:
                    targets[key] = _flat(runtime, chunk, slot, _own_piece(chunk, slot, shards[chunk.index]))
    return targets


def _state_targets(runtime, views: list, saved: dict, stored: Metadata, k: int) -> list[tuple[str, int, str, Any, Any]]:
    """(name, param index, key, local piece, DCP target) for each per-element state of one optimizer, empty to read."""
    out = []
    for i, keys in saved["flat"].items():
        chunk, slot, view = views[i]
        begin, end = chunk.shard_range(slot)
        for key in keys:
            name = f"optim.{k}.state.{i}.{key}"
            dtype = stored.state_dict_metadata[name].properties.dtype
            local = torch.empty(end - begin, dtype=dtype, device=view.device)
            out.append((name, i, key, local, _flat(runtime, chunk, slot, local)))
    return out


def _load_optimizer(optimizer: Optimizer, saved: dict, loaded: list, param_groups: Optional[list] = None) -> None:
    """Give the optimizer its loaded state through ``load_state_dict``, as a state dict of shard views."""
    state = {i: {k: _cpu_copy(v) for k, v in values.items()} for i, values in saved["values"].items()}
    for i, values in saved["values"].items():  # whole tensors: held whole, whatever their shape
        note_replicated(optimizer, i, {k: v for k, v in values.items() if k not in saved["flat"][i]})
    for _, i, key, local, _ in loaded:
        state.setdefault(i, {})[key] = local
    groups = saved["param_groups"] if param_groups is None else param_groups
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def _finish_chunks(runtime, staged: dict[int, list[tuple[Slot, torch.Tensor]]]) -> None:
    """Compute-dtype shards from the loaded masters; NVMe chunks get master and new state into their records."""
    with torch.no_grad():
        for chunk in runtime.chunks:
            if not _is_nvme(chunk):
                chunk.refresh_shard()
                continue
            with runtime.offload.resident(chunk, write=True, bind_state=False):
                for slot, local in staged.get(chunk.index, []):
                    _own_piece(chunk, slot, chunk.master).copy_(local)
                chunk.refresh_shard()


def _load_objects(runtime, objects: dict[str, Any]) -> None:
    """The modules' extra state (``get_extra_state``, any object) back into them ([Note: extra state])."""
    for key, value in objects.items():
        prefix = key.rpartition(".")[0]
        runtime.module.get_submodule(prefix).set_extra_state(value)


# ---- conversion -------------------------------------------------------------------------------------

def convert_sharded_to_full(path: PathLike, out_file: PathLike) -> None:
    """Write a sharded checkpoint as one full Lightning checkpoint file, in this process, without the model.

    The file holds ``{"state_dict": ..., "optimizer_states": [...], **extra}``: a plain module state
    dict (tied names included) and one plain torch optimizer state dict per optimizer.
    """
    meta, stored = read_checkpoint(path)
    tensors = {key: torch.empty(md.size, dtype=md.properties.dtype)
               for key, md in stored.state_dict_metadata.items() if isinstance(md, TensorStorageMetadata)}
    with _quiet_dcp():
        dcp.load(tensors, storage_reader=FileSystemReader(os.fspath(path)), no_dist=True)
    extra = dict(meta["extra"])
    full = {"state_dict": dict(_full_model(meta, tensors))}
    if not meta.get("weights_only"):  # a weights-only save has no optimizer states, as Lightning's file has none
        full["optimizer_states"] = [_full_optimizer(saved, meta["shapes"], tensors, k)
                                    for k, saved in enumerate(meta["optimizers"])]
    average = extra.pop(AVERAGE_IN_STATE_DICT, None)
    if average is not None:  # Lightning's WeightAveraging layout: the average is the state dict
        averaging = dict(extra.get("averaging_state", {}))
        buffers = {k.removeprefix("module."): averaging.pop(k) for k in list(averaging) if k.startswith("module.")}
        full["current_model_state"] = full["state_dict"]
        full["state_dict"] = {**dict(_full_model(meta, tensors, f"companion.{average}.")), **buffers}
        extra["averaging_state"] = averaging
    torch.save({**extra, **full}, os.fspath(out_file))


def _full_model(meta: dict[str, Any], tensors: dict[str, torch.Tensor],
                params: str = "model.") -> Iterator[tuple[str, Any]]:
    """The module's state dict; parameters from the tensors stored under ``params`` (the masters, or a companion)."""
    for key, name in meta["keys"]:
        if key in meta["objects"]:
            yield key, meta["objects"][key]
        elif name is None:
            yield key, tensors[f"model.{key}"]
        else:
            yield key, tensors[f"{params}{name}"].view(meta["shapes"][name])


def _full_optimizer(saved: dict, shapes: dict, tensors: dict[str, torch.Tensor], k: int) -> dict[str, Any]:
    state = {}
    for i, values in saved["values"].items():
        shape = shapes[saved["params"][i]]
        state[i] = {**values, **{key: tensors[f"optim.{k}.state.{i}.{key}"].view(shape) for key in saved["flat"][i]}}
    return {"state": state, "param_groups": saved["param_groups"]}


# ---- helpers ----------------------------------------------------------------------------------------

def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


@contextlib.contextmanager
def _quiet_dcp() -> Iterator[None]:
    """Two DCP warnings that say nothing here: that it assumes a single process when no process group
    exists (the intent), and that ShardedTensor is deprecated for DTensor, which cannot hold the
    arbitrary contiguous pieces a chunk boundary cuts (DTensor shards follow torch.chunk)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        warnings.filterwarnings("ignore", message="Please use DTensor instead", category=FutureWarning)
        yield
