"""DeepSpeed's ``deepspeed.ops.lamb.FusedLamb``: meshzero's LAMB (``meshzero.optimizers.Lamb``,
DeepSpeed's kernel's arithmetic, trust ratios over whole parameters cut into ZeRO shards)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from meshzero.optimizers import Lamb


class FusedLamb(Lamb):
    """DeepSpeed's `deepspeed.ops.lamb.FusedLamb`: meshzero's Lamb, DeepSpeed's signature."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 eps_inside_sqrt: bool = False, weight_decay: float = 0.0,
                 max_grad_norm: float = 0.0, max_coeff: float = 10.0, min_coeff: float = 0.01,
                 amsgrad: bool = False) -> None:
        if amsgrad:
            raise ValueError("FusedLamb(amsgrad=True): LAMB has no AMSGrad variant, in "
                             "DeepSpeed or meshzero; pass amsgrad=False")
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         bias_correction=bias_correction, eps_inside_sqrt=eps_inside_sqrt,
                         max_grad_norm=max_grad_norm, max_coeff=max_coeff,
                         min_coeff=min_coeff)
