"""LAMB (You et al. 2019, "Large Batch Optimization for Deep Learning") as DeepSpeed's
``"Lamb"`` type (its FusedLamb kernel) computes it, over whole parameters cut into shards.

Per parameter P (a whole tensor) with gradient g, step t::

    g      = g / c, c = (||g||_global + 1e-6) / max_grad_norm when c > 1 (max_grad_norm > 0)
    m      = b1 * m + (1 - b1) * g
    v      = b2 * v + (1 - b2) * g * g
    u      = m / (sqrt(v) + eps) + wd * p       (eps_inside_sqrt: m / sqrt(v + eps))
    ratio  = clamp(||P|| / ||U||, min_coeff, max_coeff), 1 if either norm is 0
    p      = p - step_size * ratio * u,  step_size = lr * sqrt(1 - b2**t) / (1 - b1**t)
                                         (bias_correction false: lr)

The trust ratio is what makes LAMB not elementwise: ``||P||`` and ``||U||`` are norms of the
*whole* parameter. Under ZeRO the optimizer steps fragments (parts of parameters inside this
rank's shard), so :class:`FragmentNorms` says which whole each fragment belongs to and how to
sum the squared norms over the ranks holding the other fragments (one all-reduce of a
``(parameters, 2)`` tensor per step). The update is computed twice (once for its norm, once to
apply it), as DeepSpeed's kernel does, so no parameter-sized buffer is kept.

``max_grad_norm``: DeepSpeed documents it as clipping the *global* gradient norm (its code
expects per-parameter norms from the caller, and DeepSpeed's engine passes none); meshzero
implements the documented global clip, the norm summed over every fragment and rank.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class FragmentNorms:
    """Which whole parameter each optimizer tensor is part of, and how to sum over ranks.

    ``whole_of``: id(optimizer tensor) -> index of its whole parameter (the same index on
    every rank); ``num_wholes``: how many; ``all_reduce``: sums a float64 tensor in place over
    the ranks that hold the other fragments (identity when every whole is local).
    """

    whole_of: dict[int, int]
    num_wholes: int
    all_reduce: Callable[[torch.Tensor], None]


def _local(params: list[torch.Tensor]) -> FragmentNorms:
    """Unsharded: every parameter is its own whole."""
    return FragmentNorms({id(p): i for i, p in enumerate(params)}, len(params), lambda t: None)


class Lamb(torch.optim.Optimizer):
    """LAMB with DeepSpeed's params (module docstring). State per parameter: ``step`` (a
    float32 scalar tensor), ``exp_avg`` (m), ``exp_avg_sq`` (v)."""

    elementwise = False  # the trust ratio needs whole-parameter norms: step all at once

    def __init__(self, params: Iterable[Any], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, *, bias_correction: bool = True,
                 eps_inside_sqrt: bool = False, max_grad_norm: float = 0.0,
                 max_coeff: float = 10.0, min_coeff: float = 0.01) -> None:
        if not (lr > 0 and eps > 0 and weight_decay >= 0 and max_grad_norm >= 0
                and 0 <= min_coeff <= max_coeff and all(0 <= b < 1 for b in betas)):
            raise ValueError(
                f"Lamb: invalid lr {lr}, eps {eps}, weight_decay {weight_decay}, max_grad_norm "
                f"{max_grad_norm}, betas {betas} or coeffs [{min_coeff}, {max_coeff}]; need "
                "lr, eps > 0, weight_decay, max_grad_norm >= 0, 0 <= beta < 1, "
                "0 <= min_coeff <= max_coeff")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        bias_correction=bias_correction, eps_inside_sqrt=eps_inside_sqrt,
                        max_grad_norm=max_grad_norm, max_coeff=max_coeff, min_coeff=min_coeff)
        super().__init__(params, defaults)
        self.fragment_norms: FragmentNorms | None = None  # None: each tensor is a whole

    def bind_fragments(self, norms: FragmentNorms) -> None:
        """Step fragments of parameters: norms are summed per whole and over ranks."""
        self.fragment_norms = norms

    def _norms(self) -> FragmentNorms:
        if self.fragment_norms is not None:
            return self.fragment_norms
        return _local([p for g in self.param_groups for p in g["params"]])

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        norms = self._norms()
        stepped = [(p, g) for g in self.param_groups for p in g["params"]
                   if p.grad is not None and id(p) in norms.whole_of]
        device = stepped[0][0].device if stepped else torch.device("cpu")
        clip = self._grad_clip(stepped, norms, device)
        # (whole, [||P||^2, ||U||^2]) in float64: the sum over fragments and ranks is then
        # the unsharded norm up to fp32 rounding of the terms
        sums = torch.zeros(norms.num_wholes, 2, dtype=torch.float64, device=device)
        for p, group in stepped:
            u = self._moments_and_update(p, group, clip)
            k = norms.whole_of[id(p)]
            sums[k, 0] += p.double().square().sum()
            sums[k, 1] += u.double().square().sum()
        norms.all_reduce(sums)  # every rank's fragments of each whole
        whole_norms = sums.sqrt().tolist()
        for p, group in stepped:
            w_norm, u_norm = whole_norms[norms.whole_of[id(p)]]
            ratio = self._trust_ratio(w_norm, u_norm, group)
            p.add_(self._update(p, group), alpha=-self._step_size(p, group) * ratio)
        return loss

    def _grad_clip(self, stepped: list[tuple[torch.Tensor, dict]], norms: FragmentNorms,
                   device: torch.device) -> dict[int, float]:
        """id(group) -> the divisor of its gradients (1: no clip)."""
        limits = {id(g): g["max_grad_norm"] for _, g in stepped}
        if not any(limit > 0 for limit in limits.values()):
            return {}
        sq = torch.zeros(1, dtype=torch.float64, device=device)
        for p, _ in stepped:
            assert p.grad is not None  # stepped holds only tensors with a gradient
            sq += p.grad.double().square().sum()
        norms.all_reduce(sq)
        norm = math.sqrt(float(sq))
        out = {}
        for gid, limit in limits.items():
            c = (norm + 1e-6) / limit if limit > 0 else 1.0
            out[gid] = c if c > 1 else 1.0
        return out

    def _moments_and_update(self, p: torch.Tensor, group: dict[str, Any],
                            clip: dict[int, float]) -> torch.Tensor:
        state = self.state[p]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["step"] += 1
        b1, b2 = group["betas"]
        g = p.grad
        assert g is not None  # step() takes only tensors with a gradient
        c = clip.get(id(group), 1.0)
        if c != 1.0:
            g = g / c
        state["exp_avg"].mul_(b1).add_(g, alpha=1 - b1)
        state["exp_avg_sq"].mul_(b2).addcmul_(g, g, value=1 - b2)
        return self._update(p, group)

    def _update(self, p: torch.Tensor, group: dict[str, Any]) -> torch.Tensor:
        """u = m / denom + wd * p, from the updated moments."""
        state, eps = self.state[p], group["eps"]
        v = state["exp_avg_sq"]
        denom = (v + eps).sqrt_() if group["eps_inside_sqrt"] else v.sqrt().add_(eps)
        u = state["exp_avg"] / denom
        if group["weight_decay"] != 0:
            u.add_(p, alpha=group["weight_decay"])
        return u

    def _step_size(self, p: torch.Tensor, group: dict[str, Any]) -> float:
        if not group["bias_correction"]:
            return group["lr"]
        b1, b2 = group["betas"]
        t = float(self.state[p]["step"])
        return group["lr"] * math.sqrt(1 - b2**t) / (1 - b1**t)

    @staticmethod
    def _trust_ratio(w_norm: float, u_norm: float, group: dict[str, Any]) -> float:
        if w_norm == 0 or u_norm == 0:
            return 1.0
        return min(max(w_norm / u_norm, group["min_coeff"]), group["max_coeff"])
