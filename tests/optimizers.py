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


@per_parameter_optimizer
class CountedInPlace(torch.optim.Optimizer):
    """SGD with Adam's first bias correction, the step counted in a tensor in the param group and advanced in
    place (``group["step"].add_(1)``), as timm's LAMB counts it."""

    def __init__(self, params: Any, lr: float = 0.05, beta: float = 0.9) -> None:
        super().__init__(params, dict(lr=lr, beta=beta))

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        for group in self.param_groups:
            if "step" not in group:
                group["step"] = torch.tensor(0.0)
            group["step"].add_(1)
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"] / (1 - group["beta"] ** float(group["step"])))
        return None


@per_parameter_optimizer
class AxisAccumulated(torch.optim.Optimizer):
    """SM3's cover of each tensor by its axes: one accumulator per dimension (``acc_0`` of a (n, m) matrix has
    n values, as many as a vector of n beside it has elements; per-element for the vector, whole for the
    matrix)."""

    def __init__(self, params: Any, lr: float = 0.05, eps: float = 1e-8) -> None:
        super().__init__(params, dict(lr=lr, eps=eps))

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state, g2 = self.state[p], p.grad.square()
                nu = None
                for d in range(p.dim()):
                    acc = state.setdefault(f"acc_{d}", p.new_zeros(p.shape[d]))
                    shape = [1] * p.dim()
                    shape[d] = -1
                    nu = acc.view(shape) if nu is None else torch.minimum(nu, acc.view(shape))
                nu = (g2 if nu is None else nu + g2)
                for d in range(p.dim()):
                    others = [k for k in range(p.dim()) if k != d]
                    state[f"acc_{d}"].copy_(nu.amax(dim=others) if others else nu)
                p.addcdiv_(p.grad, nu.sqrt().add_(group["eps"]), value=-group["lr"])
        return None


@per_parameter_optimizer
class SharedCount(torch.optim.Optimizer):
    """SGD scaled by a count kept in ``self.state["k"]``, as Facebook's (and pytorch_optimizer's) MADGRAD keep
    it: state under no parameter, shared by all of them."""

    def __init__(self, params: Any, lr: float = 0.05) -> None:
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        if "k" not in self.state:
            self.state["k"] = torch.tensor([0])
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"] * float(self.state["k"] + 1) ** 0.5)
        self.state["k"] += 1
        return None


@per_parameter_optimizer
class TensorStepMomentum(torch.optim.Optimizer):
    """Bias-corrected momentum with its ``step`` a 0-d tensor in each parameter's state, as torch's own
    optimizers (and timm's Adafactor of big_vision) keep it."""

    def __init__(self, params: Any, lr: float = 0.05, beta: float = 0.9) -> None:
        super().__init__(params, dict(lr=lr, beta=beta))

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"], state["exp_avg"] = torch.tensor(0.0), torch.zeros_like(p)
                state["step"] += 1
                state["exp_avg"].lerp_(p.grad, 1 - group["beta"])
                p.sub_(group["lr"] * state["exp_avg"] / (1 - group["beta"] ** state["step"]))
        return None


@per_parameter_optimizer
class CachesPerParameter(torch.optim.Optimizer):
    """SGD that caches something per parameter object, as Kron caches each parameter's einsum expressions."""

    def __init__(self, params: Any, lr: float = 0.05) -> None:
        super().__init__(params, dict(lr=lr))
        self.cache: dict[torch.Tensor, torch.Size] = {}

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self.cache.setdefault(p, p.shape)
                    p.add_(p.grad, alpha=-group["lr"])
        return None
