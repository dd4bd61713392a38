"""Build the torch optimizer that steps this rank's fp32 master fragments.

The user's choice of optimizer, in DeepSpeed's order of precedence:
    * a ``torch.optim.Optimizer`` instance: rebuilt over fragments with the same class,
      defaults and per-group hyperparameters;
    * an optimizer class or a callable ``f(param_groups) -> Optimizer``;
    * the config's ``optimizer`` block (Adam, AdamW, SGD, Lamb): torch.optim's classes, or
      meshzero.optimizers' where torch cannot compute it (LAMB; Adam with
      ``bias_correction: false``; the 1-bit family).
Each fragment lands in the param group of the parameter it came from. On CPU the fused
kernels are requested explicitly (``fused=None`` never picks them on CPU).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from meshzero.comm import Communicator
from meshzero.config import OptimizerConfig
from meshzero.config.precision import BF16Config
from meshzero.optimizers import DeepSpeedAdam, Lamb, OneBitAdam, OneBitLamb, ZeroOneAdam

logger = logging.getLogger(__name__)

_FUSED_CLASSES = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)


def _param_groups(
    model: nn.Module, model_parameters: Iterable[Any] | None
) -> list[dict[str, Any]]:
    """Normalise ``model_parameters`` (params or group dicts) into group dicts."""
    if model_parameters is None:
        return [{"params": [p for p in model.parameters() if p.requires_grad]}]
    items = list(model_parameters)
    if items and isinstance(items[0], dict):
        return [dict(g, params=list(g["params"])) for g in items]
    return [{"params": items}]


def _fragment_groups(
    groups: list[dict[str, Any]], fragments: dict[nn.Parameter, list[nn.Parameter]]
) -> list[dict[str, Any]]:
    """Replace every parameter in ``groups`` by its fragments; check nothing is left out."""
    covered: set[int] = set()
    out = []
    for group in groups:
        params = []
        for p in group["params"]:
            if not p.requires_grad:  # frozen: dropped, as DeepSpeed does
                continue
            if p not in fragments:  # not a parameter of the model
                raise ValueError(
                    "model_parameters/optimizer holds a tensor that is not a trainable "
                    f"parameter of the model (shape {tuple(p.shape)})"
                )
            covered.add(id(p))
            params.extend(fragments[p])
        out.append(dict(group, params=params))
    missing = [p for p in fragments if id(p) not in covered]
    if missing:
        shapes = [tuple(p.shape) for p in missing[:5]]
        raise ValueError(
            f"{len(missing)} trainable parameter(s) (shapes {shapes}...) are not in the "
            "optimizer's param groups; freeze them (requires_grad=False) or pass them"
        )
    if not any(g["params"] for g in out):
        # this rank's shard holds only padding: keep an empty placeholder so torch accepts it
        out[0]["params"] = [nn.Parameter(torch.zeros(0))]
    return out


def _wants_fused(cls: type, kwargs: dict[str, Any], device: torch.device) -> bool:
    """Fused kernels unless the user chose (fused=False, or foreach=True) or cannot have them."""
    fused = kwargs.get("fused")
    if fused is not None or kwargs.get("foreach") or not issubclass(cls, _FUSED_CLASSES):
        return bool(fused)
    return device.type in ("cpu", "cuda")


def _from_config(cfg: OptimizerConfig, bf16: BF16Config | None = None,
                 ) -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
    params = dict(cfg.validated_params())
    if "betas" in params:
        params["betas"] = tuple(params["betas"])
    if cfg.type == "Lamb":
        return Lamb, params
    if cfg.type == "OneBitAdam":
        return OneBitAdam, params
    if cfg.type == "ZeroOneAdam":
        return ZeroOneAdam, params
    if cfg.type == "OneBitLamb":
        return OneBitLamb, params
    if cfg.type == "SGD":
        return torch.optim.SGD, params
    # torch_adam (torch.optim whenever it can compute the config) asks for nothing more.
    # DeepSpeed's "Adam" decouples weight decay (AdamW) unless adam_w_mode is false; its
    # "AdamW" decouples whatever adam_w_mode says.
    params.pop("torch_adam", None)
    adam_w_mode = params.pop("adam_w_mode", True) or cfg.type == "AdamW"
    correct = params.pop("bias_correction", True)
    bf16_states = bf16 is not None and bf16.bf16_optimizer_states
    bf16_master = bf16 is not None and bf16.bf16_master_weights_and_grads
    # torch's Adam always corrects, keeps states in the parameters' dtype and computes in it
    if not correct or bf16_states or bf16_master:
        return DeepSpeedAdam, dict(params, adam_w_mode=adam_w_mode, bias_correction=correct,
                                   state_dtype=torch.bfloat16 if bf16_states else torch.float32)
    return (torch.optim.AdamW if adam_w_mode else torch.optim.Adam), params


def build_optimizer(
    *,
    model: nn.Module,
    fragments: dict[nn.Parameter, list[nn.Parameter]],
    device: torch.device,
    optimizer: torch.optim.Optimizer | type | Callable | None = None,
    model_parameters: Iterable[Any] | None = None,
    config: OptimizerConfig | None = None,
    bf16: BF16Config | None = None,
) -> torch.optim.Optimizer:
    """``bf16``: with bf16_optimizer_states Adam keeps m and v in bf16, with
    bf16_master_weights_and_grads it steps bf16 masters in fp32 arithmetic (the config's
    Adam is built so; a torch Adam/AdamW the caller chose is rebuilt so)."""
    if optimizer is not None and config is not None:
        raise ValueError("both an optimizer argument and the config key 'optimizer' are given; "
                         "pass one of them")
    opt = _build(model, fragments, device, optimizer, model_parameters, config, bf16)
    wanted = [k for k in ("bf16_optimizer_states", "bf16_master_weights_and_grads")
              if bf16 is not None and getattr(bf16, k)]
    if not wanted or isinstance(opt, DeepSpeedAdam):
        return opt
    return _as_deepspeed_adam(opt, f"bf16.{wanted[0]}",
                              torch.bfloat16 if "bf16_optimizer_states" in wanted
                              else torch.float32)


def _as_deepspeed_adam(opt: torch.optim.Optimizer, key: str,
                       state_dtype: torch.dtype) -> DeepSpeedAdam:
    """The caller's torch Adam or AdamW rebuilt as DeepSpeedAdam over the same groups and
    hyperparameters (nothing stepped yet: there is no state to carry)."""
    if not isinstance(opt, torch.optim.Adam) or any(
            g.get("amsgrad") for g in opt.param_groups):
        raise ValueError(f"{key} needs an Adam or AdamW optimizer (no amsgrad): meshzero keeps "
                         f"those in bf16 with its own Adam; got {type(opt).__name__}")
    decoupled = isinstance(opt, torch.optim.AdamW)
    # a subclass may carry DeepSpeed's switches in its groups (a DeepSpeed-style FusedAdam)
    groups = [{"params": g["params"], "lr": float(g["lr"]), "betas": tuple(g["betas"]),
               "eps": g["eps"], "weight_decay": g["weight_decay"],
               "adam_w_mode": decoupled or bool(g.get("decoupled_weight_decay")),
               "bias_correction": bool(g.get("bias_correction", True))}
              for g in opt.param_groups]
    return DeepSpeedAdam(groups, state_dtype=state_dtype)


def _build(model: nn.Module, fragments: dict[nn.Parameter, list[nn.Parameter]],
           device: torch.device, optimizer: Any, model_parameters: Iterable[Any] | None,
           config: OptimizerConfig | None, bf16: BF16Config | None) -> torch.optim.Optimizer:
    if isinstance(optimizer, torch.optim.Optimizer):
        groups = [dict(g) for g in optimizer.param_groups]
        cls, kwargs = type(optimizer), dict(optimizer.defaults)
    elif isinstance(optimizer, type) and issubclass(optimizer, torch.optim.Optimizer):
        groups = _param_groups(model, model_parameters)
        cls, kwargs = optimizer, {}
    else:
        groups = _param_groups(model, model_parameters)
        if optimizer is None:
            if config is None:
                raise ValueError("no optimizer: pass optimizer= to initialize() or set the "
                                 "config key 'optimizer'")
            cls, kwargs = _from_config(config, bf16)
        else:
            return _call_user_factory(optimizer, _fragment_groups(groups, fragments))
    frag_groups = _fragment_groups(groups, fragments)
    if "fused" in inspect.signature(cls.__init__).parameters:
        fused = _wants_fused(cls, kwargs, device)
        kwargs["fused"] = fused
        if fused:
            kwargs["foreach"] = None
        for g in frag_groups:
            g["fused"] = fused
            if fused and "foreach" in g:
                g["foreach"] = None
    return cls(frag_groups, **_constructor_kwargs(cls, kwargs))


def _constructor_kwargs(cls: type[torch.optim.Optimizer], kwargs: dict[str, Any]) -> dict[str, Any]:
    """``defaults`` may hold keys the constructor does not take (AdamW's
    decoupled_weight_decay); keep those it accepts (all of them if it takes ``**kwargs``)."""
    params = inspect.signature(cls.__init__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return kwargs
    return {k: v for k, v in kwargs.items() if k in params}


def _call_user_factory(factory: Callable, groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
    opt = factory(groups)
    if not isinstance(opt, torch.optim.Optimizer):
        raise ValueError(f"optimizer callable returned {type(opt).__name__}, not a "
                         "torch.optim.Optimizer")
    return opt


def bind_to_shards(optimizer: torch.optim.Optimizer, fragment_norms: Callable[[], Any]) -> None:
    """An optimizer that needs whole-parameter norms (LAMB's trust ratio) learns which
    fragments make up each parameter and how to sum over the ranks holding the others
    (``fragment_norms``: ZeRO's ``ShardedOptimizerState.fragment_norms``)."""
    if isinstance(optimizer, Lamb):
        optimizer.bind_fragments(fragment_norms())


def bind_data_parallel(optimizer: torch.optim.Optimizer, comm: Communicator,
                       keep_gradients_local: Callable[[bool], None],
                       flat_groups: bool = False) -> None:
    """An optimizer that communicates over the data-parallel group itself (the 1-bit
    family's momentum) gets the communicator and the switch that leaves the gradients
    unreduced (``GradientReducer.local_gradients``). ``flat_groups`` (fp16 or bf16
    training): compress a param group's momenta as one vector, as DeepSpeed's
    ``FP16_Optimizer`` wrapper makes 1-bit Adam do; else each parameter's on its own."""
    if isinstance(optimizer, OneBitAdam | ZeroOneAdam | OneBitLamb):
        optimizer.bind(comm, keep_gradients_local, flat_groups)


def check_forward_only(config: Any, lr_scheduler: Any, model_parameters: Any) -> None:
    """An engine without an optimizer (no ``optimizer=`` and no config ``optimizer`` block;
    DeepSpeed's ``initialize`` then builds none either): refuse what needs one, say what is
    left unused. ``config``: the :class:`meshzero.config.Config`."""
    if lr_scheduler is not None:
        raise ValueError("lr_scheduler is given but there is no optimizer for it to drive: "
                         "pass optimizer= or a config 'optimizer' block, or drop lr_scheduler")
    if config.zero_optimization.offload_param.device == "nvme":
        raise ValueError("zero_optimization.offload_param.device = 'nvme' needs an optimizer "
                         "(meshzero's NVMe tier): an engine without one keeps its parameter "
                         "shards on the device or in host memory (offload_param.device 'cpu')")
    if config.scheduler is not None:
        logger.warning("the config's 'scheduler' block (%s) is not used: this engine has no "
                       "optimizer (forward only)", config.scheduler.type)
    if model_parameters is not None:
        logger.warning("model_parameters is not used: this engine has no optimizer "
                       "(forward only)")
    if config.zero_optimization.offload_optimizer.device != "none":
        logger.info("zero_optimization.offload_optimizer is not used: this engine has no "
                    "optimizer (forward only)")


def bind_caller_optimizer(caller: torch.optim.Optimizer, engine_opt: torch.optim.Optimizer
                          ) -> None:
    """The optimizer the caller passed to ``initialize`` and the one meshzero built over
    its master fragments (``engine_opt``) share their param groups from now on: the group
    dicts are the same objects, so an lr (betas, momentum, weight_decay, ...) that the
    caller or a scheduler on ``caller`` sets is the one the next step uses, and both read
    back what a scheduler on ``engine_opt`` sets. DeepSpeed does the same by stepping the
    caller's optimizer itself over its fp32 partitions (ZeRO's ``param_group['params']`` are
    replaced in the client optimizer: runtime/zero/stage_1_and_2.py). The caller must not
    step ``caller`` itself: ``engine.step()`` does.

    torch's schedulers check, on their first step, that the optimizer they were built on
    stepped before them; the engine's steps count as ``caller``'s for that check."""
    if len(caller.param_groups) != len(engine_opt.param_groups):
        raise ValueError(f"the optimizer passed to initialize has {len(caller.param_groups)} "
                         f"param groups, the engine's {len(engine_opt.param_groups)}: cannot "
                         "bind them")
    caller.param_groups = engine_opt.param_groups

    def stepped(*_: Any) -> None:
        # torch's LRScheduler.step warns unless the optimizer it was built on set this
        # (its step wrapper does); the caller's optimizer steps through the engine
        caller._opt_called = True  # type: ignore[attr-defined]

    engine_opt.register_step_post_hook(stepped)
