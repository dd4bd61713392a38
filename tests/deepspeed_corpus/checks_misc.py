"""Checks: comm, accelerator, ops optimizers, utils and runtime helpers, moe, pipe."""

from __future__ import annotations

import contextlib
import io
import logging
import os
import random
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn

from tests.deepspeed_corpus.context import Context, batch, check, ds, ds_from, make_model

# --- comm (two ranks) ----------------------------------------------------------------------


@check("deepspeed.comm.get_rank", world_size=2)
def comm_get_rank(ctx: Context) -> None:
    assert ds().comm.get_rank() == dist.get_rank() == ctx.rank


@check("deepspeed.comm.get_world_size", world_size=2)
def comm_get_world_size(ctx: Context) -> None:
    assert ds().comm.get_world_size() == 2


@check("deepspeed.comm.get_local_rank", world_size=2)
def comm_get_local_rank(ctx: Context) -> None:
    assert ds().comm.get_local_rank() == int(os.environ["LOCAL_RANK"])


@check("deepspeed.comm.barrier", world_size=2)
def comm_barrier(ctx: Context) -> None:
    ds().comm.barrier()
    t = torch.tensor([float(ctx.rank)])
    dist.all_reduce(t)
    assert t.item() == 1.0


@check("deepspeed.comm.is_initialized", world_size=2)
def comm_is_initialized(ctx: Context) -> None:
    assert ds().comm.is_initialized() is True


@check("deepspeed.comm.destroy_process_group", world_size=2)
def comm_destroy(ctx: Context) -> None:
    """Runs last: the group is gone afterwards."""
    ds().comm.destroy_process_group()
    assert not dist.is_initialized()


# --- accelerator ---------------------------------------------------------------------------


def _acc() -> Any:
    return ds_from("deepspeed.accelerator", "get_accelerator")()


def _device_name() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


@check("deepspeed.accelerator.get_accelerator")
def accelerator(ctx: Context) -> None:
    assert _acc().device_name() == _device_name()


@check("deepspeed.get_accelerator")
def accelerator_top_level(ctx: Context) -> None:
    assert ds().get_accelerator().device_name() == _device_name()


@check("get_accelerator().device_name")
def acc_device_name(ctx: Context) -> None:
    assert torch.device(_acc().device_name()).type == _device_name()


@check("get_accelerator().current_device_name")
def acc_current_device_name(ctx: Context) -> None:
    t = torch.zeros(2, device=_acc().current_device_name())
    assert t.device.type == _device_name()


@check("get_accelerator().set_device")
def acc_set_device(ctx: Context) -> None:
    _acc().set_device(int(os.environ.get("LOCAL_RANK", "0")))
    assert torch.device(_acc().current_device_name()).type == _device_name()


@check("get_accelerator().device_count")
def acc_device_count(ctx: Context) -> None:
    count = _acc().device_count()
    assert isinstance(count, int) and count >= 1
    if torch.cuda.is_available():
        assert count == torch.cuda.device_count()


@check("get_accelerator().synchronize")
def acc_synchronize(ctx: Context) -> None:
    t = torch.ones(4, device=_acc().current_device_name()) * 2
    assert _acc().synchronize() is None and t.sum().item() == 8


@check("get_accelerator().empty_cache")
def acc_empty_cache(ctx: Context) -> None:
    assert _acc().empty_cache() is None


@check("get_accelerator().memory_allocated")
def acc_memory_allocated(ctx: Context) -> None:
    value = _acc().memory_allocated()
    assert isinstance(value, int) and value >= 0


@check("get_accelerator().max_memory_allocated")
def acc_max_memory_allocated(ctx: Context) -> None:
    assert _acc().max_memory_allocated() >= _acc().memory_allocated() >= 0


@check("get_accelerator().is_available")
def acc_is_available(ctx: Context) -> None:
    assert _acc().is_available() is True


@check("get_accelerator().manual_seed")
def acc_manual_seed(ctx: Context) -> None:
    dev = _acc().current_device_name()
    _acc().manual_seed(7)
    a = torch.rand(3, device=dev)
    _acc().manual_seed(7)
    torch.testing.assert_close(torch.rand(3, device=dev), a)


@check("get_accelerator().communication_backend_name")
def acc_backend_name(ctx: Context) -> None:
    name = _acc().communication_backend_name()
    assert name == ("nccl" if torch.cuda.is_available() else "gloo"), name


