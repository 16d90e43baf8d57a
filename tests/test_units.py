"""Hook units ([Note: hook units] in units.py): which module's hooks hold which parameters."""

from __future__ import annotations

import torch
import torch.nn as nn

from lightning_elixir.units import hook_units


class _Stacked(nn.Module):
    """Parameters in a ParameterList and a ParameterDict beside a block stack, read by the parent's forward."""

    def __init__(self) -> None:
        super().__init__()
        self.stacked = nn.ParameterList([nn.Parameter(torch.zeros(3, 2)), nn.Parameter(torch.zeros(3))])
        self.extra = nn.ParameterDict({"scale": nn.Parameter(torch.ones(2))})
        self.layers = nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)])


def test_parameter_containers_belong_to_their_parent():
    """A ParameterList/ParameterDict has no forward to hook: its parameters are the parent's own, held by the
    parent's hooks while the parent runs (where torch.vmap reads them unseen)."""
    units = {unit.name: unit.params for unit in hook_units(_Stacked())}
    assert units == {"": ("stacked.0", "stacked.1", "extra.scale"),
                     "layers.0": ("layers.0.weight", "layers.0.bias"),
                     "layers.1": ("layers.1.weight", "layers.1.bias")}


def test_a_parameter_container_under_a_plain_module_joins_its_subtree():
    model = nn.Sequential(nn.Linear(2, 2))
    model.add_module("weights", nn.ParameterList([nn.Parameter(torch.zeros(2))]))
    assert [(u.name, u.params) for u in hook_units(model)] == [("", ("0.weight", "0.bias", "weights.0"))]
