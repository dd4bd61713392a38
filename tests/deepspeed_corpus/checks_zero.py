"""Checks: ZeRO-3 (zero.Init, GatheredParameters, ds_* attributes), the utils over it,
offload_states."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from tests.deepspeed_corpus.context import (
    Context,
    assert_params,
    batch,
    check,
    config,
    ds,
    ds_from,
    engine_steps,
    full_params,
    make_model,
    plain_steps,
)
from tests.models import Block

PARTITION = "deepspeed.runtime.zero.partition_parameters"


def _status() -> type:
    return ds_from(PARTITION, "ZeroParamStatus")


@check("deepspeed.zero.Init")
def zero_init(ctx: Context) -> None:
    """Built inside zero.Init, then written on rank 0 under GatheredParameters(modifier_rank=0)
    before initialize, as transformers loads a checkpoint into a ZeRO-3 model and Megatron
    initialises its layers (runtime/zero/partition_parameters.py: Init, GatheredParameters)."""
    cfg = config()
    with ds().zero.Init(config_dict_or_path=cfg):
        model = make_model()
    with ds().zero.GatheredParameters([model.head.weight], modifier_rank=0):
        if dist.get_rank() == 0:
            model.head.weight.data.fill_(0.25)
    engine = ctx.build(model, cfg)
    ref = make_model()
    with torch.no_grad():
        ref.head.weight.fill_(0.25)
    x, _ = batch(0)
    with torch.no_grad():
        torch.testing.assert_close(engine(x), ref(x))


@check("deepspeed.zero.GatheredParameters")
def gathered_read(ctx: Context) -> None:
    """TRL / LLaVA / FastChat read full tensors inside the block (modifier_rank=None)."""
    want = dict(make_model().named_parameters())
    params = dict(ctx.engine.module.named_parameters())
    with ds().zero.GatheredParameters(list(params.values())):
        for name, p in params.items():
            torch.testing.assert_close(p.detach(), want[name].detach())


def _write_head(ctx: Context, gather: Any, single: bool) -> None:
    """Rank 0 writes the head inside GatheredParameters(modifier_rank=0); every rank must
    see it in forward and in the next optimizer step (DeepSpeed broadcasts it on exit:
    GatheredParameters.__exit__)."""
    model = make_model()
    engine = ctx.build(model, config())
    head = engine.module.head.weight
    with gather(head if single else [head], modifier_rank=0):
        if dist.get_rank() == 0:
            head.data.fill_(0.25)
    ref = make_model()
    with torch.no_grad():
        ref.head.weight.fill_(0.25)
    x, _ = batch(0)
    with torch.no_grad():
        torch.testing.assert_close(engine(x), ref(x))
    world = dist.get_world_size()
    batches = [[batch(1, size=2 * world)]]
    engine_steps(engine, batches)
    assert_params(full_params(engine), plain_steps(ref, batches))


@check("deepspeed.zero.GatheredParameters(modifier_rank=0)", world_size=2)
def gathered_write(ctx: Context) -> None:
    _write_head(ctx, ds().zero.GatheredParameters, single=False)


@check("deepspeed.runtime.zero.GatheredParameters")
def gathered_write_runtime_path(ctx: Context) -> None:
    """Megatron passes one parameter, not a list."""
    _write_head(ctx, ds_from("deepspeed.runtime.zero", "GatheredParameters"), single=True)


@check("deepspeed.zero.GatheredParameters(enabled=)")
def gathered_enabled(ctx: Context) -> None:
    """enabled=False: the block does nothing (DeepSpeed returns before gathering)."""
    status = _status()
    engine = ctx.build()  # held: a parameter no engine holds is a plain parameter again
    p = engine.module.head.weight
    with ds().zero.GatheredParameters([p], enabled=False):
        assert p.ds_status == status.NOT_AVAILABLE
    with ds().zero.GatheredParameters([p], enabled=True):
        assert p.ds_status == status.AVAILABLE and p.shape == (3, 8)
        torch.testing.assert_close(p.detach(), make_model().head.weight.detach())


@check("deepspeed.runtime.zero.partition_parameters.ZeroParamStatus.NOT_AVAILABLE")
def status_not_available(ctx: Context) -> None:
    """DeepSpeed-Chat's _z3_params_to_fetch / get_model_norm: after initialize every
    parameter is released; gathering those gives the model's values."""
    status = _status()
    engine = ctx.build()
    params = list(engine.module.parameters())
    fetch = [p for p in params if hasattr(p, "ds_id") and p.ds_status == status.NOT_AVAILABLE]
    assert len(fetch) == len(params)
    total = 0.0
    for p in params:
        should_gather = hasattr(p, "ds_id") and p.ds_status == status.NOT_AVAILABLE
        with ds().zero.GatheredParameters(p, enabled=should_gather):
            total += float(p.float().norm())
    want = sum(float(p.float().norm()) for p in make_model().parameters())
    assert abs(total - want) < 1e-4 * want, (total, want)


