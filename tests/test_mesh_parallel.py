"""Tensor and pipeline parallelism through the engine (issue 7), composed with ZeRO on the
dp axis: N optimizer steps equal one process training the same model on the same global
batch (tests.models.reference_train, plain torch)."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
from torch import nn

import meshzero
from meshzero.demo.gpt import loss_fn as gpt_loss
from meshzero.demo.layout import GPT_LAYOUT
from meshzero.parallel.pipeline_state import gather_pipeline_state_dict
from tests.distributed import run_distributed
from tests.engine_runs import ADAM_EPS, zero_config
from tests.models import make_batches, mlp_loss, reference_train, split_for_rank
from tests.test_pipeline import _gpt, _gpt_batches, _mlp_chain

# the same models and data as tests/test_pipeline.py (GPT: 4 layers, 2 heads, tied head)
STEPS, GLOBAL_BATCH = 3, 8
# A tensor-parallel matmul adds its partial products in another order than one process does.
# Where a gradient element is a near-cancellation, Adam (eps 1e-4) turns that 1e-9-sized
# round-off into a parameter difference of up to ~2e-6 after 3 steps, and how large depends on
# the CPU's matmul kernels (tp2 x dp2 gave 1.57e-6 on one Xeon, < 1e-6 on another). 1e-5 is
# 1e-3 of one Adam step at lr 1e-2: a wrong gradient or a missed shard moves parameters by
# whole steps, far beyond it.
ATOL = 1e-5


# kind -> (factory, loss, batches, pipeline layout, tensor-parallel plan)
CASES = {
    "mlp": (_mlp_chain, mlp_loss, lambda: make_batches("mlp", STEPS, GLOBAL_BATCH), None,
            {"*.fc1": "colwise", "*.fc2": "rowwise"}),
    "gpt": (_gpt, gpt_loss, _gpt_batches, GPT_LAYOUT, "gpt"),
}


@functools.cache
def _reference(kind: str, grad_accum: int, clip: float = 0.0):
    factory, loss, batches, _, _ = CASES[kind]
    return reference_train(factory, batches(), grad_accum=grad_accum, eps=ADAM_EPS,
                           loss_fn=loss, clip=clip)


def _run(rank: int, world_size: int, kind: str, stage: int, tp: int, pp: int,
         schedule: str = "1f1b", grad_accum: int = 2, clip: float = 0.0) -> dict:
    factory, loss, batches, layout, plan = CASES[kind]
    batches = batches()
    cfg = zero_config(stage, global_batch=GLOBAL_BATCH, grad_accum=grad_accum,
                      gradient_clipping=clip)
    if tp > 1:
        cfg["tensor_parallel"] = {"size": tp, "plan": plan}
    if pp > 1:
        cfg["pipeline_parallel"] = {"size": pp, "schedule": schedule}
    dp = world_size // (tp * pp)
    micro = GLOBAL_BATCH // (dp * grad_accum)
    engine, *_ = meshzero.initialize(model=factory(), config=cfg, loss_fn=loss,
                                     example_inputs=batches[0][0][:micro],
                                     pipeline_layout=layout)
    losses = train_steps(engine, batches, loss, grad_accum)
    params = _full_params(engine)
    return {"losses": losses, "params": params, "memory": engine.memory_report(),
            "held": engine.zero.held_numel()}


def train_steps(engine, batches, loss, grad_accum: int) -> list[float]:
    """One optimizer step per global batch (this rank's dp share, in grad_accum micro-batches,
    through train_batch under a pipeline); this rank's loss of each step."""
    dp, dp_rank = engine.topology.dp_size, engine.topology.dp_rank
    losses = []
    for batch in batches:
        micro_batches = [split_for_rank(batch, dp_rank, dp, grad_accum, m)
                         for m in range(grad_accum)]
        if engine.pipeline is not None:
            losses.append(engine.train_batch(iter(micro_batches)).item())
            continue
        total = 0.0
        for x, y in micro_batches:
            out = loss(engine(x), y)
            engine.backward(out)
            engine.step()
            total += out.item() / grad_accum
        losses.append(total)
    return losses


def _full_params(engine) -> dict[str, torch.Tensor]:
    """Full fp32 parameters under the original names: ZeRO gathers dp shards, then the tp
    and pp pieces are put together."""
    from meshzero.parallel.tensor_state import gather_tensor_parallel_state_dict

    state = engine.full_state_dict()
    with torch.no_grad():  # the gathered fp32 values into the (tp/pp-local) module
        for name, p in engine.module.named_parameters():
            p.data = state[name].view(p.shape).to(p.dtype)
    if engine.topology.tp_size > 1:
        state = gather_tensor_parallel_state_dict(engine.module, engine.topology.groups["tp"])
        if engine.pipeline is not None:  # put the stages' tp-gathered pieces together
            parts = [None] * engine.topology.pp_size
            dist.all_gather_object(parts, state, group=engine.topology.groups["pp"])
            state = {k: v for part in parts for k, v in part.items()}
    elif engine.pipeline is not None:
        state = gather_pipeline_state_dict(engine.pipeline)
    return {k: v.float() for k, v in state.items()}


