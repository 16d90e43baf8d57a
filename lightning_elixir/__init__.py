"""lightning-elixir: profile-driven chunk-based ZeRO sharding and offloading for PyTorch Lightning."""

from lightning_elixir.plan import ChunkSpec, ElixirPlan, PlanError

__all__ = ["ChunkSpec", "ElixirPlan", "PlanError"]
__version__ = "0.1.0"
