"""The emulated device budget ([Note: emulated device memory] in runtime/emulated.py)."""

from __future__ import annotations

import pytest
import torch

from lightning_elixir.runtime.emulated import EmulatedOutOfMemoryError, active, emulated_device_memory


def test_counts_what_a_step_creates_while_it_lives_and_raises_over_the_limit():
    x = torch.randn(100, 100, requires_grad=True)  # made before: not counted (the baseline says what is held)
    with emulated_device_memory({1: 200_000, 3: 100_000}) as memory:
        assert active() is memory
        memory.begin_step(1, rank=0, baseline_bytes=1_000)
        with memory.counting():
            y = (x @ x).relu()  # the product is freed once relu has its output: one 40 kB tensor lives
            view = y.t()[:10]  # views create no storage
            assert memory.live == 40_000 and memory.peak >= 1_000 + 40_000
            del view
            with pytest.raises(torch.OutOfMemoryError) as err:
                torch.empty(60_000)  # 240 kB more than the 200 kB limit allows
            assert isinstance(err.value, EmulatedOutOfMemoryError)
            assert err.value.needed_bytes == 1_000 + 40_000 + 240_000 and err.value.limit_bytes == 200_000
        assert memory.limit_at(2) == 200_000 and memory.limit_at(5) == 100_000
        memory.begin_step(3, rank=0, baseline_bytes=0)  # a new step: nothing of the last one is counted
        assert memory.live == 0 and memory.peak == 0
        with memory.counting(), pytest.raises(torch.OutOfMemoryError):
            torch.empty(30_000)
    assert active() is None


def test_a_limit_for_some_ranks_leaves_the_others_counting_without_one():
    with emulated_device_memory(1_000, ranks=(1,)) as memory:
        memory.begin_step(1, rank=0, baseline_bytes=0)
        with memory.counting():
            big = torch.empty(10_000)
        assert memory.peak == 40_000 and big.numel() == 10_000


def test_bad_limits_and_nesting_are_refused():
    with pytest.raises(ValueError, match="positive number of bytes"):
        with emulated_device_memory(0):
            pass
    with pytest.raises(ValueError, match="steps"):
        with emulated_device_memory({0: 1_000}):
            pass
    with emulated_device_memory(1_000), pytest.raises(RuntimeError, match="already active"):
        with emulated_device_memory(1_000):
            pass