def _check(results: list[dict], kind: str, grad_accum: int = 2, clip: float = 0.0) -> None:
    ref = _reference(kind, grad_accum, clip)
    for r in results:
        for name, want in ref.params.items():
            torch.testing.assert_close(r["params"][name], want, rtol=1e-5, atol=ATOL,
                                       msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize(("kind", "schedule"), [("mlp", "gpipe"), ("gpt", "1f1b")])
def test_pp2(tmp_path, kind, schedule):
    _check(run_distributed(_run, 2, tmp_path, kind, 0, 1, 2, schedule), kind)


@pytest.mark.parametrize("stage", [1, 2])
def test_pp2_dp2_with_zero(tmp_path, stage):
    _check(run_distributed(_run, 4, tmp_path, "gpt", stage, 1, 2), "gpt")


@pytest.mark.parametrize(("kind", "stage"), [("mlp", 0), ("gpt", 2)])
def test_tp2(tmp_path, kind, stage):
    _check(run_distributed(_run, 2, tmp_path, kind, stage, 2, 1), kind)


@pytest.mark.parametrize("stage", [1, 3])
def test_tp2_dp2_with_zero(tmp_path, stage):
    results = run_distributed(_run, 4, tmp_path, "gpt", stage, 2, 1)
    _check(results, "gpt")


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved_1f1b"])
def test_tp2_pp2(tmp_path, schedule):
    """interleaved: two stages per rank, the tp-replaced embedding and head shared by the
    rank's stage modules."""
    _check(run_distributed(_run, 4, tmp_path, "gpt", 0, 2, 2, schedule), "gpt")


def test_tp2_pp2_dp2_eight_ranks(tmp_path):
    _check(run_distributed(_run, 8, tmp_path, "gpt", 1, 2, 2), "gpt")


def _profiled(rank: int, world_size: int, stage: int, tp: int, pp: int) -> dict:
    """One profiled step of the MLP chain: what the report says and what we can count."""
    factory, loss, batches, _, plan = CASES["mlp"]
    cfg = zero_config(stage, global_batch=GLOBAL_BATCH, grad_accum=2,
                      flops_profiler={"enabled": True, "profile_step": 0})
    if tp > 1:
        cfg["tensor_parallel"] = {"size": tp, "plan": plan}
    if pp > 1:
        cfg["pipeline_parallel"] = {"size": pp, "schedule": "gpipe"}
    dp = world_size // (tp * pp)
    micro = GLOBAL_BATCH // (dp * 2)
    x, y = make_batches("mlp", 1, GLOBAL_BATCH)[0]
    engine, *_ = meshzero.initialize(model=factory(), config=cfg, loss_fn=loss,
                                     example_inputs=x[:micro])
    parts = [split_for_rank((x, y), engine.topology.dp_rank, dp, 2, m) for m in range(2)]
    if pp > 1:
        engine.train_batch(iter(parts))
    else:
        for xm, ym in parts:
            engine.backward(loss(engine(xm), ym))
            engine.step()
    linear = sum(m.weight.numel() for m in engine.module.modules()
                 if isinstance(m, nn.Linear) or hasattr(m, "tp_layouts"))
    # layers tp left whole: every tp rank runs them, model FLOPs count them once
    whole = sum(m.weight.numel() for m in engine.module.modules()
                if isinstance(m, nn.Linear) and not hasattr(m, "tp_layouts"))
    report = engine.last_profile
    return {"params_total": report.params_total, "params_per_rank": report.params_per_rank,
            "whole": whole,
            "held": engine.zero.held_numel(), "fwd": report.fwd_flops_per_rank,
            "fwd_model": report.fwd_flops_model, "tokens_local": GLOBAL_BATCH // dp,
            "linear": linear, "sizes": (report.data_parallel_size,
                                        report.tensor_parallel_size,
                                        report.pipeline_parallel_size),
            "zero": report.zero_description}


@pytest.mark.parametrize(("world", "stage", "tp", "pp"), [(4, 3, 2, 1), (2, 1, 1, 2)])
def test_profiler_counts_what_each_rank_holds_and_computes(tmp_path, world, stage, tp, pp):
    results = run_distributed(_profiled, world, tmp_path, stage, tp, pp)
    psi = sum(p.numel() for p in _mlp_chain().parameters())
    for r in results:
        assert r["params_total"] == psi  # the model's, not this rank's piece
        assert r["params_per_rank"] == r["held"]
        assert r["sizes"] == (world // (tp * pp), tp, pp)
        # forward FLOPs of this rank: 2 x its tokens x the Linear weights it holds
        assert r["fwd"] == 2 * r["tokens_local"] * r["linear"]
        assert r["fwd_model"] == sum(q["fwd"] - 2 * q["tokens_local"] * q["whole"] * (tp - 1) / tp
                                     for q in results)
    # stage 3 over dp=2 of a tp=2 model: each rank holds about psi / (tp * 2)
    if stage == 3:
        assert all(psi / 4 <= r["held"] <= psi / 2 for r in results)
        assert "split tp=2 x pp=1 ways" in results[0]["zero"]


@pytest.mark.parametrize(("stage", "tp", "pp"), [(3, 2, 1), (1, 2, 2)])
def test_clipping_norm_counts_every_tensor_once(tmp_path, stage, tp, pp):
    """The global norm adds the tp and pp parts: a tensor every tp rank holds whole (norms,
    row-parallel biases) and the embedding tied across stages are counted once."""
    clip = 0.05
    assert min(_reference("gpt", 2, clip).grad_norms) > clip  # the clip is active
    results = run_distributed(_run, 4, tmp_path, "gpt", stage, tp, pp, "1f1b", 2, clip)
    _check(results, "gpt", clip=clip)
