"""The flops profiler (issue 3): exact params per rank, measured FLOPs, no side effects, and a
summary and JSON that carry every number the issue lists.

Expected numbers come from the model's shapes and the shard arithmetic written out here, never
from the engine. Every distributed case trains several engines inside one spawn to keep the
file fast.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import math
import re
from itertools import pairwise

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
from torch.utils.checkpoint import set_checkpoint_early_stop
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

import meshzero
from meshzero.profiling import ProfileReport, get_model_profile
from tests.distributed import run_distributed
from tests.engine_runs import zero_config
from tests.models import MLPStack, TrickyModel, make_batches, split_for_rank, tricky_loss
from tests.profiler_models import (
    Attention,
    CheckpointStack,
    checkpoint_stack_flops,
    linear_only,
    linear_only_flops,
)

LINEAR_DIMS = (8, 16, 12, 4)
ROWS = 3  # per-rank micro batch rows in the FLOP tests
PEAK = 1e9  # a fixed peak FLOP/s skips the CPU matmul measurement where MFU is not under test


# --- shared rank-side helpers -------------------------------------------------------------------
def _config(stage: int, global_batch: int, grad_accum: int = 1, **profiler) -> dict:
    """Profile step 1; the report is final (printed) after one more unprofiled step."""
    return zero_config(stage, global_batch=global_batch, grad_accum=grad_accum,
                       flops_profiler={"enabled": True, "profile_step": 1, "headline_steps": 1,
                                       **profiler})


def _regression(steps: int, global_batch: int, in_dim: int, out_dim: int) -> list:
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(global_batch, in_dim, generator=gen),
             torch.randn(global_batch, out_dim, generator=gen)) for _ in range(steps)]


def _train(model: nn.Module, config: dict, batches: list, loss_fn=F.mse_loss):
    """Train on the DeepSpeed batch split; return (engine, comm_report per step, stdout)."""
    engine, *_ = meshzero.initialize(model=model, config=copy.deepcopy(config))
    rank, world = dist.get_rank(), dist.get_world_size()
    gas = engine.gradient_accumulation_steps()
    comms, out = [], io.StringIO()
    with contextlib.redirect_stdout(out):
        for batch in batches:
            for micro in range(gas):
                x, y = split_for_rank(batch, rank, world, gas, micro)
                engine.backward(loss_fn(engine(x), y))
                engine.step()
            comms.append(engine.comm_report())
    return engine, comms, out.getvalue()


def _flops(r: ProfileReport) -> tuple[int, int, int]:
    return r.fwd_flops_per_rank, r.bwd_flops_per_rank, r.recompute_flops_per_rank


def _shard(numel: int, world: int) -> int:
    return math.ceil(math.ceil(numel / world) / 4) * 4


def _expected_held(model: nn.Module, world: int) -> int:
    """Elements one rank holds at stage 3 with no persistent params: per unit (the root's own
    params, each block) and per requires_grad group, one padded shard."""
    in_blocks = {id(p) for b in model.blocks for p in b.parameters()}
    units = [[p for p in model.parameters() if id(p) not in in_blocks],
             *(list(b.parameters()) for b in model.blocks)]
    return sum(_shard(sum(p.numel() for p in params if p.requires_grad == trainable), world)
               for params in units for trainable in (True, False))


# --- 1. the seed's case: params per rank under ZeRO-3 -------------------------------------------
def _seed_case(rank: int, world: int) -> dict[str, ProfileReport]:
    reports = {}
    torch.manual_seed(0)
    mlp = MLPStack(dim=64, hidden=96, num_blocks=4)
    engine, _, _ = _train(mlp, _config(3, 2 * world, peak_flops=PEAK),
                          _regression(2, 2 * world, 7, 5))
    reports["mlp"] = engine.last_profile
    torch.manual_seed(0)
    engine, _, _ = _train(TrickyModel(), _config(3, 2 * world, peak_flops=PEAK),
                          make_batches("tricky", 2, 2 * world), tricky_loss)
    reports["tricky"] = engine.last_profile
    return reports


@pytest.mark.parametrize("world_size", [1, 4])
def test_stage3_params_per_rank_is_the_padded_shard(tmp_path, world_size):
    results = run_distributed(_seed_case, world_size, tmp_path)
    models = {"mlp": MLPStack(dim=64, hidden=96, num_blocks=4), "tricky": TrickyModel()}
    # the tie makes the test meaningful: counted twice, the total would be larger
    tied = sum(p.numel() for _, p in models["tricky"].named_parameters(remove_duplicate=False))
    assert tied > sum(p.numel() for p in models["tricky"].parameters())
    for kind, model in models.items():
        total = sum(p.numel() for p in model.parameters())  # shared parameters once
        held = _expected_held(model, world_size)
        assert total > 10_000 or kind == "tricky"
        for rank, reports in enumerate(results):
            r = reports[kind]
            where = f"{kind} rank {rank}"
            assert r.params_total == total, where
            assert r.params_per_rank == held, where
            # every rank holds one padded shard of every group, so min == max == held
            assert r.rank_min_max["params_per_rank"] == [held, held], where
            assert (r.world_size, r.data_parallel_size, r.tensor_parallel_size,
                    r.pipeline_parallel_size, r.zero_stage) == (world_size, world_size, 1, 1, 3)
            assert "data parallelism, not model parallelism" in r.zero_description
            assert f"over {world_size} data-parallel ranks" in r.zero_description
            # some full unit was gathered, never more than every unit at once
            largest = max(sum(p.numel() for p in b.parameters()) for b in model.blocks)
            assert largest <= r.gathered_params_peak <= held * world_size, where
            assert r.profile_step == 1
    # (B, T) token ids: tokens/s is T times samples/s
    r = results[0]["tricky"]
    assert r.tokens_per_second == pytest.approx(6 * r.samples_per_second)


# --- 2. FLOPs ---------------------------------------------------------------------------------
def _hook_count(model: nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def _linear_flops(rank: int, world: int) -> dict:
    """The linear-only model at every stage, at a later profile_step, and with accumulation."""
    out: dict = {}
    batches = _regression(3, ROWS * world, LINEAR_DIMS[0], LINEAR_DIMS[-1])
    for stage in range(4):
        torch.manual_seed(0)
        engine, _, text = _train(linear_only(LINEAR_DIMS), _config(stage, ROWS * world,
                                                                   peak_flops=PEAK), batches)
        r = engine.last_profile
        out[stage] = (*_flops(r), r.fwd_flops_model, r.bwd_flops_model)
        out[f"text{stage}"] = text
        out[f"modules{stage}"] = {m.path: m.fwd_flops for m in r.modules}
    # a later profile_step: the same FLOPs; hooks and dispatch mode only during that step
    torch.manual_seed(0)
    model = linear_only(LINEAR_DIMS)
    engine, *_ = meshzero.initialize(model=model, config=_config(
        3, ROWS * world, profile_step=2, peak_flops=PEAK))
    hooks = []
    with contextlib.redirect_stdout(io.StringIO()):
        for batch in batches:
            hooks.append(_hook_count(model))
            x, y = split_for_rank(batch, rank, world, 1, 0)
            engine.backward(F.mse_loss(engine(x), y))
            engine.step()
            hooks.append((engine.last_profile is not None, len(_get_current_dispatch_mode_stack())))
    out["later"] = _flops(engine.last_profile)
    out["later_step"] = engine.last_profile.profile_step
    out["hooks"] = [*hooks, _hook_count(model)]
    # gradient accumulation: the profiled step holds every micro-step
    torch.manual_seed(0)
    engine, _, _ = _train(linear_only(LINEAR_DIMS), _config(3, 2 * ROWS * world, grad_accum=2,
                                                            peak_flops=PEAK),
                          _regression(2, 2 * ROWS * world, LINEAR_DIMS[0], LINEAR_DIMS[-1]))
    r = engine.last_profile
    out["accum"] = _flops(r)
    out["accum_samples"] = (r.samples_per_second * r.iter_latency_s, engine.train_batch_size())
    return out


def test_linear_flops_are_exact_and_equal_across_stages(tmp_path):
    world = 2
    fwd, bwd = linear_only_flops(LINEAR_DIMS, ROWS)
    # 2 x tokens x matmul params
    assert fwd == 2 * ROWS * sum(a * b for a, b in pairwise(LINEAR_DIMS))
    per_layer = {str(i): 2 * ROWS * a * b for i, (a, b) in enumerate(pairwise(LINEAR_DIMS))}
    results = run_distributed(_linear_flops, world, tmp_path)
    for rank, res in enumerate(results):
        for stage in range(4):
            assert res[stage] == (fwd, bwd, 0, world * fwd, world * bwd), (rank, stage)
            assert {k: v for k, v in res[f"modules{stage}"].items() if k} == per_layer
            header = "meshzero profile of step 1"
            assert res[f"text{stage}"].count(header) == (1 if rank == 0 else 0), (rank, stage)
        # profiling step 2 instead of 1 measures the same step-sized work, once
        assert res["later"] == (fwd, bwd, 0)
        assert res["later_step"] == 2
        base = res["hooks"][0]
        # before steps 0, 1 and at the end: ZeRO's hooks only; before step 2 also the timer's
        # (registered at the end of the counting step 1, outside the timed step): a pre and a
        # post hook on each of the 4 modules. After each step no dispatch mode is left, and a
        # report exists only once step 2 was profiled
        assert res["hooks"][0::2] == [base, base, base + 2 * 4, base]
        assert res["hooks"][1::2] == [(False, 0), (False, 0), (True, 0)]
        assert res["accum"] == (2 * fwd, 2 * bwd, 0)
        samples, train_batch = res["accum_samples"]
        assert samples == pytest.approx(train_batch) and train_batch == 2 * ROWS * world


def test_linear_flops_standalone_and_profiling_twice_does_not_accumulate():
    torch.manual_seed(0)
    model = linear_only(LINEAR_DIMS)
    x = torch.randn(ROWS, LINEAR_DIMS[0])
    fwd, bwd = linear_only_flops(LINEAR_DIMS, ROWS)
    first = get_model_profile(model, args=(x,), peak_flops=PEAK)
    second = get_model_profile(model, args=(x,), peak_flops=PEAK)
    assert _flops(first) == _flops(second) == (fwd, bwd, 0)
    # an input that requires grad adds the first layer's input-grad matmul: exactly 2x forward
    r = get_model_profile(model, args=(x.clone().requires_grad_(),), peak_flops=PEAK)
    assert r.bwd_flops_per_rank == 2 * r.fwd_flops_per_rank == 2 * fwd
    assert isinstance(r, ProfileReport) and r.zero_stage is None
    assert "fwd FLOPs per rank" in str(r) and r.to_dict()["fwd_flops_per_rank"] == fwd


def test_attention_flops_count_on_cpu():
    b, h, s, d = 2, 3, 5, 4
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, h, s, d, generator=gen, requires_grad=True) for _ in range(3))
    reports = [get_model_profile(Attention(), args=(q, k, v), peak_flops=PEAK) for _ in range(2)]
    fwd = sdpa_flop_count(q.shape, k.shape, v.shape)
    assert fwd == 4 * b * h * s * s * d
    bwd = sdpa_backward_flop_count(q.shape, q.shape, k.shape, v.shape)
    for r in reports:  # twice: equal, no accumulation
        assert (r.fwd_flops_per_rank, r.bwd_flops_per_rank) == (fwd, bwd)
        assert r.modules[0].fwd_flops == fwd


def test_checkpoint_recompute_is_reported_separately():
    x = torch.randn(ROWS, 7, generator=torch.Generator().manual_seed(0))
    fwd, bwd, recompute = checkpoint_stack_flops(ROWS)
    torch.manual_seed(0)
    plain = get_model_profile(CheckpointStack(False), args=(x,), peak_flops=PEAK)
    assert _flops(plain) == (fwd, bwd, 0)
    torch.manual_seed(0)
    model = CheckpointStack(True)
    with set_checkpoint_early_stop(False):  # the whole block forward is rerun
        full = get_model_profile(model, args=(x,), peak_flops=PEAK)
    assert _flops(full) == (fwd, bwd, recompute)
    assert [m.recompute_flops for m in full.modules if m.path.count(".") == 1] == \
        [recompute // 3] * 3
    # torch's default early stop reruns a block only until its last saved tensor exists, so
    # recompute is less; forward + backward + recompute must equal what torch itself counts
    early = get_model_profile(model, args=(x,), peak_flops=PEAK)
    with FlopCounterMode(display=False) as counter:
        model(x).sum().backward()
    assert early.fwd_flops_per_rank == fwd and early.bwd_flops_per_rank == bwd
    assert 0 < early.recompute_flops_per_rank <= recompute
    assert sum(_flops(early)) == counter.get_total_flops()


def _checkpoint_engine(rank: int, world: int, early_stop: bool) -> dict:
    out = {}
    batches = _regression(2, ROWS * world, 7, 5)
    for checkpointed in (False, True):
        torch.manual_seed(0)
        with set_checkpoint_early_stop(early_stop):
            engine, _, _ = _train(CheckpointStack(checkpointed),
                                  _config(3, ROWS * world, peak_flops=PEAK), batches)
        out[checkpointed] = (_flops(engine.last_profile), engine.full_state_dict())
    return out


@pytest.mark.parametrize("early_stop", [True, False])  # True is torch's default
def test_checkpoint_recompute_under_zero3(tmp_path, early_stop):
    fwd, bwd, recompute = checkpoint_stack_flops(ROWS)
    if early_stop:  # what the ranks really rerun: torch's own count of the same step
        torch.manual_seed(0)
        model = CheckpointStack(True)
        with FlopCounterMode(display=False) as counter:
            model(torch.randn(ROWS, 7)).sum().backward()
        recompute = counter.get_total_flops() - fwd - bwd
    for res in run_distributed(_checkpoint_engine, 2, tmp_path, early_stop):
        assert res[False][0] == (fwd, bwd, 0)
        assert res[True][0] == (fwd, bwd, recompute)
        for name, p in res[False][1].items():  # recomputation changes no numbers
            assert torch.equal(p, res[True][1][name]), name


# --- 3. profiling changes nothing --------------------------------------------------------------
def _with_and_without(rank: int, world: int) -> dict:
    out = {}
    batches = _regression(3, 4 * world, 7, 5)
    for enabled in (False, True):
        torch.manual_seed(0)
        cfg = _config(3, 4 * world, peak_flops=PEAK)
        cfg["flops_profiler"]["enabled"] = enabled
        engine, comms, _ = _train(MLPStack(), cfg, batches)
        out[enabled] = (engine.full_state_dict(), comms, engine.last_profile is not None)
    return out


def test_profiling_changes_nothing(tmp_path):
    for rank, res in enumerate(run_distributed(_with_and_without, 2, tmp_path)):
        (plain, plain_comm, plain_prof), (prof, prof_comm, prof_prof) = res[False], res[True]
        assert (plain_prof, prof_prof) == (False, True)
        assert plain.keys() == prof.keys()
        for name in plain:
            assert torch.equal(plain[name], prof[name]), (rank, name)
        for step, (a, b) in enumerate(zip(plain_comm, prof_comm, strict=True)):
            # same collectives, counts and bytes; the min/max gather is not in the step's stats
            assert {op: (s["count"], s["bytes"]) for op, s in a.items()} == \
                {op: (s["count"], s["bytes"]) for op, s in b.items()}, (rank, step)
        assert prof_comm[1], "the profiled step sent nothing?"


# --- 4. the printed summary and the JSON --------------------------------------------------------
SUMMARY_LINES = {  # label at the start of a line -> what the line must contain
    "world size:": "2", "data-parallel size:": "2", "tensor-parallel size:": "1",
    "pipeline-parallel size:": "1",
    "ZeRO:": "ZeRO-3 shards parameters, gradients and optimizer states over 2 data-parallel "
             "ranks: this is data parallelism, not model parallelism",
    "params of the model:": "2.73 K", "params held by this rank at rest:": "",
    "peak of gathered params": "", "fwd FLOPs per rank / model:": "",
    "bwd FLOPs per rank / model:": "", "recompute FLOPs per rank:": "",
    "optimizer-step FLOPs per rank:": "", "fwd / bwd / step / whole profiled step:": "",
    "headline from:": "median of 1 unprofiled", "iteration latency:": "",
    "model FLOPs per step: job / this rank:": "", "hardware FLOPs per step: job / this rank:": "",
    "achieved FLOP/s per rank: model / hardware:": "FLOP/s", "peak:": "unknown",
    "MFU: job / this rank:": "unknown / unknown", "HFU: job / this rank:": "unknown / unknown",
    "samples/s": "", "tokens/s": "", "profiled step overhead:": "x the headline's latency",
    "comm all_gather:": "ops", "comm reduce_scatter:": "ops", "comm hidden behind compute:": "%",
    "memory params:": "device", "memory grads:": "device", "memory optimizer_states:": "device",
    "measured peak memory:": "process peak RSS",
    "  of which model states at rest / the rest:": "activations",
    "min / max across ranks: params_per_rank:": "", "min / max across ranks: fwd_flops": "",
}
JSON_KEYS = (  # item 6 of the issue
    "world_size", "data_parallel_size", "tensor_parallel_size", "pipeline_parallel_size",
    "zero_stage", "params_total", "params_per_rank", "gathered_params_peak",
    "fwd_flops_per_rank", "bwd_flops_per_rank", "fwd_flops_model", "fwd_latency_s",
    "bwd_latency_s", "step_latency_s", "iter_latency_s", "samples_per_second",
    "tokens_per_second", "model_flops_per_second_per_rank", "mfu", "hfu", "memory", "comm",
    "modules", "model_flops", "hardware_flops", "headline_steps", "profiled_step_overhead")
INT_KEYS = ("params_total", "params_per_rank", "gathered_params_peak", "fwd_flops_per_rank",
            "bwd_flops_per_rank", "recompute_flops_per_rank", "step_flops_per_rank",
            "fwd_flops_model", "bwd_flops_model", "model_flops", "hardware_flops")


def _printed(rank: int, world: int, output_file: str) -> tuple[str, ProfileReport]:
    torch.manual_seed(0)
    cfg = _config(3, 4 * world, module_depth=1, top_modules=2, output_file=output_file)
    engine, _, text = _train(MLPStack(), cfg, _regression(3, 4 * world, 7, 5))
    return text, engine.last_profile


def test_summary_and_json_carry_every_number(tmp_path):
    path = tmp_path / "profile.json"
    (text, report), (other, _) = run_distributed(_printed, 2, tmp_path, str(path))
    assert other == "", "only rank 0 prints"
    lines = text.splitlines()
    for label, content in SUMMARY_LINES.items():
        hits = [line for line in lines if line.startswith(label)]
        assert hits, f"no line {label!r} in:\n{text}"
        assert content in hits[0], hits[0]
    assert not re.search(r"\d [kKMGTP]s\b", text), "absurd seconds"
    # module tree: depth <= 1 (root, input, blocks, head), top-2 lines per depth
    assert "top 2 at depth 0: (root) 100.0%" in text and "top 2 at depth 1: blocks" in text
    assert "at depth 2" not in text
    table = lines[next(i for i, line in enumerate(lines) if line.startswith("module ")) + 1:]
    table = table[:table.index("")]  # the footer follows a blank line
    assert [row.split()[0] for row in table] == ["(root)", "input", "blocks", "head"]

    data = json.loads(path.read_text())
    assert set(JSON_KEYS) <= data.keys()
    for key in INT_KEYS:
        assert type(data[key]) is int, (key, data[key])
    assert data["fwd_flops_model"] == 2 * data["fwd_flops_per_rank"] > 0
    assert data["bwd_flops_model"] == 2 * data["bwd_flops_per_rank"] > 0
    assert (data["world_size"], data["data_parallel_size"], data["tensor_parallel_size"],
            data["pipeline_parallel_size"], data["zero_stage"]) == (2, 2, 1, 1, 3)
    assert data["params_total"] == 2733 and data["params_per_rank"] == report.params_per_rank
    assert {"all_gather", "reduce_scatter"} <= data["comm"].keys()
    assert {"params", "grads", "optimizer_states"} <= data["memory"].keys()
    assert [m["path"] for m in data["modules"]][:2] == ["", "input"]
    for key in ("fwd_latency_s", "bwd_latency_s", "step_latency_s", "iter_latency_s"):
        assert 0 < data[key] < 60, key
    assert data["mfu"] is None and data["hfu"] is None  # no peak for a CPU: unknown
    assert data["headline_steps"] == [2] and data["headline_final"]
    assert data == json.loads(json.dumps(report.to_dict()))


# --- 5. bad config --------------------------------------------------------------------------------
@pytest.mark.parametrize("block, key", [
    ({"recompute_fwd_factor": 1.0}, "flops_profiler.recompute_fwd_factor"),
    ({"enabeld": True}, "flops_profiler.enabeld"),
    ({"profile_step": -2}, "flops_profiler.profile_step"),
])
def test_bad_profiler_config_names_the_key(block, key):
    config = {"train_batch_size": 2, "flops_profiler": block}
    with pytest.raises(ValueError, match=re.escape(key)) as info:
        meshzero.initialize(model=nn.Linear(2, 2), config=config)
    if key.endswith("enabeld"):
        assert "enabled" in str(info.value)
