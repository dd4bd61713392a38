"""DeepSpeed's ``deepspeed.ops.lion``: ``FusedLion`` and ``DeepSpeedCPULion`` (Chen et al. 2023,
"Symbolic Discovery of Optimization Algorithms"), as DeepSpeed's kernel computes it
(csrc/lion/multi_tensor_lion.cu), per element with m the momentum::

    c = b1 * m + (1 - b1) * g
    p = p * (1 - lr * wd) - lr       where c > 0
    p = p * (1 - lr * wd) + lr       elsewhere (DeepSpeed's kernel: c == 0 moves by +lr)
    m = b2 * m + (1 - b2) * g

torch has no Lion; this is a plain ``torch.optim.Optimizer`` (elementwise, state ``exp_avg``),
computed in fp32, which meshzero rebuilds over ZeRO's fragments like any other.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch


class _Lion(torch.optim.Optimizer):
    def _setup(self, params: Iterable[Any], lr: float, betas: tuple[float, float],
               weight_decay: float, name: str) -> None:
        if not (lr > 0 and weight_decay >= 0 and all(0 <= b < 1 for b in betas)):
            raise ValueError(f"{name}: invalid lr {lr}, weight_decay {weight_decay} or betas "
                             f"{betas}; need lr > 0, weight_decay >= 0, 0 <= beta < 1")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """DeepSpeed's `deepspeed.ops.lion.FusedLion.step`: one Lion step (module docstring)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            b1, b2 = group["betas"]
            lr, wd = group["lr"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
                m, g, w = state["exp_avg"], p.grad.float(), p.float()
                c = m.mul(b1).add_(g, alpha=1 - b1)
                w.mul_(1 - lr * wd).add_(torch.where(c > 0, -lr, lr))
                m.mul_(b2).add_(g, alpha=1 - b2)
                if w.data_ptr() != p.data_ptr():
                    p.copy_(w)
        return loss


class FusedLion(_Lion):
    """DeepSpeed's `deepspeed.ops.lion.FusedLion`: Lion as DeepSpeed's kernel computes it."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), weight_decay: float = 0.0,
                 set_grad_none: bool = True) -> None:
        self._setup(params, lr, betas, weight_decay, "FusedLion")
        self.defaults["set_grad_none"] = self.set_grad_none = set_grad_none

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        """DeepSpeed's `deepspeed.ops.lion.FusedLion.zero_grad`: torch's, per set_grad_none."""
        super().zero_grad(self.set_grad_none if set_to_none is None else set_to_none)


class DeepSpeedCPULion(_Lion):
    """DeepSpeed's `deepspeed.ops.lion.DeepSpeedCPULion`: Lion, momentum kept in fp32."""

    def __init__(self, model_params: Iterable[Any], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), weight_decay: float = 0,
                 fp32_optimizer_states: bool = True) -> None:
        if not fp32_optimizer_states:
            raise ValueError("DeepSpeedCPULion(fp32_optimizer_states=False): meshzero keeps "
                             "Lion's momentum in fp32; pass True")
        self._setup(model_params, lr, betas, weight_decay, "DeepSpeedCPULion")
        self.defaults["fp32_optimizer_states"] = True
