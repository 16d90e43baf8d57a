"""Shared fixtures for the profile tests."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lightning_elixir.profile.types import HardwareProfile


@pytest.fixture
def hardware_factory():
    """Build a synthetic HardwareProfile, overriding any field."""

    def make(**changes) -> HardwareProfile:
        base = HardwareProfile(
            device_name="cpu", device_count=1, world_size=1, torch_version=torch.__version__,
            device_memory_bytes=1 << 34, matmul_flops_per_s=1e11, device_memory_bytes_per_s=1e10,
            h2d_bytes_per_s=1e10, d2h_bytes_per_s=1e10, all_gather_bytes_per_s=((1 << 20, 1e9),),
            reduce_scatter_bytes_per_s=((1 << 20, 1e9),), optimizer_device_numel_per_s=1e9,
            optimizer_cpu_numel_per_s=1e9,
        )
        return dataclasses.replace(base, **changes)

    return make
