"""An optimizer that torch does not ship, declared element-wise: tests run it on shards."""

from __future__ import annotations

from typing import Any

import torch

from lightning_elixir import elementwise_optimizer


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
