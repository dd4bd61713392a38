"""``meshzero.deepspeed.ops``: DeepSpeed's optimizers (deepspeed/ops/adam/fused_adam.py
FusedAdam, cpu_adam.py DeepSpeedCPUAdam, ops/lamb/fused_lamb.py FusedLamb) as torch
optimizers: standalone they step as torch's Adam/AdamW (or meshzero's exact DeepSpeed Adam
without bias correction, and meshzero's Lamb); passed to ``meshzero.initialize`` they are
rebuilt over ZeRO's fragments and train as plain torch does at world sizes 1, 2 and 4."""

from __future__ import annotations

import pytest
import torch

import meshzero
from meshzero.deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
from meshzero.deepspeed.ops.adam.cpu_adam import DeepSpeedCPUAdam as CPUAdamPath
from meshzero.deepspeed.ops.lamb import FusedLamb
from meshzero.optimizers import DeepSpeedAdam, Lamb
from tests.distributed import run_distributed
from tests.engine_runs import ADAM_EPS
from tests.models import build_model, loss_fn_for, make_batches, reference_train, split_for_rank


def _run(opt_factory, steps: int = 4):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))
    opt = opt_factory(model.parameters())
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        model(torch.randn(8, 6, generator=gen)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return torch.cat([p.detach().flatten() for p in model.parameters()])


KW = dict(lr=0.05, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1)


@pytest.mark.parametrize(("ours", "reference"), [
    (lambda p: FusedAdam(p, **KW), lambda p: torch.optim.AdamW(p, **KW)),
    (lambda p: FusedAdam(p, adam_w_mode=False, **KW), lambda p: torch.optim.Adam(p, **KW)),
    (lambda p: DeepSpeedCPUAdam(p, **KW), lambda p: torch.optim.AdamW(p, **KW)),
    (lambda p: DeepSpeedCPUAdam(p, adamw_mode=False, **KW), lambda p: torch.optim.Adam(p, **KW)),
    (lambda p: FusedAdam(p, bias_correction=False, **KW),
     lambda p: DeepSpeedAdam(p, bias_correction=False, **KW)),
    (lambda p: FusedLamb(p, max_grad_norm=1.0, **KW),
     lambda p: Lamb(p, max_grad_norm=1.0, **KW)),
], ids=["fused-adamw", "fused-adam-l2", "cpu-adamw", "cpu-adam-l2", "no-bias-correction",
        "lamb"])
def test_standalone_steps_equal_torch(ours, reference):
    """FusedAdam(adam_w_mode=...) and DeepSpeedCPUAdam(adamw_mode=...) are Adam/AdamW as
    DeepSpeed's kernels compute them (multi_tensor_adam; cpu_adam's Step), i.e. torch's up to
    rounding; bias_correction=False is meshzero's DeepSpeedAdam; FusedLamb is meshzero's Lamb."""
    torch.testing.assert_close(_run(ours), _run(reference), rtol=1e-6, atol=1e-7)


def test_deepspeed_signature_and_amsgrad():
    """DeepSpeed's signatures (FusedAdam.__init__, DeepSpeedCPUAdam.__init__): positional
    order lr, bias_correction, betas; amsgrad raises as DeepSpeed's kernels do."""
    p = [torch.nn.Parameter(torch.ones(3))]
    opt = FusedAdam(p, 0.1, False, (0.5, 0.6))
    assert isinstance(opt, torch.optim.Optimizer)
    assert opt.defaults["bias_correction"] is False and opt.defaults["betas"] == (0.5, 0.6)
    assert CPUAdamPath is DeepSpeedCPUAdam
    gen_groups = DeepSpeedCPUAdam([{"params": (q for q in p), "lr": 0.2}])  # read once
    assert gen_groups.param_groups[0]["params"] == p and gen_groups.param_groups[0]["lr"] == 0.2
    for make in (FusedAdam, DeepSpeedCPUAdam, FusedLamb):
        with pytest.raises(ValueError, match="amsgrad"):
            make(p, amsgrad=True)


def _train_all(rank: int, world: int) -> dict:
    return {mode: _train(rank, world, mode) for mode in ("AdamW", "Adam", "cpu")}


def _train(rank: int, world: int, mode: str) -> dict:
    model = build_model("mlp")
    kw = dict(lr=1e-2, eps=ADAM_EPS, weight_decay=0.01)
    opt = (FusedAdam(model.parameters(), adam_w_mode=(mode == "AdamW"), **kw) if mode != "cpu"
           else DeepSpeedCPUAdam(model.parameters(), **kw))
    config = {"train_batch_size": 8, "zero_optimization": {"stage": 2}}
    engine, optimizer, _, _ = meshzero.initialize(model=model, optimizer=opt, config=config)
    assert type(optimizer) is type(opt) and optimizer is not opt  # rebuilt over fragments
    loss_fn = loss_fn_for(model)
    for batch in make_batches("mlp", 3, 8):
        x, y = split_for_rank(batch, rank, world, 1, 0)
        engine.backward(loss_fn(engine(x), y))
        engine.step()
    return engine.full_state_dict()


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_initialize_with_fused_adam_trains_as_torch(tmp_path, world_size):
    """meshzero.initialize(optimizer=FusedAdam(...)) at stage 2 gives the parameters plain
    torch AdamW / Adam give on the whole batch (the rebuild keeps adam_w_mode, as DeepSpeed's
    engine keeps the user's optimizer's hyperparameters)."""
    trained = run_distributed(_train_all, world_size, tmp_path)[0]
    for mode, got in trained.items():
        ref = reference_train(lambda: build_model("mlp"), make_batches("mlp", 3, 8),
                              optimizer="Adam" if mode == "Adam" else "AdamW", lr=1e-2,
                              eps=ADAM_EPS, weight_decay=0.01)
        for name, value in ref.params.items():
            torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6)


