"""Checks: the engine's DeepSpeed surface (training loop, queries, accumulation)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from tests.deepspeed_corpus.context import (
    LR,
    MICRO,
    Context,
    adamw,
    assert_params,
    batch,
    check,
    config,
    ds,
    engine_steps,
    full_params,
    loss_of,
    make_model,
    plain_steps,
)


@check("engine(...)")
def engine_call(ctx: Context) -> None:
    x, _ = batch(0)
    torch.testing.assert_close(ctx.engine(x).detach(), make_model()(x).detach())


@check("engine.backward")
def backward(ctx: Context) -> None:
    engine = ctx.build()
    batches = [[batch(0)], [batch(1)]]
    engine_steps(engine, batches)
    assert_params(full_params(engine), plain_steps(make_model(), batches))


@check("engine.backward(retain_graph=)")
def backward_retain_graph(ctx: Context) -> None:
    """Two backward passes through one graph: gradients add (runtime/engine.py: backward
    passes retain_graph to loss.backward)."""
    engine = ctx.build()
    x, y = batch(0)
    loss = loss_of(engine(x), y)
    engine.backward(loss, retain_graph=True)
    engine.backward(loss)
    engine.step()
    ref = make_model()
    opt = adamw(ref.parameters())
    ref_loss = loss_of(ref(x), y)
    ref_loss.backward(retain_graph=True)
    ref_loss.backward()
    opt.step()
    assert_params(full_params(engine), {n: p.detach() for n, p in ref.named_parameters()})


@check("engine.step")
def step_at_boundary(ctx: Context) -> None:
    """gradient_accumulation_steps 2: step() after the first micro-batch does nothing, after
    the second it applies their mean (runtime/engine.py: step, is_gradient_accumulation_
    boundary)."""
    engine = ctx.build(cfg=config(gas=2))
    before = full_params(engine)
    micro = [batch(0), batch(1)]
    engine_steps(engine, [micro[:1]])
    assert_params(full_params(engine), before)
    engine_steps(engine, [micro[1:]])
    assert engine.global_steps == 1
    assert_params(full_params(engine), plain_steps(make_model(), [micro]))


class _StepRecorder(torch.optim.lr_scheduler.LRScheduler):
    """Megatron's OptimizerParamScheduler shape: step(increment)."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.calls: list[dict[str, Any]] = []
        super().__init__(optimizer)

    def get_lr(self) -> list[float]:
        return [LR * 0.5 ** len(self.calls) for _ in self.optimizer.param_groups]

    def step(self, increment: int | None = None) -> None:  # type: ignore[override]
        if increment is not None:
            self.calls.append({"increment": increment})
        super().step()


@check("engine.step(lr_kwargs=)")
def step_lr_kwargs(ctx: Context) -> None:
    """lr_kwargs reach lr_scheduler.step(**lr_kwargs) (runtime/engine.py: _take_model_step)."""
    model = make_model()
    opt = adamw(model.parameters())
    sched = _StepRecorder(opt)
    engine, *_ = ds().initialize(model=model, optimizer=opt, lr_scheduler=sched,
                                 config=config(optimizer=False))
    x, y = batch(0)
    engine.backward(loss_of(engine(x), y))
    engine.step(lr_kwargs={"increment": 3})
    assert sched.calls == [{"increment": 3}]
    assert engine.get_lr() == [LR / 2]


@check("engine.module")
def module(ctx: Context) -> None:
    model = make_model()
    engine = ctx.build(model)
    assert engine.module is model and engine.module.training


@check("engine.train / engine.eval")
def train_eval(ctx: Context) -> None:
    engine = ctx.build()
    engine.eval()
    assert not engine.module.training and not engine.training
    x, _ = batch(0)
    with torch.no_grad():
        torch.testing.assert_close(engine(x), make_model()(x))
    engine.train()
    assert engine.module.training


@check("engine.optimizer")
def optimizer(ctx: Context) -> None:
    groups = ctx.engine.optimizer.param_groups
    assert groups and groups[0]["lr"] == LR


@check("engine.optimizer.overflow")
def overflow(ctx: Context) -> None:
    engine = ctx.build()
    engine_steps(engine, [[batch(0)]])
    assert engine.optimizer.overflow is False


@check("engine.optimizer.cur_scale")
def cur_scale(ctx: Context) -> None:
    """fp16 with initial_scale_power 8: the dynamic scaler starts at 2**8."""
    cfg = config(fp16={"enabled": True, "initial_scale_power": 8})
    engine = ctx.build(cfg=cfg)
    assert engine.optimizer.cur_scale == 256.0


