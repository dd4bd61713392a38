"""``deepspeed.runtime.zero.partition_parameters``: ZeRO-3 construction and gathering, mapped
onto ``meshzero.zero_init`` and meshzero's gathered parameters."""

from __future__ import annotations

import logging
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn

from meshzero.zero.construction import zero_init
from meshzero.zero.gathered import gathered_parameters
from meshzero.zero.param_access import ZeroParamStatus

__all__ = ["GatheredParameters", "Init", "ZeroParamStatus", "register_external_parameter",
           "unregister_external_parameter"]

logger = logging.getLogger(__name__)


def _refuse(name: str, value: Any, default: Any, how: str) -> None:
    if value is not default and value != default:
        raise NotImplementedError(f"deepspeed.zero.Init({name}={value!r}) is not supported by "
                                  f"meshzero: {how}")


class Init:
    """DeepSpeed's `deepspeed.zero.Init`: `meshzero.zero_init` (meta parameters until initialize).

    Parameters are built on the meta device; initialize materialises and shards them.

    Keywords, each honoured or refused in one line:
    ``config_dict_or_path`` / ``config`` (an alias): the ds_config, validated, its seed set;
    ``enabled``: False builds eagerly; ``module``: refused (pass the built model to
    ``initialize``, which shards it); ``data_parallel_group`` / ``mpu``: accepted, the
    engine shards over the data-parallel group of its mesh at initialize;
    ``mem_efficient_linear``: accepted, meshzero never replaces ``F.linear`` (either value
    computes the same); ``remote_device`` / ``pin_memory``: accepted, nothing is allocated
    before initialize (placement comes from ``offload_param``); ``dtype``: must match a
    half-precision compute dtype the config sets (the engine casts to the config's);
    ``zero_param_parallel_group``: refused (use ``zero_optimization.zero_hpz_partition_size``);
    ``zero_quantized_weights`` /
    ``zero_quantized_nontrainable_weights``: True must be what the config says (the engine's
    config decides, docs/compression.md); ``sequence_data_parallel_group``: refused (the
    config's sequence parallel section builds that group); ``param_swapper``: refused (use
    ``offload_param.device: nvme``)."""

    def __init__(self, module: nn.Module | None = None, data_parallel_group: Any = None,
                 mem_efficient_linear: bool = True, remote_device: str | None = None,
                 pin_memory: bool = False, config_dict_or_path: Any = None,
                 config: Any = None, enabled: bool = True, dtype: torch.dtype | None = None,
                 mpu: Any = None, zero_param_parallel_group: Any = None,
                 zero_quantized_weights: bool = False,
                 zero_quantized_nontrainable_weights: bool = False,
                 sequence_data_parallel_group: Any = None, param_swapper: Any = None):
        _refuse("module", module, None, "pass the built model to meshzero.initialize (or "
                "deepspeed.initialize), which shards it")
        _refuse("zero_param_parallel_group", zero_param_parallel_group, None,
                "set zero_optimization.zero_hpz_partition_size in the config")
        _refuse("sequence_data_parallel_group", sequence_data_parallel_group, None,
                "the config's sequence parallel section builds that group at initialize")
        _refuse("param_swapper", param_swapper, None,
                "set zero_optimization.offload_param.device to nvme in the config")
        if remote_device not in (None, "none", "cpu", "nvme"):
            raise ValueError(f"deepspeed.zero.Init(remote_device={remote_device!r}): valid "
                             "values are None, 'none', 'cpu', 'nvme'")
        if config is not None and config_dict_or_path is not None:
            raise ValueError("deepspeed.zero.Init: pass config_dict_or_path or config (its "
                             "deprecated alias), not both")
        self.config = config_dict_or_path if config_dict_or_path is not None else config
        _check_quantized(self.config, zero_quantized_weights=zero_quantized_weights,
                         zero_quantized_nontrainable_weights=zero_quantized_nontrainable_weights)
        _check_dtype(dtype, self.config)
        self.enabled = enabled
        self._context: AbstractContextManager[Any] | None = None

    def __enter__(self) -> Init:
        self._context = zero_init(self.config, enabled=self.enabled)
        self._context.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        assert self._context is not None, "Init.__exit__ without __enter__"
        context, self._context = self._context, None
        context.__exit__(*exc)


