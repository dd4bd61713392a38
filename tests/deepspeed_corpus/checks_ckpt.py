"""Checks: save_checkpoint / load_checkpoint as real code calls them, and the 16-bit
consolidated state dicts."""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from tests.deepspeed_corpus.context import (
    Context,
    assert_params,
    batch,
    check,
    config,
    engine_steps,
    full_params,
    make_model,
    plain_steps,
)

BATCHES = [[batch(0)], [batch(1)]]


def _trained(ctx: Context, model: torch.nn.Module | None = None) -> Any:
    engine = ctx.build(model)
    engine_steps(engine, BATCHES[:1])
    return engine


def _resumed_matches(engine: Any) -> None:
    """One more step after loading equals two uninterrupted plain steps (weights, Adam
    moments and step count all came back)."""
    engine_steps(engine, BATCHES[1:])
    assert_params(full_params(engine), plain_steps(make_model(), BATCHES))


@check("engine.save_checkpoint")
def save_load_round_trip(ctx: Context) -> None:
    path = str(ctx.tmp())
    _trained(ctx).save_checkpoint(path)
    fresh = ctx.build(make_model(seed=9))
    fresh.load_checkpoint(path)
    _resumed_matches(fresh)


@check("engine.load_checkpoint")
def load_returns_path_and_client_state(ctx: Context) -> None:
    """(load_path, client_state) (runtime/engine.py: load_checkpoint)."""
    path = str(ctx.tmp())
    _trained(ctx).save_checkpoint(save_dir=path, client_state={"checkpoint_step": 1})
    load_path, client_state = ctx.build().load_checkpoint(load_dir=path)
    assert isinstance(load_path, str) and client_state["checkpoint_step"] == 1


@check("engine.save_checkpoint(client_state=)")
def client_state(ctx: Context) -> None:
    path = str(ctx.tmp())
    _trained(ctx).save_checkpoint(path, client_state={"epoch": 3, "global_step": 10},
                                  tag="checkpoint")
    fresh = ctx.build()
    _, state = fresh.load_checkpoint(path, tag="checkpoint")
    assert state["epoch"] == 3 and state["global_step"] == 10
    _resumed_matches(fresh)


@check("engine.save_checkpoint(client_state=<tensors, numpy, Namespace>)")
def client_state_objects(ctx: Context) -> None:
    """Megatron's state_dict: args Namespace, numpy and torch RNG states, tensors."""
    np_state = np.random.get_state()
    sd = {"args": argparse.Namespace(lr=0.1, name="gpt", layers=[1, 2]),
          "np_rng_state": np_state, "torch_rng_state": torch.get_rng_state(),
          "tokens": torch.arange(5), "iteration": 7}
    path = str(ctx.tmp())
    _trained(ctx).save_checkpoint(path, client_state=sd)
    _, state = ctx.build().load_checkpoint(path)
    assert state["args"] == sd["args"] and state["iteration"] == 7
    torch.testing.assert_close(state["tokens"], sd["tokens"])
    torch.testing.assert_close(state["torch_rng_state"], sd["torch_rng_state"])
    assert state["np_rng_state"][0] == np_state[0]
    np.testing.assert_array_equal(np.asarray(state["np_rng_state"][1]), np_state[1])
    assert tuple(state["np_rng_state"][2:]) == tuple(np_state[2:])


def _frozen_input(seed: int) -> torch.nn.Module:
    model = make_model(seed)
    model.input.requires_grad_(False)
    return model


@check("engine.save_checkpoint(exclude_frozen_parameters=True)")
def exclude_frozen(ctx: Context) -> None:
    """Frozen parameters are not saved; loading (strict=False) leaves them as they are
    (runtime/engine.py: module_state_dict(exclude_frozen_parameters=True))."""
    engine = ctx.build(_frozen_input(0))
    engine_steps(engine, BATCHES[:1])
    saved = full_params(engine)
    path = str(ctx.tmp())
    engine.save_checkpoint(path, exclude_frozen_parameters=True)
    other = ctx.build(_frozen_input(5))
    own_frozen = {k: v for k, v in full_params(other).items() if k.startswith("input.")}
    other.load_checkpoint(path, load_module_strict=False)
    loaded = full_params(other)
    assert_params(loaded, {k: v for k, v in saved.items() if not k.startswith("input.")})
    assert_params(loaded, own_frozen)


