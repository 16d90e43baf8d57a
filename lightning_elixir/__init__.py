"""lightning-elixir: profile-driven chunk-based ZeRO sharding and offloading for PyTorch Lightning.

Importing the package registers the strategy names "elixir", "elixir_spawn", "elixir_zero2" and
"elixir_zero3" with Lightning (``lightning.pytorch``, and ``pytorch_lightning`` when installed).
"""

from lightning_elixir.plan import ChunkSpec, ElixirPlan, PlanError
from lightning_elixir.monitor import ElixirMonitor
from lightning_elixir.precision import ElixirPrecision
from lightning_elixir.runtime.access import OutsideStepError
from lightning_elixir.runtime.optim import elementwise_optimizer
from lightning_elixir.runtime.per_parameter import per_parameter_optimizer
from lightning_elixir.search.calibrate import SelfCorrection
from lightning_elixir.strategy import ElixirStrategy

__all__ = ["ChunkSpec", "ElixirMonitor", "ElixirPlan", "ElixirPrecision", "ElixirStrategy", "OutsideStepError",
           "PlanError", "SelfCorrection", "elementwise_optimizer", "per_parameter_optimizer"]
__version__ = "0.1.0"


def _register() -> None:
    from lightning.pytorch.strategies import StrategyRegistry

    if "elixir" not in StrategyRegistry:
        ElixirStrategy.register_strategies(StrategyRegistry)
    from lightning_elixir import mirror

    mirror.register()


_register()
