"""Rank functions shared by the engine tests: train with meshzero on the DeepSpeed batch
convention of tests.models and return what the tests compare."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch

import meshzero
from tests.models import build_model, loss_fn_for, make_batches, split_for_rank

# Adam's eps: with 1e-8, an element whose gradient is a near-exact cancellation has
# m / sqrt(v) ~ +-1 whatever its size, so summation-order round-off (one rank vs N) turns into
# lr-sized differences (seen: grad -1.4e-7 at step 1, 1.2e-5 apart at eps 1e-6). eps 1e-4
# keeps the comparison well-conditioned at rtol 1e-5.
ADAM_EPS = 1e-4


def zero_config(stage: int, *, global_batch: int, grad_accum: int = 1, lr: float = 1e-2,
                **extra) -> dict:
    """A ds_config for the tests: AdamW, no persistence at stage 3 (so everything shards)."""
    cfg = {
        "train_batch_size": global_batch,
        "gradient_accumulation_steps": grad_accum,
        "optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": 0.01,
                                                          "eps": ADAM_EPS}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(cfg.get(key), dict):
            cfg[key] = {**cfg[key], **value}
        else:
            cfg[key] = value
    return cfg


@dataclass
class RunResult:
    params: dict[str, torch.Tensor]
    losses: list[float]
    memory: dict
    comm: dict
    skipped_steps: int = 0
    loss_scales: list[float] = field(default_factory=list)
    layout: list[tuple[int, int, bool, bool]] = field(default_factory=list)
    grad_norms: list[float | None] = field(default_factory=list)  # last_grad_norm per step


def train(rank: int, world_size: int, kind: str, config: dict, steps: int, *,
          overflow_step: int | None = None, seed: int = 0) -> RunResult:
    """Train ``steps`` optimizer steps; ``overflow_step`` puts an inf into rank 0's loss."""
    model = build_model(kind, seed)
    engine, _, _, _ = meshzero.initialize(model=model, config=copy.deepcopy(config))
    batches = make_batches(kind, steps, engine.train_batch_size(), seed)
    loss_fn = loss_fn_for(model)
    gas = engine.gradient_accumulation_steps()
    losses, scales, norms = [], [], []
    for step, batch in enumerate(batches):
        total = 0.0
        for micro in range(gas):
            x, y = split_for_rank(batch, rank, world_size, gas, micro)
            loss = loss_fn(engine(x).float(), y)
            if step == overflow_step and rank == 0:
                loss = loss * float("inf")
            engine.backward(loss)
            engine.step()
            total += loss.item() / gas
        losses.append(total)
        scales.append(engine.loss_scale)
        norms.append(engine.last_grad_norm)
    layout = [(g.layout.numel, g.layout.padded_numel, g.trainable, g.sharded)
              for g in engine.zero.groups]
    return RunResult(engine.full_state_dict(), losses, engine.memory_report(),
                     engine.comm_report(), engine.skipped_steps, scales, layout, norms)
