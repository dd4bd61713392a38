"""Checks: initialize and its keywords, init_distributed, arguments, version, config."""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

import torch
import torch.distributed as dist
from packaging.version import Version

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
    ds_from,
    engine_steps,
    full_params,
    loss_of,
    make_model,
    plain_steps,
)


def _halving(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 ** s)


@check("deepspeed.initialize")
def initialize_with_client_optimizer_and_scheduler(ctx: Context) -> None:
    """DeepSpeed-Chat: a torch optimizer and scheduler built by the caller; DeepSpeed steps
    the scheduler in engine.step (runtime/engine.py: DeepSpeedEngine._take_model_step)."""
    model = make_model()
    opt = adamw(model.parameters())
    sched = _halving(opt)
    engine, _, _, lr_sched = ds().initialize(model=model, optimizer=opt, lr_scheduler=sched,
                                            config=config(optimizer=False))
    assert isinstance(engine, ds().DeepSpeedEngine)
    batches = [[batch(0)], [batch(1)], [batch(2)]]
    engine_steps(engine, batches)
    assert_params(full_params(engine), plain_steps(make_model(), batches, sched=_halving))
    assert engine.get_lr() == [LR * 0.125], engine.get_lr()
    assert lr_sched is not None and lr_sched.get_last_lr() == [LR * 0.125]


@check("deepspeed.initialize(model=) without optimizer")
def initialize_reference_model(ctx: Context) -> None:
    """DeepSpeed-Chat's / TRL's frozen reference: no optimizer anywhere; forward only."""
    engine, opt, _, sched = ds().initialize(model=make_model(), config=config(optimizer=False))
    engine.eval()
    x, _ = batch(0)
    with torch.no_grad():
        out = engine(x)
    torch.testing.assert_close(out, make_model()(x).detach())
    assert opt is None and sched is None and engine.optimizer is None


@check("deepspeed.initialize(config_params=)")
def initialize_config_params(ctx: Context) -> None:
    """accelerate passes the config as config_params= (deepspeed/__init__.py: initialize)."""
    engine, opt, _, _ = ds().initialize(model=make_model(), config_params=config(gas=2))
    assert engine.gradient_accumulation_steps() == 2
    assert opt.param_groups[0]["lr"] == LR


def _groups(model: torch.nn.Module) -> list[dict[str, Any]]:
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    rest = [p for n, p in model.named_parameters() if not n.endswith("weight")]
    return [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]


@check("deepspeed.initialize(model_parameters=)")
def initialize_model_parameters(ctx: Context) -> None:
    """The config's optimizer over the caller's param groups (their weight decays kept)."""
    model = make_model()
    engine, opt, _, _ = ds().initialize(model=model, model_parameters=_groups(model),
                                        config=config())
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    batches = [[batch(0)], [batch(1)]]
    engine_steps(engine, batches)

    names = [n for n, _ in make_model().named_parameters()]

    def grouped(params: Any) -> torch.optim.AdamW:
        named = list(zip(names, params, strict=True))
        return torch.optim.AdamW(
            [{"params": [p for n, p in named if n.endswith("weight")], "weight_decay": 0.1},
             {"params": [p for n, p in named if not n.endswith("weight")],
              "weight_decay": 0.0}], lr=LR)
    assert_params(full_params(engine), plain_steps(make_model(), batches, make_opt=grouped))


@check("deepspeed.initialize(lr_scheduler=<callable>)")
def initialize_scheduler_callable(ctx: Context) -> None:
    """OpenRLHF's sched_factory: DeepSpeed calls it with the built optimizer
    (runtime/engine.py: DeepSpeedEngine._configure_lr_scheduler, callable client scheduler)."""
    engine, opt, _, sched = ds().initialize(model=make_model(), lr_scheduler=_halving,
                                            config=config())
    assert isinstance(sched, torch.optim.lr_scheduler.LambdaLR)
    engine_steps(engine, [[batch(0)]])
    assert engine.get_lr() == [LR / 2] and opt.param_groups[0]["lr"] == LR / 2


@check("deepspeed.initialize(args=)")
def initialize_args(ctx: Context) -> None:
    """cifar10_deepspeed / Megatron: args.deepspeed_config names the config file when no
    config= is given (runtime/engine.py: DeepSpeedEngine._configure_with_arguments)."""
    path = ctx.tmp() / "ds_config.json"
    path.write_text(json.dumps(config(gas=3)))
    args = argparse.Namespace(local_rank=0, deepspeed_config=str(path), deepspeed=True)
    model = make_model()
    engine, *_ = ds().initialize(args=args, model=model, model_parameters=model.parameters())
    assert engine.gradient_accumulation_steps() == 3
    lightning = argparse.Namespace(device_rank=0)
    engine, *_ = ds().initialize(args=lightning, model=make_model(), config=config())
    assert engine.train_micro_batch_size_per_gpu() == MICRO


@check("deepspeed.initialize(dist_init_required=)")
def initialize_dist_init_required(ctx: Context) -> None:
    """dist_init_required=True with a group already up: DeepSpeed keeps it (comm/comm.py:
    init_distributed returns when torch.distributed is initialized)."""
    group_size = dist.get_world_size()
    for required in (True, False):
        engine, *_ = ds().initialize(model=make_model(), config=config(),
                                     dist_init_required=required)
        x, _ = batch(0)
        with torch.no_grad():
            torch.testing.assert_close(engine(x), make_model()(x).detach())
    assert dist.is_initialized() and dist.get_world_size() == group_size


