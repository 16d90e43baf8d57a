"""Fake stand-ins for a module's state and batch, and the contexts a profiled step runs in.

Fake tensors (``torch._subclasses.FakeTensorMode``) carry shape, dtype, device and strides but no
data: a 20B-parameter model's fake parameters cost a few hundred bytes each. The module itself is
not copied: ``torch.func.functional_call`` swaps the fake tensors in for the duration of the call
and puts the originals back, so real or meta parameters both work and nothing real is duplicated.

The step is the user's own code (``training_step`` and friends), so the trace also has to survive
what such code does besides computing: read values on the host (``loss.item()``, ``if
torch.isnan(loss)``), index with boolean masks, update torchmetrics metrics or append to lists on
``self``, drive its own optimizers (manual optimization), and log. The contexts below make each
of these harmless while tracing ([Note: assumed values], ``preserved_state``, ``StepStandIns``,
``quiet_logging``), and ``preserved_rng`` keeps the trace from consuming random numbers.
"""

from __future__ import annotations

import contextlib
import inspect
import operator
import random
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.nn as nn
from lightning_utilities.core.apply_func import apply_to_collection
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
)
from torch.utils._mode_utils import no_dispatch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_leaves, tree_map_only
from torch.utils.weak import WeakIdKeyDictionary

from lightning_elixir.profile.types import ProfileError

StepFn = Callable[[nn.Module, Any], Any]
aten = torch.ops.aten


def fake_parameters(module: nn.Module, mode: FakeTensorMode, device: torch.device,
                    param_dtype: torch.dtype | None) -> dict[str, nn.Parameter]:
    """One fake Parameter per distinct parameter of ``module``, keyed by canonical name."""
    return {name: _fake_param(p, mode, device, param_dtype) for name, p in module.named_parameters()}


def fake_state(module: nn.Module, params: Mapping[str, nn.Parameter], mode: FakeTensorMode,
               device: torch.device) -> dict[str, torch.Tensor]:
    """Every parameter and buffer name of ``module`` (tied names too) -> its fake stand-in."""
    by_id = {id(p): params[name] for name, p in module.named_parameters()}
    state: dict[str, torch.Tensor] = {name: by_id[id(p)] for name, p in module.named_parameters(remove_duplicate=False)}
    buffers: dict[int, torch.Tensor] = {}
    for name, buf in module.named_buffers(remove_duplicate=False):
        if id(buf) not in buffers:
            buffers[id(buf)] = _fake_like(buf, mode, device, buf.dtype)
        state[name] = buffers[id(buf)]
    return state


def fake_batch(batch: Any, mode: FakeTensorMode, device: torch.device) -> Any:
    """``batch`` with every tensor replaced by a fake one of the same shape and dtype on ``device``."""
    return apply_to_collection(batch, torch.Tensor, lambda t: _fake_like(t, mode, device, t.dtype))


def default_device(module: nn.Module) -> torch.device:
    """Where the module's real tensors live; the CPU when all of them are on ``meta``."""
    for tensor in [*module.parameters(), *module.buffers()]:
        if tensor.device.type != "meta":
            return tensor.device
    return torch.device("cpu")


def default_step(module: nn.Module) -> StepFn:
    """The step that turns ``(module, batch)`` into a loss, for a LightningModule or a plain module.

    A LightningModule's is its ``training_step``, in automatic or manual optimization alike (with
    manual optimization the step calls ``self.manual_backward`` itself; see ``StepStandIns``).
    """
    return lightning_step("training_step") if hasattr(module, "training_step") else _module_step


def lightning_step(hook: str = "training_step", dataloader_idx: int | None = None) -> StepFn:
    """A step that calls the LightningModule hook ``hook`` as Lightning's loops do for batch 0.

    Args:
        hook: "training_step", "validation_step", "test_step" or "predict_step".
        dataloader_idx: Passed as the third argument when the stage has several dataloaders
            (Lightning passes it only then).

    Returns:
        ``step(module, batch) -> whatever the hook returns``.
    """

    def step(module: nn.Module, batch: Any) -> Any:
        fn = getattr(module, hook)
        args: list[Any] = [batch]
        if _takes_batch_idx(fn):
            args.append(0)
        if dataloader_idx is not None:
            args.append(dataloader_idx)
        return fn(*args)

    return step


