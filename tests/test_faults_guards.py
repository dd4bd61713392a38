"""Faults that were silent or hung become decisions every rank makes alike
(docs/failures.md, "Non-finite gradients" and "Timeouts and mismatched ranks").

- An inf/nan loss (or gradient) skips that step on every rank, at every precision and
  stage, with or without clipping: the weights equal plain torch trained without that
  batch, ``skipped_steps`` is 1, ``step()`` and ``was_step_applied()`` say so; in "raise"
  mode every rank raises and no weight changed.
- Ranks started with different stages, micro batches, accumulation or model widths get a
  ValueError on every rank naming the field and the ranks, within seconds.
- A stalled rank ends the job within ``faults.comm_timeout`` with an error naming the
  collective, the group and the step.

One launch per world size runs many cases one engine after another.
"""

from __future__ import annotations

import copy
import time

import pytest
import torch

import meshzero
from meshzero.comm import CollectiveError
from meshzero.faults import NonFiniteGradientsError, RankMismatchError
from tests.distributed import run_distributed
from tests.engine_runs import ADAM_EPS, zero_config
from tests.models import (
    MLPStack,
    build_model,
    loss_fn_for,
    make_batches,
    reference_train,
    split_for_rank,
)

STEPS, BAD = 3, 1  # the fault is injected at step BAD of STEPS
PRECISION = {"fp32": {}, "bf16": {"bf16": {"enabled": True}},
             "fp16": {"fp16": {"enabled": True, "initial_scale_power": 8, "hysteresis": 1}}}
DTYPE = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
TOL = {"fp32": (1e-5, 1e-6), "bf16": (2e-2, 4e-3), "fp16": (1e-2, 2e-3)}


def _case(precision: str, stage: int, fault: str, *, clip: float = 0.0, mode: str = "skip",
          fault_rank: int = 0, world: int = 1, **extra) -> dict:
    cfg = zero_config(stage, global_batch=4 * world, gradient_clipping=clip,
                      faults={"nonfinite_grads": mode}, **PRECISION[precision], **extra)
    return {"precision": precision, "stage": stage, "fault": fault, "clip": clip,
            "mode": mode, "fault_rank": fault_rank, "config": cfg}


def _inject(loss: torch.Tensor, fault: str) -> torch.Tensor:
    """The faulty loss: nan, +inf (finite gradients: the loss decides) or *inf."""
    if fault == "nan":
        return loss * float("nan")
    return loss + float("inf") if fault == "inf_add" else loss * float("inf")


def _nan_gradient_hook(model: torch.nn.Module, fault: str, faulty: bool):
    """A finite loss whose gradient turns nan at one layer's output on the faulty rank
    (d sqrt(|0 * out + c|) = 0.5 / sqrt(c) * 0: nan at c = 0, 0 at c = 1); registered on
    every rank, so stage 3 runs the same gathers everywhere."""
    layer = {"grad_last": model.blocks[2].fc2, "grad_first": model.blocks[0].fc1}[fault]
    c = 0.0 if faulty else 1.0

    def hook(module, args, out):
        return out + (out * 0 + c).abs().pow(0.5) - c ** 0.5

    return layer.register_forward_hook(hook)


def _run_case(rank: int, world: int, case: dict) -> dict:
    model = build_model("mlp", 0)
    engine, *_ = meshzero.initialize(model=model, config=copy.deepcopy(case["config"]))
    batches = make_batches("mlp", STEPS, engine.train_batch_size())
    loss_fn = loss_fn_for(model)
    out: dict = {"applied": [], "was_applied": [], "error": None, "before": None}
    for step, batch in enumerate(batches):
        x, y = split_for_rank(batch, rank, world, 1, 0)
        faulty = step == BAD and rank == case["fault_rank"]
        if step == BAD:
            out["before"] = engine.full_state_dict()
        hook = (_nan_gradient_hook(engine.module, case["fault"], faulty)
                if step == BAD and case["fault"].startswith("grad") else None)
        loss = loss_fn(engine(x).float(), y)
        if faulty and not case["fault"].startswith("grad"):
            loss = _inject(loss, case["fault"])
        engine.backward(loss)
        if hook is not None:
            hook.remove()
        try:
            out["applied"].append(engine.step())
        except NonFiniteGradientsError as exc:
            out["error"] = str(exc)
            out["applied"].append(None)
            if case["mode"] == "raise" and step == BAD:
                out["after_raise"] = engine.full_state_dict()
            break
        out["was_applied"].append(engine.was_step_applied())
    out["params"] = engine.full_state_dict()
    out["skipped"] = engine.skipped_steps
    out["check_ops"] = engine.comm_report().get("step_check", {}).get("count", 0)
    engine.close()
    return out


