"""1-bit LAMB (arXiv:2104.06069; DeepSpeed's ``"OneBitLamb"``): LAMB for ``freeze_step``
steps, then the momentum crosses the data-parallel group in 1 bit with error feedback and
the trust ratio is the one frozen at the warm-up's end, adjusted by a factor from a fresh
variance estimate.

Computed as DeepSpeed's ``OnebitLamb.step`` (runtime/fp16/onebit/lamb.py):

* the first ``step()`` only creates the state (step count 1);
* warm-up: Adam's ``m``, ``v`` on the all-reduced gradient; ``u = m / (sqrt(v) + eps) + wd
  p``; ``c = clamp(||p|| / ||u||, min_coeff, max_coeff)`` (1 for a zero norm);
  ``p -= lr c u``; the frozen ratio ``c_f = coeff_beta c_f + (1 - coeff_beta) c`` whenever
  c != 1; at the step count ``freeze_step`` the fresh variance ``v_f`` starts as ``v``;
* compression: the gradient stays local; at the first compressed step every parameter
  gets ``s = mean scale / its scale`` (scale: ``||m|| / sqrt(numel)``, the mean over all
  parameters); ``m = s (b1 m + (1-b1) g)``, all momenta through the 1-bit all-reduce as one
  vector, ``m /= s``; the gradient it implies ``(m - b1 m_last) / (1 - b1)`` updates
  ``v_f``; ``factor = max((sqrt(v) + eps) / (sqrt(v_f) + eps))`` (with weight decay mixed
  with 1 by ``min(1, ||m / (sqrt(v)+eps)|| / ||u||)``), clamped to [factor_min,
  factor_max] and to within ``factor_threshold`` of the last; ``p -= lr c_f factor u``.

No bias correction (``bias_correction``, ``eps_inside_sqrt``, ``max_grad_norm`` change
nothing, as in DeepSpeed). All param groups' momenta are compressed as one vector, as
DeepSpeed's ``exp_avg_flat`` holds them. The trust ratio needs whole parameters: stage 0.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch

from meshzero.optimizers.onebit import one_bit_mean
from meshzero.optimizers.onebit_base import FreezingOptimizer, apply_mask, closure_loss


class OneBitLamb(FreezingOptimizer):
    def __init__(self, params: Iterable[Any], lr: float = 1e-3, freeze_step: int = 100000,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, bias_correction: bool = True,
                 eps_inside_sqrt: bool = False, max_grad_norm: float = 0.0,
                 max_coeff: float = 10.0, min_coeff: float = 0.01, amsgrad: bool = False,
                 cuda_aware: bool = False, comm_backend_name: str = "nccl",
                 coeff_beta: float = 0.9, factor_max: float = 4.0, factor_min: float = 0.5,
                 factor_threshold: float = 0.1):
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                        bias_correction=bias_correction, max_grad_norm=max_grad_norm,
                        max_coeff=max_coeff, min_coeff=min_coeff)
        super().__init__(params, defaults, "1-bit LAMB", amsgrad)
        self.freeze_step = freeze_step
        self.coeff_beta, self.factor_threshold = coeff_beta, factor_threshold
        self.factor_max, self.factor_min = factor_max, factor_min
        self.lamb_coeffs: list[float] = []  # DeepSpeed's get_lamb_coeffs: the last step's

    def _live(self) -> list[tuple[dict[str, Any], torch.Tensor]]:
        return [(g, p) for g in self.param_groups for p in g["params"]
                if p.grad is not None and p.numel() > 0]

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        loss = closure_loss(closure)
        self.lamb_coeffs = []
        live = self._live()
        if not any(self.state.values()):  # DeepSpeed's first step: state only
            for _, p in live:
                self.state[p].update(step=1, lamb_coeff_freeze=0.0, last_factor=1.0,
                                     exp_avg=torch.zeros_like(p),
                                     exp_avg_sq=torch.zeros_like(p),
                                     exp_avg_sq_fresh=torch.zeros_like(p))
            return loss
        if self.compressing:
            self._compressed_step(live)
            return loss
        for group, p in live:
            self._warmup_step(group, p)
        if self.compressing:
            self._keep_local(True)
        return loss

    def _warmup_step(self, group: dict[str, Any], p: torch.Tensor) -> None:
        state, (beta1, beta2) = self.state[p], group["betas"]
        state["step"] += 1
        m, v = state["exp_avg"], state["exp_avg_sq"]
        m.mul_(beta1).add_(p.grad, alpha=1 - beta1)
        v.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
        if state["step"] == self.freeze_step:
            state["exp_avg_sq_fresh"] = v.clone()
        weight_norm = p.pow(2).sum().sqrt()
        update = m / (v.sqrt() + group["eps"])
        if group["weight_decay"] > 0.0:
            update += group["weight_decay"] * p
        update_norm = update.pow(2).sum().sqrt()
        coeff = 1.0
        if weight_norm != 0 and update_norm != 0:
            coeff = min(max((weight_norm / update_norm).item(), group["min_coeff"]),
                        group["max_coeff"])
        if coeff != 1.0:
            state["lamb_coeff_freeze"] = (self.coeff_beta * state["lamb_coeff_freeze"]
                                          + (1 - self.coeff_beta) * coeff)
        self.lamb_coeffs.append(coeff)
        p.add_(-group["lr"] * coeff * update)

    def _compressed_step(self, live: list[tuple[dict[str, Any], torch.Tensor]]) -> None:
        states = [self.state[p] for _, p in live]
        last = [s["exp_avg"].clone() for s in states]
        if "scaling_coeff" not in states[0]:
            scales = [(torch.linalg.vector_norm(s["exp_avg"])
                       / math.sqrt(s["exp_avg"].numel())).item() for s in states]
            united = sum(scales) / len(scales)
            for s, scale in zip(states, scales, strict=True):
                s["scaling_coeff"] = united / scale
        for (group, p), s in zip(live, states, strict=True):
            s["step"] += 1
            beta1 = group["betas"][0]
            s["exp_avg"].mul_(beta1).add_(p.grad, alpha=1 - beta1)
            s["exp_avg"].mul_(s["scaling_coeff"])
        if self.comm is not None and self.comm.size > 1:
            one_bit_mean(self.comm, self._errors, 0, [s["exp_avg"] for s in states])
        for (group, p), s, m_last in zip(live, states, last, strict=True):
            self._frozen_update(group, p, s, m_last)

    def _frozen_update(self, group: dict[str, Any], p: torch.Tensor, s: dict[str, Any],
                       m_last: torch.Tensor) -> None:
        (beta1, beta2), m = group["betas"], s["exp_avg"]
        m.div_(s["scaling_coeff"])
        apply_mask(group, [p], [m])
        grad = (m - m_last * beta1) / (1 - beta1)
        s["exp_avg_sq_fresh"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        denom = s["exp_avg_sq"].sqrt() + group["eps"]
        prelim = m / denom
        update = prelim + group["weight_decay"] * p if group["weight_decay"] > 0.0 else prelim
        update_norm = update.pow(2).sum().sqrt()
        factor = (denom / (s["exp_avg_sq_fresh"].sqrt() + group["eps"])).max().item()
        if group["weight_decay"] > 0.0:
            ratio = min(1.0, (prelim.pow(2).sum().sqrt() / update_norm).item())
            factor = factor * ratio + (1.0 - ratio)
        factor = min(max(factor, self.factor_min), self.factor_max)
        top, bottom = (s["last_factor"] * (1.0 + self.factor_threshold),
                       s["last_factor"] * (1.0 - self.factor_threshold))
        factor = min(max(factor, bottom), top)
        s["last_factor"] = factor
        coeff = s["lamb_coeff_freeze"] * factor
        self.lamb_coeffs.append(coeff)
        p.add_(-group["lr"] * coeff * update)
