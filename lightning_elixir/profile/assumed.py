"""Assumed values: what a traced step reads on the host, and value-dependent shapes, under fake tensors.

``AssumedValues`` is a dispatch mode that answers the operators FakeTensorMode cannot (host reads
such as ``loss.item()``, boolean-mask indexing, ``nonzero``, ``unique``) under the assumption that
the step sees ordinary, finite data; ``host_conversions`` gives ``.numpy()``, ``.tolist()`` and
``format`` of fake tensors the same answers. See [Note: assumed values].
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
)
from torch.utils._mode_utils import no_dispatch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map_only
from torch.utils.weak import WeakIdKeyDictionary

from lightning_elixir.profile.types import ProfileError

aten = torch.ops.aten


class AssumedValues(TorchDispatchMode):
    """Answers what fake tensors cannot: host reads of values, and shapes that depend on values.

    [Note: assumed values]
    A fake tensor has no values, so ``loss.item()``, ``float(loss)``, ``if torch.isnan(loss)``,
    ``.tolist()``, ``x[mask]``, ``torch.nonzero`` and ``torch.unique`` raise under FakeTensorMode.
    This mode sits above it, lets it try first (it knows the values of constants such as
    ``torch.tensor(3)``) and answers only what it cannot, under the assumption that the step
    sees ordinary data: every value is finite.

    - Host reads. A real tensor (a plain attribute of the module) is read for real. A fake tensor
      whose elements all have a known value is read as that value. Values are
      known from ``isnan``/``isinf`` (False), ``isfinite`` and ``x == x`` (True), comparisons with
      non-finite scalars, and propagate through logical operators, comparisons, reductions such
      as ``any``/``all``/``sum``, views and dtype casts. So ``if torch.isnan(loss)`` takes the
      normal path and ``torch.isfinite(loss).all()`` holds. Anything else reads as False (a bool:
      "nothing unusual happened", which skips guards such as ``if loss > 1e4: skip``), 1 (an
      integer) or 1.0 (a float: finite, nonzero and positive, so logs and divisions work).
    - Value-dependent shapes are given their largest size, the conservative bound for activation
      memory: ``nonzero``, boolean-mask indexing and ``masked_select`` select every element (none
      when the mask is known to be all False, e.g. ``x[torch.isnan(x)]``). ``unique`` finds one
      value (tiny either way, and it keeps input checks such as torchmetrics' "more unique values
      than classes" passing), ``bincount`` counts ``minlength`` bins (at least two: values read as 1),
      ``repeat_interleave`` repeats each element once; the CTC loss's forward variables cover the
      longest target the targets' shape allows.
    - In-place writes to real tensors (a plain tensor attribute: ``self.total += loss.detach()``)
      go to a fake copy: with only real inputs FakeTensorMode would run the operator for real and
      change the user's tensor.

    ``.numpy()``, ``.tolist()`` and ``format`` of fake tensors give the same assumed values (see
    ``host_conversions``). An operator not listed here still raises, and the caller falls back.
    Operators whose meta kernel refuses inputs the real kernel takes (``_grouped_mm`` on fp32, as
    Hugging Face's mixture-of-experts layers call it on a CPU) get their shapes another way.

    ``opposite=True`` answers the other way where an answer chooses a path: masks select nothing
    and unknown booleans read True. The profile traces a step that way too when the first trace
    had to assume anything, to find modules whose calls depend on tensor values ([Note:
    value-dependent module calls] in model.py).

    Values are also known from constant fills (``torch.ones``, ``torch.full(..., flag)``, ``fill_``),
    so a loop that ends on them ends in the trace as in the run: text generation until a maximum
    length, whose stopping criterion fills a mask with ``cur_len >= max_length``. A loop that ends
    only on values nobody knows (until every sequence produced an end token) would not: after
    ``max_ops`` operators the trace gives up with a ``ProfileError``, and planning falls back as for
    any step it cannot trace.
    """

    max_ops = 1_000_000
    """Operators one traced step may run (a training step of a large model runs tens of thousands)."""

    def __init__(self, fake_mode: FakeTensorMode, opposite: bool = False) -> None:
        super().__init__()
        self.fake_mode = fake_mode
        self.opposite = opposite
        self.known: WeakIdKeyDictionary = WeakIdKeyDictionary()  # tensor -> the value of all its elements
        self.assumed = False
        """Whether any answer depended on an assumption (a read or shape nobody knew)."""
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, D105
        kwargs = kwargs or {}
        self.ops += 1
        # Not from a metadata query (prim.device): torch 2.8 asks those from C++ code that cannot pass an
        # exception on, and aborts the process; the next operator raises instead.
        if self.ops > self.max_ops and func.namespace != "prim":
            raise ProfileError(f"the step ran more than {self.max_ops:,} operators on fake tensors without finishing: "
                               "a loop that ends on values the trace cannot know (generation until every sequence "
                               "has ended, say) does not end there")
        if func._schema.is_mutable:
            args, kwargs = tree_map_only(torch.Tensor, self._fake_if_real, (args, kwargs))
            for t in tree_leaves((args, kwargs)):  # written in place: what was known may no longer hold
                if isinstance(t, torch.Tensor):
                    self.known.pop(t, None)
        narrow = _NARROW_META.get(func)
        if narrow is not None:  # before FakeTensorMode tries its meta kernel (and logs the failure)
            return narrow(func, args, kwargs)
        try:
            out = func(*args, **kwargs)
        except DataDependentOutputException:
            read = _READS.get(func)
            if read is None:
                raise
            if not any(isinstance(t, FakeTensor) for t in tree_leaves((args, kwargs))):
                with no_dispatch():  # a real tensor (a plain attribute of the module): read its real value
                    return func(*args, **kwargs)
            return read(self, *args)
        except DynamicOutputShapeException:
            bound = _BOUNDS.get(func.overloadpacket)
            if bound is None:
                raise
            out = bound(self, func, args, kwargs)
        if isinstance(out, torch.Tensor):
            value = _infer(self, func.overloadpacket, args, out)
            if value is not None:
                self.known[out] = _cast(value, out.dtype)
        return out

    def value(self, t: torch.Tensor) -> bool | int | float | complex:
        """What every element of ``t`` reads as (known, or the default for its dtype)."""
        known = self.known.get(t)
        if known is not None:
            return _cast(known, t.dtype)
        self.assumed = True
        return _cast(self.opposite if t.dtype == torch.bool else 1, t.dtype)

    def selected(self, mask: torch.Tensor, numel: int) -> int:
        """How many of ``numel`` elements a mask selects: all (none when ``opposite``), unless known."""
        known = self.known.get(mask)
        if known is not None:
            return numel if known else 0
        self.assumed = True
        return 0 if self.opposite else numel

    def _fake_if_real(self, t: torch.Tensor) -> torch.Tensor:
        return t if isinstance(t, FakeTensor) else self.fake_mode.from_tensor(t)


@contextlib.contextmanager
def host_conversions(values: AssumedValues) -> Iterator[None]:
    """``.numpy()`` (so ``np.asarray``), ``.tolist()`` and ``f"{loss:.3f}"`` of fake tensors, with the assumed values.

    ``numpy`` refuses tensor subclasses, ``tolist`` reads element by element and ``format`` treats
    only plain tensors as numbers; validation and prediction steps often end in
    ``preds.cpu().numpy()`` for scikit-learn. For the duration of the trace FakeTensor gets methods
    that answer from ``values`` (restored after).
    """
    patched = {
        "numpy": lambda t, *_, **__: _as_array(values, t),
        "tolist": lambda t: _as_array(values, t).tolist(),
        "__format__": lambda t, spec: format(values.value(t), spec) if t.dim() == 0 else object.__format__(t, spec),
    }
    saved = {name: FakeTensor.__dict__[name] for name in patched if name in FakeTensor.__dict__}
    for name, fn in patched.items():
        setattr(FakeTensor, name, fn)
    try:
        yield
    finally:
        for name in patched:
            delattr(FakeTensor, name)
        for name, fn in saved.items():
            setattr(FakeTensor, name, fn)


def _cast(value: Any, dtype: torch.dtype) -> bool | int | float | complex:
    """A Python number as an element of ``dtype`` reads."""
    if dtype == torch.bool:
        return bool(value)
    if dtype.is_complex:
        return complex(value)
    if dtype.is_floating_point:
        return float(value)
    return int(value)


def _read_scalar(values: AssumedValues, t: torch.Tensor, *_: Any) -> bool | int | float | complex:
    return values.value(t)


def _read_equal(values: AssumedValues, a: torch.Tensor, b: torch.Tensor, *_: Any) -> bool:
    """``torch.equal``/``allclose``: true for a tensor and itself or two of the same known value."""
    known_a, known_b = values.known.get(a), values.known.get(b)
    return a is b or (known_a is not None and known_a == known_b)


_READS: dict[Any, Callable[..., Any]] = {
    aten._local_scalar_dense.default: _read_scalar,
    aten.is_nonzero.default: _read_scalar,
    aten.equal.default: _read_equal,
    aten.allclose.default: _read_equal,
}


def _mask_indices(values: AssumedValues, mask: torch.Tensor) -> torch.Tensor:
    """``nonzero(mask)`` with the largest shape the mask allows ([Note: assumed values])."""
    rows = values.selected(mask, mask.numel())
    return torch.empty((rows, mask.dim()), dtype=torch.long, device=mask.device)


def _bound_nonzero(values: AssumedValues, _func: Any, args: tuple, _kwargs: dict) -> torch.Tensor:
    return _mask_indices(values, args[0])


def _bound_index(values: AssumedValues, func: Any, args: tuple, kwargs: dict) -> Any:
    """Boolean-mask indices become the long indices of every selected element; then index."""
    indices: list[Any] = []
    for index in args[1]:
        if isinstance(index, torch.Tensor) and index.dtype in (torch.bool, torch.uint8):
            indices.extend(_mask_indices(values, index).unbind(1))
        else:
            indices.append(index)
    return func(args[0], indices, *args[2:], **kwargs)


def _bound_masked_select(values: AssumedValues, _func: Any, args: tuple, _kwargs: dict) -> torch.Tensor:
    x, mask = args[0], args[1]
    numel = torch.Size(torch.broadcast_shapes(x.shape, mask.shape)).numel()
    return torch.empty((values.selected(mask, numel),), dtype=x.dtype, device=x.device)


def _unique_outputs(x: torch.Tensor, values_shape: tuple[int, ...], inverse_shape: tuple[int, ...],
                    counts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    long = {"dtype": torch.long, "device": x.device}
    return (torch.empty(values_shape, dtype=x.dtype, device=x.device), torch.empty(inverse_shape, **long),
            torch.empty((counts,), **long))


def _bound_unique(_values: AssumedValues, func: Any, args: tuple, kwargs: dict) -> tuple:
    """One distinct value (or slice along ``dim``): the all-values-equal reading ([Note: assumed values])."""
    x = args[0]
    flags = dict(zip(_argument_names(func), args[1:]))
    flags.update(kwargs)
    dim = flags.get("dim")
    if dim is None:
        found = min(x.numel(), 1)
        inverse = tuple(x.shape) if flags.get("return_inverse", False) else (0,)
        return _unique_outputs(x, (found,), inverse, found if flags.get("return_counts", False) else 0)
    shape = list(x.shape)
    shape[dim] = min(shape[dim], 1)
    return _unique_outputs(x, tuple(shape), (x.shape[dim],), shape[dim])


def _argument_names(func: Any) -> list[str]:
    """The names of an operator's arguments after ``self``, from its schema."""
    return [arg.name for arg in func._schema.arguments[1:]]


def _bound_bincount(values: AssumedValues, _func: Any, args: tuple, kwargs: dict) -> torch.Tensor:
    x = args[0]
    weights = kwargs.get("weights", args[1] if len(args) > 1 else None)
    minlength = kwargs.get("minlength", args[2] if len(args) > 2 else 0)
    bins = max(minlength, int(values.value(x)) + 1)
    dtype = torch.long if weights is None else (weights.dtype if weights.is_floating_point() else torch.float64)
    return torch.empty((bins,), dtype=dtype, device=x.device)


def _bound_repeat_interleave(values: AssumedValues, _func: Any, args: tuple, _kwargs: dict) -> torch.Tensor:
    repeats = args[0]
    return torch.empty((repeats.numel() * max(int(values.value(repeats)), 0),), dtype=torch.long, device=repeats.device)


def _bound_pack_padded(values: AssumedValues, _func: Any, args: tuple, kwargs: dict) -> tuple:
    """``pack_padded_sequence``: every sequence full length (one step each when ``opposite``); the
    batch sizes as a real CPU tensor, as the real operator returns them."""
    x = args[0]
    batch_first = kwargs.get("batch_first", args[2] if len(args) > 2 else False)
    steps, batch = (x.shape[1], x.shape[0]) if batch_first else (x.shape[0], x.shape[1])
    steps = 1 if values.opposite else steps
    values.assumed = True
    with no_dispatch():  # real: the packed RNN kernels read the batch sizes on the host
        batch_sizes = torch.full((steps,), batch, dtype=torch.long)
    return torch.empty((steps * batch, *x.shape[2:]), dtype=x.dtype, device=x.device), batch_sizes


def _bound_ctc_loss(values: AssumedValues, _func: Any, args: tuple, _kwargs: dict) -> tuple:
    """``_ctc_loss``: the negative log-likelihood per sequence and the forward variables ``log_alpha``
    (batch, time, 2 * longest target + 1); the longest target is bounded by the padded width (2-d
    targets) or by every target element (concatenated 1-d targets)."""
    log_probs, targets = args[0], args[1]
    batched = log_probs.dim() == 3
    time, batch = log_probs.shape[0], log_probs.shape[1] if batched else 1
    longest = targets.shape[-1] if targets.dim() == 2 or not batched else targets.numel()
    values.assumed = True
    nll = torch.empty((batch,) if batched else (), dtype=log_probs.dtype, device=log_probs.device)
    alpha = torch.empty((batch, time, 2 * longest + 1), dtype=log_probs.dtype, device=log_probs.device)
    return nll, alpha


def _bound_ctc_loss_backward(_values: AssumedValues, _func: Any, args: tuple, _kwargs: dict) -> torch.Tensor:
    """``_ctc_loss_backward``: a gradient shaped like ``log_probs``."""
    return torch.empty_like(args[1])


_BOUNDS: dict[Any, Callable[..., Any]] = {
    aten._ctc_loss: _bound_ctc_loss,
    aten._ctc_loss_backward: _bound_ctc_loss_backward,
    aten._pack_padded_sequence: _bound_pack_padded,
    aten.nonzero: _bound_nonzero,
    aten.index: _bound_index,
    aten.index_put: _bound_index,
    aten.index_put_: _bound_index,
    aten._index_put_impl_: _bound_index,
    aten.masked_select: _bound_masked_select,
    aten._unique2: _bound_unique,
    aten.unique_consecutive: _bound_unique,
    aten.unique_dim: _bound_unique,
    aten.bincount: _bound_bincount,
    aten.repeat_interleave: _bound_repeat_interleave,
}

def _grouped_mm_in_bf16(func: Any, args: tuple, kwargs: dict) -> torch.Tensor:
    """``_grouped_mm`` on fp32 or fp16: torch's meta kernel accepts bf16 only, its CPU kernel any float
    (Hugging Face's mixture-of-experts layers call it on fp32 there). The shapes do not depend on the
    dtype, so the meta kernel runs on bf16 stand-ins and the result takes the dtype the kernel gives."""
    out_dtype = kwargs.get("out_dtype") or args[0].dtype
    cast = [t.to(torch.bfloat16) if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in args]
    rest = {k: v.to(torch.bfloat16) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
            for k, v in kwargs.items() if k != "out_dtype"}
    return func(*cast, **rest).to(out_dtype)


_NARROW_META: dict[Any, Callable[..., Any]] = {
    aten._grouped_mm.default: _grouped_mm_in_bf16,
}
"""Operators whose meta kernel refuses inputs the real kernel takes: answered another way."""

_NEVER = {aten.isnan, aten.isinf, aten.isposinf, aten.isneginf}  # finite data: these are all False
_ALWAYS = {aten.isfinite}
_SAME_VALUE = {  # every element still has the input's value (possibly cast to the output dtype)
    aten.any, aten.all, aten.amax, aten.amin, aten.max, aten.min, aten.mean, aten.clone, aten.detach,
    aten.alias, aten.view, aten._unsafe_view, aten.reshape, aten.squeeze, aten.unsqueeze, aten.expand,
    aten.select, aten.slice, aten.permute, aten.t, aten.transpose, aten._to_copy, aten.lift_fresh,
    aten.lift_fresh_copy, aten.contiguous, aten.flatten, aten.index, aten.masked_select,
}
_CONSTANT = {aten.ones: 1, aten.ones_like: 1, aten.new_ones: 1, aten.zeros: 0, aten.zeros_like: 0, aten.new_zeros: 0}
_FILLS = {aten.full: 1, aten.full_like: 1, aten.new_full: 2, aten.fill: 1, aten.fill_: 1, aten.scalar_tensor: 0}
"""Factories and fills by the position of their fill value."""
_NEGATE = {aten.logical_not, aten.bitwise_not}
_COMPARE = {aten.eq: operator.eq, aten.ne: operator.ne, aten.lt: operator.lt, aten.le: operator.le,
            aten.gt: operator.gt, aten.ge: operator.ge}
_LOGICAL = {aten.logical_and: all, aten.bitwise_and: all, aten.mul: all, aten.logical_or: any,
            aten.bitwise_or: any, aten.logical_xor: None, aten.bitwise_xor: None}


def _infer(values: AssumedValues, packet: Any, args: tuple, out: torch.Tensor) -> Any:
    """The value every element of ``out`` has, when the inputs determine it; else None."""
    if packet in _NEVER:
        return False
    if packet in _ALWAYS:
        return True
    if packet in _CONSTANT:
        return _CONSTANT[packet]
    if packet in _FILLS:
        at = _FILLS[packet]
        return _known(values, args[at]) if len(args) > at else None
    first = args[0] if args else None
    if not isinstance(first, torch.Tensor):
        return None
    if packet in _SAME_VALUE:
        known = values.known.get(first)
        return known if known is not None or isinstance(first, FakeTensor) else _uniform(first)
    if packet in _NEGATE:
        known = values.known.get(first)
        return None if known is None else not known
    if packet is aten.sum:
        known = values.known.get(first)
        return None if known is None else known * (first.numel() // max(out.numel(), 1))
    if packet in _COMPARE:
        return _infer_compare(values, _COMPARE[packet], first, args[1])
    if packet in _LOGICAL and out.dtype == torch.bool:
        return _infer_logical(values, _LOGICAL[packet], args[:2])
    if _LOGICAL.get(packet) is all and any(k is not None and not k for k in (_known(values, x) for x in args[:2])):
        return 0  # an integer mask and-ed (or multiplied) with a known zero: finished sequences stay finished
    return None


def _uniform(t: torch.Tensor) -> Any:
    """The value of every element of a real tensor (a plain attribute of the module, the batch sizes
    of a packed sequence) when they are all equal, else None: ``int(batch_sizes[0])`` must read the
    real size, not an assumed one."""
    with no_dispatch():
        if t.numel() == 0 or t.is_complex() or t.is_meta:
            return None
        flat = t.reshape(-1)
        return flat[0].item() if bool((flat == flat[0]).all()) else None


def _infer_compare(values: AssumedValues, op: Callable[[Any, Any], bool], a: torch.Tensor, b: Any) -> Any:
    """Comparisons: ``x == x`` holds for finite data, a finite value never equals inf or nan."""
    if a is b:
        return op(0, 0)
    other = _known(values, b)
    known = values.known.get(a)
    if isinstance(other, float) and not (other == other and abs(other) != float("inf")):
        if op in (operator.eq, operator.ne):
            return op is operator.ne  # a finite value is never inf or nan
        return None
    if known is None or other is None:
        return None
    return op(known, other)


def _infer_logical(values: AssumedValues, reduce: Callable[[Any], bool] | None, operands: tuple) -> Any:
    """and/or (and ``mul`` of bools): decided by one known operand; xor only by both."""
    known = [_known(values, x) for x in operands]
    if reduce is all and any(k is not None and not k for k in known):
        return False
    if reduce is any and any(k is not None and k for k in known):
        return True
    if any(k is None for k in known):
        return None
    truths = [bool(k) for k in known]
    return truths[0] != truths[1] if reduce is None else reduce(truths)


def _known(values: AssumedValues, x: Any) -> Any:
    """An operand's value: a scalar's own, a tensor's when known (else None)."""
    return values.known.get(x) if isinstance(x, torch.Tensor) else x


_NUMPY_DTYPES = {
    torch.bool: "bool", torch.uint8: "uint8", torch.int8: "int8", torch.int16: "int16", torch.int32: "int32",
    torch.int64: "int64", torch.float16: "float16", torch.float32: "float32", torch.float64: "float64",
    torch.complex64: "complex64", torch.complex128: "complex128",
}


def _as_array(values: AssumedValues, t: torch.Tensor) -> Any:
    """A numpy array shaped like ``t``, filled with the value ``t`` reads as."""
    import numpy as np

    if t.dtype not in _NUMPY_DTYPES:
        raise TypeError(f"Got unsupported ScalarType {t.dtype} for numpy conversion")
    return np.full(tuple(t.shape), values.value(t), dtype=_NUMPY_DTYPES[t.dtype])