@check("deepspeed.runtime.zero.partition_parameters.ZeroParamStatus.AVAILABLE")
def status_available(ctx: Context) -> None:
    """TRL's get_gather context: gather what is not AVAILABLE; inside, all are."""
    status = _status()
    engine = ctx.build()
    params = list(engine.module.parameters())
    to_gather = [p for p in params if p.ds_status != status.AVAILABLE]
    with ds().zero.GatheredParameters(to_gather):
        assert all(p.ds_status == status.AVAILABLE for p in params)


@check("param.ds_id")
def ds_id(ctx: Context) -> None:
    ids = [p.ds_id for p in ctx.engine.module.parameters()]
    assert all(isinstance(i, int) for i in ids) and len(set(ids)) == len(ids)


@check("param.ds_status")
def ds_status(ctx: Context) -> None:
    status = _status()
    assert all(isinstance(p.ds_status, status) for p in ctx.engine.module.parameters())


@check("param.ds_numel")
def ds_numel(ctx: Context) -> None:
    """Megatron counts parameters with ds_numel when the param has ds_id."""
    params = ctx.engine.module.parameters()
    total = sum(p.ds_numel if hasattr(p, "ds_id") else p.nelement() for p in params)
    assert total == sum(p.numel() for p in make_model().parameters())


@check("param.ds_shape")
def ds_shape(ctx: Context) -> None:
    want = {n: p.shape for n, p in make_model().named_parameters()}
    for name, p in ctx.engine.module.named_parameters():
        assert tuple(p.ds_shape) == tuple(want[name]), name


@check("param.ds_tensor", world_size=2)
def ds_tensor(ctx: Context) -> None:
    """This rank's part of the parameter, 1-D: the ranks' parts in rank order are the
    flattened parameter (DeepSpeed cuts each parameter in ceil(numel / world) parts; meshzero
    cuts whole units, so a part may be longer, shorter or empty). DeepSpeedExamples counts
    with it as ``p.ds_numel if hasattr(p, "ds_tensor") else p.numel()``."""
    world = dist.get_world_size()
    want = dict(make_model().named_parameters())
    for name, p in ctx.engine.module.named_parameters():
        assert hasattr(p, "ds_tensor") and p.ds_numel == want[name].numel(), name
        shard = p.ds_tensor.detach().reshape(-1).float().cpu()
        parts: list = [None] * world
        dist.all_gather_object(parts, shard)
        full = torch.cat(parts)
        assert full.numel() >= p.ds_numel, name
        torch.testing.assert_close(full[:p.ds_numel], want[name].detach().reshape(-1))


@check("engine.optimizer.parameter_offload")
def parameter_offload_hooks(ctx: Context) -> None:
    """TRL removes the ZeRO-3 hooks for generation and registers them again (trl
    models/utils.py: remove_hooks / add_hooks)."""
    engine = ctx.build()
    offload = engine.optimizer.parameter_offload
    for hook in offload.forward_hooks + offload.backward_hooks:
        hook.remove()
    offload.forward_hooks, offload.backward_hooks = [], []
    offload._register_deepspeed_module(offload.module)
    batches = [[batch(0)]]
    engine_steps(engine, batches)
    assert_params(full_params(engine), plain_steps(make_model(), batches))


@check("deepspeed.utils.set_z3_leaf_modules")
def leaf_modules(ctx: Context) -> None:
    """Blocks become leaves (gathered whole); training is unchanged (utils/z3_leaf_module.py:
    set_z3_leaf_modules returns the modules it marked)."""
    model = make_model()
    set_leaf = ds_from("deepspeed.utils", "set_z3_leaf_modules")
    marked = set_leaf(model, [Block])
    assert {id(m) for m in marked} == {id(b) for b in model.blocks}
    engine = ctx.build(model)
    batches = [[batch(0)]]
    engine_steps(engine, batches)
    assert_params(full_params(engine), plain_steps(make_model(), batches))


