"""The stall watch (faults/stall.py): ranks whose waits close a cycle raise PhaseError
within seconds, naming both sides; a rank that is only slow closes no cycle; the posts ahead
of another backend (NCCL) still name the same calls (docs/failures.md, "Calls made on some
ranks only").

- :func:`deadlocked` on reports: a cycle across groups, one through a third rank, none
  where the awaited rank has issued the op, none where a rank waits on a rank that is not
  waiting;
- four ranks, rank 0 in a save while ranks 1-3 train: every rank raises within seconds;
- a rank that sleeps before a save and before a backward: the others' waits are reported
  and withdrawn, nothing raises, and training goes on;
- the cases of tests/test_faults_phase.py again with the watch off (no store: the engine
  posts ahead, as with NCCL): the same errors, with no wait at all.
"""

from __future__ import annotations

import time

import meshzero
import meshzero.faults.phase as phase
from meshzero.faults.phase import PhaseError
from meshzero.faults.stall import StallWatch, deadlocked
from tests.distributed import run_distributed
from tests.engine_runs import zero_config
from tests.models import build_model, loss_fn_for
from tests.test_faults_phase import CASES, X, Y, _subset_call


def _report(group: str, n: int, ranks: list[int], **issued: int) -> dict:
    return {"row": [0, 1], "at": [group, n], "in": ranks, "issued": issued}


def test_a_cycle_across_groups_is_a_deadlock():
    # rank 0 waits on its 3rd op over the check group, which rank 1 has not issued; rank 1
    # on its 9th over dp, which rank 0 has not issued
    reports = {0: _report("check", 3, [0, 1], check=3, dp=8),
               1: _report("dp", 9, [0, 1], check=2, dp=9)}
    assert sorted(deadlocked(0, reports)) == [0, 1]
    assert sorted(deadlocked(1, reports)) == [0, 1]


def test_no_cycle_where_the_awaited_rank_has_issued_the_op_or_is_not_waiting():
    # rank 1 has issued rank 0's op: rank 0 waits for someone else (a slow rank 2)
    assert deadlocked(0, {0: _report("dp", 5, [0, 1, 2], dp=5),
                          1: _report("dp", 6, [0, 1, 2], dp=6)}) == []
    # rank 1 waits on rank 2, which is not waiting (computing, loading data): no report
    assert deadlocked(1, {1: _report("dp", 5, [0, 1, 2], dp=5),
                          0: _report("dp", 5, [0, 1, 2], dp=5)}) == []
    # the same collective on both ranks: each has issued it, the wait is on a third rank
    assert deadlocked(0, {0: _report("g", 2, [0, 1, 2], g=2),
                          1: _report("g", 2, [0, 1, 2], g=2)}) == []
    assert deadlocked(0, {}) == []


def test_a_rank_waiting_into_a_cycle_of_others_finds_it():
    reports = {0: _report("check", 3, [0, 1, 2], check=3, dp=8),
               1: _report("dp", 9, [0, 1, 2], check=2, dp=9),
               2: _report("dp", 9, [0, 1, 2], check=2, dp=9)}
    assert sorted(deadlocked(2, reports)) in ([0, 1], [0, 2])


def _train_step(engine) -> None:
    engine.backward(loss_fn_for(engine.module)(engine(X), Y))
    engine.step()


def test_slices_grow_with_the_wait_and_with_the_ranks_to_read():
    def watch(n: int) -> StallWatch:
        return StallWatch(None, "p", 0, range(n), list, {}, {}, RuntimeError)  # type: ignore[arg-type]

    small, large = watch(2), watch(256)
    assert small.next_wait(0.0) == large.next_wait(0.0) == 1.0  # a stall is seen after 1 s
    assert small.next_wait(1.0) == 0.5  # then looked at again soon: a deadlock in ~1.5 s
    assert small.next_wait(1000.0) == 8.0 and large.next_wait(1000.0) == 32.0
    assert watch(10_000).next_wait(1000.0) == 60.0


