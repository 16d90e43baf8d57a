"""Keep what a traced step could change for the run: the module's state and the random streams.

Profiling runs the user's step, which may keep what it computes on ``self`` (fake tensors that
would break the real run later) and consumes random numbers (which would shift the run's random
stream under the same seed). ``preserved_state`` and ``preserved_rng`` put both back.
"""

from __future__ import annotations

import contextlib
import random
from collections import deque
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn as nn


@contextlib.contextmanager
def preserved_rng(cuda: bool = False) -> Iterator[None]:
    """Put the global random generators back as they were after the block.

    Planning must not shift the random stream the run sees: dropout masks, ``reset_parameters``
    of meta-initialised modules and the sampler's shuffle would differ from a run without it under
    the same seed. Covered: torch's CPU generator, Python's ``random``, numpy's global generator,
    and the CUDA generators when ``cuda`` is set or CUDA is already initialised (reading them
    otherwise would initialise CUDA in a CPU-only run).
    """
    states = rng_states(cuda)
    try:
        yield
    finally:
        set_rng_states(states)


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
                items = _contents(value)
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


def _contents(container: Any) -> list[Any]:
    """What a container holds, in order: a dict's (key, value) pairs, any other's elements."""
    return list(container.items()) if isinstance(container, dict) else list(container)


def _changed(container: Any, items: list[Any]) -> bool:
    """Whether a container now holds other objects (by identity) than ``items``."""
    now = _contents(container)
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
    if isinstance(container, (dict, set)):
        container.update(items)  # a dict from its (key, value) pairs
    else:
        container.extend(items)


def rng_states(cuda: bool, every_device: bool = True) -> dict[str, Any]:
    """The global generators' states (see ``preserved_rng``); of the CUDA generators every device's, or
    the current device's only (``every_device=False``: what one rank's step draws from)."""
    states: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and (cuda or torch.cuda.is_initialized()):
        if every_device:
            states["cuda"] = torch.cuda.get_rng_state_all()
        else:
            states["cuda_current"] = (torch.cuda.current_device(), torch.cuda.get_rng_state())
    try:
        import numpy as np
    except ImportError:  # numpy is optional for torch
        return states
    states["numpy"] = np.random.get_state()
    return states


def set_rng_states(states: dict[str, Any]) -> None:
    """Restore what ``rng_states`` recorded."""
    torch.set_rng_state(states["torch"])
    random.setstate(states["python"])
    if "cuda" in states:
        torch.cuda.set_rng_state_all(states["cuda"])
    if "cuda_current" in states:
        device, state = states["cuda_current"]
        torch.cuda.set_rng_state(state, device)
    if "numpy" in states:
        import numpy as np

        np.random.set_state(states["numpy"])
