"""Full checkpoint files written while their chunks are gathered, in ``torch.save``'s format.

[Note: streamed full checkpoints]
A full checkpoint holds every parameter and optimizer state whole. Building it as a dict first
means one rank holds the whole model's state in host memory (and Lightning's TorchCheckpointIO
then serializes that dict into a second in-memory copy before writing it). Instead, the strategy's
``lightning_module_state_dict`` and ``optimizer_state`` return the checkpoint's structure with a
``DeferredTensor`` (shape and dtype, no data) for every gathered tensor. ``save_checkpoint`` then
gathers chunk by chunk on every rank; rank 0 writes each gathered tensor as one storage record of
the zip archive and drops it, and writes the pickled structure (``data.pkl``) last. The file is
what ``torch.save`` writes for the same dict (``torch.load``, also with ``weights_only=True``,
reads it), and no rank holds more than one gathered chunk beyond its shards.

When the Trainer's checkpoint_io is not one that writes ``torch.save`` files (a user's plugin,
AsyncCheckpointIO, storage options), the deferred tensors are filled in first, gathered the same
way, and the plugin gets an ordinary dict. A deferred tensor cannot be computed with: hooks that
read checkpoint["state_dict"] values in ``on_save_checkpoint`` see it raise an error that says
what to do (dropping or replacing entries works as with a plain dict).
"""

from __future__ import annotations

import io
import pickle
import sys
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Iterator
from dataclasses import dataclass
from typing import IO, Any, Callable, Optional

import torch
from torch.serialization import location_tag

_ALIGNMENT = 64  # torch.save's storage alignment (the records' offsets in the archive)
_PROTOCOL = 2  # torch.save's pickle protocol


class DeferredTensor:
    """A tensor of a full checkpoint that is gathered while the checkpoint is written.

    It knows its shape and dtype; any computation with it raises, saying what to do instead.
    ``source`` names what it is (a parameter, an optimizer state entry) for the gathering code."""

    __slots__ = ("source", "shape", "dtype")

    def __init__(self, source: Hashable, shape: torch.Size, dtype: torch.dtype) -> None:
        self.source, self.shape, self.dtype = source, torch.Size(shape), dtype

    def size(self, dim: Optional[int] = None) -> Any:
        return self.shape if dim is None else self.shape[dim]

    def dim(self) -> int:
        return len(self.shape)

    def numel(self) -> int:
        return self.shape.numel()

    @property
    def nbytes(self) -> int:
        return self.numel() * self.dtype.itemsize

    def __repr__(self) -> str:
        return f"DeferredTensor(shape={tuple(self.shape)}, dtype={self.dtype})"

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(_unusable(f"attribute {name!r}"))

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        raise TypeError(_unusable(getattr(func, "__name__", str(func))))


def _unusable(what: str) -> str:
    return (f"{what} of a DeferredTensor: full checkpoints gather each chunk while the file is written, so "
            "checkpoint['state_dict'] and the optimizer states hold no data in on_save_checkpoint; read full "
            "parameters with `trainer.strategy.gathered_params()`, or drop or replace entries of the dict")


def deferred_in(obj: Any) -> list[DeferredTensor]:
    """Every DeferredTensor inside nested dicts, lists and tuples, in order, each once."""
    found: dict[int, DeferredTensor] = {}
    stack = [obj]
    while stack:
        item = stack.pop()
        if isinstance(item, DeferredTensor):
            found.setdefault(id(item), item)
        elif isinstance(item, dict):
            stack.extend(reversed(list(item.values())))
        elif isinstance(item, (list, tuple)):
            stack.extend(reversed(item))
    return list(found.values())


def fill_deferred(obj: Any, values: dict[int, torch.Tensor]) -> Any:
    """``obj`` with each DeferredTensor replaced by ``values[id(deferred)]`` (dicts and lists in place)."""
    if isinstance(obj, DeferredTensor):
        return values[id(obj)]
    if isinstance(obj, dict):
        for key, item in obj.items():
            obj[key] = fill_deferred(item, values)
    elif isinstance(obj, list):
        obj[:] = [fill_deferred(item, values) for item in obj]
    elif isinstance(obj, tuple):
        return type(obj)(*(fill_deferred(i, values) for i in obj)) if hasattr(obj, "_fields") else \
            tuple(fill_deferred(i, values) for i in obj)
    return obj


@dataclass
class Gathered:
    """One gather of a full checkpoint: a 1-D region of the gathered buffer and the tensors that view it."""

    region: Optional[torch.Tensor]
    """The part of the buffer the views cover (None on ranks that do not keep the values)."""
    views: list[tuple[DeferredTensor, Optional[torch.Tensor]]]
    """Each deferred tensor with its value, a view of ``region``'s storage (None where not kept)."""


Records = Iterable[Gathered]
"""The gathers of a full checkpoint, in order; each is valid until the next one is taken."""


