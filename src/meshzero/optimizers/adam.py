"""Adam and AdamW exactly as DeepSpeed's fused (GPU) and CPU Adam kernels compute them.

Per element, with g the gradient, p the parameter, t the step::

    g      = g + wd * p                        (adam_w_mode false: L2 in the gradient)
    m      = b1 * m + (1 - b1) * g
    v      = b2 * v + (1 - b2) * g * g
    bc1    = 1 - b1**t, bc2 = 1 - b2**t        (bias_correction false: both 1)
    update = (m / bc1) / (sqrt(v / bc2) + eps)
    update = update + wd * p                   (adam_w_mode true: decoupled decay)
    p      = p - lr * update

With bias correction this is torch's Adam/AdamW up to rounding, and meshzero builds torch's
(fused) optimizer then; this class is built for ``bias_correction: false``, which torch
cannot express (early steps then move by lr * m / (sqrt(v) + eps) with m, v still near 0,
BERT's original recipe). Elementwise: stepping any subset of the parameters gives each the
update a step over all of them would (offload tiers step units and tiles apart).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch


class DeepSpeedAdam(torch.optim.Optimizer):
    """Adam with DeepSpeed's ``adam_w_mode`` and ``bias_correction`` switches (module doc).

    State per parameter, as torch's Adam keeps it: ``step`` (a float32 scalar tensor),
    ``exp_avg`` (m) and ``exp_avg_sq`` (v), so checkpoints and offload tiers treat both alike;
    m and v in ``state_dtype`` (bf16: ``bf16.bf16_optimizer_states``), computed in fp32.
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, *, adam_w_mode: bool = True,
                 bias_correction: bool = True, state_dtype: torch.dtype = torch.float32) -> None:
        if lr <= 0 or eps <= 0 or weight_decay < 0 or not all(0 <= b < 1 for b in betas):
            raise ValueError(f"DeepSpeedAdam: invalid lr {lr}, eps {eps}, weight_decay "
                             f"{weight_decay} or betas {betas}; need lr, eps > 0, "
                             "weight_decay >= 0, 0 <= beta < 1")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        adam_w_mode=adam_w_mode, bias_correction=bias_correction)
        super().__init__(params, defaults)
        self.state_dtype = state_dtype  # not a group value: checkpoints keep groups plain

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._step_one(p, group)
        return loss

    def _step_one(self, p: torch.Tensor, group: dict[str, Any]) -> None:
        adam_step(p, self.state[p], group, self.state_dtype)


def adam_step(p: torch.Tensor, state: dict[str, Any], group: dict[str, Any],
              state_dtype: torch.dtype = torch.float32) -> None:
    """One DeepSpeed Adam step of ``p`` (module docstring) with its optimizer ``state`` (m
    and v made in ``state_dtype`` on the first step) and its param ``group``'s ``lr``,
    ``betas``, ``eps``, ``weight_decay``, ``adam_w_mode`` and ``bias_correction``."""
    b1, b2 = group["betas"]
    wd, lr, eps = group["weight_decay"], group["lr"], group["eps"]
    if not state:
        state["step"] = torch.zeros((), dtype=torch.float32)
        state["exp_avg"] = torch.zeros_like(p, dtype=state_dtype)
        state["exp_avg_sq"] = torch.zeros_like(p, dtype=state_dtype)
    state["step"] += 1
    g = p.grad
    assert g is not None  # step() takes only tensors with a gradient
    # 16-bit states or parameters (bf16 masters): the arithmetic in fp32, each result
    # rounded once into its tensor
    m, v = state["exp_avg"].float(), state["exp_avg_sq"].float()
    w, g = p.float(), g.float()
    if wd != 0 and not group["adam_w_mode"]:
        g = g.add(w, alpha=wd)
    m.mul_(b1).add_(g, alpha=1 - b1)
    v.mul_(b2).addcmul_(g, g, value=1 - b2)
    if m.data_ptr() != state["exp_avg"].data_ptr():
        state["exp_avg"].copy_(m)
        state["exp_avg_sq"].copy_(v)
    bc1, bc2 = 1.0, 1.0
    if group["bias_correction"]:
        t = float(state["step"])
        bc1, bc2 = 1 - b1**t, 1 - b2**t
    update = (m / bc1).div_((v / bc2).sqrt_().add_(eps))
    if wd != 0 and group["adam_w_mode"]:
        update.add_(w, alpha=wd)
    w.add_(update, alpha=-lr)
    if w.data_ptr() != p.data_ptr():
        p.copy_(w)
