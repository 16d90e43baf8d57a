"""What the runtime's hooks are wrapped in: profiler labels that cost nothing when no profiler runs,
and exclusion from torch.compile's tracing.

``torch.autograd.profiler.record_function`` costs about 5 us per use even with no profiler running:
at one label per parameter and per module call, that alone was a tenth of a launch-bound step. So
the runtime labels its work through ``label``, which asks the profiler first (70 ns).

[Note: compiled models]
A model compiled whole (``torch.compile(model)``) or per block (``block.compile()``, as torchtitan
does under FSDP2) runs its modules' hooks inside the frames Dynamo traces. The runtime's hooks
gather, release, swap parameter classes and count arrivals: side effects on Python state that a
traced graph cannot replay. So every hook the runtime registers on a module, and
``ChunkedParameter.__torch_function__``, is ``eager``: Dynamo breaks its graph there, runs the hook
as Python, and compiles what lies between. For a hook unit that is a graph per block, as under
FSDP2; the block's own operators see plain ``nn.Parameter``s (the unit's pre-forward swapped their
class), so its graph holds no call back into the runtime. Gradient arrivals are counted by
post-accumulate-grad hooks, which autograd runs outside any compiled graph. The wrapper costs
0.3 us per call when nothing is compiled.
"""

from __future__ import annotations

import contextlib
from typing import Callable, ContextManager, TypeVar

import torch
from torch.autograd.profiler import record_function

_UNLABELLED = contextlib.nullcontext()
F = TypeVar("F", bound=Callable)


def label(name: str) -> ContextManager:
    """``record_function(name)`` while a profiler runs, else a shared no-op context."""
    if torch._C._autograd._profiler_enabled():
        return record_function(name)
    return _UNLABELLED


def eager(fn: F) -> F:
    """``fn``, never traced by torch.compile: see [Note: compiled models]."""
    return torch.compiler.disable(fn)
