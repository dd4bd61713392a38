"""1-bit LAMB (DeepSpeed's "OneBitLamb") at ZeRO stage 0 equals a plain-torch replay of the
algorithm that simulates the N ranks on one process.

What DeepSpeed computes, and where (DeepSpeed 0.19.6): ``OnebitLamb.step``
(runtime/fp16/onebit/lamb.py): a state-only first step; warm-up LAMB without bias
correction (trust ratio clamped to [min_coeff, max_coeff], ``lamb_coeff_freeze`` its
``coeff_beta`` average, ``exp_avg_sq_fresh`` started at the step count ``freeze_step``);
then the engine's all-reduce off, per-parameter ``scaling_coeff`` from the momentum scales
at the first compressed step, every momentum through one ``compressed_allreduce``
(runtime/comm/nccl.py; replayed by tests/test_onebit.py's ``_one_bit_mean``), the
reconstructed gradient into ``exp_avg_sq_fresh`` and the factor clamped to [factor_min,
factor_max] and to ``factor_threshold`` of the last one.
"""

from __future__ import annotations

import math

import pytest
import torch

import meshzero
from meshzero.comm.compressed import padded_numel
from tests.distributed import run_distributed
from tests.models import build_model, make_batches, mlp_loss, split_for_rank
from tests.test_onebit import (
    FP32_AND_BF16,
    _local_gradients,
    _one_bit_mean,
    by_step,
    family_config,
    record_seen_gradients,
)

STEPS, FREEZE, BATCH = 7, 3, 8
PARAMS = {"lr": 1e-2, "freeze_step": FREEZE, "betas": [0.9, 0.999], "eps": 1e-4,
          "weight_decay": 0.01, "max_coeff": 0.5, "min_coeff": 0.01, "coeff_beta": 0.9,
          "factor_max": 4.0, "factor_min": 0.5, "factor_threshold": 0.1}


def config(stage: int = 0, bf16: bool = False) -> dict:
    return family_config("OneBitLamb", PARAMS, BATCH, stage, bf16)


