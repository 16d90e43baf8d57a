"""Optimizers that torch does not ship, declared element-wise or per-parameter: tests run them on shards."""

from __future__ import annotations

from typing import Any

import torch

from lightning_elixir import elementwise_optimizer, per_parameter_optimizer


@elementwise_optimizer
class Lion(torch.optim.Optimizer):
    """Lion (sign of an interpolated momentum, decoupled weight decay): each element reads only itself."""

    def __init__(self, params: Any, lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.99),
                 weight_decay: float = 0.0) -> None:
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p)
                exp_avg = state["exp_avg"]
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(exp_avg.mul(beta1).add_(p.grad, alpha=1 - beta1).sign_(), alpha=-group["lr"])
                exp_avg.mul_(beta2).add_(p.grad, alpha=1 - beta2)
        return loss


@per_parameter_optimizer
class TrustRatioAdam(torch.optim.Optimizer):
    """Adam's moments, each parameter's update scaled by ||parameter|| / ||update|| (LAMB's trust ratio), which
    no shard can compute alone; a trace of each matrix's flattened update (state of another shape than its
    parameter); the step counted in the param group, as timm's LAMB counts it."""

    def __init__(self, params: Any, lr: float = 0.01, betas: tuple[float, float] = (0.9, 0.99), eps: float = 1e-6,
                 weight_decay: float = 0.0) -> None:
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            group["step"] = group.get("step", 0) + 1
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"], state["exp_avg_sq"] = torch.zeros_like(p), torch.zeros_like(p)
                    if p.dim() > 1:
                        state["trace"] = p.new_zeros(p.numel())
                state["exp_avg"].lerp_(p.grad, 1 - beta1)
                state["exp_avg_sq"].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                m = state["exp_avg"] / (1 - beta1 ** group["step"])
                v = state["exp_avg_sq"] / (1 - beta2 ** group["step"])
                update = m / (v.sqrt() + group["eps"]) + group["weight_decay"] * p
                w, u = p.norm(), update.norm()
                trust = torch.where((w > 0) & (u > 0), w / u, torch.ones_like(w))
                if "trace" in state:
                    state["trace"].mul_(0.9).add_(update.reshape(-1), alpha=0.1)
                p.add_(update * trust, alpha=-group["lr"])
        return loss