def run_cases(rank: int, world: int, cases: list[dict]) -> list[dict]:
    return [_run_case(rank, world, case) for case in cases]


def _reference_without_bad(case: dict) -> dict[str, torch.Tensor]:
    batches = make_batches("mlp", STEPS, case["config"]["train_batch_size"])
    kept = batches[:BAD] + batches[BAD + 1:]
    return reference_train(lambda: build_model("mlp", 0), kept, clip=case["clip"],
                           dtype=DTYPE[case["precision"]], eps=ADAM_EPS).params


def _check_skipped(case: dict, results: list[dict]) -> None:
    want = _reference_without_bad(case)
    rtol, atol = TOL[case["precision"]]
    for r in results:
        assert r["error"] is None, (case["fault"], r["error"])
        assert r["skipped"] == 1
        assert r["applied"] == [True, False, True] and r["was_applied"] == r["applied"]
        for name, ref in want.items():
            torch.testing.assert_close(r["params"][name], ref, rtol=rtol, atol=atol,
                                       msg=lambda m, n=name: f"{case}: {n}: {m}")
        for name, t in r["params"].items():  # every rank ends with the same weights
            assert torch.equal(t, results[0]["params"][name]), name


def _default_cases(world: int) -> list[dict]:
    last = world - 1  # the fault on another rank than 0 when there is one
    offload = {"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}
    return [
        _case("fp32", 0, "nan", world=world),
        _case("fp32", 1, "inf_add", world=world, fault_rank=last),
        _case("bf16", 2, "nan", clip=1.0, world=world),
        _case("bf16", 3, "inf_mul", world=world, fault_rank=last),
        _case("fp16", 3, "nan", world=world),
        _case("fp32", 3, "grad_first", clip=1.0, world=world, fault_rank=last),
        _case("fp32", 2, "nan", world=world, fault_rank=last, **offload),
        _case("fp32", 1, "grad_last", world=world, **offload),
        _case("fp32", 2, "nan", mode="raise", world=world, fault_rank=last),
    ]


def _check(cases: list[dict], per_rank: list[list[dict]]) -> None:
    for i, case in enumerate(cases):
        results = [ranks[i] for ranks in per_rank]
        if case["mode"] == "raise":
            for r in results:  # raised on every rank, after closing the step: nothing moved
                assert r["error"] is not None and "no weight changed" in r["error"]
                assert r["skipped"] == 1
                for name, t in r["after_raise"].items():
                    assert torch.equal(t, r["before"][name]), name
            continue
        _check_skipped(case, results)


@pytest.mark.parametrize("world_size", [1, 2])
def test_nonfinite_step_is_skipped_on_every_rank(tmp_path, world_size):
    cases = _default_cases(world_size)
    per_rank = run_distributed(run_cases, world_size, tmp_path, cases, timeout=300)
    _check(cases, per_rank)
    # stage 1-3 without clipping or fp16: the check is one all-reduce of its own per step
    fp32_stage1 = [ranks[1] for ranks in per_rank]
    assert all(r["check_ops"] == 1 for r in fp32_stage1)


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_nonfinite_full_grid(tmp_path, world_size):
    """fp32/bf16/fp16 x stages 0-3 x clipping off/on x nan and inf losses."""
    cases = [_case(p, s, fault, clip=clip, world=world_size,
                   fault_rank=(s + int(clip)) % world_size)
             for p in PRECISION for s in range(4) for clip in (0.0, 1.0)
             for fault in ("nan", "inf_add")]
    per_rank = run_distributed(run_cases, world_size, tmp_path, cases, timeout=900)
    _check(cases, per_rank)


def test_unit_steps_in_backward_refuse_a_later_nonfinite_unit(tmp_path):
    """The known limit: with offload_optimizer cpu and no clipping, units are stepped during
    backward; a finite loss whose nan gradient appears in an early layer (reduced last)
    reaches the optimizer after later units were stepped. Every rank raises, and no weight
    holds inf/nan."""
    case = _case("fp32", 2, "grad_first", world=2, fault_rank=1,
                 zero_optimization={"offload_optimizer": {"device": "cpu"}})
    for r in run_distributed(run_cases, 2, tmp_path, [case])[0:2]:
        r = r[0]
        assert r["error"] is not None and "part of the model" in r["error"]
        assert all(torch.isfinite(t).all() for t in r["params"].values())


# -- mismatched ranks --------------------------------------------------------------------------
def _mismatch(rank: int, world: int, variants: list[tuple[str, dict, dict]]) -> list:
    """For each (what, config of rank 0, config of the others): the error and its time."""
    out = []
    for what, cfg0, cfg1 in variants:
        cfg = cfg0 if rank == 0 else cfg1
        cfg = dict(cfg)
        hidden = cfg.pop("_hidden", 24)
        torch.manual_seed(0)
        t0 = time.perf_counter()
        try:
            meshzero.initialize(model=MLPStack(hidden=hidden), config=cfg)
            out.append((what, None, time.perf_counter() - t0))
        except RankMismatchError as exc:
            out.append((what, str(exc), time.perf_counter() - t0))
    return out


def test_mismatched_ranks_fail_on_every_rank_naming_the_field(tmp_path):
    base = zero_config(2, global_batch=8)
    micro = {"train_micro_batch_size_per_gpu": 2, "optimizer": base["optimizer"]}
    variants = [
        ("zero_optimization.stage", base, zero_config(3, global_batch=8)),
        ("train_micro_batch_size_per_gpu", micro, {**micro, "train_micro_batch_size_per_gpu": 4}),
        ("gradient_accumulation_steps", base, zero_config(2, global_batch=8, grad_accum=2)),
        ("model parameters", base, {**base, "_hidden": 32}),
    ]
    per_rank = run_distributed(_mismatch, 2, tmp_path, variants, timeout=120)
    for i, (what, _, _) in enumerate(variants):
        for rank in range(2):
            field, error, seconds = per_rank[rank][i]
            assert error is not None, (what, rank)
            assert what in error and "rank(s) 0" in error and "rank(s) 1" in error, error
            assert seconds < 10, (what, seconds)
    assert "blocks.0.fc1.weight of shape (24, 16)" in per_rank[0][3][1]


# -- a stalled rank ----------------------------------------------------------------------------
def _stall(rank: int, world: int, cfg: dict) -> tuple[str, float]:
    model = build_model("mlp", 0)
    engine, *_ = meshzero.initialize(model=model, config=cfg)
    x, y = torch.randn(2, 7), torch.randn(2, 5)
    for step in range(2):
        loss = loss_fn_for(model)(engine(x), y)
        if step == 1 and rank == 1:
            time.sleep(4.0)  # past the 2 s timeout
        t0 = time.perf_counter()
        try:
            engine.backward(loss)
            engine.step()
        except CollectiveError as exc:
            return str(exc), time.perf_counter() - t0
    return "", 0.0


def test_stalled_rank_ends_within_the_timeout_naming_the_collective(tmp_path):
    cfg = zero_config(2, global_batch=4, faults={"comm_timeout": 2})
    (msg0, waited0), (msg1, _) = run_distributed(_stall, 2, tmp_path, cfg, timeout=60)
    assert 1.5 < waited0 < 4.0, waited0
    # the backward's first wait: its reduction (the stall watch reports the wait, but the
    # sleeping rank waits in no collective, so it finds no deadlock: faults/stall.py)
    assert "reduce_scatter over group dp failed at step 1 (backward)" in msg0, msg0
    assert "collective" in msg1 and "group dp" in msg1, msg1  # the peer's side fails too
