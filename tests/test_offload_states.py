"""``engine.offload_states()`` / ``engine.reload_states()``: RLHF frees the accelerator of a
trainer's states while another model generates, then trains on.

What DeepSpeed does (read from its source, deepspeed 0.19.6):

* ``DeepSpeedEngine.offload_states`` (runtime/engine.py): ``include`` a subset of
  ``OffloadStateTypeEnum`` (runtime/zero/offload_config.py: optim_states, hp_params,
  lp_params, lp_grads, contiguous_grad_buffer; None: all); ``_refine_include_states``
  drops optim_states and hp_params (and lp_grads at stage 3) when the optimizer is offloaded
  to the CPU already; it asserts parameters are not offloaded (``offload_param``) and that the
  engine has an optimizer; ``reload_states`` brings everything back.
* ``DeepSpeedZeroOptimizer.offload_states`` / ``reload_states``
  (runtime/zero/stage_1_and_2.py) and ``DeepSpeedZeroOptimizer_Stage3.offload_states``
  (runtime/zero/stage3.py): each state moves to (pinned) CPU buffers once
  (``needs_offload``: a state offloaded already is skipped) and is copied back on reload.

meshzero moves the same categories (zero/offload/states.py), shows them under ``host`` in
``memory_report()`` while they are away, refuses the calls that would read them, and
training after the round trip is bit-identical to training without it. On this CPU-only
machine the device is the CPU: the copies are real host buffers and the device storage is
freed, so the bookkeeping is the same as on a GPU. Unlike DeepSpeed, an engine without an
optimizer may offload its parameters (a reference model between phases).
"""

from __future__ import annotations

import enum
import logging

import pytest
import torch

import meshzero
from tests.distributed import run_distributed
from tests.engine_runs import zero_config
from tests.models import build_model, make_batches, mlp_loss, split_for_rank

CATEGORY = {"optim_states": "optimizer_states", "hp_params": "master_params",
            "lp_params": "params", "lp_grads": "grads"}


class OffloadStateTypeEnum(str, enum.Enum):
    """DeepSpeed's enum (runtime/zero/offload_config.py): str values, as callers pass it."""

    optim_states = "optim_states"
    hp_params = "hp_params"
    lp_params = "lp_params"
    lp_grads = "lp_grads"
    contiguous_grad_buffer = "contiguous_grad_buffer"


def _steps(engine, rank: int, world: int, batches) -> None:
    for x, y in batches:
        x, y = split_for_rank((x, y), rank, world, 1, 0)
        engine.backward(mlp_loss(engine(x).float(), y))
        engine.step()


def _round_trip(rank: int, world: int, stage: int, bf16: bool, include) -> dict:
    config = zero_config(stage, global_batch=2 * world,
                         **({"bf16": {"enabled": True}} if bf16 else {}))
    batches = make_batches("mlp", 4, 2 * world)
    plain, *_ = meshzero.initialize(model=build_model("mlp"), config=config)
    _steps(plain, rank, world, batches)
    engine, *_ = meshzero.initialize(model=build_model("mlp"), config=config)
    _steps(engine, rank, world, batches[:2])
    before = engine.memory_report()
    engine.offload_states(include=include, pin_memory=True)
    engine.offload_states(include=include)  # again: what is away already is skipped
    away = engine.memory_report()
    refused = []
    for call in (lambda: engine(torch.zeros(1, 7)), engine.step,
                 lambda: engine.save_checkpoint("unused")):
        try:
            call()
        except RuntimeError as exc:
            refused.append(str(exc))
    engine.reload_states()
    back = engine.memory_report()
    _steps(engine, rank, world, batches[2:])
    same = all(torch.equal(a, b) for a, b in zip(engine.full_state_dict().values(),
                                                 plain.full_state_dict().values(), strict=True))
    engine.close()
    plain.close()
    return {"before": before, "away": away, "back": back, "refused": refused, "same": same}