@check("deepspeed.utils.safe_get_full_fp32_param")
def safe_full_fp32(ctx: Context) -> None:
    engine = ctx.build()
    batches = [[batch(0)]]
    engine_steps(engine, batches)
    want = plain_steps(make_model(), batches)
    get = ds_from("deepspeed.utils", "safe_get_full_fp32_param")
    for name, p in engine.module.named_parameters():
        value = get(p)
        assert value.dtype == torch.float32
        torch.testing.assert_close(value, want[name], rtol=1e-5, atol=1e-5)


@check("deepspeed.checkpoint.utils.clone_tensors_for_torch_save")
def clone_for_save(ctx: Context) -> None:
    """Fresh CPU tensors with their own storage (checkpoint/utils.py)."""
    model = make_model()
    sd = model.state_dict()
    out = ds_from("deepspeed.checkpoint.utils", "clone_tensors_for_torch_save")(sd)
    assert list(out) == list(sd)
    for key, value in sd.items():
        assert out[key].device.type == "cpu"
        assert out[key].untyped_storage().data_ptr() != value.untyped_storage().data_ptr()
        torch.testing.assert_close(out[key], value)


@check("deepspeed.utils.zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint")
def zero_to_fp32(ctx: Context) -> None:
    engine = ctx.build()
    batches = [[batch(0)]]
    engine_steps(engine, batches)
    path = ctx.tmp()
    engine.save_checkpoint(str(path), tag="t")
    get = ds_from("deepspeed.utils.zero_to_fp32", "get_fp32_state_dict_from_zero_checkpoint")
    assert_params(get(str(path), "t"), plain_steps(make_model(), batches))


@check("deepspeed.runtime.zero.offload_config.OffloadDeviceEnum")
def offload_device_enum(ctx: Context) -> None:
    enum = ds_from("deepspeed.runtime.zero.offload_config", "OffloadDeviceEnum")
    assert enum.cpu == "cpu" and enum.none == "none" and enum.nvme == "nvme"


@check("deepspeed.runtime.zero.offload_config.OffloadStateTypeEnum")
def offload_state_enum(ctx: Context) -> None:
    enum = ds_from("deepspeed.runtime.zero.offload_config", "OffloadStateTypeEnum")
    for name in ("optim_states", "hp_params", "lp_params", "lp_grads",
                 "contiguous_grad_buffer"):
        assert getattr(enum, name) == name


def _offload_round_trip(ctx: Context, non_blocking: bool) -> None:
    mod = ds_from("deepspeed.runtime.zero.offload_config")
    types = mod.OffloadStateTypeEnum
    engine = ctx.build()
    batches = [[batch(0)], [batch(1)]]
    engine_steps(engine, batches[:1])
    engine.offload_states(include=[types.optim_states, types.contiguous_grad_buffer,
                                   types.hp_params, types.lp_grads],
                          device=mod.OffloadDeviceEnum.cpu, pin_memory=False,
                          non_blocking=non_blocking)
    engine.reload_states(non_blocking=non_blocking)
    engine_steps(engine, batches[1:])
    assert_params(full_params(engine), plain_steps(make_model(), batches))


@check("engine.offload_states")
def offload_states(ctx: Context) -> None:
    """Offloaded then reloaded: training goes on as if nothing happened
    (runtime/engine.py: offload_states / reload_states)."""
    _offload_round_trip(ctx, non_blocking=False)


@check("engine.reload_states")
def reload_states(ctx: Context) -> None:
    _offload_round_trip(ctx, non_blocking=True)


@check("engine.empty_partition_cache")
def empty_partition_cache(ctx: Context) -> None:
    engine = ctx.build()
    x, _ = batch(0)
    with torch.no_grad():
        before = engine(x)
    engine.empty_partition_cache()
    with torch.no_grad():
        torch.testing.assert_close(engine(x), before)
    batches = [[batch(1)]]
    engine_steps(engine, batches)
    assert_params(full_params(engine), plain_steps(make_model(), batches))