def loss_of(out: Any) -> torch.Tensor:
    """The loss in a step's output: the tensor itself, or the "loss" entry of a dict."""
    loss = out.get("loss") if isinstance(out, Mapping) else out
    if not isinstance(loss, torch.Tensor):
        raise ProfileError(f"the step returned no loss tensor for the profiling batch (got {type(out).__name__}) "
                           "and called no manual_backward; return a loss tensor or a dict with 'loss', or pass "
                           "step_fn=lambda module, batch: <loss>")
    return loss


# ---- contexts the step runs in ------------------------------------------------------------------


@contextlib.contextmanager
def quiet_logging(module: nn.Module) -> Iterator[None]:
    """Make ``module.log``/``log_dict`` no-ops on this instance for the duration (restored after).

    With a trainer attached, ``LightningModule.log`` outside the trainer's loop raises; without one
    it warns. Neither is useful while profiling, so the instance gets no-op attributes that shadow
    the methods and are removed afterwards.
    """
    if not hasattr(module, "training_step"):
        yield
        return
    with _shadowed(module, {"log": _no_op, "log_dict": _no_op}):
        yield


@contextlib.contextmanager
def training_mode(module: nn.Module, training: bool = True) -> Iterator[None]:
    """Put every submodule in training (or eval) mode, and restore each one's mode after."""
    modes = [(m, m.training) for m in module.modules()]
    module.train(training)
    try:
        yield
    finally:
        for m, was_training in modes:
            m.training = was_training


@contextlib.contextmanager
def preserved_rng(cuda: bool = False) -> Iterator[None]:
    """Put the global random generators back as they were after the block.

    Planning must not shift the random stream the run sees: dropout masks, ``reset_parameters``
    of meta-initialised modules and the sampler's shuffle would differ from a run without it under
    the same seed. Covered: torch's CPU generator, Python's ``random``, numpy's global generator,
    and the CUDA generators when ``cuda`` is set or CUDA is already initialised (reading them
    otherwise would initialise CUDA in a CPU-only run).
    """
    states = _rng_states(cuda)
    try:
        yield
    finally:
        _set_rng_states(states)


@contextlib.contextmanager
def preserved_state(module: nn.Module) -> Iterator[None]:
    """Put every attribute of every submodule, and the containers they hold, back as they were.

    The traced step is the user's code and may keep what it computes: ``self.losses.append(loss)``,
    ``self.last = out``, torchmetrics states (attributes, some of them lists) and counters such as
    ``_update_count``. Kept, those would be fake tensors that break the real run later. Every
    module reachable from ``module`` (registered, or held in a list or dict) has its ``__dict__``
    recorded shallowly, and every list, dict, set and deque reachable through such containers a
    shallow copy. After the block each changed entry is put back (new attributes are dropped) and
    each changed container refilled in place, since other objects may hold the same list. Objects
    of other classes are not entered: their attributes are the user's responsibility.
    """
    snapshot = _Snapshot(module)
    try:
        yield
    finally:
        snapshot.restore()