# -- launches ----------------------------------------------------------------------------------
def _slow_rank(rank: int, world: int, save_dir: str) -> tuple:
    """Rank 1 sleeps 2.5 s before a save and before a backward (comm_timeout 60): rank 0's
    waits stall and are reported, and nothing raises."""
    model = build_model("mlp", 0)
    cfg = zero_config(2, global_batch=2 * world, faults={"comm_timeout": 60})
    with meshzero.initialize(model=model, config=cfg)[0] as engine:
        watch = engine.guard.phases.watch
        for step in range(2):
            if rank == 1:
                time.sleep(2.5)
            if step == 1:
                engine.save_checkpoint(save_dir)
            loss = loss_fn_for(model)(engine(X), Y)
            if rank == 1:
                time.sleep(2.5)
            engine.backward(loss)
            engine.step()
        return watch is not None, watch.reported, engine.global_steps


def test_a_slow_rank_is_waited_for(tmp_path):
    results = run_distributed(_slow_rank, 2, tmp_path, str(tmp_path / "ck"), timeout=120)
    for watched, still_reported, steps in results:
        assert watched and not still_reported and steps == 2


def _four(rank: int, world: int, save_dir: str) -> list:
    """Rank 0 saves while the other three train: before their forward (they wait in
    backward), and after their backward (they wait in the step)."""
    out = []
    for where in ("before forward", "after backward"):
        model = build_model("mlp", 0)
        cfg = zero_config(2, global_batch=2 * world, faults={"comm_timeout": 60})
        engine, *_ = meshzero.initialize(model=model, config=cfg)
        t0 = time.perf_counter()
        try:
            with engine:
                _train_step(engine)
                if where == "after backward":
                    engine.backward(loss_fn_for(model)(engine(X), Y))
                t0 = time.perf_counter()
                if rank == 0:
                    engine.save_checkpoint(save_dir)
                elif where == "after backward":
                    engine.step()
                else:
                    _train_step(engine)
        except PhaseError as exc:
            out.append((str(exc), time.perf_counter() - t0))
            continue
        out.append(("", time.perf_counter() - t0))
    return out


def test_four_ranks_all_name_the_call(tmp_path):
    per_rank = run_distributed(_four, 4, tmp_path, str(tmp_path / "ck"), timeout=150)
    for results in per_rank:
        waiting = ("backward (step 1)", "step() (step 1)")
        for (message, seconds), theirs in zip(results, waiting, strict=True):
            # the other side: the ranks that had reported when the cycle was found
            assert message.startswith("save_checkpoint was called on rank 0 while rank"), \
                message
            assert message.endswith(f"in {theirs}; call it on every rank"), message
            assert seconds < 10, (theirs, seconds)


def _posted(rank: int, world: int, save_dir: str) -> list:
    phase.default_store = lambda: None  # no store: the engine posts ahead (as with NCCL)
    return [_subset_call(rank, world, *case[:4], save_dir, case[5]) for case in CASES]


def test_posts_ahead_name_the_same_calls(tmp_path):
    per_rank = run_distributed(_posted, 2, tmp_path, str(tmp_path / "ck"), timeout=150)
    for results in per_rank:
        for (kind, message, seconds), (_, odd, _, _, theirs, _) in zip(results, CASES, strict=True):
            assert kind == "PhaseError", message
            assert message.startswith(f"{odd} was called on rank 0 while {theirs}"), message
            assert seconds < 1.0, (odd, seconds)  # at the post: no wait for a stall


def _one_rank(rank: int, world: int) -> bool:
    cfg = zero_config(2, global_batch=2)
    with meshzero.initialize(model=build_model("mlp", 0), config=cfg)[0] as engine:
        _train_step(engine)
        return engine.guard.phases.watch is None


def test_one_rank_has_nothing_to_watch(tmp_path):
    assert run_distributed(_one_rank, 1, tmp_path) == [True]