@check("engine.lr_scheduler")
def lr_scheduler(ctx: Context) -> None:
    model = make_model()
    opt = adamw(model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 ** s)
    engine, *_ = ds().initialize(model=model, optimizer=opt, lr_scheduler=sched,
                                 config=config(optimizer=False))
    assert engine.lr_scheduler is sched
    engine_steps(engine, [[batch(0)]])
    assert engine.lr_scheduler.get_last_lr() == engine.get_lr() == [LR / 2]


@check("engine.config")
def engine_config(ctx: Context) -> None:
    """transformers' trainer.py reads it as DeepSpeed's dict."""
    assert ctx.engine.config.get("zero_optimization", {}).get("stage", None) == 3
    assert ctx.engine.config["train_micro_batch_size_per_gpu"] == MICRO


@check("engine.get_global_grad_norm")
def global_grad_norm(ctx: Context) -> None:
    """The 2-norm of the whole gradient of the step (before clipping)."""
    engine = ctx.build()
    x, y = batch(0)
    engine.backward(loss_of(engine(x), y))
    engine.step()
    ref = make_model()
    loss_of(ref(x), y).backward()
    want = torch.linalg.vector_norm(torch.stack(
        [torch.linalg.vector_norm(p.grad) for p in ref.parameters()]))
    norm = engine.get_global_grad_norm()
    torch.testing.assert_close(torch.as_tensor(float(norm)), want, rtol=1e-5, atol=1e-7)


@check("engine.zero_optimization_stage")
def zero_stage(ctx: Context) -> None:
    assert ctx.engine.zero_optimization_stage() == 3
    assert ctx.build(cfg=config(stage=1)).zero_optimization_stage() == 1


@check("engine.no_sync")
def no_sync(ctx: Context) -> None:
    """Stage 1: gradients accumulate locally inside the block. Stages 2/3 refuse, as
    DeepSpeed's assert does (runtime/engine.py: no_sync)."""
    try:
        with ctx.engine.no_sync():
            pass
    except (AssertionError, ValueError, RuntimeError) as exc:
        assert "no_sync" in str(exc), str(exc)
    else:
        raise AssertionError("no_sync accepted at stage 3")
    engine = ctx.build(cfg=config(stage=1))
    first, second = batch(0), batch(1)
    with engine.no_sync():
        engine.backward(loss_of(engine(first[0]), first[1]))
    engine.backward(loss_of(engine(second[0]), second[1]))
    engine.step()
    ref = make_model()
    opt = adamw(ref.parameters())
    for x, y in (first, second):
        loss_of(ref(x), y).backward()
    opt.step()
    assert_params(full_params(engine), {n: p.detach() for n, p in ref.named_parameters()})


@check("engine.set_gradient_accumulation_boundary")
def set_boundary(ctx: Context) -> None:
    """accelerate's DeepSpeedEngineWrapper.backward: boundary False, backward; boundary True,
    backward, step."""
    engine = ctx.build(cfg=config(gas=2))
    micro = [batch(0), batch(1)]
    for i, (x, y) in enumerate(micro):
        engine.set_gradient_accumulation_boundary(is_boundary=i == 1)
        engine.backward(loss_of(engine(x), y))
        if i == 1:
            engine.step()
    assert_params(full_params(engine), plain_steps(make_model(), [micro]))


@check("engine.is_gradient_accumulation_boundary")
def is_boundary(ctx: Context) -> None:
    engine = ctx.build(cfg=config(gas=2))
    seen = []
    for x, y in (batch(0), batch(1), batch(2), batch(3)):
        engine.backward(loss_of(engine(x), y))
        seen.append(engine.is_gradient_accumulation_boundary())
        engine.step()
    assert seen == [False, True, False, True], seen


@check("engine.gradient_accumulation_steps")
def gas(ctx: Context) -> None:
    assert ctx.build(cfg=config(gas=4)).gradient_accumulation_steps() == 4


@check("engine.train_micro_batch_size_per_gpu")
def micro_batch(ctx: Context) -> None:
    assert ctx.engine.train_micro_batch_size_per_gpu() == MICRO


@check("engine.fp16_enabled")
def fp16_enabled(ctx: Context) -> None:
    assert ctx.engine.fp16_enabled() is False
    assert ctx.build(cfg=config(fp16={"enabled": True})).fp16_enabled() is True


@check("engine.bfloat16_enabled")
def bf16_enabled(ctx: Context) -> None:
    assert ctx.engine.bfloat16_enabled() is False
    assert ctx.build(cfg=config(bf16={"enabled": True})).bfloat16_enabled() is True


