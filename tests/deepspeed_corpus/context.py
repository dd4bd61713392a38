"""What a check gets: a tiny model, a built stage-3 engine, configs, a tmp dir, a reference.

Checks register with ``@check(api, world_size=...)``; ``world_size`` 1 checks run in one
process, 2 in a gloo group of two (tests/distributed.py). DeepSpeed names are reached the way
the project spells them, with ``deepspeed`` -> ``meshzero.deepspeed``: ``ds`` is the module,
``ds_from("deepspeed.runtime.zero.partition_parameters", "ZeroParamStatus")`` is
``from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus``.
"""

from __future__ import annotations

import copy
import importlib
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from tests.models import MLPStack

LR = 1e-2
MICRO = 2
IN, OUT = 5, 3

Check = Callable[["Context"], None]


@dataclass(frozen=True)
class Registered:
    api: str
    fn: Check
    world_size: int


REGISTRY: dict[str, Registered] = {}


def check(api: str, world_size: int = 1, variant: str = "") -> Callable[[Check], Check]:
    """Register ``fn`` as a check of the corpus entry ``api`` (an entry works when all its
    checks pass; ``variant`` names a second one)."""
    key = f"{api} [{variant}]" if variant else api

    def register(fn: Check) -> Check:
        if key in REGISTRY:
            raise ValueError(f"two checks named {key}")
        REGISTRY[key] = Registered(api, fn, world_size)
        return fn
    return register


def ds() -> Any:
    """``import meshzero.deepspeed as deepspeed``."""
    return importlib.import_module("meshzero.deepspeed")


def ds_from(module: str, name: str | None = None) -> Any:
    """``from <module> import <name>`` with DeepSpeed's package name mapped to meshzero's."""
    if not (module == "deepspeed" or module.startswith("deepspeed.")):
        raise ValueError(f"not a DeepSpeed module: {module}")
    mod = importlib.import_module("meshzero." + module)
    return mod if name is None else getattr(mod, name)


def make_model(seed: int = 0) -> MLPStack:
    """The tiny model of every check (two Blocks, 5 -> 3)."""
    torch.manual_seed(seed)
    return MLPStack(dim=8, hidden=12, num_blocks=2, out=OUT, in_dim=IN)


def batch(step: int = 0, size: int = MICRO) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(size, IN, generator=g), torch.randn(size, OUT, generator=g)


def loss_of(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, y)


def config(stage: int = 3, *, optimizer: bool = True, gas: int = 1, **extra: Any) -> dict:
    """A DeepSpeed config: micro batch 2, AdamW lr 1e-2 (unless optimizer=False)."""
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": gas,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }
    if optimizer:
        cfg["optimizer"] = {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}}
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(cfg.get(key), dict):
            cfg[key] = {**cfg[key], **value}
        else:
            cfg[key] = value
    return cfg


def adamw(params: Any, lr: float = LR) -> torch.optim.AdamW:
    return torch.optim.AdamW(params, lr=lr, weight_decay=0.0)


def plain_steps(model: nn.Module, batches: list, make_opt: Callable = adamw,
                sched: Callable | None = None) -> dict[str, torch.Tensor]:
    """Plain torch: one optimizer step per batch (each batch a list of micro-batches whose
    mean-loss gradients are averaged, as DeepSpeed's gradient accumulation does)."""
    model = copy.deepcopy(model)
    opt = make_opt(model.parameters())
    scheduler = sched(opt) if sched else None
    for micro_batches in batches:
        for x, y in micro_batches:
            (loss_of(model(x), y) / len(micro_batches)).backward()
        opt.step()
        opt.zero_grad()
        if scheduler is not None:
            scheduler.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def engine_steps(engine: Any, batches: list) -> None:
    """DeepSpeed's loop: forward, backward, step per micro-batch (rank r takes its slice)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    for micro_batches in batches:
        for x, y in micro_batches:
            per = x.shape[0] // world
            xs, ys = x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]
            engine.backward(loss_of(engine(xs), ys))
            engine.step()


def full_params(engine: Any) -> dict[str, torch.Tensor]:
    """Every parameter of the engine, gathered (meshzero's own API, not the one under test)."""
    return {k: v.float() for k, v in engine.full_state_dict().items()}


def assert_params(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor],
                  tol: float = 1e-5) -> None:
    assert set(want) <= set(got), f"missing {sorted(set(want) - set(got))}"
    for name, value in want.items():
        torch.testing.assert_close(got[name].float(), value.float(), rtol=tol, atol=tol,
                                   msg=lambda m, n=name: f"{n}: {m}")


@dataclass
class Context:
    """Per-process fixture: built lazily, shared by the checks of one process."""

    rank: int
    world_size: int
    root: Path
    _engine: Any = None
    _dirs: int = 0
    closers: list[Callable[[], None]] = field(default_factory=list)

    def tmp(self) -> Path:
        """A fresh directory shared by the ranks (same name on every rank)."""
        self._dirs += 1
        path = self.root / f"d{self._dirs}"
        path.mkdir(parents=True, exist_ok=True)
        return path

    def build(self, model: nn.Module | None = None, cfg: dict | None = None,
              **kwargs: Any) -> Any:
        """``deepspeed.initialize(model=..., config=...)``; returns the engine."""
        engine, *_ = ds().initialize(model=model if model is not None else make_model(),
                                     config=cfg if cfg is not None else config(), **kwargs)
        return engine

    @property
    def engine(self) -> Any:
        """A stage-3 engine (AdamW from the config) that no check may step."""
        if self._engine is None:
            self._engine = self.build()
        return self._engine


def temp_root() -> Path:
    return Path(tempfile.mkdtemp(prefix="ds_corpus_"))
