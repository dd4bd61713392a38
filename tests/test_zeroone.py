"""0/1 Adam (DeepSpeed's "ZeroOneAdam") at ZeRO stage 0 equals a plain-torch replay of the
algorithm that simulates the N ranks on one process.

What DeepSpeed computes, and where (DeepSpeed 0.19.6): ``ZeroOneAdam.step``
(runtime/fp16/onebit/zoadam.py): a state-only first step; variance steps on step counts
that are multiples of ``var_interval`` (Adam on the all-reduced gradient; the engine's
all-reduce is switched on for exactly those steps through ``enable_backward_allreduce``),
``m`` from the 1-bit mean of the local gradients on the others, ``var_interval`` doubling
every ``var_update_scaler`` variance steps; after ``var_freeze_step`` local steps whose
accumulated updates are replaced by their 1-bit mean every ``local_step_interval`` steps
(doubling every ``local_step_scaler`` steps up to ``local_step_clipper``), the errors
zeroed once at the freeze; the compression is ``NcclBackend.compressed_allreduce``
(runtime/comm/nccl.py), replayed by tests/test_onebit.py's ``_one_bit_mean``, called by
``ZeroOneAdam.step`` on each parameter with its own ``worker_error``/``server_error`` (fp32:
no ``FP16_Optimizer`` flattening), replayed by tests/test_onebit.py's ``Compressor``.

With the parameters below the 12 steps cover: variance steps (2, 3, 4, 6), 1-bit gradient
steps (5, 7), synchronised local steps (8, 9, 10, 12) and an unsynchronised one (11), after
which the ranks' parameters differ until step 12.
"""

from __future__ import annotations

import pytest
import torch

import meshzero
from tests.distributed import run_distributed
from tests.models import build_model, make_batches, mlp_loss, split_for_rank
from tests.test_onebit import (
    FP32_AND_BF16,
    Compressor,
    _local_gradients,
    by_step,
    family_config,
    param_sizes,
    record_seen_gradients,
)

STEPS, BATCH = 12, 8
PARAMS = {"lr": 1e-2, "betas": [0.9, 0.999], "eps": 1e-4, "weight_decay": 0.01,
          "var_freeze_step": 6, "var_update_scaler": 2, "local_step_scaler": 2,
          "local_step_clipper": 4}


def config(stage: int = 0, bf16: bool = False) -> dict:
    return family_config("ZeroOneAdam", PARAMS, BATCH, stage, bf16)


class _Replay:
    """The ranks' state: parameters, m and accumulators per rank; v, counters shared."""

    def __init__(self, world: int, flat: bool = False):
        w = torch.cat([p.detach().reshape(-1) for p in build_model("mlp", 0).parameters()])
        self.n, self.flat = world, flat
        self.mask: torch.Tensor | None = None  # the group's exp_avg_mask, flat
        self.w = [w.clone() for _ in range(world)]
        self.m = [torch.zeros_like(w) for _ in range(world)]
        self.acc = [torch.zeros_like(w) for _ in range(world)]
        self.v = torch.zeros_like(w)
        # fp32: each parameter its own vector; bf16: the param group as one
        self.compress = Compressor(param_sizes(flat), world)
        self.t, self.lrs, self.frozen = 0, 0.0, False
        self.var_interval, self.var_counter, self.lsi, self.lsc = 1, 0, 1, 0

    def mean(self, vectors: list[torch.Tensor]) -> list[torch.Tensor] | None:
        if self.n == 1:
            return None
        avg = self.compress(vectors)
        avg = avg if self.mask is None else avg * self.mask
        return [avg] * self.n

    def step(self, grads: list[torch.Tensor], reduced: bool = False) -> None:
        """``grads``: each rank's local gradient, or (``reduced``) what each rank's optimizer
        saw: the all-reduced mean on a variance step."""
        (b1, b2), eps, lr, wd = PARAMS["betas"], PARAMS["eps"], PARAMS["lr"], \
            PARAMS["weight_decay"]
        self.t += 1
        frozen, var_step = self.frozen, self.t % self.var_interval == 0
        if not frozen and var_step:  # the engine all-reduced: the sum times 1 / N
            g = grads[0] if reduced else torch.stack(grads).sum(0) * (1.0 / self.n)
            self.v = b2 * self.v + (1 - b2) * g * g
            self.m = [b1 * m + (1 - b1) * g for m in self.m]
        elif not frozen:
            means = self.mean(grads)
            if means is not None:
                self.m = [b1 * m + (1 - b1) * g for m, g in zip(self.m, means, strict=True)]
        else:
            self.m = [b1 * m + (1 - b1) * g for m, g in zip(self.m, grads, strict=True)]
            self.lrs += lr
        denom = self.v.sqrt() + eps
        for r in range(self.n):
            u = self.m[r] / denom + wd * self.w[r]
            self.w[r] = self.w[r] - lr * u
            if frozen:
                self.acc[r] = self.acc[r] - lr * u
        if frozen and self.t % self.lsi == 0:
            self.w = [w - a for w, a in zip(self.w, self.acc, strict=True)]
            self.acc = [a * denom for a in self.acc]
            self.acc = self.mean(self.acc) or self.acc
            self.m = [-(a / self.lrs) for a in self.acc]
            self.w = [w + a / denom for w, a in zip(self.w, self.acc, strict=True)]
            self.acc = [torch.zeros_like(a) for a in self.acc]
            self.lrs = 0.0
        self._count(frozen, var_step)

    def _count(self, frozen: bool, var_step: bool) -> None:
        if not frozen and var_step:
            self.var_counter += 1
            if self.var_counter == PARAMS["var_update_scaler"]:
                self.var_counter, self.var_interval = 0, self.var_interval * 2
        elif frozen:
            self.lsc += 1
            if self.lsc == PARAMS["local_step_scaler"]:
                self.lsc, self.lsi = 0, min(PARAMS["local_step_clipper"], self.lsi * 2)
        if not frozen and self.t > PARAMS["var_freeze_step"]:
            self.frozen = True
            self.compress = Compressor(param_sizes(self.flat), self.n)  # errors zeroed