def test_bf16_optimizer_states_rebuilds_fused_adam():
    """bf16.bf16_optimizer_states turns the caller's Adam into meshzero's DeepSpeedAdam; a
    FusedAdam (a torch Adam subclass) is accepted and keeps its switches."""
    from meshzero.optim import _as_deepspeed_adam  # noqa: PLC0415

    p = [torch.nn.Parameter(torch.ones(3))]
    opt = _as_deepspeed_adam(FusedAdam(p, lr=0.1, bias_correction=False, adam_w_mode=False),
                             "bf16.bf16_optimizer_states", torch.bfloat16)
    group = opt.param_groups[0]
    assert group["bias_correction"] is False and group["adam_w_mode"] is False
    assert group["lr"] == 0.1


def test_adagrad_and_op_builders():
    """DeepSpeedCPUAdagrad (ops/adagrad/cpu_adagrad.py) is torch's Adagrad update; the op
    builders (op_builder/builder.py OpBuilder) build nothing: is_compatible() is False, load()
    raises naming meshzero's way, and Megatron's OpBuilder.is_rocm_pytorch() answers."""
    from meshzero.deepspeed.ops.adagrad import DeepSpeedCPUAdagrad
    from meshzero.deepspeed.ops.op_builder import AsyncIOBuilder, CPUAdamBuilder
    from meshzero.deepspeed.ops.op_builder.builder import OpBuilder

    kw = dict(lr=0.05, eps=1e-6, weight_decay=0.1)
    torch.testing.assert_close(_run(lambda p: DeepSpeedCPUAdagrad(p, **kw)),
                               _run(lambda p: torch.optim.Adagrad(p, **kw)))
    with pytest.raises(ValueError, match="amsgrad"):
        DeepSpeedCPUAdagrad([torch.nn.Parameter(torch.ones(2))], amsgrad=True)
    assert OpBuilder.is_rocm_pytorch() is False or torch.version.hip is not None
    assert not AsyncIOBuilder().is_compatible() and CPUAdamBuilder.NAME == "cpu_adam"
    with pytest.raises(NotImplementedError, match="DeepSpeedCPUAdam"):
        CPUAdamBuilder().load()


def _lion_reference(params, lr=0.05, betas=(0.8, 0.99), weight_decay=0.1):
    """DeepSpeed's multi_tensor_lion.cu per element: c = b1 m + (1-b1) g; p = p (1 - lr wd)
    -+ lr by c > 0; m = b2 m + (1-b2) g (a plain SGD-shaped loop over the same model)."""
    params = list(params)

    class Ref(torch.optim.Optimizer):
        @torch.no_grad()
        def step(self, closure=None):
            for p in params:
                m = self.state[p].setdefault("m", torch.zeros_like(p))
                c = betas[0] * m + (1 - betas[0]) * p.grad
                p.mul_(1 - lr * weight_decay).add_(torch.where(c > 0, -lr, lr))
                m.mul_(betas[1]).add_((1 - betas[1]) * p.grad)

    return Ref(params, {})


def test_lion_matches_deepspeeds_kernel_and_trains_under_initialize(tmp_path):
    """FusedLion / DeepSpeedCPULion (ops/lion/fused_lion.py, cpu_lion.py) step as DeepSpeed's
    kernel; under initialize at stage 2 on two ranks they train as on one process."""
    from meshzero.deepspeed.ops.lion import DeepSpeedCPULion, FusedLion

    kw = dict(lr=0.05, betas=(0.8, 0.99), weight_decay=0.1)
    want = _run(_lion_reference)
    torch.testing.assert_close(_run(lambda p: FusedLion(p, **kw)), want)
    torch.testing.assert_close(_run(lambda p: DeepSpeedCPULion(p, **kw)), want)
    got = run_distributed(_train_lion, 2, tmp_path)[0]
    model = build_model("mlp")
    opt = FusedLion(model.parameters(), lr=1e-3, weight_decay=0.01)
    loss_fn = loss_fn_for(model)
    for x, y in make_batches("mlp", 3, 8):
        loss_fn(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    for name, value in model.named_parameters():
        torch.testing.assert_close(got[name], value.detach(), rtol=1e-5, atol=1e-6)


def _train_lion(rank: int, world: int) -> dict:
    from meshzero.deepspeed.ops.lion import FusedLion

    model = build_model("mlp")
    engine, _, _, _ = meshzero.initialize(
        model=model, optimizer=FusedLion(model.parameters(), lr=1e-3, weight_decay=0.01),
        config={"train_batch_size": 8, "zero_optimization": {"stage": 2}})
    loss_fn = loss_fn_for(model)
    for batch in make_batches("mlp", 3, 8):
        x, y = split_for_rank(batch, rank, world, 1, 0)
        engine.backward(loss_fn(engine(x), y))
        engine.step()
    return engine.full_state_dict()
