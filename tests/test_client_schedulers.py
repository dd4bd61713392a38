"""Schedulers as real training code passes them (issue 33, item 6).

meshzero builds its own optimizer over the master fragments, so a scheduler the caller built
on *its* optimizer would never reach training (silently: the lr stays where it started).
The optimizer passed to ``initialize`` is therefore bound to the engine's: they share their
param groups (optim.bind_caller_optimizer), so every hyperparameter a scheduler sets on it
(lr, Adam's betas as OneCycleLR cycles them, weight_decay) is the one the next step uses.

What DeepSpeed does (read from its source, deepspeed 0.19.6, runtime/engine.py):

* ``DeepSpeedEngine._configure_optimizer``: a client optimizer instance becomes the
  ``basic_optimizer`` that ZeRO steps itself (its ``param_group['params']`` replaced by the
  fp32 partitions: runtime/zero/stage_1_and_2.py ``DeepSpeedZeroOptimizer.__init__``), so a
  scheduler on it, stepped by the caller (transformers' and accelerate's habit), drives
  training;
* ``DeepSpeedEngine._configure_lr_scheduler``: a client scheduler object is taken as it is, a
  callable is called with the basic optimizer; ``_do_sanity_check`` asserts a scheduler
  object comes with an instantiated client optimizer;
* ``DeepSpeedEngine._take_model_step``: after an applied step (no overflow) the engine steps
  ``self.lr_scheduler``.

Each case trains 6 steps at ZeRO stages 1 and 3, W = 1, 2, 4, and is held to one plain-torch
process on the same global batches with the same scheduler: the lr (and betas) of every
step, and the final parameters.
"""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch

import meshzero
from tests.distributed import run_distributed
from tests.engine_runs import ADAM_EPS
from tests.models import build_model, make_batches, mlp_loss, split_for_rank

STEPS = 6
WARMUP = 2
# (scheduler, how it is passed): "object" lr_scheduler=<scheduler on the caller's
# optimizer>, stepped by engine.step(); "caller" the caller steps it after engine.step()
# (transformers / accelerate); "returned" built on the optimizer initialize returns (config
# optimizer block), stepped by the caller; "callable" lr_scheduler=f(optimizer)
CASES = [(stage, sched, how) for stage in (1, 3)
         for sched in ("lambda", "linear_warmup", "onecycle") for how in ("object", "caller")]
CASES += [(1, "lambda", "returned"), (3, "linear_warmup", "callable")]


def _scheduler(kind: str, optimizer: torch.optim.Optimizer
               ) -> torch.optim.lr_scheduler.LRScheduler:
    if kind == "lambda":
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1.0 + s))
    if kind == "linear_warmup":  # transformers' get_linear_schedule_with_warmup
        def linear(s: int) -> float:
            if s < WARMUP:
                return s / max(1, WARMUP)
            return max(0.0, (STEPS - s) / max(1, STEPS - WARMUP))
        return torch.optim.lr_scheduler.LambdaLR(optimizer, linear)
    # cycles Adam's beta1 between 0.85 and 0.95 as the lr goes up and down
    return torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.03, total_steps=STEPS)


def _adamw(params) -> torch.optim.AdamW:
    return torch.optim.AdamW(params, lr=1e-2, eps=ADAM_EPS, weight_decay=0.01,
                             foreach=False, fused=False)


def _hyper(optimizer: torch.optim.Optimizer) -> tuple[float, float]:
    group = optimizer.param_groups[0]
    return float(group["lr"]), float(group["betas"][0])


def reference(kind: str, global_batch: int) -> tuple[list, dict]:
    """Plain torch: the (lr, beta1) each step ran with, and the final parameters."""
    model = build_model("mlp")
    opt = _adamw(model.parameters())
    sched = _scheduler(kind, opt)
    seen = []
    for x, y in make_batches("mlp", STEPS, global_batch):
        mlp_loss(model(x), y).backward()
        seen.append(_hyper(opt))
        opt.step()
        opt.zero_grad()
        sched.step()
    return seen, {n: p.detach().clone() for n, p in model.named_parameters()}