def reference(world: int, seen: list[list[torch.Tensor]] | None = None,
              mask: torch.Tensor | None = None) -> list[list[torch.Tensor]]:
    """Each rank's flat parameters after every step. ``seen`` (bf16): the flat gradients
    each rank's optimizer saw at each step, replayed with the group compressed as one
    vector, instead of fp32 gradients computed here and compressed per parameter.
    ``mask``: the group's exp_avg_mask (flat), times each 1-bit mean."""
    replay, history = _Replay(world, flat=seen is not None), []
    replay.mask = mask
    for step, batch in enumerate(make_batches("mlp", STEPS, BATCH)):
        grads = ([_local_gradients(replay.w[r], batch, world)[r] for r in range(world)]
                 if seen is None else seen[step])
        if replay.t == 0:
            replay.t = 1  # the first step creates the state only
        else:
            replay.step(grads, reduced=seen is not None)
        history.append([w.clone() for w in replay.w])
    return history


def _train(rank: int, world_size: int, bf16: bool) -> tuple[list[torch.Tensor], list]:
    engine, _, _, _ = meshzero.initialize(model=build_model("mlp", 0), config=config(0, bf16))
    history, seen = [], record_seen_gradients(engine)
    for batch in make_batches("mlp", STEPS, BATCH):
        x, y = split_for_rank(batch, rank, world_size, 1, 0)
        engine.backward(mlp_loss(engine(x).float(), y))
        engine.step()
        history.append(torch.cat([t.float().reshape(-1)
                                  for t in engine.full_state_dict().values()]))
    engine.close()
    return history, seen


@FP32_AND_BF16
def test_zero_one_adam_equals_plain_replay(tmp_path, world_size, bf16):
    """fp32 (each parameter compressed on its own) and bf16 (DeepSpeed's ``FP16_Optimizer``
    around ``ZeroOneAdam``: the group's flat master, one vector; bf16 gradients all-reduced
    on variance steps), bf16 replayed on the gradients the ranks' optimizers saw."""
    results = run_distributed(_train, world_size, tmp_path, bf16, timeout=300)
    seen = by_step([r[1] for r in results]) if bf16 else None
    want = reference(world_size, seen)
    if world_size > 1:  # the unsynchronised local step moved the ranks apart
        assert not torch.equal(want[10][0], want[10][1])
    for rank, (got, _) in enumerate(results):
        for step, (g, w) in enumerate(zip(got, want, strict=True)):
            torch.testing.assert_close(g, w[rank], rtol=1e-5, atol=1e-6,
                                       msg=lambda m, s=step, r=rank: f"rank {r} step {s}: {m}")


def test_zero_one_adam_refused_with_zero_stages():
    with pytest.raises(meshzero.ConfigError, match="ZeroOneAdam.*zero_optimization.stage 2"):
        meshzero.load_config(config(2))