@check("engine.destroy")
def destroy(ctx: Context) -> None:
    """accelerate frees an engine before building the next one."""
    engine = ctx.build()
    engine_steps(engine, [[batch(0)]])
    engine.destroy()
    batches = [[batch(1)]]
    fresh = ctx.build()
    engine_steps(fresh, batches)
    assert_params(full_params(fresh), plain_steps(make_model(), batches))


@check("engine.steps_per_print")
def steps_per_print(ctx: Context) -> None:
    assert ctx.engine.steps_per_print() == 10  # DeepSpeed's default
    assert ctx.build(cfg=config(steps_per_print=7)).steps_per_print() == 7


@check("engine.global_steps")
def global_steps(ctx: Context) -> None:
    engine = ctx.build()
    engine_steps(engine, [[batch(0)], [batch(1)]])
    assert engine.global_steps == 2


@check("engine.wall_clock_breakdown")
def wall_clock_breakdown(ctx: Context) -> None:
    assert ctx.engine.wall_clock_breakdown() is False
    assert ctx.build(cfg=config(wall_clock_breakdown=True)).wall_clock_breakdown() is True


@check("engine.get_lr")
def get_lr(ctx: Context) -> None:
    assert ctx.engine.get_lr() == [LR]


@check("engine.optimizer_name")
def optimizer_name(ctx: Context) -> None:
    """A config optimizer: its type lower-cased (runtime/config.py: get_optimizer_name);
    a client optimizer: its class name (runtime/engine.py: optimizer_name)."""
    assert ctx.engine.optimizer_name() == "adamw"
    model = make_model()
    engine = ctx.build(model, config(optimizer=False), optimizer=adamw(model.parameters()))
    assert engine.optimizer_name() == "AdamW"


def _loader_iter(n: int) -> Any:
    world, rank = dist.get_world_size(), dist.get_rank()
    for step in range(n):
        x, y = batch(step, size=MICRO * world)
        yield x[rank * MICRO:(rank + 1) * MICRO], y[rank * MICRO:(rank + 1) * MICRO]


@check("engine.train_batch")
def train_batch(ctx: Context) -> None:
    """One optimizer step over gradient_accumulation_steps micro-batches from data_iter
    (pipe/engine.py: PipelineEngine.train_batch); returns the mean loss."""
    engine = ctx.build(cfg=config(gas=2))
    loss = engine.train_batch(data_iter=_loader_iter(2))
    assert engine.global_steps == 1 and torch.isfinite(torch.as_tensor(loss)).all()
    assert_params(full_params(engine), plain_steps(make_model(), [[batch(0), batch(1)]]))


@check("engine.eval_batch")
def eval_batch(ctx: Context) -> None:
    """(loss, logits) with return_logits=True, no step (pipe/engine.py: eval_batch)."""
    engine = ctx.build()
    loss, logits = engine.eval_batch(data_iter=_loader_iter(1), return_logits=True)
    x, y = batch(0)
    with torch.no_grad():
        want = make_model()(x)
    torch.testing.assert_close(logits, want)
    torch.testing.assert_close(torch.as_tensor(loss).float(), loss_of(want, y))
    assert engine.global_steps == 0


@check("engine.set_train_batch_size")
def set_train_batch_size(ctx: Context) -> None:
    """Megatron's batch-size ramp: the micro batch stays, accumulation follows
    (runtime/engine.py: set_train_batch_size)."""
    engine = ctx.build()
    engine.set_train_batch_size(MICRO * 3 * dist.get_world_size())
    assert engine.gradient_accumulation_steps() == 3
    assert engine.train_batch_size() == MICRO * 3 * dist.get_world_size()


@check("engine.was_step_applied")
def was_step_applied(ctx: Context) -> None:
    engine = ctx.build()
    engine_steps(engine, [[batch(0)]])
    assert engine.was_step_applied() is True


@check("engine.zero_grad")
def zero_grad(ctx: Context) -> None:
    """transformers calls model.zero_grad() before training: the next step is unchanged."""
    engine = ctx.build()
    engine.zero_grad()
    batches = [[batch(0)]]
    engine_steps(engine, batches)
    assert_params(full_params(engine), plain_steps(make_model(), batches))


@check("engine.allreduce_gradients")
def allreduce_gradients(ctx: Context) -> None:
    """Megatron's optimizer calls it after backward; engine.step then applies the step."""
    engine = ctx.build(cfg=config(stage=1))
    x, y = batch(0)
    engine.backward(loss_of(engine(x), y))
    engine.allreduce_gradients()
    engine.step()
    assert_params(full_params(engine), plain_steps(make_model(), [[(x, y)]]))
