"""Chunked parameters: every torch operation on a parameter asks the runtime for its value first.

[Note: reads the hooks do not see]
Module hooks gather a module's chunks around its own forward and backward. Code that reads a
parameter anywhere else (``nn.MultiheadAttention`` reading ``out_proj.weight`` in its own
forward, ``F.linear(h, self.emb.weight)`` in another module, an L2 penalty over
``self.parameters()`` in ``training_step``, ``grad_norm(self)`` in a callback) would otherwise
compute with a released placeholder. So the module's parameters become ``ChunkedParameter``: the
same objects, still ``nn.Parameter``, whose class adds a ``__torch_function__`` that runs before
any operator, method or attribute read that needs the parameter's values (``.data``,
``.detach()``, ``F.linear``...). It calls ``runtime.on_param_read``, which returns at once when
the module that owns the parameter is running (the hooks hold its chunk) and otherwise gathers the
chunk or raises an error that says how to read it ([Note: reading outside the hooks] in
runtime.py). Metadata reads (shape, dtype, ``numel()``, ``requires_grad``, new tensors ``*_like`` it)
never gather. Assigning ``.grad`` or ``.data`` goes to the runtime too, which puts the value in the
chunk (``AccessGuard.on_grad_write``, ``on_data_write``): a rebound ``.data`` would cut the parameter
off from its chunk. The cost is one Python call per operator on a parameter, a few microseconds.

Teardown turns them back into plain ``nn.Parameter`` objects.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any, Callable

import torch
import torch.nn as nn

from lightning_elixir.runtime.hotpath import eager

_METADATA = frozenset({
    # attributes
    "shape", "dtype", "device", "requires_grad", "is_leaf", "grad_fn", "ndim", "layout", "is_meta", "is_cuda",
    "is_cpu", "is_xpu", "is_mps", "is_sparse", "is_quantized", "is_mkldnn", "is_nested", "names", "itemsize",
    "nbytes", "_version", "output_nr", "_base", "_cdata", "is_sparse_csr", "_backward_hooks",
    "_post_accumulate_grad_hooks", "is_inference", "_grad_fn", "_grad",
    # methods
    "dim", "size", "numel", "nelement", "stride", "element_size", "is_floating_point", "is_complex",
    "is_contiguous", "storage_offset", "__hash__", "register_hook", "register_post_accumulate_grad_hook",
    "requires_grad_", "_is_view", "get_device", "__len__", "ndimension", "is_signed", "has_names",
    "_is_zerotensor", "is_inference", "untyped_storage", "data_ptr", "__setstate__",
    # new tensors shaped like it (an optimizer's constructor making state, as Adagrad's does)
    "zeros_like", "ones_like", "empty_like", "full_like", "rand_like", "randn_like", "randint_like", "new_zeros",
    "new_ones", "new_empty", "new_full",
})
"""Names of tensor attributes, methods and functions that do not read values (getter and setter alike)."""

_READ, _META, _GRAD, _SET_GRAD, _SET_DATA, _GET_DATA = 0, 1, 2, 3, 4, 5


@functools.cache
def _kind(func: Any) -> int:
    """Whether ``func`` reads values, only metadata, or reads or sets the ``.grad`` attribute (memoised
    per function)."""
    owner = getattr(func, "__self__", None)
    is_accessor = getattr(func, "__name__", "") in ("__get__", "__set__", "__delete__")
    name = getattr(owner, "__name__", "") if is_accessor else getattr(func, "__name__", "")
    setter = is_accessor and func.__name__ != "__get__"
    if name == "grad" and is_accessor:  # the attribute, not torch.autograd.grad
        return _SET_GRAD if setter else _GRAD
    if name == "data" and is_accessor:  # ``.data`` aliases the values without the parameter's version counter
        return _SET_DATA if setter else _GET_DATA
    if name in _METADATA:
        return _META
    return _READ


class ChunkedParameter(nn.Parameter):
    """An ``nn.Parameter`` whose values live in a chunk; see [Note: reads the hooks do not see]."""

    _elixir_read: Callable[["ChunkedParameter", bool], bool]
    _elixir_grad: Callable[["ChunkedParameter"], Any]
    _elixir_set_grad: Callable[["ChunkedParameter", Any], bool]
    _elixir_set_data: Callable[["ChunkedParameter", Any], bool]

    @classmethod
    @eager  # [Note: compiled models] in hotpath.py
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kind = _kind(func)
        if kind == _GRAD:
            return args[0]._elixir_grad(args[0])
        if kind == _SET_GRAD and args[0]._elixir_set_grad(args[0], args[1] if len(args) > 1 else None):
            return None  # the shards took it
        if kind == _SET_DATA and len(args) > 1 and args[0]._elixir_set_data(args[0], args[1]):
            return None  # copied into the chunk
        if kind == _READ:
            detached_copy = _announce_reads(args, kwargs) and func is torch.Tensor.detach
        else:
            detached_copy = False
            if kind == _GET_DATA:
                _announce_reads(args, kwargs, aliasing=True)
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
            # A detached view would outlive the chunk's storage (state_dict() snapshots): copy it.
            return out.clone() if detached_copy else out


    def __deepcopy__(self, memo: dict) -> nn.Parameter:
        # A plain copy of the values: a copy of the class would drag the runtime along with it.
        copied = self._plain_copy()
        memo[id(self)] = copied
        return copied

    def __reduce_ex__(self, protocol: int) -> Any:
        return self._plain_copy().__reduce_ex__(protocol)

    def _plain_copy(self) -> nn.Parameter:
        """An ``nn.Parameter`` holding a copy of the current values (gathered, or an error saying how)."""
        self._elixir_read(self)
        with torch._C.DisableTorchFunctionSubclass():
            return nn.Parameter(self.data.clone(), requires_grad=self.requires_grad)


def _announce_reads(args: tuple, kwargs: dict, aliasing: bool = False) -> bool:
    """Ask the runtime for every chunked parameter among the arguments; True if any was outside its owner.
    ``aliasing``: the read is of ``.data``, whose in-place writes move no version counter of the parameter."""
    outside = False
    for value in (*args, *kwargs.values()):
        if isinstance(value, ChunkedParameter):
            outside |= bool(value._elixir_read(value, aliasing))
        elif isinstance(value, (list, tuple)):
            for item in value:
                if isinstance(item, ChunkedParameter):
                    outside |= bool(item._elixir_read(item, aliasing))
    return outside


def chunk_parameter(param: nn.Parameter, on_read: Callable, on_grad: Callable, on_set_grad: Callable,
                    on_set_data: Callable) -> None:
    """Turn ``param`` (in place: same object) into a ChunkedParameter reporting to the runtime.

    ``on_set_grad(param, value)``: ``param.grad = value`` (``del param.grad``: None); ``on_set_data(param,
    value)``: ``param.data = value``. Each returns True when the runtime took it, False to set the
    attribute itself (autograd's own gradient, in a backward)."""
    param.__class__ = ChunkedParameter
    param._elixir_read = on_read
    param._elixir_grad = on_grad
    param._elixir_set_grad = on_set_grad
    param._elixir_set_data = on_set_data


def check_reads(params: Iterable[nn.Parameter], checked: bool) -> None:
    """Make ``params`` report their reads (``ChunkedParameter``) or not (plain ``nn.Parameter``).

    A unit's parameters are plain while its forward runs, so that its operators dispatch with no
    Python in between ([Note: host cost] in protocol.py); the class is all that changes.
    """
    cls = ChunkedParameter if checked else nn.Parameter
    for param in params:
        param.__class__ = cls


def unchunk_parameter(param: nn.Parameter) -> None:
    """Make ``param`` a plain ``nn.Parameter`` again."""
    if isinstance(param, ChunkedParameter):
        with torch._C.DisableTorchFunctionSubclass():
            del param._elixir_read, param._elixir_grad, param._elixir_set_grad, param._elixir_set_data
            param.__class__ = nn.Parameter
