"""DeepSpeed's `deepspeed.initialize`: every keyword it takes, mapped onto `meshzero.initialize`.

The engine built is a :class:`~meshzero.deepspeed.engine.DeepSpeedEngine`.

What the keywords become here (DeepSpeed's ``deepspeed/__init__.py: initialize``):

- ``config`` / ``config_params`` / ``args.deepspeed_config`` (or the deprecated
  ``args.deepscale_config``): one of them is the ds_config, as DeepSpeed requires;
- ``dist_init_required``: False needs a process group already made; None or True make one
  if none exists (torchrun's environment, or a world of one), as DeepSpeed;
- ``distributed_port``: ``MASTER_PORT`` when the group is made from an environment that has
  ``RANK`` and ``WORLD_SIZE`` but no port (DeepSpeed uses it only for such discovery);
- ``mpu``: Megatron's model-parallel unit. meshzero slices the model itself, so only an mpu
  of tensor and pipeline size 1 (data parallel over the world) maps; otherwise one error;
- ``mesh_param``: DeepSpeed's ``(data_parallel, sequence_parallel)`` mesh: the config's
  ``sequence_parallel_size``;
- ``training_data`` / ``collate_fn``: meshzero's distributed loader (third return value).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from meshzero.config import Config
from meshzero.config.errors import read_json
from meshzero.deepspeed.engine import DeepSpeedEngine
from meshzero.engine import initialize as meshzero_initialize

logger = logging.getLogger(__name__)

TORCH_DISTRIBUTED_DEFAULT_PORT = 29500  # DeepSpeed's constants.TORCH_DISTRIBUTED_DEFAULT_PORT

ConfigLike = Config | dict[str, Any] | str | os.PathLike


def initialize(
    args: Any = None,
    model: nn.Module | None = None,
    optimizer: torch.optim.Optimizer | Callable | None = None,
    model_parameters: Iterable[Any] | None = None,
    training_data: Any = None,
    lr_scheduler: Any = None,
    distributed_port: int = TORCH_DISTRIBUTED_DEFAULT_PORT,
    mpu: Any = None,
    dist_init_required: bool | None = None,
    collate_fn: Callable | None = None,
    config: ConfigLike | None = None,
    mesh_param: tuple[int, int] | None = None,
    config_params: ConfigLike | None = None,
) -> tuple[DeepSpeedEngine, Any, Any, Any]:
    """DeepSpeed's `deepspeed.initialize`: `meshzero.initialize` building a `DeepSpeedEngine`.

    Returns ``(engine, optimizer, training_dataloader, lr_scheduler)``; the module docstring
    says what each keyword becomes."""
    if model is None:
        raise ValueError("deepspeed.initialize() needs model= (the torch.nn.Module to train)")
    if collate_fn is not None and training_data is None:
        raise ValueError("initialize(collate_fn=...) batches training_data; pass "
                         "training_data= too, or build your own DataLoader with it")
    config = _config_source(args, config, config_params)
    _check_pipeline_module(model)
    config = _with_tp_model_init(config, model)
    if mesh_param is not None:
        config = _with_mesh(config, mesh_param)
    _process_group(dist_init_required, distributed_port)
    if mpu is not None:
        _check_mpu(mpu, config)
    data: dict[str, Any] = {}  # passed to the core only when given
    if training_data is not None:
        data["training_data"] = training_data
    if collate_fn is not None:
        data["collate_fn"] = collate_fn
    engine, opt, loader, scheduler = meshzero_initialize(
        model=model, optimizer=optimizer, model_parameters=model_parameters,
        lr_scheduler=lr_scheduler, config=config, engine_class=DeepSpeedEngine, **data)
    assert isinstance(engine, DeepSpeedEngine)
    engine.training_dataloader = loader
    if args is not None and hasattr(args, "local_rank"):
        args.local_rank = engine.local_rank  # as DeepSpeed aligns it (_configure_with_arguments)
    return engine, opt, loader, scheduler


def _check_pipeline_module(model: nn.Module) -> None:
    """A ``deepspeed.pipe.PipelineModule`` of one stage trains data-parallel; of more, meshzero's
    pipeline needs one micro-batch of inputs that DeepSpeed's signature cannot carry."""
    from meshzero.deepspeed.pipe import PipelineModule

    if isinstance(model, PipelineModule) and model.num_stages > 1:
        raise ValueError(
            f"deepspeed.initialize(model=PipelineModule(num_stages={model.num_stages})): "
            "meshzero's pipeline fixes the shapes sent between stages from one micro-batch of "
            "inputs: call meshzero.initialize(model=module, config=<with pipeline_parallel."
            f"size {model.num_stages}, layers \"\">, loss_fn=module.loss_fn, "
            "example_inputs=<one micro-batch>) and train with engine.train_batch(data_iter)")


