"""Profiling: what one training step of a model does, and how fast this machine is.

``profile_model`` traces a step on fake tensors (no real weights or activations are allocated);
``profile_hardware`` runs microbenchmarks once per machine and caches them. Neither uses a
process group: collectives are injected by the caller.
"""

from lightning_elixir.profile.bench import BenchSizes
from lightning_elixir.profile.hardware import profile_hardware
from lightning_elixir.profile.model import profile_model
from lightning_elixir.profile.types import Access, HardwareProfile, ModelProfile, ParamInfo, ProfileError

__all__ = [
    "Access",
    "BenchSizes",
    "HardwareProfile",
    "ModelProfile",
    "ParamInfo",
    "ProfileError",
    "profile_hardware",
    "profile_model",
]