def _check_quantized(config: Any, **keys: bool) -> None:
    """ZeRO++ qwZ asked of Init: the config must ask for it too (the engine reads the
    config at initialize; Init builds nothing that depends on it)."""
    asked = [k for k, v in keys.items() if v]
    if not asked:
        return
    from meshzero.config import load_config

    zc = None if config is None else load_config(config).zero_optimization
    for key in asked:
        if zc is None or not getattr(zc, key):
            raise ValueError(f"deepspeed.zero.Init({key}=True): set zero_optimization.{key}: "
                             "true in the config passed to Init and initialize (the engine's "
                             "config decides), or drop the keyword")


def _check_dtype(dtype: torch.dtype | None, config: Any) -> None:
    if dtype is None:
        return
    if dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"deepspeed.zero.Init(dtype={dtype}): valid values are "
                         "torch.float32, torch.float16, torch.bfloat16")
    if config is None:
        return
    from meshzero.config import load_config

    want = load_config(config).compute_dtype
    if want == torch.float32 and dtype != torch.float32:  # unset or "auto" in the config
        logger.info("deepspeed.zero.Init(dtype=%s): parameters are built in fp32 and cast "
                    "at initialize to the compute dtype the engine's config gives", dtype)
    elif want != dtype:
        raise ValueError(f"deepspeed.zero.Init(dtype={dtype}) differs from the config's "
                         f"compute dtype {want}: meshzero casts to the config's (set "
                         "bf16/fp16 there, or drop dtype=)")


def _as_list(params: Any) -> list[torch.Tensor]:
    if isinstance(params, torch.Tensor):
        return [params]
    if params is None:
        return []
    return [p for p in params if isinstance(p, torch.Tensor)]


class GatheredParameters:
    """DeepSpeed's `deepspeed.zero.GatheredParameters`: meshzero's gathered parameters.

    A `modifier_rank`'s writes reach every rank's shard, fp32 master and optimizer
    (``meshzero.zero.gathered.gathered_parameters``).

    ``params``: one parameter or an iterable (a generator too); held by an engine, built
    under ``zero_init`` (made real on the spot, kept with ``modifier_rank``) or plain.
    ``modifier_rank``: the data-parallel rank whose writes are kept (at every stage, not
    only 3; shapes cannot change); None: read-only. ``fwd_module``: accepted; meshzero
    gathers any parameter wherever it is used, so registering it as an external parameter
    changes nothing. ``enabled=False``: a no-op. A collective: enter it on every rank."""

    def __init__(self, params: Any, modifier_rank: int | None = None,
                 fwd_module: nn.Module | None = None, enabled: bool = True):
        self.params = _as_list(params)
        self.modifier_rank = modifier_rank
        self.fwd_module = fwd_module
        self.enabled = enabled
        self._context: AbstractContextManager[None] | None = None

    def __enter__(self) -> None:
        if not self.enabled or not self.params:
            return
        self._context = gathered_parameters(self.params, self.modifier_rank)
        self._context.__enter__()

    def __exit__(self, *exc: Any) -> None:
        context, self._context = self._context, None
        if context is not None:
            context.__exit__(*exc)


def register_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    """DeepSpeed's `deepspeed.zero.register_external_parameter`: accepted, nothing to do.

    Accepted; meshzero gathers a parameter wherever it is used, so nothing needs
    registering. A ``parameter`` that is not an ``nn.Parameter`` raises RuntimeError, as
    DeepSpeed's does."""
    if not isinstance(parameter, nn.Parameter):
        raise RuntimeError(f"register_external_parameter: the parameter is a "
                           f"{type(parameter).__name__}, not a torch.nn.Parameter")
    if not isinstance(module, nn.Module):
        raise ValueError(f"register_external_parameter(module, parameter) needs an "
                         f"nn.Module, got {type(module).__name__}")


def unregister_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    """DeepSpeed's `deepspeed.zero.unregister_external_parameter`: accepted, a no-op.

    Accepted; nothing was registered (meshzero gathers a parameter wherever it is used)."""
    register_external_parameter(module, parameter)
