"""DeepSpeed's ``deepspeed.ops.adagrad.DeepSpeedCPUAdagrad``: torch's Adagrad (DeepSpeed's CPU
kernel computes the same update: L2 weight decay in the gradient, the squared gradients
summed, ``p -= lr * g / (sqrt(sum) + eps)``)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch


class DeepSpeedCPUAdagrad(torch.optim.Adagrad):
    """DeepSpeed's `deepspeed.ops.adagrad.DeepSpeedCPUAdagrad`: torch's Adagrad (subclass).

    ``amsgrad=True`` raises (Adagrad has none); ``fp32_optimizer_states`` (default True)
    needs fp32 parameters, whose states torch keeps in fp32 (meshzero's masters are fp32).
    """

    def __init__(self, model_params: Iterable[Any], lr: float = 1e-2, eps: float = 1e-10,
                 weight_decay: float = 0, amsgrad: bool = False,
                 fp32_optimizer_states: bool = True, *, fused: bool | None = None,
                 foreach: bool | None = None) -> None:
        if amsgrad:
            raise ValueError("DeepSpeedCPUAdagrad(amsgrad=True): Adagrad has no AMSGrad "
                             "variant; pass amsgrad=False")
        params = [dict(p, params=list(p["params"])) if isinstance(p, dict) else p
                  for p in model_params]
        super().__init__(params, lr=lr, eps=eps, weight_decay=weight_decay, fused=fused,
                         foreach=foreach)
        low = [tuple(p.shape) for g in self.param_groups for p in g["params"]
               if p.dtype != torch.float32]
        if fp32_optimizer_states and low:
            raise ValueError(f"DeepSpeedCPUAdagrad(fp32_optimizer_states=True): parameters "
                             f"of shapes {low[:3]} are not fp32 and torch's Adagrad keeps "
                             "states in their dtype; pass fp32 parameters (meshzero's master "
                             "copies are) or fp32_optimizer_states=False")
        self.defaults.update(amsgrad=False, fp32_optimizer_states=fp32_optimizer_states)