def _with_tp_model_init(config: ConfigLike, model: nn.Module) -> ConfigLike:
    """The tp size ``deepspeed.tp_model_init`` recorded, merged into the config."""
    from meshzero.deepspeed.tp import recorded_tp_size, with_recorded_tp

    if recorded_tp_size(model) is None:
        return config
    raw = _raw(config)
    if raw is None:  # a typed Config is canonical: it must say the same size
        assert isinstance(config, Config)
        if config.tensor_parallel.size != recorded_tp_size(model):
            raise ValueError(f"tp_model_init(tp_size={recorded_tp_size(model)}) but the Config "
                             f"has tensor_parallel.size {config.tensor_parallel.size}")
        return config
    return with_recorded_tp(raw, model)


def _config_source(args: Any, config: ConfigLike | None,
                   config_params: ConfigLike | None) -> ConfigLike:
    """The one ds_config among ``config``, ``config_params`` and ``args.deepspeed_config``
    (``args.deepscale_config``, deprecated, counts as ``deepspeed_config``)."""
    if config is not None and config_params is not None and config is not config_params:
        raise ValueError("initialize() got config and config_params (the same argument, "
                         "kept by DeepSpeed for old code); pass one of them")
    config = config if config is not None else config_params
    from_args = getattr(args, "deepspeed_config", None)
    old = getattr(args, "deepscale_config", None)
    if old is not None:
        if from_args is not None:
            raise ValueError("args has both deepscale_config and deepspeed_config; keep "
                             "--deepspeed_config (deepscale_config is its deprecated name)")
        logger.warning("--deepscale_config is deprecated, use --deepspeed_config")
        from_args = old
    if from_args is not None and config is not None:
        raise ValueError(f"initialize() got config= and args.deepspeed_config="
                         f"{from_args!r}; pass one of them")
    config = config if config is not None else from_args
    if config is None:
        raise ValueError("initialize() needs a ds_config: config= (a dict or a JSON path), "
                         "config_params=, or args.deepspeed_config (--deepspeed_config)")
    return config


def _raw(config: ConfigLike) -> dict[str, Any] | None:
    """The config as a dict (read from a path; None for a typed Config)."""
    if isinstance(config, (str, os.PathLike)):
        raw = read_json(Path(config))
        return raw if isinstance(raw, dict) else None
    return config if isinstance(config, dict) else None


def _mesh_sizes(config: ConfigLike) -> dict[str, int]:
    """The tensor, pipeline and sequence parallel sizes the config asks for."""
    if isinstance(config, Config):
        return {"tensor": config.tensor_parallel.size,
                "pipeline": config.pipeline_parallel.size,
                "sequence": config.sequence_parallel_size}
    raw = _raw(config) or {}
    tp = raw.get("tensor_parallel") if isinstance(raw.get("tensor_parallel"), dict) else {}
    pp = raw.get("pipeline_parallel") if isinstance(raw.get("pipeline_parallel"), dict) else {}
    assert isinstance(tp, dict) and isinstance(pp, dict)
    return {"tensor": int(tp.get("size", tp.get("autotp_size", 1)) or 1),
            "pipeline": int(pp.get("size", 1)),
            "sequence": int(raw.get("sequence_parallel_size", 1))}