@check("engine.save_checkpoint(save_latest=)")
def save_latest(ctx: Context) -> None:
    """save_latest=False writes no `latest`: a load without a tag finds nothing
    (DeepSpeed warns and returns (None, None)); save_latest=True points it at the tag."""
    path = str(ctx.tmp())
    engine = _trained(ctx)
    engine.save_checkpoint(path, tag="a", client_state={"t": "a"}, save_latest=False)
    assert ctx.build().load_checkpoint(path) == (None, None)
    engine.save_checkpoint(path, tag="b", client_state={"t": "b"}, save_latest=True)
    _, state = ctx.build().load_checkpoint(path)
    assert state["t"] == "b"


@check("engine.load_checkpoint(load_module_strict=)")
def load_strict_flag(ctx: Context) -> None:
    """transformers' resume: strict=False (a PEFT model) with optimizer and scheduler."""
    path = str(ctx.tmp())
    _trained(ctx).save_checkpoint(path)
    fresh = ctx.build()
    fresh.load_checkpoint(path, load_module_strict=False, load_optimizer_states=True,
                          load_lr_scheduler_states=True)
    _resumed_matches(fresh)


def _module_only(ctx: Context, **kwargs: Any) -> None:
    """Weights only: the next step starts a fresh optimizer from the saved weights."""
    path = str(ctx.tmp())
    engine = _trained(ctx)
    saved = full_params(engine)
    engine.save_checkpoint(path, tag="m")
    fresh = ctx.build(make_model(seed=4))
    fresh.load_checkpoint(path, tag="m", **kwargs)
    assert_params(full_params(fresh), saved)
    start = make_model()
    with torch.no_grad():
        for name, p in start.named_parameters():
            p.copy_(saved[name])
    engine_steps(fresh, BATCHES[1:])
    assert_params(full_params(fresh), plain_steps(start, BATCHES[1:]))


@check("engine.load_checkpoint(load_optimizer_states=False, load_lr_scheduler_states=False)")
def load_without_optimizer(ctx: Context) -> None:
    _module_only(ctx, load_optimizer_states=False, load_lr_scheduler_states=False)


@check("engine.load_checkpoint(load_module_only=True)")
def load_module_only(ctx: Context) -> None:
    _module_only(ctx, load_optimizer_states=False, load_lr_scheduler_states=False,
                 load_module_only=True)


def _consolidated(ctx: Context, method: str, **kwargs: Any) -> None:
    """Collective; rank 0 gets the full state dict in the compute dtype, the others {}
    (runtime/engine.py: _zero3_consolidated_16bit_state_dict)."""
    engine = ctx.build(_frozen_input(0))
    engine_steps(engine, BATCHES[:1])
    want = full_params(engine)
    sd = getattr(engine, method)(**kwargs)
    if dist.get_rank() != 0:
        assert sd == {}
        return
    keys = set(want)
    if kwargs.get("exclude_frozen_parameters"):
        keys = {k for k in keys if not k.startswith("input.")}
    assert set(sd) == keys, sorted(set(sd) ^ keys)
    assert_params(sd, {k: want[k] for k in keys})


@check("engine._zero3_consolidated_16bit_state_dict")
def zero3_consolidated(ctx: Context) -> None:
    _consolidated(ctx, "_zero3_consolidated_16bit_state_dict", exclude_frozen_parameters=True)
    _consolidated(ctx, "_zero3_consolidated_16bit_state_dict")


@check("engine._zero3_consolidated_16bit_state_dict", world_size=2, variant="two ranks")
def zero3_consolidated_w2(ctx: Context) -> None:
    _consolidated(ctx, "_zero3_consolidated_16bit_state_dict")


@check("engine._consolidated_16bit_state_dict")
def consolidated(ctx: Context) -> None:
    _consolidated(ctx, "_consolidated_16bit_state_dict")


@check("engine.zero_gather_16bit_weights_on_model_save")
def gather_on_save(ctx: Context) -> None:
    """The config's stage3_gather_16bit_weights_on_model_save (accelerate asks before
    consolidating)."""
    key = "stage3_gather_16bit_weights_on_model_save"
    on = ctx.build(cfg=config(zero_optimization={key: True}))
    off = ctx.build(cfg=config(zero_optimization={key: False}))
    assert on.zero_gather_16bit_weights_on_model_save() is True
    assert off.zero_gather_16bit_weights_on_model_save() is False