def write_torch_file(obj: Any, records: Records, file: IO[bytes]) -> None:
    """Write ``obj`` to ``file`` as ``torch.save`` would, each DeferredTensor's data from ``records``.

    Each gathered region is written when it arrives, as one storage record, and the tensors are
    views of it in the file (as ``torch.save`` writes views that share a storage). A DeferredTensor
    that no record fills raises before ``data.pkl`` is written, so the file is never complete."""
    sink = _Sink(file)
    writer = torch._C.PyTorchFileWriter(sink, True, _ALIGNMENT)
    try:
        placed: dict[int, tuple[_StorageRef, int, tuple[int, ...]]] = {}  # id(deferred) -> (storage, offset, stride)
        for gathered in records:
            if gathered.region is not None:
                _write_region(writer, gathered, placed)
            del gathered  # before the next gather: its views are the only references to the gathered buffer
        pickled, storages = _pickle(obj, placed)
        writer.write_record("data.pkl", pickled, len(pickled))
        writer.write_record(".format_version", "1", 1)
        writer.write_record(".storage_alignment", str(_ALIGNMENT), len(str(_ALIGNMENT)))
        writer.write_record("byteorder", sys.byteorder, len(sys.byteorder))
        for key, storage in storages.items():
            storage = storage.cpu()
            writer.write_record(f"data/{key}", storage, storage.nbytes())
        writer.write_end_of_file()
    except BaseException:
        # An unfinished writer ends the archive when it is destroyed, in C++, where an error (the file closed
        # by then, or the disk full) aborts the process: it is destroyed here, into a sink that takes no more.
        sink.closed = True
        del writer
        raise
    file.flush()


class _Sink:
    """The file a ``PyTorchFileWriter`` writes to, which drops what comes after ``closed`` is set."""

    def __init__(self, file: IO[bytes]) -> None:
        self.file, self.closed = file, False

    def write(self, data: Any) -> int:
        return memoryview(data).nbytes if self.closed else self.file.write(data)


def _write_region(writer: Any, gathered: Gathered, placed: dict[int, tuple[_StorageRef, int, tuple[int, ...]]]) -> None:
    """Write one gathered region as a storage record and note where each of its tensors lies in it."""
    region = gathered.region.detach().cpu()  # a copy of only the region, from a device
    if region.untyped_storage().nbytes() != region.nbytes:  # write only the region, without copying it
        region = torch.from_numpy(region.view(_SAME_SIZE_INT[region.element_size()]).numpy()).view(region.dtype)
    ref = _StorageRef(f"g{len(placed)}", region.dtype, region.numel())
    writer.write_record(f"data/{ref.key}", region.untyped_storage(), region.nbytes)
    base = gathered.region.storage_offset()
    for deferred, value in gathered.views:
        if value.dtype != deferred.dtype or value.shape != deferred.shape:
            raise ValueError(f"gathered {tuple(value.shape)} {value.dtype} for {deferred}")
        placed[id(deferred)] = (ref, value.storage_offset() - base, value.stride())


def filled(obj: Any, records: Records) -> Any:
    """``obj`` with its DeferredTensors replaced by copies of their gathered values (all held at once)."""
    values = {}
    for gathered in records:
        values.update((id(deferred), value.cpu().clone()) for deferred, value in gathered.views)
        del gathered
    return fill_deferred(obj, values)


_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class _StorageRef:
    """The storage record of a DeferredTensor, for the pickler's persistent ids."""

    def __init__(self, key: str, dtype: torch.dtype, numel: int) -> None:
        self.key, self.dtype, self.numel = key, dtype, numel


def _pickle(obj: Any, placed: dict[int, tuple[_StorageRef, int, tuple[int, ...]]]) -> tuple[bytes, dict[str, torch.UntypedStorage]]:
    """``obj`` pickled as ``torch.save`` pickles it, and the real storages it refers to, by record key."""
    storages: dict[str, torch.UntypedStorage] = {}
    keys_by_storage: dict[int, str] = {}
    dtypes_by_pointer: dict[int, torch.dtype] = {}

    def storage_id(item: Any) -> Optional[tuple]:
        if isinstance(item, _StorageRef):
            return ("storage", _storage_type(item.dtype), item.key, "cpu", item.numel)
        if isinstance(item, torch.storage.TypedStorage):
            storage, dtype, numel = item._untyped_storage, item.dtype, item._size()
            storage_type = getattr(torch, item._pickle_storage_type())
        elif torch.is_storage(item):
            storage, dtype, numel = item, torch.uint8, item.nbytes()
            storage_type = torch.UntypedStorage
        else:
            return None
        if storage.device.type != "meta" and storage.data_ptr() != 0:
            if dtypes_by_pointer.setdefault(storage.data_ptr(), dtype) != dtype:
                raise RuntimeError("cannot save tensors that view the same data as different dtypes")
        key = keys_by_storage.setdefault(storage._cdata, str(len(keys_by_storage)))
        storages[key] = storage
        return ("storage", storage_type, key, location_tag(storage), numel)

    def reduce_deferred(item: Any) -> Any:
        if not isinstance(item, DeferredTensor):
            return NotImplemented
        if id(item) not in placed:
            raise RuntimeError(f"{item} was not gathered; was the checkpoint saved by the strategy that made it?")
        ref, offset, stride = placed[id(item)]
        return torch._utils._rebuild_tensor_v2, (ref, offset, item.shape, stride, False, OrderedDict())

    buffer = io.BytesIO()
    pickler = _Pickler(buffer, protocol=_PROTOCOL)
    pickler.storage_id, pickler.reduce_deferred = storage_id, reduce_deferred
    pickler.dump(obj)
    return buffer.getvalue(), storages


class _Pickler(pickle.Pickler):
    storage_id: Callable[[Any], Optional[tuple]]
    reduce_deferred: Callable[[Any], Any]

    def persistent_id(self, obj: Any) -> Optional[tuple]:
        return self.storage_id(obj)

    def reducer_override(self, obj: Any) -> Any:
        return self.reduce_deferred(obj)


def _storage_type(dtype: torch.dtype) -> Any:
    return getattr(torch, torch.storage._dtype_to_storage_type_map()[dtype])


def drain(records: Iterator[Any]) -> None:
    """Take every remaining record (each is a collective step on every rank)."""
    for _ in records:
        pass