@check("deepspeed.initialize(training_data=)")
def initialize_training_data(ctx: Context) -> None:
    """The third return value is a distributed loader of micro batches (runtime/engine.py:
    deepspeed_io with DeepSpeedDataLoader)."""
    xs, ys = torch.randn(8, 5), torch.randn(8, 3)
    data = torch.utils.data.TensorDataset(xs, ys)
    engine, _, loader, _ = ds().initialize(model=make_model(), training_data=data,
                                           config=config())
    assert loader is not None
    items = list(loader)
    assert len(items) == 8 // (MICRO * dist.get_world_size())
    x, y = items[0]
    assert x.shape == (MICRO, 5) and y.shape == (MICRO, 3)
    engine.backward(loss_of(engine(x), y))
    engine.step()
    assert engine.global_steps == 1


class _Mpu:
    """The Megatron mpu surface DeepSpeed reads (runtime/engine.py: _set_distributed_vars,
    utils/groups.py)."""

    def get_model_parallel_world_size(self) -> int:
        return 1

    def get_model_parallel_rank(self) -> int:
        return 0

    def get_model_parallel_group(self) -> Any:
        return dist.new_group([dist.get_rank()])

    def get_data_parallel_group(self) -> Any:
        return dist.group.WORLD

    def get_data_parallel_world_size(self) -> int:
        return dist.get_world_size()

    def get_data_parallel_rank(self) -> int:
        return dist.get_rank()


@check("deepspeed.initialize(mpu=)")
def initialize_mpu(ctx: Context) -> None:
    """An mpu with tensor-parallel size 1: data parallel over the world, as without one."""
    model = make_model()
    engine, *_ = ds().initialize(model=model, optimizer=adamw(model.parameters()),
                                 config=config(optimizer=False), mpu=_Mpu())
    batches = [[batch(0)]]
    engine_steps(engine, batches)
    assert_params(full_params(engine), plain_steps(make_model(), batches))


@check("deepspeed.init_distributed")
def init_distributed_fresh(ctx: Context) -> None:
    """DeepSpeed-Chat calls it with no argument before anything else: the env:// group of
    RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT (comm/comm.py: init_distributed)."""
    dist.destroy_process_group()
    ds().init_distributed()
    assert dist.is_initialized()
    assert dist.get_world_size() == int(os.environ["WORLD_SIZE"]) == 1
    ds().init_distributed()  # a second call keeps the group
    assert dist.get_world_size() == 1


@check("deepspeed.init_distributed", world_size=2, variant="group already up")
def init_distributed_existing(ctx: Context) -> None:
    ds().init_distributed(dist_backend="gloo")
    assert dist.get_world_size() == 2


@check("deepspeed.comm.init_distributed", world_size=2)
def comm_init_distributed(ctx: Context) -> None:
    """axolotl's keywords, with a group already up (gloo here: CPU)."""
    ds().comm.init_distributed(dist_backend="gloo", auto_mpi_discovery=False,
                               dist_init_required=True)
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == 2


@check("deepspeed.add_config_arguments")
def add_config_arguments(ctx: Context) -> None:
    """deepspeed/__init__.py: add_config_arguments (_add_core_arguments) adds --deepspeed and
    --deepspeed_config to the caller's parser and returns it."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--lr", type=float, default=0.1)
    parser = ds().add_config_arguments(parser)
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", "ds.json", "--lr", "1"])
    assert args.deepspeed is True and args.deepspeed_config == "ds.json" and args.lr == 1.0
    assert parser.parse_args([]).deepspeed is False


@check("deepspeed.__version__")
def version_gate(ctx: Context) -> None:
    """OpenRLHF / TRL / transformers gate features on it."""
    assert Version(ds().__version__) >= Version("0.16.5")


@check("deepspeed.DeepSpeedEngine")
def engine_class(ctx: Context) -> None:
    """Lightning finds engines with isinstance(m, DeepSpeedEngine); it is an nn.Module."""
    assert isinstance(ctx.engine, ds().DeepSpeedEngine)
    assert isinstance(ctx.engine, torch.nn.Module)


@check("deepspeed.runtime.engine.DeepSpeedEngine")
def engine_class_path(ctx: Context) -> None:
    assert ds_from("deepspeed.runtime.engine", "DeepSpeedEngine") is ds().DeepSpeedEngine


@check("deepspeed.DeepSpeedConfig")
def deepspeed_config(ctx: Context) -> None:
    """BingBertGlue reads the config file through DeepSpeedConfig (runtime/config.py)."""
    path = ctx.tmp() / "ds.json"
    path.write_text(json.dumps(config(gas=2)))
    cfg = ds().DeepSpeedConfig(str(path))
    assert cfg.train_micro_batch_size_per_gpu == MICRO
    assert cfg.gradient_accumulation_steps == 2
    assert cfg.fp16_enabled is False


@check("deepspeed.tp_model_init")
def tp_model_init(ctx: Context) -> None:
    """tp_size 1: the model as it was, in the dtype asked (deepspeed/__init__.py)."""
    model = ds().tp_model_init(make_model(), tp_size=1, dtype=torch.float32)
    x, _ = batch(0)
    torch.testing.assert_close(model(x), make_model()(x))