def _split(flat: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    out, offset = [], 0
    for t in like:
        out.append(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()
    return out


class _Replay:
    def __init__(self, world: int):
        self.n = world
        self.p = [p.detach().clone() for p in build_model("mlp", 0).parameters()]
        self.m = [torch.zeros_like(p) for p in self.p]
        self.v = [torch.zeros_like(p) for p in self.p]
        self.vf = [torch.zeros_like(p) for p in self.p]
        self.coeff_freeze = [0.0] * len(self.p)
        self.last_factor = [1.0] * len(self.p)
        self.scaling: list[float] | None = None
        total = padded_numel(sum(p.numel() for p in self.p), world)
        self.worker = [torch.zeros(total) for _ in range(world)]
        self.server = [torch.zeros(total // world) for _ in range(world)]
        self.coeffs: list[float] = []
        self.mask: torch.Tensor | None = None

    def warmup(self, t: int, g: list[torch.Tensor]) -> None:
        (b1, b2), eps, lr, wd = PARAMS["betas"], PARAMS["eps"], PARAMS["lr"], \
            PARAMS["weight_decay"]
        for i, p in enumerate(self.p):
            self.m[i] = b1 * self.m[i] + (1 - b1) * g[i]
            self.v[i] = b2 * self.v[i] + (1 - b2) * g[i] * g[i]
            if t == FREEZE:
                self.vf[i] = self.v[i].clone()
            u = self.m[i] / (self.v[i].sqrt() + eps) + wd * p
            w_norm, u_norm = float(p.pow(2).sum().sqrt()), float(u.pow(2).sum().sqrt())
            c = 1.0 if w_norm == 0 or u_norm == 0 else \
                min(max(w_norm / u_norm, PARAMS["min_coeff"]), PARAMS["max_coeff"])
            if c != 1.0:
                cb = PARAMS["coeff_beta"]
                self.coeff_freeze[i] = cb * self.coeff_freeze[i] + (1 - cb) * c
            self.coeffs.append(c)
            self.p[i] = p - lr * c * u

    def compressed(self, grads: list[list[torch.Tensor]]) -> None:
        b1, b2 = PARAMS["betas"]
        last = [m.clone() for m in self.m]
        if self.scaling is None:
            scales = [float(torch.linalg.vector_norm(m)) / math.sqrt(m.numel()) for m in self.m]
            united = sum(scales) / len(scales)
            self.scaling = [united / s for s in scales]
        flats = [torch.cat([((b1 * m + (1 - b1) * g) * s).reshape(-1) for m, g, s in
                            zip(self.m, grads[r], self.scaling, strict=True)])
                 for r in range(self.n)]
        avg = _one_bit_mean(flats, self.worker, self.server) if self.n > 1 else flats[0]
        self.m = [m / s for m, s in zip(_split(avg, self.m), self.scaling, strict=True)]
        if self.mask is not None:
            self.m = [m * k for m, k in zip(self.m, _split(self.mask, self.m), strict=True)]
        for i, p in enumerate(self.p):
            gr = (self.m[i] - last[i] * b1) / (1 - b1)
            self.vf[i] = b2 * self.vf[i] + (1 - b2) * gr * gr
            self.p[i] = p - PARAMS["lr"] * self._coeff(i, p) * self._update(i, p)

    def _update(self, i: int, p: torch.Tensor) -> torch.Tensor:
        return self.m[i] / (self.v[i].sqrt() + PARAMS["eps"]) + PARAMS["weight_decay"] * p

    def _coeff(self, i: int, p: torch.Tensor) -> float:
        denom = self.v[i].sqrt() + PARAMS["eps"]
        prelim, update = self.m[i] / denom, self._update(i, p)
        factor = float((denom / (self.vf[i].sqrt() + PARAMS["eps"])).max())
        ratio = min(1.0, float(prelim.pow(2).sum().sqrt() / update.pow(2).sum().sqrt()))
        factor = factor * ratio + (1.0 - ratio)
        factor = min(max(factor, PARAMS["factor_min"]), PARAMS["factor_max"])
        last, th = self.last_factor[i], PARAMS["factor_threshold"]
        factor = min(max(factor, last * (1 - th)), last * (1 + th))
        self.last_factor[i] = factor
        self.coeffs.append(self.coeff_freeze[i] * factor)
        return self.coeff_freeze[i] * factor


def reference(world: int, seen: list[list[torch.Tensor]] | None = None,
              mask: torch.Tensor | None = None) -> tuple[list[torch.Tensor], list[float]]:
    """Every step's flat parameters and the LAMB coefficients. ``seen``: the flat gradients
    each rank's optimizer saw at each step (bf16: the all-reduced mean in the warm-up, its
    own after), replayed instead of fp32 gradients computed here. ``mask``: the group's
    exp_avg_mask (flat), multiplied into each momentum after the compressed all-reduce."""
    replay, history, t = _Replay(world), [], 0
    replay.mask = mask
    for step, batch in enumerate(make_batches("mlp", STEPS, BATCH)):
        w = torch.cat([p.reshape(-1) for p in replay.p])
        local = _local_gradients(w, batch, world) if seen is None else seen[step]
        grads = [_split(g, replay.p) for g in local]
        if t == 0:
            t = 1  # the first step creates the state only
        elif t < max(FREEZE, 2):
            t += 1
            mean = (torch.stack(local).sum(0) * (1.0 / world) if seen is None
                    else local[0])  # the engine's all-reduce: the sum, times 1 / N
            replay.warmup(t, _split(mean, replay.p))
        else:
            t += 1
            replay.compressed(grads)
        history.append(torch.cat([p.reshape(-1) for p in replay.p]))
    return history, replay.coeffs


def _train(rank: int, world_size: int, bf16: bool
           ) -> tuple[list[torch.Tensor], list[float], list[torch.Tensor]]:
    engine, _, _, _ = meshzero.initialize(model=build_model("mlp", 0), config=config(0, bf16))
    history, coeffs, seen = [], [], record_seen_gradients(engine)
    for batch in make_batches("mlp", STEPS, BATCH):
        x, y = split_for_rank(batch, rank, world_size, 1, 0)
        engine.backward(mlp_loss(engine(x).float(), y))
        engine.step()
        coeffs += engine.optimizer.lamb_coeffs
        history.append(torch.cat([t.float().reshape(-1)
                                  for t in engine.full_state_dict().values()]))
    engine.close()
    return history, coeffs, seen


@FP32_AND_BF16
def test_onebit_lamb_equals_plain_replay(tmp_path, world_size, bf16):
    """fp32, and bf16, whose stage 0 all-reduces bf16 gradients in the warm-up (DeepSpeed's
    ``FP16_Optimizer`` around ``OnebitLamb``): replayed on the gradients the ranks' optimizers
    saw, all momenta one vector in both (``OnebitLamb.step`` flattens them itself)."""
    results = run_distributed(_train, world_size, tmp_path, bf16, timeout=300)
    seen = by_step([r[2] for r in results]) if bf16 else None
    want, coeffs = reference(world_size, seen)
    frozen = coeffs[-10:]
    # the ratios clamp, the frozen factor moves: the test would mean little otherwise
    assert PARAMS["max_coeff"] in coeffs and len(set(frozen)) > 1
    for rank, (got, got_coeffs, _) in enumerate(results):
        assert got_coeffs == pytest.approx(coeffs, rel=1e-5)
        for step, (g, w) in enumerate(zip(got, want, strict=True)):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6,
                                       msg=lambda m, s=step, r=rank: f"rank {r} step {s}: {m}")


def test_onebit_lamb_refused_with_zero_stages():
    with pytest.raises(meshzero.ConfigError, match="OneBitLamb.*zero_optimization.stage 1"):
        meshzero.load_config(config(1))