# ---- [Note: assumed values] ---------------------------------------------------------------------


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
      ``repeat_interleave`` repeats each element once.
    - In-place writes to real tensors (a plain tensor attribute: ``self.total += loss.detach()``)
      go to a fake copy: with only real inputs FakeTensorMode would run the operator for real and
      change the user's tensor.

    ``.numpy()``, ``.tolist()`` and ``format`` of fake tensors give the same assumed values (see
    ``host_conversions``). An operator not listed here still raises, and the caller falls back.
    """

    def __init__(self, fake_mode: FakeTensorMode) -> None:
        super().__init__()
        self.fake_mode = fake_mode
        self.known: WeakIdKeyDictionary = WeakIdKeyDictionary()  # tensor -> the value of all its elements

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, D105
        kwargs = kwargs or {}
        if func._schema.is_mutable:
            args, kwargs = tree_map_only(torch.Tensor, self._fake_if_real, (args, kwargs))
            for t in tree_leaves((args, kwargs)):  # written in place: what was known may no longer hold
                if isinstance(t, torch.Tensor):
                    self.known.pop(t, None)
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
        return _cast(False if t.dtype == torch.bool else 1, t.dtype)

    def selected(self, mask: torch.Tensor, numel: int) -> int:
        """How many of ``numel`` elements a mask selects: all, unless it is known to be all False."""
        known = self.known.get(mask)
        return 0 if known is not None and not known else numel

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


# ---- manual optimization and other trainer-facing methods ----------------------------------------


class StepStandIns:
    """Harmless stand-ins for a LightningModule's trainer-facing methods while its step is traced.

    At planning time no optimizer is configured yet, and nothing may really step. While installed
    (instance attributes that shadow the methods, as ``quiet_logging`` does):

    - ``optimizers()`` / ``lr_schedulers()`` return wrappers whose ``step`` and ``zero_grad`` do
      nothing (``step(closure)`` runs the closure) and whose other attributes (``param_groups``)
      are those of the objects ``configure_optimizers()`` returns; it is called once, on the first
      request, with the trace paused. Several optimizers unpack as usual (``g_opt, d_opt = ...``).
    - ``manual_backward(loss, ...)`` calls ``backward`` (the traced backward) and counts the calls.
    - ``toggle_optimizer``, ``untoggle_optimizer``, ``toggled_optimizer`` and ``clip_gradients`` do
      nothing: they change which gradients exist, not which modules run (the access order).
    """

    def __init__(self, module: nn.Module, backward: Callable[..., None]) -> None:
        self.module = module
        self.backward = backward
        self.backward_calls = 0
        self._configured: tuple[list[_StandInOptimizer], list[_StandInScheduler]] | None = None

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """Shadow the module's methods with the stand-ins for the duration (LightningModules only)."""
        if not hasattr(self.module, "training_step"):
            yield
            return
        stand_ins = {
            "optimizers": self.optimizers, "lr_schedulers": self.lr_schedulers,
            "manual_backward": self.manual_backward, "toggle_optimizer": _no_op, "untoggle_optimizer": _no_op,
            "toggled_optimizer": _null_context, "clip_gradients": _no_op,
        }
        with _shadowed(self.module, stand_ins):
            yield

    def optimizers(self, use_pl_optimizer: bool = True) -> Any:
        """Like ``LightningModule.optimizers``: one optimizer, or a list of several."""
        optimizers = self._configure()[0]
        return optimizers[0] if len(optimizers) == 1 else list(optimizers)

    def lr_schedulers(self) -> Any:
        """Like ``LightningModule.lr_schedulers``: None, one scheduler, or a list of several."""
        schedulers = self._configure()[1]
        if not schedulers:
            return None
        return schedulers[0] if len(schedulers) == 1 else list(schedulers)

    def manual_backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        """The traced backward of ``loss``."""
        self.backward_calls += 1
        self.backward(loss, *args, **kwargs)

    def _configure(self) -> tuple[list[_StandInOptimizer], list[_StandInScheduler]]:
        """Stand-ins for what ``configure_optimizers()`` returns (called once; at least one optimizer)."""
        if self._configured is None:
            configure = getattr(self.module, "configure_optimizers", None)
            with _disable_current_modes():  # the user's setup code is not part of the step
                out = configure() if configure is not None else None
            optimizers: list[Any] = []
            schedulers: list[Any] = []
            _collect_optimizers(out, optimizers, schedulers)
            self._configured = ([_StandInOptimizer(opt) for opt in optimizers] or [_StandInOptimizer(None)],
                                [_StandInScheduler(s) for s in schedulers])
        return self._configured


# ---- helpers ------------------------------------------------------------------------------------


@contextlib.contextmanager
def _shadowed(module: nn.Module, attributes: Mapping[str, Any]) -> Iterator[None]:
    """Set instance attributes on ``module`` (shadowing its methods), and restore the previous ones."""
    saved = {name: module.__dict__[name] for name in attributes if name in module.__dict__}
    for name, value in attributes.items():
        module.__dict__[name] = value  # not setattr: nn.Module would register a Module or Parameter value
    try:
        yield
    finally:
        for name in attributes:
            module.__dict__.pop(name, None)
        module.__dict__.update(saved)


class _StandInOptimizer:
    """What ``self.optimizers()`` returns while tracing: stepping does nothing, reading works."""

    def __init__(self, optimizer: Any) -> None:
        self.optimizer = optimizer
        self.param_groups = optimizer.param_groups if optimizer is not None else []

    def step(self, closure: Callable[[], Any] | None = None, **_kwargs: Any) -> Any:
        """Run the closure (it usually holds the forward and ``manual_backward``), update nothing."""
        return closure() if closure is not None else None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing: the trace's gradients are fake and released when the trace ends."""

    def toggle_model(self, *_args: Any, **_kwargs: Any) -> contextlib.AbstractContextManager:
        """Nothing to toggle (see ``StepStandIns``)."""
        return contextlib.nullcontext()

    def __getattr__(self, name: str) -> Any:
        optimizer = self.__dict__.get("optimizer")  # not self.optimizer: no recursion before __init__ sets it
        if optimizer is None:
            raise AttributeError(f"configure_optimizers returned no optimizer, so it has no {name!r}")
        return getattr(optimizer, name)


