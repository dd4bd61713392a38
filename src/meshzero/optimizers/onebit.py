"""1-bit Adam (arXiv:2102.02888; DeepSpeed's ``"OneBitAdam"``): Adam whose momentum, not
its gradient, crosses the data-parallel group after a warm-up, compressed to one bit per
element with error feedback (comm/compressed.py).

Computed as DeepSpeed's ``OnebitAdam.step`` (runtime/fp16/onebit/adam.py) computes it:

* the first ``step()`` only creates the state (DeepSpeed's ``initialize`` pass): the step
  count becomes 1 and nothing is updated;
* warm-up (until the step count reaches ``freeze_step``): the engine all-reduces the
  gradients as usual; ``m = b1 m + (1-b1) g``, ``v = b2 v + (1-b2) g^2``;
* compression (after): the gradients stay on their rank (the engine is told through
  ``keep_gradients_local``); ``m = b1 m + (1-b1) g_local``, then ``m`` is replaced by the
  1-bit estimate of its mean over the ranks; ``v`` is frozen;
* both: ``u = m / (sqrt(v) + eps) + weight_decay * p``; ``p -= lr * u``. There is no bias
  correction (DeepSpeed accepts ``bias_correction`` and ignores it, as it does
  ``eps_inside_sqrt`` and ``max_grad_norm``).

What is compressed as one vector (one scale, one pair of error buffers) follows DeepSpeed,
whose ``OnebitAdam.step`` compresses each tensor of its param groups on its own:

* fp32 (DeepSpeed's engine hands the optimizer the model's parameters: no wrapper in
  ``_do_optimizer_sanity_check``): each parameter's momentum, padded, separately;
* fp16 or bf16 (``_configure_fp16_optimizer`` wraps 1-bit Adam in ``FP16_Optimizer``,
  whose param groups hold one flat fp32 master each): a param group's momenta as one
  vector (its parameters in order, padded). ``bind(..., flat_groups=True)`` selects it.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from typing import Any

import torch
import torch.nn.functional as F

from meshzero.comm.communicator import Communicator
from meshzero.comm.compressed import ErrorFeedback, compressed_all_reduce, padded_numel
from meshzero.optimizers.onebit_base import FreezingOptimizer, apply_mask, closure_loss


class OneBitAdam(FreezingOptimizer):
    def __init__(self, params: Iterable[Any], lr: float = 1e-3, freeze_step: int = 100000,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, bias_correction: bool = True,
                 eps_inside_sqrt: bool = False, max_grad_norm: float = 0.0,
                 amsgrad: bool = False, cuda_aware: bool = False,
                 comm_backend_name: str = "nccl"):
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                        bias_correction=bias_correction, max_grad_norm=max_grad_norm)
        super().__init__(params, defaults, "1-bit Adam", amsgrad)
        self.freeze_step = freeze_step

    @property
    def initialized(self) -> bool:
        """The state exists (DeepSpeed's first, state-only step has run)."""
        return any(self.state.values())

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        loss = closure_loss(closure)
        if not self.initialized:  # DeepSpeed's first step: state only
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        self.state[p].update(step=1, exp_avg=torch.zeros_like(p),
                                             exp_avg_sq=torch.zeros_like(p))
            return loss
        compressing = self.compressing
        for index, group in enumerate(self.param_groups):
            params = [p for p in group["params"] if p.grad is not None]
            if params:
                self._step_group(index, group, params, compressing)
        if not compressing and self.compressing:  # the warm-up ended with this step
            self._keep_local(True)
        return loss

    def _step_group(self, index: int, group: dict[str, Any], params: list[torch.Tensor],
                    compressing: bool) -> None:
        beta1, beta2 = group["betas"]
        for p in params:
            state = self.state[p]
            state["step"] += 1
            state["exp_avg"].mul_(beta1).add_(p.grad, alpha=1 - beta1)
            if not compressing:  # v is frozen after the warm-up
                state["exp_avg_sq"].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
        if compressing and self.comm is not None and self.comm.size > 1:
            self._average_momentum(index, params)
        if compressing:  # as DeepSpeed, at one rank too
            apply_mask(group, params, [self.state[p]["exp_avg"] for p in params])
        for p in params:
            state = self.state[p]
            update = state["exp_avg"] / (state["exp_avg_sq"].sqrt() + group["eps"])
            if group["weight_decay"] > 0.0:
                update += group["weight_decay"] * p
            p.add_(update.mul_(-group["lr"]))

    def _average_momentum(self, index: int, params: list[torch.Tensor]) -> None:
        """The group's momenta through the 1-bit all-reduce (see ``flat_groups``)."""
        assert self.comm is not None
        one_bit_average(self.comm, self._errors, index, params,
                        [self.state[p]["exp_avg"] for p in params], self.flat_groups)


def one_bit_average(comm: Communicator, errors: dict[Hashable, ErrorFeedback], index: int,
                    params: list[torch.Tensor], tensors: list[torch.Tensor],
                    flat_groups: bool) -> None:
    """``tensors`` (one per parameter of ``params``, of param group ``index``) <- their
    1-bit mean over ``comm``'s ranks: all as one vector with the errors ``("group",
    index)`` when ``flat_groups``, else each on its own with the errors ``("param",
    id(p))``, one scale per parameter (DeepSpeed's ``OnebitAdam``/``ZeroOneAdam`` in fp32)."""
    if flat_groups:
        one_bit_mean(comm, errors, ("group", index), tensors)
        return
    for p, t in zip(params, tensors, strict=True):
        one_bit_mean(comm, errors, ("param", id(p)), [t])


def one_bit_mean(comm: Communicator, errors: dict[Hashable, ErrorFeedback], key: Hashable,
                 tensors: list[torch.Tensor]) -> None:
    """``tensors`` <- the 1-bit estimate of their mean over ``comm``'s ranks, compressed as
    one padded vector with the error feedback ``errors[key]`` (made on first use)."""
    flat = torch.cat([t.reshape(-1) for t in tensors])
    numel = flat.numel()
    padded = padded_numel(numel, comm.size)
    if key not in errors:
        errors[key] = ErrorFeedback.zeros(padded, comm.size, flat.device)
    x = F.pad(flat, (0, padded - numel))  # (P,)
    compressed_all_reduce(comm, x, errors[key])
    offset = 0
    for t in tensors:
        t.copy_(x[offset:offset + t.numel()].view_as(t))
        offset += t.numel()
