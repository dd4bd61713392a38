"""The engine's training surface as DeepSpeed's ``DeepSpeedEngine`` offers it
(runtime/engine.py), on meshzero's core: ``backward(retain_graph=)``, ``step(lr_kwargs=)``,
``no_sync()``, ``set_gradient_accumulation_boundary``, ``set_train_batch_size``,
``last_grad_norm`` and ``engine.config`` read as DeepSpeed's dict. Each is held to plain torch
on the same global batch at W = 1, 2, 4 (tests.models.reference_train)."""

from __future__ import annotations

import pytest
import torch

import meshzero
from meshzero.config import load_config
from tests.engine_runs import ADAM_EPS, zero_config
from tests.models import build_model, make_batches, mlp_loss, reference_train, split_for_rank
from tests.real_configs import LOADS
from tests.test_real_configs import hf_fill

LR, MICRO = 1e-2, 2


def _sgd(stage: int, global_batch: int, **extra) -> dict:
    cfg = zero_config(stage, global_batch=global_batch, **extra)
    cfg["optimizer"] = {"type": "SGD", "params": {"lr": LR}}
    return cfg


def _engine(cfg: dict) -> meshzero.Engine:
    engine, *_ = meshzero.initialize(model=build_model("mlp"), config=cfg)
    return engine


def _loss(engine: meshzero.Engine, batch) -> torch.Tensor:
    x, y = batch
    return mlp_loss(engine(x), y)


def _no_sync(rank: int, world: int, stage: int) -> dict:
    """gas 1; the first micro-batch's backward inside no_sync, the second's outside."""
    engine = _engine(_sgd(stage, MICRO * world))
    for g in make_batches("mlp", 2, 2 * MICRO * world, seed=1):
        halves = [split_for_rank(g, 0, 1, 2, k) for k in range(2)]  # X_0, X_1
        mine = [split_for_rank(h, rank, world, 1, 0) for h in halves]
        with engine.no_sync():
            engine.backward(_loss(engine, mine[0]))
        engine.backward(_loss(engine, mine[1]))
        assert engine.step()
    return engine.full_state_dict()


def _retain_graph(rank: int, world: int) -> dict:
    """Two backwards of one loss (retain_graph on the first): twice the gradient."""
    engine = _engine(_sgd(1, MICRO * world))
    for g in make_batches("mlp", 2, MICRO * world, seed=2):
        loss = _loss(engine, split_for_rank(g, rank, world, 1, 0))
        engine.backward(loss, retain_graph=True)
        engine.backward(loss)
        engine.step()
    return engine.full_state_dict()


def _forced_boundary(rank: int, world: int) -> dict:
    """gas 2 at stage 2: the caller forces the boundary (False then True), then None
    (counted again)."""
    engine = _engine(zero_config(2, global_batch=2 * MICRO * world, grad_accum=2, lr=LR))
    applied = []
    for step, g in enumerate(make_batches("mlp", 2, 2 * MICRO * world, seed=3)):
        for k in range(2):
            if step == 0:
                engine.set_gradient_accumulation_boundary(k == 1)
            engine.backward(_loss(engine, split_for_rank(g, rank, world, 2, k)))
            applied.append(engine.step())
        engine.set_gradient_accumulation_boundary(None)
    assert applied == [False, True] * 2
    return engine.full_state_dict()


def _new_batch_size(rank: int, world: int) -> dict:
    """"auto" micro batch from the first batch (stage 3, gas 1), one step; then
    set_train_batch_size doubles the batch: gas 2, micro batch kept."""
    cfg = zero_config(3, global_batch=0, lr=LR)
    del cfg["train_batch_size"]
    cfg["train_micro_batch_size_per_gpu"] = "auto"
    engine = _engine(cfg)
    g1, g2 = make_batches("mlp", 1, MICRO * world, 4) + make_batches("mlp", 1, 2 * MICRO * world, 5)
    engine.backward(_loss(engine, split_for_rank(g1, rank, world, 1, 0)))
    assert engine.train_batch_size() == MICRO * world and engine.step()
    engine.set_train_batch_size(2 * MICRO * world)
    applied = []
    for k in range(2):
        engine.backward(_loss(engine, split_for_rank(g2, rank, world, 2, k)))
        applied.append(engine.step())
    assert applied == [False, True] and engine.gradient_accumulation_steps() == 2
    assert (engine.config["train_batch_size"], engine.config["gradient_accumulation_steps"],
            engine.config.train_micro_batch_size_per_gpu) == (2 * MICRO * world, 2, MICRO)
    return engine.full_state_dict()


def _surface(rank: int, world: int) -> dict:
    return {"no_sync": _no_sync(rank, world, {1: 1, 2: 0, 4: 2}[world]),
            "retain_graph": _retain_graph(rank, world),
            "boundary": _forced_boundary(rank, world),
            "batch_size": _new_batch_size(rank, world)}


