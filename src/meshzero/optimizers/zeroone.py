"""0/1 Adam (arXiv:2202.06009; DeepSpeed's ``"ZeroOneAdam"``): Adam whose variance is
updated on ever rarer steps and then frozen, with 1-bit communication in between and, after
the freeze, local steps synchronised on ever rarer steps.

Computed as DeepSpeed's ``ZeroOneAdam.step`` (runtime/fp16/onebit/zoadam.py):

* the first ``step()`` only creates the state (step count 1);
* variance phase (step count <= ``var_freeze_step``): on a step whose count is a multiple
  of ``var_interval`` the engine all-reduces the gradient and ``m``, ``v`` are Adam's;
  on the others the gradient stays local and ``m = b1 m + (1-b1) onebit_mean(g)`` (``v``
  kept). Every ``var_update_scaler`` variance steps ``var_interval`` doubles;
* frozen phase: local steps ``m = b1 m + (1-b1) g_local``, ``p -= lr u`` (``u = m /
  (sqrt(v) + eps) + wd p``), summing ``-lr u`` into an accumulator ``a`` and the lrs into
  ``L``; on a step whose count is a multiple of ``local_step_interval`` the local steps
  are replaced by their 1-bit average: ``p += -a``, ``a = onebit_mean(a (sqrt(v) + eps))``,
  ``m = -a / L``, ``p += a / (sqrt(v) + eps)``. Every ``local_step_scaler`` steps the
  interval doubles, up to ``local_step_clipper``. The errors restart from zero at the
  freeze.
* ``u`` is applied every step; no bias correction. At one rank nothing is communicated
  and, as in DeepSpeed, ``m`` keeps its value on the variance phase's local steps.

Each parameter's vector is compressed on its own in fp32, a param group's as one under
fp16/bf16, as in optimizers/onebit.py (DeepSpeed's ``ZeroOneAdam.step`` compresses each
tensor of its param groups; its fp16/bf16 wrapper ``FP16_Optimizer`` flattens each group).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from meshzero.optimizers.onebit import one_bit_average
from meshzero.optimizers.onebit_base import CompressingOptimizer, apply_mask, closure_loss


class ZeroOneAdam(CompressingOptimizer):
    def __init__(self, params: Iterable[Any], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, bias_correction: bool = True,
                 eps_inside_sqrt: bool = False, max_grad_norm: float = 0.0,
                 var_freeze_step: int = 100000, var_update_scaler: int = 16,
                 local_step_scaler: int = 32678, local_step_clipper: int = 16,
                 amsgrad: bool = False, cuda_aware: bool = False,
                 comm_backend_name: str = "nccl"):
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                        bias_correction=bias_correction, max_grad_norm=max_grad_norm)
        super().__init__(params, defaults, "0/1 Adam", amsgrad)
        self.var_freeze_step = var_freeze_step
        self.var_update_scaler = var_update_scaler
        self.local_step_scaler = local_step_scaler
        self.local_step_clipper = local_step_clipper

    def _first(self) -> dict[str, Any] | None:
        return next((s for s in self.state.values() if s), None)

    @property
    def frozen(self) -> bool:
        """Past ``var_freeze_step``: v frozen, local steps."""
        first = self._first()
        return first is not None and first["step"] >= 2 and first["step"] > self.var_freeze_step

    def wants_local_gradients(self) -> bool:
        """Whether the next step's gradients stay on their rank."""
        first = self._first()
        if first is None:
            return False
        return self.frozen or (first["step"] + 1) % first["var_interval"] != 0

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        loss = closure_loss(closure)
        if self._first() is None:  # DeepSpeed's first step: state only
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        self.state[p].update(
                            step=1, exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p),
                            momentum_accumulator=torch.zeros_like(p), var_interval=1,
                            var_counter=0, local_step_interval=1, local_step_counter=0, lrs=0.0)
            return loss
        frozen = self.frozen
        for index, group in enumerate(self.param_groups):
            params = [p for p in group["params"] if p.grad is not None]
            if params:
                self._step_group(index, group, params, frozen)
        if not frozen and self.frozen:  # the errors restart at the freeze
            for errors in self._errors.values():
                errors.worker.zero_()
                errors.server.zero_()
        self._keep_local(self.wants_local_gradients())
        return loss

    def _mean(self, index: int, params: list[torch.Tensor], tensors: list[torch.Tensor]) -> bool:
        """The 1-bit mean in place, times the group's ``exp_avg_mask``; False at one rank
        (nothing done, as in DeepSpeed)."""
        if self.comm is None or self.comm.size == 1:
            return False
        one_bit_average(self.comm, self._errors, index, params, tensors, self.flat_groups)
        apply_mask(self.param_groups[index], params, tensors)
        return True

    def _step_group(self, index: int, group: dict[str, Any], params: list[torch.Tensor],
                    frozen: bool) -> None:
        beta1, beta2 = group["betas"]
        states = [self.state[p] for p in params]
        for s in states:
            s["step"] += 1
        step, first = states[0]["step"], states[0]
        if not frozen and step % first["var_interval"] == 0:  # a variance step
            for p, s in zip(params, states, strict=True):
                s["exp_avg_sq"].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                s["exp_avg"].mul_(beta1).add_(p.grad, alpha=1 - beta1)
        elif not frozen:
            grads = [p.grad.clone() for p in params if p.grad is not None]
            if self._mean(index, params, grads):
                for g, s in zip(grads, states, strict=True):
                    s["exp_avg"].mul_(beta1).add_(g, alpha=1 - beta1)
        else:
            for p, s in zip(params, states, strict=True):
                s["exp_avg"].mul_(beta1).add_(p.grad, alpha=1 - beta1)
                s["lrs"] += group["lr"]
        for p, s in zip(params, states, strict=True):
            update = s["exp_avg"] / (s["exp_avg_sq"].sqrt() + group["eps"])
            if group["weight_decay"] > 0.0:
                update += group["weight_decay"] * p
            p.add_(-group["lr"] * update)
            if frozen:
                s["momentum_accumulator"].add_(-group["lr"] * update)
        if frozen and step % first["local_step_interval"] == 0:
            self._synchronise(index, group, params, states)
        for s in states:
            self._count(s, frozen)

    def _synchronise(self, index: int, group: dict[str, Any], params: list[torch.Tensor],
                     states: list[dict[str, Any]]) -> None:
        """The local steps since the last one replaced by their 1-bit average."""
        accs = [s["momentum_accumulator"] for s in states]
        for p, s, acc in zip(params, states, accs, strict=True):
            p.add_(-1 * acc)
            acc.mul_(s["exp_avg_sq"].sqrt() + group["eps"])
        self._mean(index, params, accs)
        for p, s, acc in zip(params, states, accs, strict=True):
            s["exp_avg"].zero_().add_(acc / s["lrs"], alpha=-1)
            p.add_(acc / (s["exp_avg_sq"].sqrt() + group["eps"]))
            acc.zero_()
            s["lrs"] = 0.0

    def _count(self, s: dict[str, Any], frozen: bool) -> None:
        """DeepSpeed's interval counters, per parameter state."""
        if not frozen:
            if s["step"] % s["var_interval"] == 0:
                s["var_counter"] += 1
                if s["var_counter"] == self.var_update_scaler:
                    s["var_counter"] = 0
                    s["var_interval"] *= 2
            return
        s["local_step_counter"] += 1
        if s["local_step_counter"] == self.local_step_scaler:
            s["local_step_counter"] = 0
            s["local_step_interval"] = min(self.local_step_clipper,
                                           s["local_step_interval"] * 2)
