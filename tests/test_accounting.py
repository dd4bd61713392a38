"""DESIGN.md section 4.2-4.3: memory_report() and comm_report() equal the formulas, to the byte.

The expected layout is recomputed here from the model itself (units = the root's own
parameters and each Block; each unit padded to a multiple of world_size * 4 elements), not
read from the engine, so the shard arithmetic is checked independently.
"""

from __future__ import annotations

import math

import pytest

from meshzero.zero.state import CATEGORIES
from tests.distributed import run_distributed
from tests.engine_runs import train, zero_config
from tests.models import build_model

STEPS = 2


def _units(kind: str) -> list[list[int]]:
    """Parameter sizes per unit, in registration order: root's own first, then each Block."""
    model = build_model(kind)
    blocks = [[p.numel() for p in b.parameters()] for b in model.blocks]
    in_blocks = {id(p) for b in model.blocks for p in b.parameters()}
    root = [p.numel() for p in model.parameters() if id(p) not in in_blocks]
    return [root, *blocks]


def _shard(numel: int, world: int) -> int:
    return math.ceil(math.ceil(numel / world) / 4) * 4


def _owned(sizes: list[int], world: int, rank: int, sharded: bool) -> tuple[int, int]:
    """(real elements, fragments) of a unit's flat buffer inside ``rank``'s owned range."""
    s = _shard(sum(sizes), world)
    lo, hi = (rank * s, (rank + 1) * s) if sharded else (0, s * world)
    elems = frags = offset = 0
    for n in sizes:
        a, b = max(lo, offset), min(hi, offset + n)
        if a < b:
            elems, frags = elems + b - a, frags + 1
        offset += n
    return elems, frags


def expected_memory(kind: str, stage: int, world: int, rank: int, param_bytes: int,
                    grad_bytes: int = 4) -> dict:
    """Bytes at rest for AdamW (exp_avg, exp_avg_sq: 8 B/element; step: 4 B/fragment)."""
    out = dict.fromkeys(("params", "master_params", "grads", "optimizer_states"), 0)
    for sizes in _units(kind):
        shard = _shard(sum(sizes), world)
        padded = shard * world
        out["params"] += (shard if stage == 3 else padded) * param_bytes
        owned = padded if stage == 0 else shard
        if param_bytes != 4:
            out["master_params"] += owned * 4
        out["grads"] += (padded if stage <= 1 else shard) * grad_bytes
        elems, frags = _owned(sizes, world, rank, sharded=stage >= 1)
        out["optimizer_states"] += 8 * elems + 4 * frags
    return out


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_memory_report_equals_formula(tmp_path, stage, world_size):
    cfg = zero_config(stage, global_batch=8)
    results = run_distributed(train, world_size, tmp_path, "mlp", cfg, STEPS)
    for rank, r in enumerate(results):
        want = expected_memory("mlp", stage, world_size, rank, param_bytes=4)
        got = {k: v["device"] for k, v in r.memory.items() if k in CATEGORIES}
        assert got == want, f"rank {rank}"
        assert all(v["host"] == 0 and v["nvme"] == 0 for k, v in r.memory.items()
                   if k in CATEGORIES)


@pytest.mark.parametrize("world_size", [2, 4])
def test_stage3_bf16_fp32_grads_is_18_bytes_per_param_over_n(tmp_path, world_size):
    """bf16 param shard + fp32 master + fp32 grad shard + Adam m, v: (2+4+4+8) * psi/N
    (data_types.grad_accum_dtype fp32; bf16 gradients: tests/test_grad_dtype.py)."""
    cfg = zero_config(3, global_batch=8, bf16={"enabled": True},
                      data_types={"grad_accum_dtype": "fp32"})
    results = run_distributed(train, world_size, tmp_path, "mlp", cfg, STEPS)
    for rank, r in enumerate(results):
        want = expected_memory("mlp", 3, world_size, rank, param_bytes=2)
        got = {k: v["device"] for k, v in r.memory.items() if k in CATEGORIES}
        assert got == want
    psi = sum(sum(u) for u in _units("mlp"))
    padded = sum(_shard(sum(u), world_size) * world_size for u in _units("mlp"))
    frags = sum(_owned(u, world_size, rank, sharded=True)[1]
                for rank in range(world_size) for u in _units("mlp"))
    total = sum(sum(v["device"] for k, v in r.memory.items() if k in CATEGORIES)
                for r in results)
    # summed over ranks: 18 psi, plus 10 bytes per padding element (param, master, grad
    # shards) and Adam's 4-byte step counter per fragment
    assert total == 18 * psi + 10 * (padded - psi) + 4 * frags