class _StandInScheduler:
    """What ``self.lr_schedulers()`` returns while tracing: stepping does nothing, reading works."""

    def __init__(self, scheduler: Any) -> None:
        self.scheduler = scheduler

    def step(self, *_args: Any, **_kwargs: Any) -> None:
        """Nothing: the learning rate must not move at planning time."""

    def __getattr__(self, name: str) -> Any:
        if "scheduler" not in self.__dict__:  # not yet set (copying): no recursion
            raise AttributeError(name)
        return getattr(self.__dict__["scheduler"], name)


def _collect_optimizers(out: Any, optimizers: list[Any], schedulers: list[Any]) -> None:
    """Optimizers and schedulers, in order, from any of ``configure_optimizers``' return formats.

    Formats: an optimizer; a list or tuple of optimizers (and dicts); ``([optimizers],
    [schedulers])``; a dict with "optimizer" and "lr_scheduler" (a scheduler, or a dict with
    "scheduler"). Anything with ``step`` and an ``optimizer`` attribute counts as a scheduler.
    """
    if isinstance(out, torch.optim.Optimizer):
        optimizers.append(out)
    elif isinstance(out, Mapping):
        if "scheduler" in out:
            schedulers.append(out["scheduler"])
            return
        for value in out.values():
            _collect_optimizers(value, optimizers, schedulers)
    elif isinstance(out, (list, tuple)):
        for item in out:
            _collect_optimizers(item, optimizers, schedulers)
    elif out is not None and hasattr(out, "step") and hasattr(out, "optimizer"):
        schedulers.append(out)


_CONTAINERS = (list, dict, set, deque, tuple)


class _Snapshot:
    """Shallow copies of module ``__dict__``s and of the containers reachable from them."""

    def __init__(self, root: nn.Module) -> None:
        self.attributes: list[tuple[nn.Module, dict[str, Any]]] = []
        self.containers: list[tuple[Any, list[Any]]] = []
        seen: set[int] = set()
        work: list[Any] = [root]
        while work:
            value = work.pop()
            if id(value) in seen:
                continue
            seen.add(id(value))
            if isinstance(value, nn.Module):
                self.attributes.append((value, dict(value.__dict__)))
                work.extend(value.__dict__.values())
            elif isinstance(value, _CONTAINERS):
                items = list(value.items()) if isinstance(value, dict) else list(value)
                if not isinstance(value, tuple):
                    self.containers.append((value, items))
                work.extend(v for _, v in items) if isinstance(value, dict) else work.extend(items)

    def restore(self) -> None:
        """Put back every changed container (in place) and attribute; drop new attributes."""
        for container, items in self.containers:
            if _changed(container, items):
                _refill(container, items)
        for module, attributes in self.attributes:
            current = module.__dict__
            for name in [n for n in current if n not in attributes]:
                del current[name]
            for name, value in attributes.items():
                if current.get(name, _MISSING) is not value:
                    current[name] = value


_MISSING = object()


def _changed(container: Any, items: list[Any]) -> bool:
    """Whether a container now holds other objects (by identity) than ``items``."""
    now = list(container.items()) if isinstance(container, dict) else list(container)
    if len(now) != len(items):
        return True
    if isinstance(container, dict):
        return any(k is not k0 or v is not v0 for (k, v), (k0, v0) in zip(now, items))
    if isinstance(container, set):
        return {id(x) for x in now} != {id(x) for x in items}
    return any(x is not y for x, y in zip(now, items))


def _refill(container: Any, items: list[Any]) -> None:
    """Make a list, dict, set or deque hold ``items`` again, keeping its identity."""
    container.clear()
    if isinstance(container, dict):
        container.update(items)
    elif isinstance(container, list):
        container.extend(items)
    elif isinstance(container, set):
        container.update(items)
    else:
        container.extend(items)


