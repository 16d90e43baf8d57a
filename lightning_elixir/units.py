"""Hook units: the groups of modules the runtime gathers, pins and releases together.

[Note: hook units]
The runtime's Python work per step is paid once per hook firing. Hooking every module that holds
parameters (every Linear and LayerNorm) cost a GPT-2 medium step on an H200 more host time than
DDP's whole step ([Note: host cost] in runtime/protocol.py). So the runtime hooks *units*, as FSDP2
hooks each ``fully_shard`` module, and the profile traces the same units, so that the search's
access sequence lines up with the runtime's acquisitions one to one:

- a *block*: a child of an ``nn.ModuleList``, ``nn.Sequential`` or ``nn.ModuleDict`` that has at
  least one sibling of its own class there (the layers of a transformer, the residual blocks of a
  ResNet stage), and that holds parameters. A block owns every parameter of its subtree: a
  mixture-of-experts layer inside it is gathered whole at the block's entry, so which experts a
  rank's tokens happen to choose never changes the collectives a rank issues.
- outside blocks, a module holding parameters directly (an embedding, a final norm, a head). It
  owns its subtree when no block lies inside it (``nn.MultiheadAttention`` then owns its
  ``out_proj``, whose weight it reads without calling it), else only its own parameters.
- an ``nn.ParameterList`` or ``nn.ParameterDict`` is never a unit of its own: it has no forward
  to hook, so its parameters count as its parent's own. The parent's code reads them, often in
  ways that no ``__torch_function__`` sees (``torch.vmap`` over an ensemble's stacked parameters
  wraps them in C++), and only the parent's hooks hold their chunks while it runs.

The rule reads the module tree only, not the chunk layout, because the profile traces the step
before the search chooses a layout; the layout then decides which chunks a unit needs. A
parameter registered by several modules (tied weights) belongs to the first unit that owns it in
``named_modules()`` order; such parameters get private chunks anyway.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch.nn as nn

CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)
"""Module classes whose repeated children are blocks."""
PARAMETER_CONTAINERS = (nn.ParameterList, nn.ParameterDict)
"""Module classes that only hold parameters for their parent: never called, so never hooked."""


@dataclass(frozen=True)
class Unit:
    """One hook unit: a module and the parameters it owns."""

    name: str
    """Qualified name of the module ("" for the root)."""
    params: tuple[str, ...]
    """Canonical names (``named_parameters()``) of the parameters it owns, in registration order."""


def hook_units(module: nn.Module) -> tuple[Unit, ...]:
    """The hook units of ``module``'s tree, in ``named_modules()`` order (see [Note: hook units])."""
    canonical = {id(p): name for name, p in module.named_parameters()}
    owned: dict[str, list[str]] = {}
    claimed: set[str] = set()

    def own(unit: str, mod: nn.Module, recurse: bool) -> None:
        for p in (mod.parameters() if recurse else _own_params(mod)):
            name = canonical[id(p)]
            if name not in claimed:
                claimed.add(name)
                owned.setdefault(unit, []).append(name)

    def visit(name: str, mod: nn.Module, parent: nn.Module | None) -> None:
        if _is_block(mod, parent):
            own(name, mod, recurse=True)
            return
        direct = any(True for _ in _own_params(mod))
        if direct and not _holds_blocks(mod):
            own(name, mod, recurse=True)
            return
        if direct:
            own(name, mod, recurse=False)
        for child_name, child in mod.named_children():
            if not isinstance(child, PARAMETER_CONTAINERS):
                visit(f"{name}.{child_name}" if name else child_name, child, mod)

    visit("", module, None)
    order = {name: i for i, (name, _) in enumerate(module.named_modules())}
    return tuple(Unit(name, tuple(params)) for name, params in sorted(owned.items(), key=lambda kv: order[kv[0]]))


def block_names(module: nn.Module) -> tuple[str, ...]:
    """The blocks of ``module``'s tree (see [Note: hook units]) that no other block contains, in order."""
    found: list[str] = []

    def visit(name: str, mod: nn.Module, parent: nn.Module | None) -> None:
        if _is_block(mod, parent):
            found.append(name)
            return
        for child_name, child in mod.named_children():
            visit(f"{name}.{child_name}" if name else child_name, child, mod)

    visit("", module, None)
    return tuple(found)


def _is_block(mod: nn.Module, parent: nn.Module | None) -> bool:
    """A repeated child of a container that holds parameters."""
    if not isinstance(parent, CONTAINERS):
        return False
    same = sum(type(sibling) is type(mod) for sibling in parent.children())
    return same >= 2 and any(True for _ in mod.parameters())


def _own_params(mod: nn.Module) -> Iterator[nn.Parameter]:
    """The parameters ``mod`` holds itself: registered on it, or in its ParameterList/ParameterDict children."""
    yield from (p for p in mod._parameters.values() if p is not None)
    for child in mod.children():
        if isinstance(child, PARAMETER_CONTAINERS):
            yield from child.parameters()


def _holds_blocks(mod: nn.Module) -> bool:
    """Whether a block lies anywhere inside ``mod``'s subtree."""
    return any(_is_block(child, parent) for parent in mod.modules() for child in parent.children())


def unit_of(units: tuple[Unit, ...]) -> dict[str, str]:
    """Canonical parameter name -> the name of the unit that owns it."""
    return {param: unit.name for unit in units for param in unit.params}


def most_public_chunks(units: tuple[Unit, ...], chunk_of: dict[str, int], private: set[int]) -> int:
    """The most public chunks one unit needs at once (at least 1): the fewest cache blocks a plan can run with.

    Args:
        units: the hook units.
        chunk_of: the chunk index of each parameter name.
        private: the indices of private chunks (always gathered: they take no block).
    """
    return max([len({chunk_of[p] for p in unit.params} - private) for unit in units] + [1])