def test_stages_shrink_exactly_what_they_shard(tmp_path):
    by_stage = {}
    for stage in range(4):
        r = run_distributed(train, 4, tmp_path, "mlp", zero_config(stage, global_batch=8), STEPS)
        by_stage[stage] = {k: v["device"] for k, v in r[0].memory.items()
                           if k in CATEGORIES}
    assert by_stage[1]["optimizer_states"] < by_stage[0]["optimizer_states"] / 3
    assert by_stage[1]["params"] == by_stage[0]["params"]
    assert by_stage[1]["grads"] == by_stage[0]["grads"]
    assert by_stage[2]["grads"] * 4 == by_stage[1]["grads"]
    assert by_stage[2]["params"] == by_stage[1]["params"]
    assert by_stage[3]["params"] * 4 == by_stage[2]["params"]
    assert by_stage[3]["grads"] == by_stage[2]["grads"]


def _ring(nbytes: int, world: int) -> int:
    return nbytes * (world - 1) // world


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_comm_bytes_equal_theory(tmp_path, stage, world_size):
    """Per step: stage 0 all-reduces 2 psi; stages 1-2 reduce-scatter psi and all-gather
    psi; stage 3 all-gathers psi in forward, in backward the units its reuse plan did not keep
    gathered (2 psi - psi_kept in all, zero/gather_plan.py; DeepSpeed's default reuse
    distance and live bound, 1e9 each, keep every unit of this model: psi), and
    reduce-scatters psi; each times (N-1)/N, psi being the padded flat size in bytes.
    tests/test_reuse.py checks plans that keep some units only."""
    cfg = zero_config(stage, global_batch=8)
    results = run_distributed(train, world_size, tmp_path, "mlp", cfg, STEPS)
    padded = sum(_shard(sum(u), world_size) * world_size for u in _units("mlp")) * 4
    units = len(_units("mlp"))
    if stage == 0:
        want = {"all_reduce": (units, 2 * _ring(padded, world_size))}
    elif stage in (1, 2):
        want = {"reduce_scatter": (units, _ring(padded, world_size)),
                "all_gather": (units, _ring(padded, world_size))}
    else:
        want = {"reduce_scatter": (units, _ring(padded, world_size)),
                "all_gather": (units, _ring(padded, world_size))}
        if world_size > 1:  # one unit-order check before the gathers of a hook: the root's
            # forward hook gathers every unit (prefetch), [phase, step, count, units,
            # padding] in int64 (faults/phase.py)
            want["order_check"] = (1, _ring(8 * (units + 3) * world_size, world_size))
    # no phase check on the training path: gloo's waits are watched instead (faults/stall.py)
    if stage >= 1:  # the non-finite check: two float64 summed once per step
        want["step_check"] = (1, 2 * _ring(16, world_size))
    for r in results:
        got = {op: (v["count"], v["bytes"]) for op, v in r.comm.items()}
        assert got == want
        assert all(v["seconds"] >= v["exposed_seconds"] >= 0 for v in r.comm.values())


def test_comm_bf16_gathers_half_the_bytes(tmp_path):
    cfg = zero_config(3, global_batch=8, bf16={"enabled": True})
    r = run_distributed(train, 4, tmp_path, "mlp", cfg, STEPS)[0]
    padded_elems = sum(_shard(sum(u), 4) * 4 for u in _units("mlp"))
    assert r.comm["all_gather"]["bytes"] == _ring(padded_elems * 2, 4)  # every unit reused
    # reduced in the gradient dtype, by default the compute dtype (bf16)
    assert r.comm["reduce_scatter"]["bytes"] == _ring(padded_elems * 2, 4)


def test_stage3_gathered_peak_is_bounded_by_units_in_flight(tmp_path):
    """Without prefetch and reuse, at most the root and two blocks are gathered at once (the
    next block's gather can begin as the previous block's last gradient arrives)."""
    cfg = zero_config(3, global_batch=8,
                      zero_optimization={"stage3_prefetch_bucket_size": 0,
                                         "stage3_max_reuse_distance": 0})
    r = run_distributed(train, 4, tmp_path, "mlp", cfg, STEPS)[0]
    units = [_shard(sum(u), 4) * 4 * 4 for u in _units("mlp")]
    root, blocks = units[0], units[1:]
    peak = r.memory["gathered_params_peak"]
    assert root + max(blocks) <= peak <= root + 2 * max(blocks) < sum(units)


@pytest.mark.parametrize("stage, reductions_per_step", [(0, 1), (1, 1), (2, 2), (3, 2)])
def test_accumulation_communicates_on_the_boundary_only_at_stages_0_1(tmp_path, stage,
                                                                     reductions_per_step):
    """Two micro-steps per step: stages 0-1 reduce once (at the boundary); stages 2-3 reduce
    every micro-step into the gradient shard."""
    cfg = zero_config(stage, global_batch=16, grad_accum=2)
    r = run_distributed(train, 2, tmp_path, "mlp", cfg, STEPS)[0]
    units = len(_units("mlp"))
    op = "all_reduce" if stage == 0 else "reduce_scatter"
    assert r.comm[op]["count"] == units * reductions_per_step
