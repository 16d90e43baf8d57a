"""Code that runs on an accelerator only, checked on the CPU (meta tensors stand in for device ones)."""

from __future__ import annotations

import pytest
import torch

from lightning_elixir.runtime.optim import _norm_part


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.complex64])
def test_norm_part_on_an_accelerator_takes_every_gradient_dtype(dtype):
    """A float64 or complex gradient shard (64-true, parameters of their own dtype) clipped by norm on a GPU:
    its part of the norm is a float32 scalar, as for the others."""
    g = torch.empty(8, dtype=dtype, device="meta")  # not "cpu": the accelerator's branch
    part = _norm_part(g, 2.0, infinite=False)
    assert part.dtype == torch.float32 and part.shape == ()


def test_norm_part_of_a_complex_host_shard_counts_its_magnitudes():
    """An offloaded complex gradient shard (in host memory, also on a GPU machine): |g|, not its real part."""
    g = torch.tensor([3 + 4j, 1j, -2 + 0j], dtype=torch.complex64)
    torch.testing.assert_close(_norm_part(g, 2.0, infinite=False), torch.tensor(30.0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.complex64])
def test_shadow_on_an_accelerator_steps_every_parameter_dtype(dtype):
    """On a GPU machine an offloaded chunk's shadow takes torch's fused CPU kernel where the user chose no
    implementation; a chunk of complex parameters (their own dtype) steps with torch's default instead."""
    import torch.nn as nn

    from lightning_elixir.runtime.shadow import Shadow

    user = nn.Parameter(torch.ones(4, dtype=dtype))
    shadow_view = nn.Parameter(user.data)
    optimizer = torch.optim.AdamW([user], lr=0.1)
    shadow = Shadow(optimizer, [(0, user, shadow_view)], fused_when_unset=True)
    assert shadow.fused == (not dtype.is_complex)
    shadow.step(shadow.snapshot(), [torch.ones(4, dtype=dtype)])
    reference = nn.Parameter(torch.ones(4, dtype=dtype))
    reference.grad = torch.ones(4, dtype=dtype)
    torch.optim.AdamW([reference], lr=0.1).step()
    torch.testing.assert_close(user.data, reference.data)
