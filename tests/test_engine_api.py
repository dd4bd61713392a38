"""initialize()'s DeepSpeed habits, engine options, stage 3 mechanics and determinism."""

from __future__ import annotations

import pytest
import torch

import meshzero
from tests.distributed import run_distributed
from tests.engine_runs import ADAM_EPS, train, zero_config
from tests.models import build_model, make_batches, mlp_loss, reference_train, split_for_rank


def _train_with(rank, world_size, config, steps, make_optimizer=None, make_scheduler=None,
                param_groups=None):
    """Train MLPStack with a user-built optimizer/scheduler; return params and lrs."""
    model = build_model("mlp")
    optimizer = make_optimizer(model) if make_optimizer else None
    params = param_groups(model) if param_groups else None
    engine, opt, _, sched = meshzero.initialize(
        model=model, optimizer=optimizer, model_parameters=params, lr_scheduler=make_scheduler,
        config=config)
    lrs = []
    for batch in make_batches("mlp", steps, engine.train_batch_size()):
        x, y = split_for_rank(batch, rank, world_size, 1, 0)
        engine.backward(mlp_loss(engine(x), y))
        engine.step()
        lrs.append(engine.get_lr())
    return engine.full_state_dict(), lrs, [len(g["params"]) for g in opt.param_groups]


def _adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01, eps=ADAM_EPS)


def _two_groups(model):
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    no_decay = [p for n, p in model.named_parameters() if not n.endswith("weight")]
    return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]


def _linear_warmup(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))


def _no_optimizer_config(stage):
    cfg = zero_config(stage, global_batch=8)
    del cfg["optimizer"]
    return cfg


@pytest.mark.parametrize("stage", [1, 3])
def test_user_optimizer_instance_is_rebuilt_over_fragments(tmp_path, stage):
    results = run_distributed(_train_with, 2, tmp_path, _no_optimizer_config(stage), 3,
                              make_optimizer=_adamw)
    ref = reference_train(lambda: build_model("mlp"), make_batches("mlp", 3, 8), eps=ADAM_EPS)
    for params, _, _ in results:
        for name, want in ref.params.items():
            torch.testing.assert_close(params[name], want, rtol=1e-5, atol=1e-6)


def _grouped_adamw(model):
    return torch.optim.AdamW(_two_groups(model), lr=1e-2, eps=ADAM_EPS)


def _adamw_class(model):
    return torch.optim.AdamW  # a class: built over the fragments with its own defaults


def test_optimizer_class_is_built_over_fragments(tmp_path):
    results = run_distributed(_train_with, 2, tmp_path, _no_optimizer_config(3), 2,
                              make_optimizer=_adamw_class)
    ref = reference_train(lambda: build_model("mlp"), make_batches("mlp", 2, 8), lr=1e-3)
    for params, lrs, _ in results:
        assert lrs[-1] == [1e-3]
        for name, want in ref.params.items():
            torch.testing.assert_close(params[name], want, rtol=1e-5, atol=1e-6)


def test_param_groups_keep_their_hyperparameters(tmp_path):
    """Two groups with different weight decay and a callable scheduler."""
    results = run_distributed(_train_with, 2, tmp_path, _no_optimizer_config(2), 3,
                              make_optimizer=_grouped_adamw, make_scheduler=_linear_warmup)
    model = build_model("mlp")
    opt = _grouped_adamw(model)
    sched = _linear_warmup(opt)
    for batch in make_batches("mlp", 3, 8):
        mlp_loss(model(batch[0]), batch[1]).backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    for params, lrs, _ in results:
        for name, want in model.named_parameters():
            torch.testing.assert_close(params[name], want.detach(), rtol=1e-5, atol=1e-6)
        assert [lr[0] for lr in lrs] == pytest.approx([1e-2 * 2 / 3, 1e-2, 1e-2])


def test_model_parameters_groups_with_config_optimizer_and_scheduler(tmp_path):
    cfg = zero_config(1, global_batch=8, scheduler={
        "type": "WarmupLR",
        "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01, "warmup_num_steps": 2,
                   "warmup_type": "linear"}})
    results = run_distributed(_train_with, 2, tmp_path, cfg, 3, param_groups=_two_groups)
    for _, lrs, group_sizes in results:
        assert len(group_sizes) == 2
        # the lr after steps 1-3 (that of steps 2-4): DeepSpeed's alignment runs steps 0 and
        # 1 at warmup_min_lr, and a 2-step linear warmup is at 1/2 on step 3
        assert [lr[0] for lr in lrs] == pytest.approx([0.0, 0.005, 0.01])