def _world_size() -> int:
    if dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def _with_mesh(config: ConfigLike, mesh_param: Any) -> ConfigLike:
    """DeepSpeed's ``mesh_param`` ``(data_parallel, sequence_parallel)`` as the config's
    ``sequence_parallel_size``; the mesh must cover the world."""
    if (not isinstance(mesh_param, (tuple, list)) or len(mesh_param) != 2
            or not all(isinstance(n, int) and n > 0 for n in mesh_param)):
        raise ValueError(f"initialize(mesh_param={mesh_param!r}): expected "
                         "(data_parallel_size, sequence_parallel_size), two positive ints")
    dp, sp = mesh_param
    sizes = _mesh_sizes(config)
    world = _world_size()
    if dp * sp * sizes["tensor"] * sizes["pipeline"] != world:
        raise ValueError(f"initialize(mesh_param={tuple(mesh_param)}): data {dp} x sequence "
                         f"{sp} x tensor {sizes['tensor']} x pipeline {sizes['pipeline']} != "
                         f"world size {world}")
    raw = _raw(config)
    if raw is None:  # a typed Config: it must already say so
        if sizes["sequence"] != sp:
            raise ValueError(f"initialize(mesh_param={tuple(mesh_param)}) asks sequence "
                             f"parallel {sp}; the Config has sequence_parallel_size "
                             f"{sizes['sequence']}")
        return config
    if raw.get("sequence_parallel_size", sp) != sp:
        raise ValueError(f"initialize(mesh_param={tuple(mesh_param)}) asks sequence parallel "
                         f"{sp}; the config has sequence_parallel_size "
                         f"{raw['sequence_parallel_size']}")
    return {**raw, "sequence_parallel_size": sp}


def _process_group(dist_init_required: bool | None, port: int) -> None:
    """DeepSpeed's ``comm.init_distributed`` as ``initialize`` calls it: refuse a missing
    group when told not to make one; otherwise meshzero makes it (build.py)."""
    if dist_init_required not in (None, True, False):
        raise ValueError(f"initialize(dist_init_required={dist_init_required!r}): expected "
                         "None, True or False")
    if dist.is_initialized():
        return
    if dist_init_required is False:
        raise ValueError("initialize(dist_init_required=False) but no torch.distributed "
                         "process group exists: call deepspeed.init_distributed() or "
                         "torch.distributed.init_process_group() first, or leave "
                         "dist_init_required unset")
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env and "MASTER_PORT" not in env:
        env["MASTER_PORT"] = str(port)
        logger.info("MASTER_PORT=%d from initialize(distributed_port=)", port)
    elif port != TORCH_DISTRIBUTED_DEFAULT_PORT:
        logger.info("initialize(distributed_port=%d) not used: %s", port,
                    "MASTER_PORT is set" if "MASTER_PORT" in env else
                    "no RANK/WORLD_SIZE in the environment: a world of one process")


def _mpu_size(mpu: Any, *names: str, default: int | None = None) -> int:
    """The first of ``mpu.<name>()`` that exists; ``default`` (or an error) if none does."""
    for name in names:
        method = getattr(mpu, name, None)
        if callable(method):
            return int(method())
    if default is not None:
        return default
    raise ValueError(f"initialize(mpu=...): the mpu has no {' / '.join(names)}(); meshzero "
                     "reads the model-parallel sizes from it")


def _check_mpu(mpu: Any, config: ConfigLike) -> None:
    """Megatron's mpu maps when its tensor and pipeline sizes are 1 and its data-parallel
    group is the world (the config then asks no tp/pp either); else one error."""
    tp = _mpu_size(mpu, "get_tensor_model_parallel_world_size", "get_model_parallel_world_size")
    pp = _mpu_size(mpu, "get_pipeline_model_parallel_world_size", default=1)
    if tp > 1 or pp > 1:
        raise ValueError(
            f"initialize(mpu=...) with tensor parallel {tp} and pipeline parallel {pp}: "
            "meshzero slices the model itself; pass the unsliced model with "
            f"tensor_parallel.size = {tp} and pipeline_parallel.size = {pp} in the config, "
            "and no mpu")
    dp = _mpu_size(mpu, "get_data_parallel_world_size")
    sizes = _mesh_sizes(config)
    world = _world_size()
    expected = world // (sizes["tensor"] * sizes["pipeline"] * sizes["sequence"])
    if sizes["tensor"] * sizes["pipeline"] > 1 or dp != expected:
        raise ValueError(
            f"initialize(mpu=...): the mpu's data-parallel size is {dp} (tensor {tp}, "
            f"pipeline {pp}), but the config's mesh (tensor {sizes['tensor']}, pipeline "
            f"{sizes['pipeline']}, sequence {sizes['sequence']}) over {world} ranks gives "
            f"{expected}; make them agree, or drop the mpu")