@check("get_accelerator().current_device")
def acc_current_device(ctx: Context) -> None:
    """CUDA: the device index (Megatron allocates on it); CPU: LOCAL_RANK, as DeepSpeed's
    CPU_Accelerator.current_device answers."""
    if torch.cuda.is_available():
        t = torch.empty(1, device=_acc().current_device())
        assert t.device.type == "cuda"
    else:
        assert int(_acc().current_device()) == int(os.environ.get("LOCAL_RANK", 0))


@check("get_accelerator().get_rng_state")
def acc_rng_state(ctx: Context) -> None:
    dev = _acc().current_device_name()
    state = _acc().get_rng_state()
    assert isinstance(state, torch.Tensor) and state.dtype == torch.uint8
    a = torch.rand(3, device=dev)
    _acc().set_rng_state(state)
    torch.testing.assert_close(torch.rand(3, device=dev), a)


@check("get_accelerator().LongTensor")
def acc_long_tensor(ctx: Context) -> None:
    t = _acc().LongTensor([0, 3])
    assert t.dtype == torch.int64 and t.device.type == _device_name() and t.tolist() == [0, 3]


# --- ops -----------------------------------------------------------------------------------


def _one_step(opt_cls: Any, **kwargs: Any) -> dict[str, torch.Tensor]:
    model = make_model()
    opt = opt_cls(model.parameters(), **kwargs)
    for step in range(2):
        x, y = batch(step)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _same(got: dict, want: dict) -> None:
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6)


@check("deepspeed.ops.adam.FusedAdam")
def fused_adam(ctx: Context) -> None:
    """adam_w_mode=True by default: decoupled weight decay (ops/adam/fused_adam.py)."""
    cls = ds_from("deepspeed.ops.adam", "FusedAdam")
    _same(_one_step(cls, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1),
          _one_step(torch.optim.AdamW, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1))


@check("deepspeed.ops.adam.DeepSpeedCPUAdam")
def cpu_adam(ctx: Context) -> None:
    """adamw_mode=True by default (ops/adam/cpu_adam.py)."""
    cls = ds_from("deepspeed.ops.adam", "DeepSpeedCPUAdam")
    _same(_one_step(cls, lr=1e-2, betas=(0.9, 0.999), weight_decay=0.1),
          _one_step(torch.optim.AdamW, lr=1e-2, betas=(0.9, 0.999), weight_decay=0.1))


@check("deepspeed.ops.adagrad.DeepSpeedCPUAdagrad")
def cpu_adagrad(ctx: Context) -> None:
    """eps 1e-10, L2 weight decay added to the gradient, as torch's (ops/adagrad)."""
    cls = ds_from("deepspeed.ops.adagrad", "DeepSpeedCPUAdagrad")
    _same(_one_step(cls, lr=1e-2, weight_decay=0.1),
          _one_step(torch.optim.Adagrad, lr=1e-2, weight_decay=0.1, eps=1e-10))


