"""Deferred initialisation: build a model without its memory, then give each tensor the values a real build would have.

[Note: deferred initialisation]
``configure_model`` builds the model under the strategy's init context, which must not allocate
it: a model that needs sharding does not fit on one device (nor, per rank, in host memory). On
the plain meta device every tensor has a shape and no values, so each module had to be
initialised again at materialisation by its ``reset_parameters()``, which (a) many modules lack
(Hugging Face's Conv1D, rotary embeddings whose buffers their ``__init__`` computes), (b) is not
the model's own scheme (a Hugging Face model re-initialises every module in ``post_init`` with
``normal(0, initializer_range)``; that step even skips itself when it sees the meta device), and
(c) draws random numbers in another order than the real build, so even where it is the right
scheme the weights differ from those DDP starts from under the same seed.

So the build runs under ``record_init``: a dispatch mode that turns every tensor factory into a
meta tensor and records, in order, every operation that touches a meta tensor, with the random
generator's state before each random operation. Nothing believes it is on the meta device (the
default device stays what the real build's is, so Hugging Face initialises as usual). To keep the
generator's stream where the real build would leave it, each random operation is also run once on
a scratch tensor of the same size on the real device and dropped: later draws (the user's own, the
data order) then match a real build's too.

At materialisation ``InitRecord.materialize(t)`` replays only what ``t``'s final values depend on
(the operations that created or wrote its storage, and recursively what those read, each as of
its own position in the recording), on the real device, with each random operation's generator
state restored (and the generator's own state put back afterwards). The result is bit-identical
to the tensor a real build would have made, while at most one parameter's history is alive at a
time. An operation that needs real values during the build (``.item()`` on a tensor the build
computed) gets them by the same replay, on the spot. A meta tensor the recording does not know
(created under a plain ``torch.device("meta")``) is left to the module's ``reset_parameters()``.

Host data put straight onto a build's device needs one more step: ``torch.tensor(data,
device=w.device)``, ``w.new_tensor(data)`` and a list or array index (``w[[3, 5, 7]]``, as PEFT's
trainable tokens take their rows) are made in C++, which copies the data onto the meta device
without dispatching an operation, so the recording would hold a meta tensor whose values no
operation made. ``_HostData`` makes such tensors on the host instead (real, small: host data) and
moves them onto the meta device with a dispatched copy, which the recording keeps with its source
values; index lists become host index tensors, as a user's own ``w[torch.tensor([3, 5, 7])]`` is.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

_META = torch.device("meta")


@dataclass
class _Op:
    func: Any
    args: tuple
    kwargs: dict
    outputs: list[torch.Tensor]
    """The meta tensors it returned."""
    rng: Optional[tuple[torch.Generator, torch.Tensor]]
    """For a random operation: the generator it drew from and that generator's state before it."""
    places: dict[int, "_Place"]
    """Where each meta tensor it read or wrote was then, by id: a tensor object may be given another
    storage later (``p.data = other`` is not dispatched), and the replay needs the one it had here."""


@dataclass(frozen=True)
class _Place:
    """A tensor's storage and its view of it, as of one operation."""

    key: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


def _place(t: torch.Tensor) -> _Place:
    return _Place(_key(t), tuple(t.shape), tuple(t.stride()), t.storage_offset())


def _is_meta(t: torch.Tensor) -> bool:
    return t.device.type == "meta"  # not ``is_meta``, which a tensor of a build in progress denies


class _Deferred(torch.Tensor):
    """A meta tensor of a build in progress, which says it is not one.

    ``torch.nn.init``'s trunc_normal_, orthogonal_, sparse_ and dirac_ return at once for a meta
    tensor ("sampling is a no-op"), so a build on the meta device would record no initialisation
    for them. Only ``is_meta`` changes; ``record_init`` turns these back into plain tensors and
    parameters when the build ends.
    """

    __torch_function__ = torch._C._disabled_torch_function_impl

    @property
    def is_meta(self) -> bool:  # type: ignore[override]
        return False


def _key(t: torch.Tensor) -> int:
    """The identity of a tensor's storage (shared by its views)."""
    return t.untyped_storage()._cdata


def _metas(tree: Any) -> list[torch.Tensor]:
    return [t for t in _flat_tensors(tree) if _is_meta(t)]