def _close(got: dict, ref) -> None:
    for name, want in ref.params.items():
        torch.testing.assert_close(got[name], want, rtol=1e-5, atol=1e-6,
                                   msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("world", [1, 2, 4])
def test_training_surface_equals_plain_torch(run_ranks, world):
    """DeepSpeed's ``DeepSpeedEngine.no_sync`` (no reduction inside; the next backward
    reduces; at W = 4 stage 2, which meshzero allows, reducing each backward),
    ``backward(retain_graph=)`` (passed to autograd), ``set_gradient_accumulation_boundary``
    (the caller's boundary, read by ``is_gradient_accumulation_boundary``) and
    ``set_train_batch_size`` (new gas, same micro batch), each against plain torch on the
    global batch."""
    res = run_ranks(_surface, world)[0]
    model = lambda: build_model("mlp")  # noqa: E731
    sgd = {"optimizer": "SGD", "lr": 2 * LR, "weight_decay": 0.0}  # 2 x lr: summed grads
    _close(res["no_sync"], reference_train(model, make_batches("mlp", 2, 2 * MICRO * world, 1),
                                           grad_accum=2, **sgd))
    _close(res["retain_graph"], reference_train(model, make_batches("mlp", 2, MICRO * world, 2),
                                                **sgd))
    _close(res["boundary"], reference_train(model, make_batches("mlp", 2, 2 * MICRO * world, 3),
                                            lr=LR, eps=ADAM_EPS, grad_accum=2))
    batches = make_batches("mlp", 1, MICRO * world, 4) + make_batches("mlp", 1, 2 * MICRO * world,
                                                                      5)
    _close(res["batch_size"], reference_train(model, batches, lr=LR, eps=ADAM_EPS))


def test_surface_errors_name_the_fix():
    """DeepSpeed's ``no_sync`` asserts against re-entry and ``step()`` inside (and stage 2/3:
    meshzero's core allows those, Accelerate calls it at any stage; tested in training);
    ``set_train_batch_size`` raises when not divisible (here with the three numbers)."""
    engine = _engine(_sgd(1, MICRO))
    with engine.no_sync():
        with pytest.raises(ValueError, match="not re-entrant"), engine.no_sync():
            pass
        with pytest.raises(ValueError, match=r"step\(\) on the accumulation boundary inside "
                           "no_sync"):
            engine.step()
    with pytest.raises(ValueError, match=r"train_batch_size \(7\) must be a positive multiple "
                       r"of train_micro_batch_size_per_gpu \(2\) \* data-parallel size \(1\)"):
        engine.set_train_batch_size(7)
    with pytest.raises(ValueError, match="a bool or None"):
        engine.set_gradient_accumulation_boundary(1)  # type: ignore[arg-type]
    gas2 = _engine(zero_config(1, global_batch=2 * MICRO, grad_accum=2))
    x, y = make_batches("mlp", 1, MICRO)[0]
    gas2.backward(mlp_loss(gas2(x), y))
    gas2.step()
    with pytest.raises(ValueError, match="middle of an accumulation window"):
        gas2.set_train_batch_size(4 * MICRO)


def test_step_passes_lr_kwargs_to_the_scheduler():
    """DeepSpeed's ``_take_model_step``: ``lr_scheduler.step(**(lr_kwargs or {}))``."""
    seen = []

    class Stepped(torch.optim.lr_scheduler.LambdaLR):
        def step(self, increment: int = 1) -> None:  # type: ignore[override]
            seen.append(increment)
            super().step()

    engine, *_ = meshzero.initialize(model=build_model("mlp"), config=_sgd(0, MICRO),
                                     lr_scheduler=lambda opt: Stepped(opt, lambda s: 1.0))
    x, y = make_batches("mlp", 1, MICRO)[0]
    for kwargs in ({"increment": 5}, None):
        engine.backward(mlp_loss(engine(x), y))
        engine.step(lr_kwargs=kwargs)
    assert seen[1:] == [5, 1]  # (the first: LambdaLR.__init__ steps once)


@pytest.mark.parametrize("name", sorted(LOADS)[::6])
def test_config_reads_as_deepspeeds_dict(name: str):
    """DeepSpeed code reads ``engine.config`` as the ds_config dict; the typed Config keeps
    its attributes."""
    raw = hf_fill(LOADS[name])
    config = load_config(raw)
    stage = raw.get("zero_optimization", {}).get("stage", 0)
    assert config["zero_optimization"]["stage"] == config.zero_optimization.stage == stage
    assert ("optimizer" in config) == ("optimizer" in raw)
    for key in ("fp16", "bf16"):
        assert config.get(key, {}).get("enabled") == getattr(config, key).enabled
    assert config.get("no_such_key", 3) == 3 and "no_such_key" not in config
    assert dict(config) == config.as_dict() and set(config.keys()) == set(config)
    config["zero_optimization"]["stage"] = 99  # a copy: the config is read-only
    assert config["zero_optimization"]["stage"] == stage
    with pytest.raises(TypeError):
        config["gradient_clipping"] = 1.0  # type: ignore[index]


def test_engine_config_holds_the_resolved_batch():
    engine = _engine({"train_batch_size": 4, "gradient_accumulation_steps": 2,
                      "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    assert (engine.config["train_micro_batch_size_per_gpu"], engine.config["train_batch_size"],
            engine.config.zero_optimization.stage) == (2, 4, 0)
