"""The same strategy for the standalone ``pytorch_lightning`` package.

``lightning.pytorch`` and ``pytorch_lightning`` ship the same code under two names, and each
Trainer accepts only strategies built on its own base classes. Instead of a hand-kept second
copy, the Lightning-facing modules (launcher, precision, checkpointing, monitor, averaging, autoplan,
toggling, finetuning, after_step, rank_hooks, inputs, steps, strategy) are executed a second time from their own source with the package names swapped, as Lightning
itself derives one package from the other. The result lives under ``lightning_elixir.mirror.<module>``.
"""

from __future__ import annotations

import importlib.util
import sys
import types

MIRRORED = ("lightning_elixir.launcher", "lightning_elixir.precision", "lightning_elixir.checkpointing",
            "lightning_elixir.monitor", "lightning_elixir.averaging", "lightning_elixir.autoplan",
            "lightning_elixir.toggling", "lightning_elixir.finetuning", "lightning_elixir.after_step",
            "lightning_elixir.rank_hooks", "lightning_elixir.inputs", "lightning_elixir.steps",
            "lightning_elixir.strategy")
_RENAMES = (("lightning.pytorch", "pytorch_lightning"), ("lightning.fabric", "lightning_fabric"))


def mirror_name(name: str) -> str:
    return f"{__name__}.{name.rsplit('.', 1)[1]}"


def _translate(source: str) -> str:
    for old, new in _RENAMES:
        source = source.replace(old, new)
    for name in MIRRORED:
        source = source.replace(f"from {name} import", f"from {mirror_name(name)} import")
    return source


def _load(name: str) -> types.ModuleType:
    target = mirror_name(name)
    if target in sys.modules:
        return sys.modules[target]
    spec = importlib.util.find_spec(name)
    module = types.ModuleType(target)
    module.__file__ = spec.origin
    sys.modules[target] = module
    exec(compile(_translate(spec.loader.get_source(name)), spec.origin, "exec"), module.__dict__)
    return module


def register() -> None:
    """Register the Elixir strategy names with ``pytorch_lightning`` (no-op when it is absent)."""
    if importlib.util.find_spec("pytorch_lightning") is None:
        return
    from pytorch_lightning.strategies import StrategyRegistry

    modules = [_load(name) for name in MIRRORED]
    if "elixir" not in StrategyRegistry:
        modules[-1].ElixirStrategy.register_strategies(StrategyRegistry)
