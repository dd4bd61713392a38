"""An engine call made on some ranks only fails at once on every rank, naming both sides,
and a failed collective names the phase its rank was in as it waited (docs/failures.md,
"Calls made on some ranks only" and "Timeouts and mismatched ranks").

- ``if rank == 0: engine.save_checkpoint(...)`` (or ``load_checkpoint``,
  ``full_state_dict``) while the other rank trains: a PhaseError on both ranks within
  seconds ("save_checkpoint was called on rank 0 while rank 1 is in forward (step 1,
  gathering unit 0 ('<root>')); call it on every rank"), at stages 0, 2 and 3; made
  between a backward and the step, it meets the other rank's step at the step's non-finite
  check, which carries the step's phase (stages 2 and 3, and with units stepped during
  backward), or at stage 0, whose step runs no collective, the next backward.
- A rank stalled inside a checkpoint save: the other rank's CollectiveError says
  "(checkpoint save)", not the last training phase; an op issued in backward and waited on
  in a save names both; a tensor-parallel style collective (``meshzero.comm.all_reduce``
  counted by a ``CommStats.counter``) names the phase too.
"""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import meshzero
from meshzero.checkpoint.atomic import set_fault_hook
from meshzero.comm import CollectiveError, CommStats, Communicator, all_reduce
from meshzero.faults.phase import PhaseError
from tests.distributed import run_distributed
from tests.engine_runs import zero_config
from tests.models import build_model, loss_fn_for

X, Y = torch.randn(2, 7, generator=torch.Generator().manual_seed(0)), torch.zeros(2, 5)


def _train_step(engine, model) -> None:
    loss = loss_fn_for(model)(engine(X), Y)
    engine.backward(loss)
    engine.step()


def _subset_call(rank: int, world: int, stage: int, odd: str, others: str, where: str,
                 save_dir: str, zero: dict):
    """In the second step rank 0 makes ``odd`` (before its forward, or after its backward)
    while rank 1 goes on (``others``: trains, or makes another engine call); (error type,
    message, seconds) on each rank."""
    model = build_model("mlp", 0)
    cfg = zero_config(stage, global_batch=2 * world, faults={"comm_timeout": 60},
                      zero_optimization=zero)
    engine, *_ = meshzero.initialize(model=model, config=cfg)
    calls = {"save_checkpoint": lambda: engine.save_checkpoint(save_dir),
             "load_checkpoint": lambda: engine.load_checkpoint(save_dir),
             "full_state_dict": engine.full_state_dict, "train": engine.step,
             # stage 0's step runs no collective: the next backward meets the call
             "step, train": lambda: (engine.step(), _train_step(engine, model))}
    t0 = time.perf_counter()
    try:
        with engine:
            _train_step(engine, model)
            t0 = time.perf_counter()
            if where == "after backward":  # together: forward and backward
                engine.backward(loss_fn_for(model)(engine(X), Y))
            elif rank == 1 and others == "train":
                _train_step(engine, model)
            calls[odd if rank == 0 else others]()
    except (PhaseError, CollectiveError) as exc:
        return type(exc).__name__, str(exc), time.perf_counter() - t0
    return None, "", time.perf_counter() - t0


OFFLOAD = {"offload_optimizer": {"device": "cpu"}}  # units stepped during backward
CASES = [  # (stage, rank 0's call, rank 1's, where, what rank 1 is said to be in, zero)
    (3, "save_checkpoint", "train", "before forward",
     "rank 1 is in forward (step 1, gathering unit 0 ('<root>'))", {}),
    (2, "save_checkpoint", "train", "before forward", "rank 1 is in backward (step 1)", {}),
    (0, "full_state_dict", "train", "before forward", "rank 1 is in backward (step 1)", {}),
    # the step posts nothing of its own: its non-finite check's sum carries its phase
    (2, "load_checkpoint", "train", "after backward", "rank 1 is in step() (step 1)", {}),
    (3, "save_checkpoint", "train", "after backward", "rank 1 is in step() (step 1)", {}),
    (2, "save_checkpoint", "train", "after backward", "rank 1 is in step() (step 1)",
     OFFLOAD),
    (0, "save_checkpoint", "step, train", "after backward", "rank 1 is in backward (step 2)",
     {}),
    (3, "full_state_dict", "save_checkpoint", "before forward",
     "rank 1 called save_checkpoint (step 1)", {}),
]


