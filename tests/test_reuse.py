"""Stage 3 reuse (zero/gather_plan.py): DeepSpeed's stage3_max_reuse_distance and
stage3_max_live_parameters keep the last units of forward gathered into backward.

The kept set is recomputed here by hand for the MLP stack (root = input + head, then 3
blocks run in order): reuse distances root 0, block 3 P(root), block 2 P(root) + 2 P(block),
block 1 P(root) + 4 P(block); kept closest first while kept + root (if not kept) + the
largest unit not kept <= max_live. Per step a rank then gathers (2 psi - P(kept)) (N-1)/N;
training equals one plain-torch process; the gathered peak stays within max_live; the
estimator's communication volume and gathered peak are the engine's.
"""

from __future__ import annotations

import pytest

import meshzero
from meshzero.estimate import Estimator, load_model, settings_from_config
from meshzero.estimate.plan import communication_bytes
from meshzero.zero.gather_plan import nested_orders, plan_reuse, reuse_distance
from tests.distributed import run_distributed
from tests.engine_runs import train, zero_config
from tests.models import build_model, loss_fn_for, make_batches, split_for_rank
from tests.test_accounting import _ring, _shard, _units
from tests.test_equivalence import STEPS, _assert_params_equal, _reference

WORLD = 2
BIG = 1_000_000_000


def _padded() -> list[int]:
    return [_shard(sum(u), WORLD) * WORLD for u in _units("mlp")]


def _kept_by_hand(max_reuse: int, max_live: int) -> set[int]:
    """The plan for root + blocks 1..3, from the rule in the module docstring."""
    p = _padded()
    root, block = p[0], p[1]
    distance = {0: 0, 3: root, 2: root + 2 * block, 1: root + 4 * block}
    kept: set[int] = set()
    for u in sorted(distance, key=lambda u: (distance[u], -u)):
        if distance[u] > max_reuse:
            continue
        trial = kept | {u}
        others = [p[v] for v in range(1, 4) if v not in trial]
        bound = sum(p[v] for v in trial) + max(others, default=0)
        bound += 0 if 0 in trial else root
        if bound <= max_live:
            kept = trial
    return kept


# (max_reuse_distance, max_live_parameters): all kept (the defaults), the root only, root and
# the last block (by distance, then by the live bound), nothing
CASES = [(BIG, BIG), (0, BIG), (1000, BIG), (BIG, 2735), (BIG, 1055)]


def _config(max_reuse: int, max_live: int) -> dict:
    return zero_config(3, global_batch=8, zero_optimization={
        "stage3_max_reuse_distance": max_reuse, "stage3_max_live_parameters": max_live})


def _runs(rank: int, world: int) -> list:
    out = []
    for case in CASES:
        r = train(rank, world, "mlp", _config(*case), STEPS)
        out.append((r.params, r.comm, r.memory["gathered_params_peak"]))
    return out


def test_kept_by_hand_cases_differ():
    """The cases cover every plan shape: all, root only, root + last block, none."""
    assert [_kept_by_hand(*c) for c in CASES] == [{0, 1, 2, 3}, {0}, {0, 3}, {0, 3}, set()]


def test_reuse_gathers_less_trains_the_same_and_matches_the_estimator(tmp_path):
    results = run_distributed(_runs, WORLD, tmp_path)
    ref = _reference("mlp", 8)
    p = _padded()
    estimator = Estimator(load_model(lambda: build_model("mlp")))
    for i, case in enumerate(CASES):
        kept = _kept_by_hand(*case)
        gathered = 2 * sum(p) - sum(p[u] for u in kept)
        settings = settings_from_config(_config(*case), WORLD)
        states = estimator.states(settings, WORLD)
        for params, comm, peak in (r[i] for r in results):
            _assert_params_equal(params, ref.params, rtol=1e-5, atol=1e-6)
            assert comm["all_gather"]["count"] == 2 * len(p) - len(kept), case
            assert comm["all_gather"]["bytes"] == _ring(gathered * 4, WORLD), case
            # one order check per hook that gathers (its unit and its prefetches)
            assert 1 <= comm["order_check"]["count"] <= comm["all_gather"]["count"]
            control = ("order_check", "phase_check", "step_check")  # not data
            data = sum(op["bytes"] for name, op in comm.items() if name not in control)
            assert communication_bytes(states.layout, settings) == pytest.approx(data, abs=8)
            assert peak == states.gathered_bytes(), case
            if case[1] < BIG:  # the live bound holds (prefetch included), unless the root
                # and the block in use alone exceed it
                assert peak <= max(case[1], p[0] + p[1]) * 4, case
    # the default keeps every unit: the whole model is gathered at the end of forward
    assert results[0][0][2] == sum(p) * 4


def _orders(rank: int, world: int, kind: str) -> tuple:
    model = build_model(kind)
    engine, *_ = meshzero.initialize(model=model, config=_config(BIG, BIG))
    loss_fn = loss_fn_for(model)
    x, y = split_for_rank(make_batches(kind, 1, 8)[0], rank, world, 1, 0)
    engine.backward(loss_fn(engine(x).float(), y))
    engine.step()
    s = engine.zero.sharder
    assert s is not None
    paths = [u.path for u in engine.zero.layout.units]
    return list(s.fwd_order), list(s.bwd_order), dict(s.release_pos), paths, s.kept


@pytest.mark.parametrize("kind", ["mlp", "tricky"])
def test_estimator_orders_equal_the_recorded_ones(tmp_path, kind):
    """nested_orders (the estimator's release points and backward order, from module paths)
    equals what the engine records, on a model with a unit run twice (tricky)."""
    fwd, bwd, release, paths, kept = run_distributed(_orders, 1, tmp_path, kind)[0]
    want_release, want_bwd = nested_orders(fwd, paths)
    assert (release, bwd) == (want_release, want_bwd)
    assert kept == set(u for u in fwd)  # the defaults keep every unit


def test_plan_on_a_gpt_shape():
    """Root (embedding + head) 40, six blocks of 7 run in order: distances as documented;
    the live bound keeps the closest."""
    numel = [40] + [7] * 6
    fwd = list(range(7))
    release, bwd = nested_orders(fwd, ["", *(f"h.{i}" for i in range(6))])
    assert bwd == [0, 6, 5, 4, 3, 2, 1]
    assert reuse_distance(fwd, bwd, numel, 0, release[0]) == 0
    assert reuse_distance(fwd, bwd, numel, 6, release[6]) == 40
    assert reuse_distance(fwd, bwd, numel, 4, release[4]) == 40 + 2 * 14
    plan = plan_reuse(fwd, bwd, numel, release, max_reuse_distance=BIG,
                      max_live_parameters=40 + 3 * 7)
    assert plan == {0, 6, 5}  # root + 2 kept blocks + 1 block in use
    plan = plan_reuse(fwd, bwd, numel, release, max_reuse_distance=54,
                      max_live_parameters=BIG)
    assert plan == {0, 6, 5}  # block 5's distance: 7 (block 6) + 40 + 7 = 54
    assert plan_reuse(fwd, bwd, numel, release, max_reuse_distance=53,
                      max_live_parameters=BIG) == {0, 6}
    assert plan_reuse(fwd, bwd, numel, release, max_reuse_distance=0,
                      max_live_parameters=46) == frozenset()  # root 40 + a block 7 > 46