class _Lion(torch.optim.Optimizer):
    """Lion as DeepSpeed's ops/lion computes it (decoupled weight decay)."""

    def __init__(self, params: Any, lr: float, betas: tuple, weight_decay: float) -> None:
        super().__init__(params, {"lr": lr, "betas": betas, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                m = self.state[p].setdefault("exp_avg", torch.zeros_like(p))
                update = (beta1 * m + (1 - beta1) * p.grad).sign()
                p.mul_(1 - group["lr"] * group["weight_decay"]).add_(update, alpha=-group["lr"])
                m.mul_(beta2).add_(p.grad, alpha=1 - beta2)


@check("deepspeed.ops.lion.DeepSpeedCPULion")
def cpu_lion(ctx: Context) -> None:
    cls = ds_from("deepspeed.ops.lion", "DeepSpeedCPULion")
    kw = {"lr": 1e-3, "betas": (0.9, 0.99), "weight_decay": 0.1}
    _same(_one_step(cls, **kw), _one_step(_Lion, **kw))


@check("deepspeed.ops.lion.FusedLion")
def fused_lion(ctx: Context) -> None:
    cls = ds_from("deepspeed.ops.lion", "FusedLion")
    kw = {"lr": 1e-3, "betas": (0.9, 0.99), "weight_decay": 0.1}
    _same(_one_step(cls, **kw), _one_step(_Lion, **kw))


# --- utils, runtime helpers ----------------------------------------------------------------


@check("deepspeed.utils.logger")
def utils_logger(ctx: Context) -> None:
    logger = ds_from("deepspeed.utils", "logger")
    assert isinstance(logger, logging.Logger)
    level = logger.level
    try:
        logger.setLevel(logging.WARNING)
        assert logger.getEffectiveLevel() == logging.WARNING
    finally:
        logger.setLevel(level)


@check("deepspeed.utils.logging.logger")
def utils_logging_logger(ctx: Context) -> None:
    assert ds_from("deepspeed.utils.logging", "logger") is ds_from("deepspeed.utils", "logger")


def _repeats(cls: Any) -> None:
    loader = cls(torch.utils.data.DataLoader(list(range(3)), batch_size=1))
    it = iter(loader)
    assert [int(next(it)) for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]


@check("deepspeed.utils.RepeatingLoader")
def repeating_loader(ctx: Context) -> None:
    _repeats(ds_from("deepspeed.utils", "RepeatingLoader"))


@check("deepspeed.runtime.dataloader.RepeatingLoader")
def repeating_loader_path(ctx: Context) -> None:
    _repeats(ds_from("deepspeed.runtime.dataloader", "RepeatingLoader"))


@check("deepspeed.utils.groups._get_sequence_parallel_world_size")
def sp_world_size(ctx: Context) -> None:
    """No sequence parallelism: 1 (utils/groups.py)."""
    assert ds_from("deepspeed.utils.groups")._get_sequence_parallel_world_size() == 1


@check("deepspeed.utils.groups._get_sequence_parallel_rank")
def sp_rank(ctx: Context) -> None:
    assert ds_from("deepspeed.utils.groups")._get_sequence_parallel_rank() == 0


@check("deepspeed.utils.groups._get_sequence_parallel_group")
def sp_group(ctx: Context) -> None:
    """Without one DeepSpeed raises KeyError("No sequence parallel group found"); accelerate
    only asks when sp_size > 1. With an mpu that has one, the mpu's group."""
    groups = ds_from("deepspeed.utils.groups")
    try:
        groups._get_sequence_parallel_group()
    except KeyError:
        pass
    else:
        raise AssertionError("a sequence parallel group without sequence parallelism")


@check("deepspeed.runtime.utils.see_memory_usage")
def see_memory_usage(ctx: Context) -> None:
    """Prints the message and the memory figures on rank 0 with force=True, nothing without
    (runtime/utils.py: see_memory_usage prints, it does not log)."""
    see = ds_from("deepspeed.runtime.utils", "see_memory_usage")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        see("Before Building Model", force=True)
        see("not shown")
    text = out.getvalue()
    assert "Before Building Model" in text and "MA " in text and "not shown" not in text, text


@check("deepspeed.runtime.utils.set_random_seed")
def set_random_seed(ctx: Context) -> None:
    seed = ds_from("deepspeed.runtime.utils", "set_random_seed")
    seed(3)
    a = (random.random(), np.random.rand(), torch.rand(1).item())
    seed(3)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == a


@check("deepspeed.runtime.lr_schedules.VALID_LR_SCHEDULES")
def valid_lr_schedules(ctx: Context) -> None:
    valid = ds_from("deepspeed.runtime.lr_schedules", "VALID_LR_SCHEDULES")
    assert {"LRRangeTest", "OneCycle", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR"} <= set(
        valid)
    assert "LambdaLR" not in valid


@check("deepspeed.runtime.config.LAMB_OPTIMIZER")
def lamb_constant(ctx: Context) -> None:
    assert ds_from("deepspeed.runtime.config", "LAMB_OPTIMIZER") == "lamb"


@check("deepspeed.runtime.base_optimizer.DeepSpeedOptimizer")
def deepspeed_optimizer_class(ctx: Context) -> None:
    """Lightning: isinstance(item, (Optimizer, DeepSpeedOptimizer)) finds the engine's."""
    cls = ds_from("deepspeed.runtime.base_optimizer", "DeepSpeedOptimizer")
    assert isinstance(ctx.engine.optimizer, (torch.optim.Optimizer, cls))


@check("deepspeed.runtime.bf16_optimizer.BF16_Optimizer")
def bf16_optimizer_class(ctx: Context) -> None:
    """gpt-neox: isinstance(optimizer, BF16_Optimizer) is False for an fp32 ZeRO-3 engine."""
    cls = ds_from("deepspeed.runtime.bf16_optimizer", "BF16_Optimizer")
    assert isinstance(cls, type) and not isinstance(ctx.engine.optimizer, cls)