def test_a_call_on_some_ranks_only_fails_at_once_on_every_rank(launched):
    per_rank = [subset for subset, *_ in launched]
    for i, (stage, odd, others, _, theirs, _) in enumerate(CASES):
        for kind, message, seconds in (per_rank[0][i], per_rank[1][i]):
            assert kind == "PhaseError", (stage, odd, kind, message)
            assert message.startswith(f"{odd} was called on rank 0 while {theirs}"), message
            assert message.endswith("call it on every rank") or "train" not in others, message
            assert seconds < 10, (stage, odd, seconds)


# -- the phase a failed collective names --------------------------------------------------------
def _stall_in_save(rank: int, world: int, save_dir: str, store: str) -> str:
    # the world group again with the 1 s timeout (as initialize makes it under torchrun):
    # a checkpoint's collectives run over it
    dist.destroy_process_group()
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank,
                            world_size=world, timeout=timedelta(seconds=1))
    model = build_model("mlp", 0)
    cfg = zero_config(2, global_batch=2 * world, faults={"comm_timeout": 1})
    engine, *_ = meshzero.initialize(model=model, config=cfg)
    _train_step(engine, model)

    def stall(kind, path) -> None:
        if kind == "write" and rank == 1:
            set_fault_hook(None)
            time.sleep(2.5)  # past the 1 s timeout, inside the save

    set_fault_hook(stall)
    try:
        engine.save_checkpoint(save_dir)
    except CollectiveError as exc:
        return str(exc)
    finally:
        set_fault_hook(None)
    return ""


def _wait_in_another_phase(rank: int, world: int) -> tuple[str, str]:
    """An all-reduce issued in backward and waited on in a save; a bare one in forward."""
    group = dist.new_group([0, 1], timeout=timedelta(seconds=1))
    stats = CommStats(phase="backward", step=4)
    comm = Communicator(group, "dp", stats)
    if rank == 0:
        time.sleep(2.5)  # joins neither in time (1 s each)
        return "", ""
    messages = []
    for op in ("issued in backward", "bare"):
        try:
            if op == "bare":
                stats.phase = "forward"
                all_reduce(torch.ones(3), group, stats.counter("tp"))
            else:
                handle = comm.all_reduce(torch.ones(3))
                with stats.in_phase("checkpoint save"):
                    handle.wait()
        except CollectiveError as exc:
            messages.append(str(exc))
    return messages[0], messages[1]


def _control_group(rank: int, world: int) -> tuple[str, str]:
    """The phase check's group backend and the device of its rows (stage 3)."""
    cfg = zero_config(3, global_batch=2 * world)
    with meshzero.initialize(model=build_model("mlp", 0), config=cfg)[0] as engine:
        phases = engine.guard.phases
        return dist.get_backend(phases.comm.group), phases.device.type


def _barrier(store: str, world: int) -> None:
    """The ranks leave a failed collective apart: meet (over a file store) before the next."""
    arrived = dist.FileStore(store, world)
    arrived.add("ranks", 1)
    while arrived.add("ranks", 0) < world:
        time.sleep(0.01)


def _launch(rank: int, world: int, tmp: str) -> tuple:
    control = _control_group(rank, world)  # first: the failures below break the world group
    subset = [_subset_call(rank, world, *case[:4], f"{tmp}/ck", case[5]) for case in CASES]
    _barrier(f"{tmp}/barrier1", world)
    saved = _stall_in_save(rank, world, f"{tmp}/ck", f"{tmp}/store2")
    _barrier(f"{tmp}/barrier2", world)
    return subset, saved, _wait_in_another_phase(rank, world), control


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> list:
    """One launch of two ranks for every case of this file."""
    tmp = tmp_path_factory.mktemp("phase")
    return run_distributed(_launch, 2, tmp, str(tmp), timeout=150)


def test_a_collective_error_names_the_phase_its_rank_waited_in(launched):
    saved, (issued, bare) = launched[0][1], launched[1][2]
    assert "over group checkpoint failed at step 1 (checkpoint save)" in saved, saved
    assert ("all_reduce over group dp failed at step 4 (checkpoint save; issued at step 4 "
            "(backward))") in issued, issued
    assert "all_reduce over group of ranks [0, 1] failed at step 4 (forward)" in bare, bare


def test_the_check_is_a_gloo_group_on_host_tensors(launched):
    """Whatever the data backend: with NCCL a check on the device would make the host wait
    for every kernel queued before it at each stage-3 gather (faults/phase.py). On this CPU
    machine the data group is gloo too; the GPU check runs it with NCCL."""
    for *_, control in launched:
        assert control == ("gloo", "cpu"), control
