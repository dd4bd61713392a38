"""DeepSpeed's ``deepspeed.ops.adam.FusedAdam`` and ``DeepSpeedCPUAdam``: torch's Adam.

Both are ``torch.optim.Adam`` subclasses, so meshzero's optimizer rebuild (``optim.py``:
``type(opt)(groups, **defaults)``) makes the same optimizer over ZeRO's fragments with the
same hyperparameters, and asks for torch's fused kernels (CPU and CUDA). DeepSpeed's
switches are honoured: ``adam_w_mode`` is torch's ``decoupled_weight_decay`` (AdamW), and
``bias_correction=False``, which torch cannot compute, steps with meshzero's exact DeepSpeed
Adam arithmetic (``meshzero.optimizers.adam_step``). ``amsgrad=True`` raises, as DeepSpeed's
kernels do.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from typing import Any

import torch

from meshzero.optimizers import adam_step

# torch >= 2.6: Adam decouples weight decay itself (AdamW); on 2.5 meshzero's arithmetic does
_TORCH_DECOUPLES = "decoupled_weight_decay" in inspect.signature(torch.optim.Adam).parameters


class _AdamMap(torch.optim.Adam):
    """torch's Adam with DeepSpeed's ``adam_w_mode``, ``bias_correction`` and
    ``fp32_optimizer_states`` kept in ``defaults`` (so a rebuild keeps them)."""

    def _setup(self, params: Iterable[Any], lr: float, betas: tuple[float, float], eps: float,
               weight_decay: float, adam_w_mode: bool, bias_correction: bool, amsgrad: bool,
               fused: bool | None, foreach: bool | None, name: str) -> None:
        if amsgrad:
            raise ValueError(f"{name}(amsgrad=True): DeepSpeed's kernel has no AMSGrad and "
                             "neither has this map; pass torch.optim.Adam(amsgrad=True) to "
                             "initialize instead")
        params = _listed(params)
        self._exact = not bias_correction or (adam_w_mode and not _TORCH_DECOUPLES)
        if self._exact:
            fused = foreach = None  # meshzero's arithmetic steps these
        elif fused is None and foreach is None:
            fused = _fusable(params)
        extra = {"decoupled_weight_decay": adam_w_mode} if _TORCH_DECOUPLES else {}
        super().__init__(params, lr=lr, betas=tuple(betas), eps=eps,  # type: ignore[arg-type]
                         weight_decay=weight_decay, fused=fused, foreach=foreach, **extra)
        self.defaults.update(bias_correction=bias_correction)
        for group in self.param_groups:
            group.setdefault("bias_correction", bias_correction)
            group.setdefault("adam_w_mode", adam_w_mode)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """DeepSpeed's `deepspeed.ops.adam.FusedAdam.step`: torch's Adam step (or meshzero's)."""
        if not self._exact and all(g["bias_correction"] for g in self.param_groups):
            return super().step(closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    adam_step(p, self.state[p], group, self._state_dtype(p))
        return loss

    def _state_dtype(self, p: torch.Tensor) -> torch.dtype:
        return p.dtype


def _listed(params: Iterable[Any]) -> list[Any]:
    """``params`` as a list, each group's ``params`` a list too (generators read once)."""
    return [dict(p, params=list(p["params"])) if isinstance(p, dict) else p for p in params]


def _tensors(params: list[Any]) -> list[torch.Tensor]:
    """The tensors of ``params`` (tensors, ``(name, tensor)`` pairs or group dicts)."""
    items = [t for p in params for t in (p["params"] if isinstance(p, dict) else [p])]
    return [t[1] if isinstance(t, tuple) else t for t in items]


def _fusable(params: list[Any]) -> bool:
    """torch's fused Adam takes floating tensors on CPU or CUDA, all on one device type."""
    tensors = _tensors(params)
    kinds = {t.device.type for t in tensors}
    return bool(tensors) and len(kinds) == 1 and kinds <= {"cpu", "cuda"} and all(
        t.is_floating_point() for t in tensors)


class FusedAdam(_AdamMap):
    """DeepSpeed's `deepspeed.ops.adam.FusedAdam`: torch's fused Adam/AdamW (subclass).

    ``adam_w_mode`` (default True): decoupled weight decay (AdamW), else L2 in the gradient;
    ``bias_correction=False`` steps with meshzero's DeepSpeed arithmetic; ``amsgrad=True``
    raises; ``set_grad_none``: ``zero_grad()`` sets gradients to None (torch's default).
    ``fused``/``foreach`` (torch's, keyword-only): None picks torch's fused kernels where
    every parameter is a floating CPU or CUDA tensor.
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 adam_w_mode: bool = True, weight_decay: float = 0.0, amsgrad: bool = False,
                 set_grad_none: bool = True, *, fused: bool | None = None,
                 foreach: bool | None = None) -> None:
        self._setup(params, lr, betas, eps, weight_decay, adam_w_mode, bias_correction,
                    amsgrad, fused, foreach, "FusedAdam")
        self.defaults.update(adam_w_mode=adam_w_mode, set_grad_none=set_grad_none)
        self.set_grad_none = set_grad_none

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        """DeepSpeed's `deepspeed.ops.adam.FusedAdam.zero_grad`: torch's, per set_grad_none."""
        super().zero_grad(self.set_grad_none if set_to_none is None else set_to_none)


class DeepSpeedCPUAdam(_AdamMap):
    """DeepSpeed's `deepspeed.ops.adam.DeepSpeedCPUAdam`: torch's fused Adam/AdamW (subclass).

    ``adamw_mode`` (default True): decoupled weight decay; ``bias_correction=False``: meshzero's
    exact DeepSpeed arithmetic; ``fp32_optimizer_states`` (default True): m and v in fp32
    whatever the parameters' dtype (meshzero's fp32 masters have it anyway), False keeps them
    in the parameters' dtype as torch's Adam does; ``amsgrad=True`` raises.
    """

    def __init__(self, model_params: Iterable[Any], lr: float = 1e-3,
                 bias_correction: bool = True, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0, amsgrad: bool = False,
                 adamw_mode: bool = True, fp32_optimizer_states: bool = True, *,
                 fused: bool | None = None, foreach: bool | None = None) -> None:
        params = _listed(model_params)
        wants_fp32 = fp32_optimizer_states and not all(
            t.dtype == torch.float32 for t in _tensors(params))
        self._setup(params, lr, betas, eps, weight_decay, adamw_mode,
                    bias_correction, amsgrad, fused, foreach, "DeepSpeedCPUAdam")
        self._exact = self._exact or wants_fp32  # 16-bit parameters, fp32 m and v
        self.defaults.update(adamw_mode=adamw_mode,
                             fp32_optimizer_states=fp32_optimizer_states)
        self.fp32_optimizer_states = fp32_optimizer_states

    def _state_dtype(self, p: torch.Tensor) -> torch.dtype:
        return torch.float32 if self.fp32_optimizer_states else p.dtype