def _engine(stage: int, kind: str, how: str, world: int):
    model = build_model("mlp")
    config: dict = {"train_batch_size": 2 * world,
                    "zero_optimization": {"stage": stage,
                                          "stage3_param_persistence_threshold": 0}}
    if how == "returned":
        config["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-2, "eps": ADAM_EPS,
                                                           "weight_decay": 0.01}}
        engine, opt, _, _ = meshzero.initialize(model=model, config=config)
        return engine, opt, _scheduler(kind, opt), True
    if how == "callable":
        engine, opt, _, sched = meshzero.initialize(
            model=model, optimizer=_adamw(model.parameters()), config=config,
            lr_scheduler=lambda o: _scheduler(kind, o))
        return engine, opt, sched, False
    caller = _adamw(model.parameters())
    sched = _scheduler(kind, caller)
    given = sched if how == "object" else None
    engine, _, _, returned = meshzero.initialize(model=model, optimizer=caller, config=config,
                                                 lr_scheduler=given)
    assert returned is given
    return engine, caller, sched, how == "caller"


def _train(rank: int, world: int, cases: list) -> list:
    out, engines = [], []
    for stage, kind, how in cases:
        engine, held, sched, caller_steps = _engine(stage, kind, how, world)
        seen = []
        for batch in make_batches("mlp", STEPS, 2 * world):
            x, y = split_for_rank(batch, rank, world, 1, 0)
            engine.backward(mlp_loss(engine(x), y))
            # what the next step uses, as the engine's optimizer and the caller's hold it
            assert _hyper(held) == _hyper(engine.optimizer)
            seen.append(_hyper(engine.optimizer))
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # no "lr_scheduler.step() before optimizer"
                engine.step()
                if caller_steps:
                    sched.step()
        out.append((seen, engine.full_state_dict()))
        engines.append(engine)
    for engine in engines:  # closed together at the end: see tests/test_forward_only.py
        engine.close()
    return out


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_client_schedulers_drive_training_as_in_plain_torch(tmp_path, world_size):
    results = run_distributed(_train, world_size, tmp_path, CASES, timeout=300)
    refs = {kind: reference(kind, 2 * world_size) for kind in ("lambda", "linear_warmup",
                                                                "onecycle")}
    for i, (stage, kind, how) in enumerate(CASES):
        want_seen, want_params = refs[kind]
        for rank in range(world_size):
            seen, params = results[rank][i]
            assert len(seen) == STEPS
            for (lr, beta), (want_lr, want_beta) in zip(seen, want_seen, strict=True):
                assert math.isclose(lr, want_lr, rel_tol=1e-12), (stage, kind, how, seen)
                assert math.isclose(beta, want_beta, rel_tol=1e-12), (stage, kind, how)
            for name, want in want_params.items():
                torch.testing.assert_close(params[name], want, rtol=1e-5, atol=1e-6,
                                           msg=f"{(stage, kind, how)} {name}")
    # the schedules do change what training uses (a constant lr would fail above)
    assert len({lr for lr, _ in refs["linear_warmup"][0]}) > 3
    assert len({beta for _, beta in refs["onecycle"][0]}) > 3


def _refused(rank: int, world: int, how: str) -> str:
    model = build_model("mlp")
    other = _adamw(copy.deepcopy(model).parameters())
    config: dict = {"train_batch_size": world}
    kwargs: dict = {}
    if how == "other_optimizer":
        kwargs = {"optimizer": _adamw(model.parameters()),
                  "lr_scheduler": _scheduler("lambda", other)}
    else:  # a scheduler object with the config's optimizer: nothing it can be built on
        config["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-2}}
        kwargs = {"lr_scheduler": _scheduler("lambda", other)}
    try:
        meshzero.initialize(model=model, config=config, **kwargs)
    except ValueError as exc:
        return str(exc)
    return ""


@pytest.mark.parametrize("how, message", [
    ("other_optimizer", "was built on another optimizer than the one passed as optimizer="),
    ("config_optimizer", "pass the optimizer instance the scheduler was built on"),
])
def test_scheduler_object_that_cannot_drive_training_is_refused(tmp_path, how, message):
    """DeepSpeed's ``_do_sanity_check`` asserts a client scheduler object comes with an
    instantiated client optimizer; meshzero also refuses one built on another optimizer
    (it could never drive training)."""
    assert message in run_distributed(_refused, 1, tmp_path, how)[0]