@pytest.mark.parametrize("opt_cfg, ref_kwargs", [
    ({"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}},
     {"optimizer": "SGD", "lr": 0.05, "momentum": 0.9, "weight_decay": 0.0}),
    # DeepSpeed's "Adam" with adam_w_mode false is L2-regularised Adam
    ({"type": "adam", "params": {"lr": 0.01, "adam_w_mode": False, "weight_decay": 0.01,
                                 "eps": ADAM_EPS}},
     {"optimizer": "Adam", "lr": 0.01, "weight_decay": 0.01}),
])
def test_config_optimizers(tmp_path, opt_cfg, ref_kwargs):
    cfg = zero_config(2, global_batch=8, optimizer=opt_cfg)
    results = run_distributed(train, 2, tmp_path, "mlp", cfg, 3)
    ref = reference_train(lambda: build_model("mlp"), make_batches("mlp", 3, 8),
                          **{"eps": ADAM_EPS, **ref_kwargs})
    for r in results:
        for name, want in ref.params.items():
            torch.testing.assert_close(r.params[name], want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("zero_extra", [
    {"overlap_comm": False},
    {"stage3_param_persistence_threshold": 100},  # biases and norms stay resident
    {"stage3_max_live_parameters": 1, "stage3_prefetch_bucket_size": 1,
     "reduce_bucket_size": 1, "allgather_bucket_size": 1},  # no overlap room at all
    {"unit_classes": ["Block", "Linear"]},  # nested units: every Linear inside each Block
])
def test_stage3_options_keep_equivalence(tmp_path, zero_extra):
    cfg = zero_config(3, global_batch=8, zero_optimization=zero_extra)
    results = run_distributed(train, 2, tmp_path, "tricky", cfg, 3)
    ref = reference_train(lambda: build_model("tricky"), make_batches("tricky", 3, 8),
                          eps=ADAM_EPS)
    for r in results:
        for name, want in ref.params.items():
            torch.testing.assert_close(r.params[name], want, rtol=1e-5, atol=1e-6)
    if "stage3_param_persistence_threshold" in zero_extra:
        assert any(not sharded for *_, sharded in results[0].layout)


def test_bf16_communication_dtype(tmp_path):
    cfg = zero_config(2, global_batch=8, communication_data_type="bf16")
    results = run_distributed(train, 2, tmp_path, "mlp", cfg, 3)
    ref = reference_train(lambda: build_model("mlp"), make_batches("mlp", 3, 8), eps=ADAM_EPS)
    for r in results:
        for name, want in ref.params.items():  # gradients rounded to bf16 on the wire only
            torch.testing.assert_close(r.params[name], want, rtol=2e-2, atol=2e-3)
    padded = sum(p for _, p, *_ in results[0].layout)
    assert results[0].comm["reduce_scatter"]["bytes"] == padded * 2 // 2  # bf16, (N-1)/N = 1/2


def _stage3_at_rest(rank, world_size):
    model = build_model("mlp")
    engine, *_ = meshzero.initialize(model=model, config=zero_config(3, global_batch=8))
    for batch in make_batches("mlp", 2, 8):
        x, y = split_for_rank(batch, rank, world_size, 1, 0)
        engine.backward(mlp_loss(engine(x), y))
        engine.step()
    freed = [g.full.untyped_storage().nbytes() for g in engine.zero.groups]
    same_objects = all(p is q for p, q in zip(model.parameters(), engine.module.parameters(),
                                              strict=True))
    with torch.no_grad():  # eval forward at rest gathers and releases again
        engine(torch.zeros(2, 7))
    after_eval = [g.full.untyped_storage().nbytes() for g in engine.zero.groups]
    # on CPU the fused optimizer kernels must be asked for (fused=None never picks them)
    assert all(g["fused"] for g in engine.optimizer.param_groups)
    return freed, same_objects, after_eval


def test_stage3_frees_full_params_at_rest_and_keeps_tensors(tmp_path):
    for freed, same_objects, after_eval in run_distributed(_stage3_at_rest, 2, tmp_path):
        assert freed == [0] * len(freed)
        assert after_eval == freed
        assert same_objects


@pytest.mark.parametrize("stage", [2, 3])
def test_same_seed_gives_bit_identical_losses(tmp_path, stage):
    cfg = zero_config(stage, global_batch=8)
    first = run_distributed(train, 4, tmp_path, "tricky", cfg, 3)
    second = run_distributed(train, 4, tmp_path, "tricky", cfg, 3)
    for a, b in zip(first, second, strict=True):
        assert a.losses == b.losses
        for name, t in a.params.items():
            assert torch.equal(t, b.params[name])


def _init_only(rank, world_size, kwargs):
    try:
        meshzero.initialize(model=build_model("mlp"), **kwargs)
    except ValueError as exc:  # ConfigError is a ValueError too
        return str(exc)
    return None


@pytest.mark.parametrize("kwargs, message", [
    ({"config": zero_config(1, global_batch=8), "optimizer": _adamw(build_model("mlp"))},
     "both an optimizer argument and the config key 'optimizer'"),
    ({"config": zero_config(1, global_batch=7)}, "train_batch_size"),
    ({"config": zero_config(1, global_batch=8), "training_data": [1, 2]}, "training_data"),
    ({"config": zero_config(3, global_batch=8,
                            zero_optimization={"unit_classes": ["Nope"]})}, "unit_classes"),
])
def test_bad_initialize_arguments_fail_before_work(tmp_path, kwargs, message):
    for error in run_distributed(_init_only, 2, tmp_path, kwargs):
        assert error is not None and message in error