@pytest.mark.parametrize("stage, bf16, include", [
    (1, False, None),
    (3, False, None),
    (3, True, [OffloadStateTypeEnum.optim_states, OffloadStateTypeEnum.hp_params]),
    (1, True, ["lp_grads", "contiguous_grad_buffer"]),
])
def test_offload_and_reload_states_round_trip(tmp_path, stage, bf16, include):
    """W = 2: the named categories move to host and back; training after the round trip
    equals training without it, bit for bit."""
    for got in run_distributed(_round_trip, 2, tmp_path, stage, bf16, include, timeout=240):
        names = list(CATEGORY) if include is None else [getattr(n, "value", n)
                                                        for n in include]
        for name, category in CATEGORY.items():
            before, away = got["before"][category], got["away"][category]
            if name in names:
                assert away["device"] == 0 and away["host"] == before["device"] + before["host"]
            else:
                assert away == before
        if "hp_params" in names and bf16:  # the fp32 master is a copy, and it moved
            assert got["before"]["master_params"]["device"] > 0
        assert got["back"] == got["before"]
        assert got["same"]
        needs = {"forward": ["lp_params"], "step": ["optim_states", "hp_params", "lp_params",
                                                    "lp_grads"]}
        needs["save_checkpoint"] = needs["step"]
        want = [call for call, reads in needs.items() if set(reads) & set(names)]
        assert len(got["refused"]) == len(want)
        assert all("call engine.reload_states() first" in m for m in got["refused"])


def _tiers(rank: int, world: int) -> dict:
    out = {}
    # offload_optimizer cpu: the optimizer side is in host memory already; params move
    config = zero_config(3, global_batch=2 * world,
                         zero_optimization={"offload_optimizer": {"device": "cpu"}})
    engine, *_ = meshzero.initialize(model=build_model("mlp"), config=config)
    _steps(engine, rank, world, make_batches("mlp", 1, 2 * world))
    before = engine.memory_report()
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("meshzero.zero.offload.states").addHandler(handler)
    engine.offload_states()
    out["host_tier"] = (before, engine.memory_report())
    out["info"] = lines
    engine.reload_states()
    engine.close()
    # offload_param: refused, as DeepSpeed refuses it
    config["zero_optimization"]["offload_param"] = {"device": "cpu"}
    engine, *_ = meshzero.initialize(model=build_model("mlp"), config=config)
    for include in (None, ["bogus"]):
        try:
            engine.offload_states(include=include)
        except ValueError as exc:
            out.setdefault("refused", []).append(str(exc))
    engine.close()
    # an engine without an optimizer: its parameters go and come back
    ref, *_ = meshzero.initialize(model=build_model("mlp"),
                                  config={"train_batch_size": world,
                                          "zero_optimization": {"stage": 3}})
    x = torch.randn(2, 7)
    want = ref(x)
    ref.offload_states()
    out["ref_away"] = ref.memory_report()["params"]
    ref.reload_states()
    out["ref_same"] = torch.equal(ref(x), want)
    ref.close()
    return out


def test_offload_states_on_offload_tiers_and_without_an_optimizer(tmp_path):
    """offload_optimizer cpu: only the parameters move (DeepSpeed's
    ``_refine_include_states`` drops the states an offloaded optimizer keeps on the CPU);
    offload_param and unknown names are refused before anything moves."""
    for rank, got in enumerate(run_distributed(_tiers, 2, tmp_path, timeout=240)):
        before, away = got["host_tier"]
        assert away["params"] == {"device": 0, "host": before["params"]["device"], "nvme": 0}
        for category in ("master_params", "grads", "optimizer_states"):  # stayed on host
            assert away[category] == before[category] and before[category]["host"] > 0
        if rank == 0:  # INFO lines are rank 0's (log.py)
            assert got["info"] == ["offload_states: optim_states, hp_params, lp_grads stay "
                                   "where offload_optimizer keeps them (host): not moved"]
        assert "offload_param (cpu) places already" in got["refused"][0]
        assert "'bogus' is not a state; valid: optim_states, hp_params" in got["refused"][1]
        assert got["ref_away"]["device"] == 0 and got["ref_away"]["host"] > 0
        assert got["ref_same"]
