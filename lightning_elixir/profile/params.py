"""Canonical parameter names, their owners, and the hook units that own them."""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn

from lightning_elixir.profile.types import ParamInfo
from lightning_elixir.units import hook_units


@dataclass(frozen=True)
class ParamTable:
    """How a module tree names and owns its parameters.

    A tied parameter (one ``Parameter`` registered under several modules) has one canonical name,
    the first that ``named_parameters()`` yields, and several owners.
    """

    infos: tuple[ParamInfo, ...]
    """Every parameter once, in registration order."""
    direct: dict[str, tuple[str, ...]]
    """Qualified module name -> canonical names of the parameters in its ``_parameters``."""
    owners: dict[str, tuple[str, ...]]
    """Canonical parameter name -> qualified names of the modules that register it directly."""
    units: dict[str, tuple[str, ...]]
    """Hook unit (qualified module name) -> canonical names of the parameters it owns ([Note: hook units])."""
    unit_of: dict[str, str]
    """Canonical parameter name -> the hook unit that owns it."""

    @classmethod
    def from_module(cls, module: nn.Module) -> "ParamTable":
        """Read the names and owners of ``module``'s parameters (no tensor is touched)."""
        canonical = {id(p): name for name, p in module.named_parameters()}
        direct: dict[str, tuple[str, ...]] = {}
        owners: dict[str, list[str]] = {name: [] for name in canonical.values()}
        for mod_name, mod in module.named_modules():
            names = tuple(dict.fromkeys(canonical[id(p)] for p in mod._parameters.values() if p is not None))
            direct[mod_name] = names
            for name in names:
                owners[name].append(mod_name)
        infos = tuple(_param_info(name, p) for name, p in module.named_parameters())
        units = {unit.name: unit.params for unit in hook_units(module)}
        unit_of = {param: unit for unit, params in units.items() for param in params}
        return cls(infos, direct, {k: tuple(v) for k, v in owners.items()}, units, unit_of)

    def tied(self) -> tuple[str, ...]:
        """Parameters registered by more than one module, in registration order."""
        return tuple(info.name for info in self.infos if len(self.owners[info.name]) > 1)


def _param_info(name: str, param: nn.Parameter) -> ParamInfo:
    """The ParamInfo of one parameter under its canonical name."""
    owner = name.rsplit(".", 1)[0] if "." in name else ""
    dtype = str(param.dtype).removeprefix("torch.")
    return ParamInfo(name, param.numel(), tuple(param.shape), dtype, param.requires_grad, owner)