def _rng_states(cuda: bool) -> dict[str, Any]:
    """The global generators' states (see ``preserved_rng``)."""
    states: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and (cuda or torch.cuda.is_initialized()):
        states["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np
    except ImportError:  # numpy is optional for torch
        return states
    states["numpy"] = np.random.get_state()
    return states


def _set_rng_states(states: dict[str, Any]) -> None:
    """Restore what ``_rng_states`` recorded."""
    torch.set_rng_state(states["torch"])
    random.setstate(states["python"])
    if "cuda" in states:
        torch.cuda.set_rng_state_all(states["cuda"])
    if "numpy" in states:
        import numpy as np

        np.random.set_state(states["numpy"])


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


_BOUNDS: dict[Any, Callable[..., Any]] = {
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

_NEVER = {aten.isnan, aten.isinf, aten.isposinf, aten.isneginf}  # finite data: these are all False
_ALWAYS = {aten.isfinite}
_SAME_VALUE = {  # every element still has the input's value (possibly cast to the output dtype)
    aten.any, aten.all, aten.amax, aten.amin, aten.max, aten.min, aten.mean, aten.clone, aten.detach,
    aten.alias, aten.view, aten._unsafe_view, aten.reshape, aten.squeeze, aten.unsqueeze, aten.expand,
    aten.select, aten.slice, aten.permute, aten.t, aten.transpose, aten._to_copy, aten.lift_fresh,
    aten.lift_fresh_copy, aten.contiguous, aten.flatten, aten.index, aten.masked_select,
}
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
    first = args[0] if args else None
    if not isinstance(first, torch.Tensor):
        return None
    if packet in _SAME_VALUE:
        return values.known.get(first)
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
    return None


def _infer_compare(values: AssumedValues, op: Callable[[Any, Any], bool], a: torch.Tensor, b: Any) -> Any:
    """Comparisons: ``x == x`` holds for finite data, a finite value never equals inf or nan."""
    if a is b:
        return op(0, 0)
    other = values.known.get(b) if isinstance(b, torch.Tensor) else b
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
    known = [values.known.get(x) if isinstance(x, torch.Tensor) else x for x in operands]
    if reduce is all and any(k is not None and not k for k in known):
        return False
    if reduce is any and any(k is not None and k for k in known):
        return True
    if any(k is None for k in known):
        return None
    truths = [bool(k) for k in known]
    return truths[0] != truths[1] if reduce is None else reduce(truths)


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


def _takes_batch_idx(fn: Callable[..., Any]) -> bool:
    """Whether Lightning would pass ``batch_idx`` to this hook (its rule: a second argument)."""
    fn = getattr(fn, "__wrapped__", fn)
    spec = inspect.getfullargspec(fn)
    args = spec.args[1:]  # without self, as Lightning counts
    return "batch_idx" in args or spec.varargs is not None or len(args) >= 2


def _fake_param(p: nn.Parameter, mode: FakeTensorMode, device: torch.device,
                param_dtype: torch.dtype | None) -> nn.Parameter:
    """A fake Parameter like ``p``, in ``param_dtype`` when that is given and ``p`` is floating."""
    dtype = param_dtype if param_dtype is not None and p.is_floating_point() else p.dtype
    with mode:
        return nn.Parameter(_fake_like(p, mode, device, dtype), requires_grad=p.requires_grad)


def _fake_like(t: torch.Tensor, mode: FakeTensorMode, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A fake tensor with ``t``'s shape and strides (no data is read or allocated)."""
    with mode:
        fake = torch.empty_strided(t.shape, t.stride(), dtype=dtype, device=device)
    if t.requires_grad and fake.is_floating_point() and not isinstance(t, nn.Parameter):
        fake.requires_grad_(True)
    return fake


class StepModule(nn.Module):
    """Wraps a module and a step so ``functional_call`` can run forward, loss and backward at once.

    Backward must run while the fake tensors are swapped in: activation checkpointing re-runs the
    forward during backward.
    """

    def __init__(self, module: nn.Module, run: Any) -> None:
        super().__init__()
        self.module = module
        self.run = run

    def forward(self, batch: Any) -> Any:
        return self.run(self.module, batch)


def _module_step(module: nn.Module, batch: Any) -> torch.Tensor:
    """A plain module's loss: the sum of its output (batch unpacked when it is a tuple or list)."""
    out = module(*batch) if isinstance(batch, (tuple, list)) else module(batch)
    if not isinstance(out, torch.Tensor):
        raise ProfileError("the module returned no tensor; pass step_fn=lambda module, batch: <loss>")
    return out if out.dim() == 0 else out.sum()


def _no_op(*_args: Any, **_kwargs: Any) -> None:
    """Stands in for ``LightningModule.log`` (and other trainer calls) while profiling."""


def _null_context(*_args: Any, **_kwargs: Any) -> contextlib.AbstractContextManager:
    """Stands in for ``LightningModule.toggled_optimizer`` while profiling."""
    return contextlib.nullcontext()