class InitRecord:
    """The operations of one deferred build, and the replay of any tensor they made ([Note: deferred initialisation]).

    Args:
        device: where the real build would have made the tensors (its random generator is the one the
            recording keeps in step, and the replay's results live there).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self.ops: list[_Op] = []
        self._producer: dict[int, tuple[int, int]] = {}
        """id of a meta tensor an operation returned -> that operation, and the storage the tensor had then.
        A tensor whose storage changed since (``p.data = other``, which is not dispatched) is no longer that
        operation's result: its values are its new storage's."""
        self._creator: dict[int, int] = {}
        """storage -> the operation that allocated it."""
        self._writers: dict[int, list[int]] = defaultdict(list)
        """storage -> the operations that wrote to it, in order."""
        self._bases: dict[int, torch.Tensor] = {}
        """storage -> the tensor its creator returned (views of it are rebuilt from its replay)."""
        self._generators: dict[int, torch.Generator] = {}
        """The generators random operations drew from (their states are put back after a replay)."""

    def knows(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is a meta tensor made by this recording."""
        return _is_meta(t) and _key(t) in self._creator

    def owns(self, t: torch.Tensor) -> bool:
        """Whether the meta tensor ``t`` stands for a real one of the build: made by this recording, or a tensor of
        it that the build disguised (``_Deferred``)."""
        return type(t) is _Deferred or _key(t) in self._creator

    # ---- recording ----------------------------------------------------------------------------

    def record(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        outputs = _metas(out)
        if not outputs and not _metas((args, kwargs)):
            return
        index = len(self.ops)
        rng = None
        if torch.Tag.nondeterministic_seeded in func.tags:
            generator = kwargs.get("generator") or _default_generator(self.device)
            self._generators[id(generator)] = generator
            rng = (generator, generator.get_state())
            _advance(func, args, kwargs, self.device)
        self.ops.append(_Op(func, args, kwargs, outputs, rng, {id(t): _place(t) for t in _metas((args, kwargs))}))
        for i, argument in enumerate(func._schema.arguments):
            if argument.alias_info is not None and argument.alias_info.is_write:
                value = args[i] if i < len(args) else kwargs.get(argument.name)
                for t in _metas(value):
                    self._writers[_key(t)].append(index)
        for t in outputs:
            self._producer[id(t)] = (index, _key(t))
            if _key(t) not in self._creator:
                self._creator[_key(t)] = index
                self._bases[_key(t)] = t

    # ---- replay -------------------------------------------------------------------------------

    def materialize(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` with the values a real build would have given it, on ``device`` (a new tensor)."""
        return self._replay([t])[0].clone()

    def _replay(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        needed = self._slice(tensors)
        env: dict[int, torch.Tensor] = {}
        saved = [(g, g.get_state()) for g in self._generators.values()]
        try:
            with torch.no_grad():
                for index in sorted(needed):
                    op = self.ops[index]
                    if op.rng is not None:
                        op.rng[0].set_state(op.rng[1])
                    real = lambda v: self._real(v, env, op.places.get(id(v))) if isinstance(v, torch.Tensor) else v  # noqa: E731,B023
                    args, kwargs = tree_map(real, op.args), tree_map(real, op.kwargs)
                    if kwargs.get("device") == _META:
                        kwargs["device"] = self.device
                    result = op.func(*args, **kwargs)
                    for meta, value in zip(op.outputs, _flat_tensors(result)):
                        env[id(meta)] = value
        finally:
            for generator, state in saved:
                generator.set_state(state)
        return [self._real(t, env) for t in tensors]

    def _real(self, t: torch.Tensor, env: dict[int, torch.Tensor], place: Optional[_Place] = None) -> torch.Tensor:
        """The replayed counterpart of a meta tensor where it is now, or at ``place`` (a view of its storage's
        replayed base if it was made without an operation, as ``nn.Parameter(t)`` is)."""
        if not _is_meta(t):
            return t
        place = place or _place(t)
        if id(t) in env and self._produced(t, place.key) is not None:
            return env[id(t)]
        base = env.get(id(self._bases.get(place.key)))
        if base is None:
            raise RuntimeError(f"a meta tensor of shape {place.shape} was not made by this recording")
        return base.as_strided(place.shape, place.stride, place.offset)

    def _produced(self, t: torch.Tensor, key: int) -> Optional[int]:
        """The operation that returned ``t``, where ``t`` is in the storage ``key`` it returned it in."""
        index, produced_in = self._producer.get(id(t), (None, None))
        return index if produced_in == key else None

    def _slice(self, tensors: list[torch.Tensor]) -> set[int]:
        """The operations the final values of ``tensors`` depend on."""
        needed: set[int] = set()
        seen: set[tuple[int, float, int]] = set()
        stack = [(t, math.inf, _key(t)) for t in tensors if _is_meta(t)]
        while stack:
            t, before, key = stack.pop()
            if (id(t), before, key) in seen:
                continue
            seen.add((id(t), before, key))
            if key not in self._creator:
                raise RuntimeError(f"a meta tensor of shape {tuple(t.shape)} was not made by this recording")
            found = [self._creator[key]]
            producer = self._produced(t, key)
            if producer is not None:
                found.append(producer)
            found += [w for w in self._writers[key] if w < before]
            for index in found:
                if index in needed:
                    continue
                needed.add(index)
                op = self.ops[index]
                stack += [(u, index, op.places[id(u)].key) for u in _metas((op.args, op.kwargs))]
        return needed


def _flat_tensors(result: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(result)[0] if isinstance(t, torch.Tensor)]


def _default_generator(device: torch.device) -> torch.Generator:
    if device.type == "cuda":
        torch.cuda.init()  # the generators exist once CUDA is initialized (a build before fit may come first)
        return torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()]
    return torch.default_generator


def _advance(func: Any, args: tuple, kwargs: dict, device: torch.device) -> None:
    """Draw what ``func`` draws on ``device`` into scratch tensors, so that the generator moves as in a real build."""
    scratch = lambda v: torch.empty(v.shape, dtype=v.dtype, device=device) if isinstance(v, torch.Tensor) and _is_meta(v) else v  # noqa: E731
    args, kwargs = tree_map(scratch, args), tree_map(scratch, kwargs)
    if kwargs.get("device") == _META:
        kwargs["device"] = device
    with torch.no_grad():
        func(*args, **kwargs)


class _Recorder(TorchDispatchMode):
    """Tensor factories make meta tensors; operations that touch them are recorded."""

    def __init__(self, record: InitRecord) -> None:
        super().__init__()
        self.record = record
        self.meta_default = False
        """Whether the operation being dispatched runs under a ``torch.device("meta")`` context
        (``_meta_contexts_seen_by``)."""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = dict(kwargs or {})
        if self._on_meta_as_built(args, kwargs):
            return func(*args, **kwargs)
        if "device" in kwargs and not _flat_tensors((args, kwargs)):  # a factory: empty, zeros, arange, randn...
            if _is_empty(func(*args, **{**kwargs, "device": _META})):
                # Holds no memory, and may get a real storage next: ``torch.load`` rebuilds each tensor as
                # ``torch.empty(0).set_(storage)``, so a state dict loaded in the build stays real.
                return func(*args, **kwargs)
            kwargs["device"] = _META  # replayed on the record's device, where the real build makes its tensors
        try:
            out = func(*args, **kwargs)
        except (NotImplementedError, RuntimeError):
            if not _metas((args, kwargs)):
                raise
            # Needs values (``.item()``, a data-dependent shape): compute them now from the recording.
            metas = _metas((args, kwargs))
            values = dict(zip(map(id, metas), self.record._replay(metas)))
            real = lambda v: values.get(id(v), v) if isinstance(v, torch.Tensor) else v  # noqa: E731
            return func(*tree_map(real, args), **tree_map(real, kwargs))
        out = tree_map(_disguise, out)
        self.record.record(func, args, kwargs, out)
        return out

    def _on_meta_as_built(self, args: tuple, kwargs: dict) -> bool:
        """Whether the real build runs this operation on the meta device too: a factory asked for the meta
        device under a ``torch.device("meta")`` context (Hugging Face's ``from_pretrained`` builds under one and
        then loads the weights), or an operation whose meta tensors are all such. It is run as the real build
        runs it, unrecorded, and draws no random numbers, as a meta tensor's initialisation draws none; had it
        been recorded, the generator would have moved where the real build's does not, and every later draw
        (the heads ``from_pretrained`` initialises, dropout, the data order) would differ from DDP's."""
        tensors = _flat_tensors((args, kwargs))
        if not tensors:  # a factory: ``device="meta"`` alone could be a tensor of the build's ``.device``
            device = kwargs.get("device")
            return self.meta_default and device is not None and torch.device(device).type == "meta"
        metas = [t for t in tensors if _is_meta(t)]
        return bool(metas) and not any(self.record.owns(t) for t in metas)


def _is_empty(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.numel() == 0


def _disguise(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and _is_meta(value) and type(value) is torch.Tensor:
        return value.as_subclass(_Deferred)
    return value


def _reveal(t: torch.Tensor) -> None:
    """A tensor of a finished build: a plain meta tensor, or parameter, again."""
    if type(t) is _Deferred:
        t.__class__ = torch.nn.Parameter if getattr(t, "_is_param", False) else torch.Tensor


_FROM_DATA = (torch.tensor, torch.as_tensor, torch.asarray)
"""Functions that copy host data (lists, numbers, arrays) into a new tensor on a device they are given."""
_INDEXING = (torch.Tensor.__getitem__, torch.Tensor.__setitem__)


def _meta_target(device: Any) -> bool:
    if device is None or isinstance(device, int):
        return False
    return torch.device(device).type == "meta"


def _host_data(data: Any) -> bool:
    return not isinstance(data, torch.Tensor) and not _flat_tensors(data)


def _host_index(index: Any) -> Any:
    """An index of a meta tensor with its lists and arrays made host tensors (what C++ would put on the meta
    device, without their values), keeping the meaning torch gives each."""
    if isinstance(index, tuple):
        return tuple(_index_tensor(part) for part in index)
    if isinstance(index, list) and _list_is_one_index(index):
        return _index_tensor(index)
    if type(index).__module__ == "numpy" and getattr(index, "ndim", None) == 1:
        return _index_tensor(index)
    return index


def _list_is_one_index(index: list) -> bool:
    """Whether torch indexes with ``index`` as one index tensor rather than as a tuple of indices (NumPy's rule
    for sequences, as ``treatSequenceAsTuple`` applies it: short lists holding sequences, slices, tensors,
    None or Ellipsis are tuples)."""
    if len(index) >= 32:
        return True
    return not any(isinstance(v, (torch.Tensor, slice, list, tuple)) or v is None or v is Ellipsis
                   or hasattr(v, "__len__") for v in index)


def _index_tensor(part: Any) -> Any:
    is_array = type(part).__module__ == "numpy" and hasattr(part, "ndim")
    if not (isinstance(part, list) or is_array) or not _host_data(part):
        return part
    tensor = torch.as_tensor(part)
    if tensor.dtype != torch.bool and not tensor.dtype.is_floating_point and not tensor.is_complex():
        tensor = tensor.long()
    return tensor


class _HostData(TorchFunctionMode):
    """Tensors made from host data for the meta device, and index lists of meta tensors, made on the host
    ([Note: deferred initialisation], last paragraph)."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = dict(kwargs or {})
        if func in _FROM_DATA and args and _host_data(args[0]):
            if func is torch.as_tensor and len(args) > 1:  # as_tensor(data, dtype, device)
                kwargs.update(zip(("dtype", "device"), args[1:]))
                args = args[:1]
            if _meta_target(kwargs.get("device")):
                return self._via_host(func, args, kwargs)
        elif func is torch.Tensor.new_tensor and len(args) > 1 and _host_data(args[1]) and _is_meta(args[0]):
            kwargs.setdefault("device", args[0].device)
            if _meta_target(kwargs["device"]):
                kwargs.setdefault("dtype", args[0].dtype)
                return self._via_host(torch.tensor, args[1:], kwargs)
        elif func in _INDEXING and len(args) > 1 and isinstance(args[0], torch.Tensor) and _is_meta(args[0]):
            args = (args[0], _host_index(args[1]), *args[2:])
        return func(*args, **kwargs)

    @staticmethod
    def _via_host(func: Any, args: tuple, kwargs: dict) -> torch.Tensor:
        requires_grad = kwargs.pop("requires_grad", False)
        kwargs.pop("pin_memory", None)
        device = kwargs.pop("device")
        host = func(*args, **kwargs, device="cpu")
        return host.to(device).requires_grad_(requires_grad)  # a dispatched copy: recorded with its source


@contextmanager
def _meta_contexts_seen_by(recorder: _Recorder) -> Iterator[None]:
    """Sets ``recorder.meta_default`` while a ``torch.device("meta")`` context (``torch.set_default_device("meta")``)
    puts a call on the meta device: its ``DeviceContext`` mode is not visible from inside another mode's call,
    and ``with torch.device(...)`` pushes it from C++, so its own ``__torch_function__`` is where to see it."""
    from torch.utils._device import DeviceContext

    original = DeviceContext.__dict__.get("__torch_function__")
    if original is None:  # another torch's layout: such builds are recorded, as before this was seen
        yield
        return

    def seen(mode: Any, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        if recorder.meta_default or torch.device(mode.device).type != "meta":
            return original(mode, func, types, args, kwargs)
        recorder.meta_default = True
        try:
            return original(mode, func, types, args, kwargs)
        finally:
            recorder.meta_default = False

    DeviceContext.__torch_function__ = seen  # type: ignore[method-assign]
    try:
        yield
    finally:
        DeviceContext.__torch_function__ = original  # type: ignore[method-assign]


@contextmanager
def record_init(device: torch.device) -> Iterator[InitRecord]:
    """Build under this context to get meta tensors that ``InitRecord.materialize`` can give real values."""
    record = InitRecord(device)
    try:
        recorder = _Recorder(record)
        with recorder, _HostData(), _meta_contexts_seen_by(recorder):
            yield record
    finally:
        for op in record.ops:
            for t in op.outputs:
                _reveal(t)


def recording_of(t: torch.Tensor, records: Sequence[InitRecord]) -> Optional[InitRecord]:
    """The recording among ``records`` that made the meta tensor ``t``, if any."""
    return next((r for r in records if r.knows(t)), None)
