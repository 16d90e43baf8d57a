"""Record one step's access sequence, live bytes and cost, with the hooks the runtime uses.

[Note: access granularity]
The runtime gathers parameters from two kinds of hooks on every hook unit ([Note: hook units] in
units.py), and the profile emits one Access per hook firing so that the two sequences line up
one to one:

- a forward pre-hook on every unit -> a "forward" access (or "recompute" when it fires during
  backward: activation checkpointing re-running a forward), listing every parameter the unit
  owns, in the order its operators first read them (owned parameters it did not read last);
- a pre-backward hook (tensor hooks on that unit call's forward outputs; the first to fire
  wins) -> a "backward" access, in the order autograd reaches that unit's backward.

A parameter used outside the unit that owns it (``F.linear(x, self.wte.weight)`` in a parent) is
seen at operator level: the operator mode knows each parameter's storage. It is listed as shared,
added to the running unit's access when a unit is running, and otherwise gets an op-level access
(``op`` set, module "module:op") that no runtime hook sees. In backward an op-level access is
emitted when an operator first touches such a parameter outside an access that lists it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_elixir.profile.cost import OpCost, op_cost
from lightning_elixir.profile.memory import LiveStorages, new_storages, storage_keys, storages_of, tensors_in
from lightning_elixir.profile.params import ParamTable
from lightning_elixir.profile.types import Access, HardwareProfile


@dataclass
class _Record:
    """An access under construction (mutable while the step runs)."""

    phase: str
    module: str
    params: list[str]
    op: str = ""
    live_bytes: int = 0
    peak_bytes: int = 0
    flops: float = 0.0
    moved_bytes: int = 0
    compute_s: float = 0.0

    def add(self, cost: OpCost, live_bytes: int) -> None:
        """Charge one operator to this access."""
        self.flops += cost.flops
        self.moved_bytes += cost.moved_bytes
        self.compute_s += cost.time_s
        self.peak_bytes = max(self.peak_bytes, live_bytes)

    def freeze(self) -> Access:
        """The finished, immutable access."""
        return Access(self.phase, self.module, tuple(self.params), self.live_bytes, self.compute_s,
                      self.flops, self.peak_bytes, self.moved_bytes, self.op)


@dataclass
class _Call:
    """One running forward call of a module (module "" with no record: the step outside modules)."""

    module: str
    record: _Record | None
    op_record: _Record | None = None


@dataclass
class _Totals:
    """Step-wide sums per phase group ("forward"; "backward" includes recomputation)."""

    compute_s: dict[str, float] = field(default_factory=lambda: {"forward": 0.0, "backward": 0.0})
    peak_bytes: dict[str, int] = field(default_factory=lambda: {"forward": 0, "backward": 0})
    recomputed_ops: int = 0
    """Operators run in backward with gradients enabled: forward operators re-run to rebuild a graph
    (activation checkpointing, wherever it is applied, also inside a module's own forward)."""


class StepTracer:
    """Hooks and operator callbacks that turn one running step into a list of accesses."""

    def __init__(self, table: ParamTable, hardware: HardwareProfile | None = None) -> None:
        self.table = table
        self.hardware = hardware
        self.live = LiveStorages()
        self.records: list[_Record] = []
        self.shared: set[str] = set(table.tied())
        self.totals = _Totals()
        self.in_backward = False
        self._stack: list[_Call] = []
        self._outside = _Call("", None)
        self._current: _Record | None = None
        self._param_keys: dict[int, str] = {}
        self._op_level: list[_Record] = []
        self._matched: set[int] = set()

    @contextlib.contextmanager
    def attached(self, module: nn.Module, params: dict[str, nn.Parameter]) -> Iterator[None]:
        """Hook ``module`` and the (fake) ``params`` it runs with, keyed by canonical name."""
        handles = [self._hook_module(name, module.get_submodule(name)) for name in self.table.units]
        handles = [h for pair in handles for h in pair]
        for name, param in params.items():
            self._param_keys[param.untyped_storage()._cdata] = name
            if param.requires_grad:
                handles.append(param.register_post_accumulate_grad_hook(self._on_grad))
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def op_mode(self) -> "_OpMode":
        """A dispatch mode that reports every operator to this tracer."""
        return _OpMode(self)

    def begin_backward(self) -> None:
        """Mark the start of ``loss.backward()``."""
        self._close_current()
        self._current = None
        self.in_backward = True
        self.totals.peak_bytes["backward"] = max(self.totals.peak_bytes["backward"], self.live.live_bytes)

    def end_backward(self) -> None:
        """Mark the end of a backward: what runs next is forward again.

        A manual-optimization step may run several forward/backward pairs (a GAN's generator and
        discriminator losses); each pair is recorded in order, as the runtime's hooks see it.
        """
        self._close_current()
        self._current = None
        self.in_backward = False

    def finish(self) -> list[Access]:
        """Close the last access and return the sequence."""
        self._close_current()
        return [r.freeze() for r in self.records]

    def on_op(self, func: torch._ops.OpOverload, args: tuple, kwargs: dict, out: object) -> None:
        """Account one operator: new storages, cost, and parameter uses."""
        inputs, outputs = tensors_in((args, kwargs)), tensors_in(out)
        for storage in new_storages(inputs, outputs):
            self.live.track(storage)
        cost = op_cost(func, args, kwargs, out, inputs + outputs, self.hardware)
        group = "backward" if self.in_backward else "forward"
        if self.in_backward and torch.is_grad_enabled() and _in_autograd_engine():
            self.totals.recomputed_ops += 1  # the engine runs backward functions with gradients disabled
        self.totals.compute_s[group] += cost.time_s
        self.totals.peak_bytes[group] = max(self.totals.peak_bytes[group], self.live.live_bytes)
        used = self._params_used(inputs)
        if used and (self._stack or not self.in_backward):
            self._forward_uses(used, str(func.overloadpacket))
        elif used:
            self._backward_uses(used)
        if self._current is not None:
            self._current.add(cost, self.live.live_bytes)

    def _hook_module(self, name: str, module: nn.Module) -> tuple:
        """Register the forward pre-hook and forward hook of one module."""
        pre = module.register_forward_pre_hook(partial(self._pre_forward, name))
        post = module.register_forward_hook(partial(self._post_forward, name), always_call=True)
        return pre, post

    def _pre_forward(self, name: str, _module: nn.Module, _args: tuple) -> None:
        """A unit's forward starts: a forward (or recompute) access; its parameters join as they are read."""
        record = _Record(self._forward_phase(), name, [])
        self._start(record)
        self._stack.append(_Call(name, record))

    def _post_forward(self, name: str, _module: nn.Module, _args: tuple, output: object) -> None:
        """A unit's forward ends: list the parameters it owns but did not read; hook its outputs."""
        call = self._stack.pop()
        assert call.module == name, f"module stack out of order: {call.module} != {name}"
        assert call.record is not None
        call.record.params.extend(p for p in self.table.units[name] if p not in call.record.params)
        self._hook_pre_backward(tensors_in(output), partial(self._backward_record, call.record))

    def _hook_pre_backward(self, outputs: list[torch.Tensor], make: Callable[[], _Record]) -> None:
        """Start ``make()`` when the first gradient reaches any of ``outputs``."""
        fired: list[bool] = []

        def hook(_grad: torch.Tensor) -> None:
            if not fired:
                fired.append(True)
                self._start(make())

        for t in outputs:
            if t.requires_grad:
                t.register_hook(hook)

    def _backward_record(self, forward: _Record) -> _Record:
        """The backward access of a module call (its parameters as its forward used them)."""
        return _Record("backward", forward.module, list(forward.params))

    def _forward_uses(self, used: list[str], op: str) -> None:
        """Parameters read by an operator in a forward: find uses outside an access that lists them."""
        call = self._stack[-1] if self._stack else self._outside
        listed = call.record.params if call.record is not None else ()
        for name in used:
            if name in listed:
                continue
            # Outside every unit's call (``call.record`` is None) even the root unit's own parameters are
            # read where no hook holds them: the root unit and the step outside modules share the name "".
            if call.record is None or self.table.unit_of.get(name) != call.module or name in self.shared:
                self.shared.add(name)
            self._attribute(call, name, op)

    def _attribute(self, call: _Call, name: str, op: str) -> None:
        """Add a parameter used outside its access to the call's access, or to an op-level one."""
        if call.record is not None:
            call.record.params.append(name)
            return
        if call.op_record is None:
            call.op_record = _Record(self._forward_phase(), f"{call.module}:{op}", [], op=op)
            self._start(call.op_record)
            self._op_level.append(call.op_record)
        if name not in call.op_record.params:
            call.op_record.params.append(name)

    def _backward_uses(self, used: list[str]) -> None:
        """Parameters read in backward outside an access that lists them: an op-level access."""
        listed = self._current.params if self._current is not None else ()
        missing = [n for n in used if n not in listed and n in self.shared]
        if not missing:
            return
        forward = self._latest_op_level(missing[0])
        label, op = (forward.module, forward.op) if forward is not None else (":backward", "backward")
        self._start(_Record("backward", label, missing, op=op))

    def _latest_op_level(self, name: str) -> _Record | None:
        """The latest forward op-level access of ``name`` not yet matched in backward."""
        for i in range(len(self._op_level) - 1, -1, -1):
            record = self._op_level[i]
            if i not in self._matched and record.phase == "forward" and name in record.params:
                self._matched.add(i)
                return record
        return None

    def _params_used(self, inputs: list[torch.Tensor]) -> list[str]:
        """Canonical names of the parameters whose storage an operator reads."""
        keys = storage_keys(inputs)
        return [self._param_keys[k] for k in keys if k in self._param_keys]

    def _on_grad(self, param: nn.Parameter) -> None:
        """A gradient landed in ``param.grad``: it is no longer activation memory."""
        for storage in storages_of(param.grad):  # a sparse gradient (nn.Embedding(sparse=True)): its parts
            self.live.release(storage)

    def _forward_phase(self) -> str:
        """"recompute" for a forward running inside backward (checkpointing), else "forward"."""
        return "recompute" if self.in_backward else "forward"

    def _start(self, record: _Record) -> None:
        """Make ``record`` the access that the following operators are charged to."""
        self._close_current()
        record.peak_bytes = self.live.live_bytes
        self.records.append(record)
        self._current = record

    def _close_current(self) -> None:
        """Note the live bytes at the end of the current access."""
        if self._current is not None:
            self._current.live_bytes = self.live.live_bytes


def _in_autograd_engine() -> bool:
    """Whether the autograd engine is running a backward (not ``backward()``'s own set-up, which seeds the
    gradient with gradients enabled); torch.utils.checkpoint asks the same."""
    return torch._C._current_graph_task_id() != -1


class _OpMode(TorchDispatchMode):
    """Reports every operator (forward, backward, recompute) to a StepTracer."""

    def __init__(self, tracer: StepTracer) -> None:
        super().__init__()
        self.tracer = tracer

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, D105
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.namespace != "prim":  # prim.device and friends: metadata queries, not work
            self.tracer.on_op(func, args, kwargs, out)
        return out
