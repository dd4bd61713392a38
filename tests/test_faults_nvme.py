"""NVMe offload faults (issue 17, items 1 and 6): a failed gradient write refuses the step on
every rank (no hang, no weight moves, no stale retries) until a new backward, and recovery is
bit-identical to a run without the lost batch; files go on SIGTERM / SIGINT, and directories
of dead runs are reclaimed at initialize while live and foreign ones are kept."""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import meshzero
from meshzero.zero.offload import NvmeIOError, nvme_owner
from tests.distributed import REPO_ROOT, run_distributed
from tests.engine_runs import zero_config
from tests.models import build_model, make_batches, split_for_rank
from tests.test_offload import offload


def _config(path: str, stage: int, grad_accum: int) -> dict:
    cfg = zero_config(stage, global_batch=8, grad_accum=grad_accum)
    cfg["zero_optimization"].update(offload("nvme", "nvme" if stage == 3 else "none", path))
    return cfg


def _batch(engine, batch, rank: int, world_size: int) -> float:
    """Forward and backward of every micro-batch of one global batch (no step); the loss
    of the last."""
    for micro in range(engine.grad_accum):
        x, y = split_for_rank(batch, rank, world_size, engine.grad_accum, micro)
        loss = F.mse_loss(engine(x), y)
        engine.backward(loss)
        if micro < engine.grad_accum - 1:
            engine.step()
    return loss.item()


def _train(path: str, stage: int, grad_accum: int, batches, rank: int, world_size: int):
    engine, *_ = meshzero.initialize(model=build_model("mlp"),
                                     config=_config(path, stage, grad_accum))
    for batch in batches:
        _batch(engine, batch, rank, world_size)
        engine.step()
    return engine


# fault -> (the os call that fails, on files whose name starts with, the errno)
FAULTS = {"grad-write": ("pwrite", "grad", errno.ENOSPC),
          "shard-read": ("preadv", "params.", errno.EIO)}


def _inject(fault: str):
    """Every ``os.pwrite`` (or ``os.preadv``) on the fault's files fails with its errno, as
    on a full (or failing) disk; returns the undo (what freeing space does)."""
    return _inject_on(*FAULTS[fault])


def _inject_on(call: str, prefix: str, code: int):
    real = getattr(os, call)

    def failing(fd, *args):
        if os.path.basename(os.readlink(f"/proc/self/fd/{fd}")).startswith(prefix):
            raise OSError(code, os.strerror(code))
        return real(fd, *args)

    setattr(os, call, failing)
    return lambda: setattr(os, call, real)


def _refusals(engine, count: int) -> tuple[list[str], list[float]]:
    errors, seconds = [], []
    for _ in range(count):
        t0 = time.monotonic()
        with pytest.raises(NvmeIOError) as info:
            engine.step()
        seconds.append(time.monotonic() - t0)
        errors.append(str(info.value))
    return errors, seconds


def _fault_run(rank: int, world_size: int, root: str, stage: int, grad_accum: int,
               fault: str) -> dict:
    batches = make_batches("mlp", 4, 8)
    engine = _train(f"{root}/run", stage, grad_accum, batches[:2], rank, world_size)
    # the fp32 masters (a collective; touching stage-3 parameters would gather them)
    before, steps = engine.full_state_dict(), engine.global_steps
    free_space = _inject(fault) if rank == 1 else None  # only rank 1's disk fails
    loss = _batch(engine, batches[2], rank, world_size)
    # the agreed refusal, then the same one again: no stale error per queued write
    errors, seconds = _refusals(engine, 3)
    if free_space is not None:
        free_space()
    errors += _refusals(engine, 1)[0]  # space is back, but the gradients are still lost
    out = {"errors": errors, "seconds": seconds, "steps": engine.global_steps - steps,
           "loss": loss,
           "unchanged": all(torch.equal(v, before[n])
                            for n, v in engine.full_state_dict().items())}
    _batch(engine, batches[3], rank, world_size)  # a new backward, then the step works
    engine.step()
    # reading the files in for a checkpoint fails on rank 1: every rank raises
    undo = _inject_on("preadv", "master.", errno.EIO) if rank == 1 else None
    with pytest.raises(NvmeIOError) as info:
        engine.full_state_dict()
    out["read_error"] = str(info.value)
    if undo is not None:
        undo()
    out["params"] = engine.full_state_dict()
    engine.close()
    # the run that never saw batch 2
    engine = _train(f"{root}/ref", stage, grad_accum, [batches[i] for i in (0, 1, 3)],
                    rank, world_size)
    out["want"] = engine.full_state_dict()
    engine.close()
    return out


@pytest.mark.parametrize(("stage", "grad_accum", "fault"), [
    (2, 1, "grad-write"), (3, 1, "shard-read"),
    pytest.param(3, 2, "grad-write", marks=pytest.mark.slow)])
def test_failed_nvme_io_refuses_the_step_on_every_rank(tmp_path, stage, grad_accum, fault):
    """Gradient writes fail on rank 1 (disk full), or at stage 3 its parameter shard reads
    in forward: every rank refuses the step with rank 1's file and errno, without a hang."""
    for sub in ("run", "ref"):
        (tmp_path / sub).mkdir()
    # one rank's disk full must not hang the other: the helper's timeout fails a hang
    results = run_distributed(_fault_run, 2, tmp_path, str(tmp_path), stage, grad_accum,
                              fault, timeout=90)
    want = {"grad-write": "/grad cannot be written: [ENOSPC] No space left on device",
            "shard-read": "cannot be read: [EIO] Input/output error (parameter shard of"}
    for rank, r in enumerate(results):
        first = r["errors"][0]
        assert want[fault] in first, first
        # a shard read fails in forward: the all-gather goes on with a NaN shard
        assert math.isnan(r["loss"]) == (fault == "shard-read"), r["loss"]
        assert "lost data of this step on rank 1" in first, first
        assert "step() is refused on every rank and no weight changed" in first, first
        assert f"meshzero-rank{1:05d}-" in first  # the file of rank 1, on every rank
        assert all(e == first for e in r["errors"]), r["errors"]
        assert max(r["seconds"]) < 10, r["seconds"]
        assert r["unchanged"] and r["steps"] == 0, rank
        assert re.search(r"/master\.[01] cannot be read: \[EIO\] Input/output error",
                         r["read_error"]), r["read_error"]
        assert ("another rank" in r["read_error"]) == (rank == 0), r["read_error"]
        for name, value in r["want"].items():
            assert torch.equal(r["params"][name], value), (rank, name)


# -- the documented recoveries, exactly as written (docs/zero-offload.md, "Atomic steps") --------
def _documented_recovery(rank: int, world_size: int, root: str) -> dict:
    """"A file that ... cannot be written raises NvmeIOError ... ("... the optimizer step
    was not applied on any rank") ... Fix the cause and call engine.step() again to apply
    the same step": the disk is full while the step writes the new master tiles (one rank:
    that every rank raises is test_offload_io.py::test_nvme_fault_applies_the_step_on_no_shard)."""
    batches = make_batches("mlp", 3, 8)
    engine = _train(f"{root}/run", 2, 1, batches[:1], rank, world_size)
    _batch(engine, batches[1], rank, world_size)
    free_space = _inject_on("pwrite", "master.", errno.ENOSPC)
    with pytest.raises(NvmeIOError) as info:
        engine.step()
    free_space()  # fix the cause
    out = {"error": str(info.value), "retry": engine.step()}  # and call engine.step() again
    _batch(engine, batches[2], rank, world_size)
    engine.step()
    out["params"] = engine.full_state_dict()
    engine.close()
    engine = _train(f"{root}/ref", 2, 1, batches, rank, world_size)  # never interrupted
    out["want"] = engine.full_state_dict()
    engine.close()
    return out


def test_a_failed_step_write_is_recovered_as_documented(tmp_path):
    for sub in ("run", "ref"):
        (tmp_path / sub).mkdir()
    (r,) = run_distributed(_documented_recovery, 1, tmp_path, str(tmp_path), timeout=90)
    assert "the optimizer step was not applied on any rank" in r["error"], r["error"]
    assert "master.0 cannot be written: [ENOSPC]" in r["error"], r["error"]
    assert r["retry"] is True
    for name, value in r["want"].items():
        assert torch.equal(r["params"][name], value), name


# -- a real full disk (tmpfs) ------------------------------------------------------------------
def _fill(path: str) -> None:
    with open(path, "wb") as f, contextlib.suppress(OSError):
        while True:
            f.write(b"\0" * 65536)
            f.flush()


def _tmpfs_run(rank: int, world_size: int, full: str, ref: str) -> dict:
    batches = make_batches("mlp", 3, 8)
    engine = _train(full, 2, 1, [], rank, world_size)
    dist.barrier()
    if rank == 0:
        _fill(f"{full}/filler")
    dist.barrier()
    _batch(engine, batches[0], rank, world_size)  # the gradient files are still sparse
    errors = _refusals(engine, 2)[0]
    dist.barrier()
    if rank == 0:
        os.remove(f"{full}/filler")
    dist.barrier()
    for batch in batches[1:]:
        _batch(engine, batch, rank, world_size)
        engine.step()
    out = {"errors": errors, "params": engine.full_state_dict()}
    engine.close()
    engine = _train(ref, 2, 1, batches[1:], rank, world_size)
    out["want"] = engine.full_state_dict()
    engine.close()
    return out


@pytest.mark.slow
def test_full_tmpfs_refuses_then_recovers(tmp_path):
    full, ref = tmp_path / "full", tmp_path / "ref"
    full.mkdir()
    ref.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(full)],
                             capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        results = run_distributed(_tmpfs_run, 2, tmp_path, str(full), str(ref), timeout=120)
    finally:
        subprocess.run(["umount", str(full)], check=False)
    for r in results:
        assert "[ENOSPC] No space left on device" in r["errors"][0], r["errors"]
        assert r["errors"][0] == r["errors"][1]
        for name, value in r["want"].items():
            assert torch.equal(r["params"][name], value), name


# -- signals -----------------------------------------------------------------------------------
SIGNAL_SCRIPT = """
import sys, time, torch
from torch import nn
import meshzero
torch.manual_seed(0)
cfg = {"train_batch_size": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
       "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme",
                                                               "nvme_path": sys.argv[1]}}}
engine, *_ = meshzero.initialize(model=nn.Linear(8, 8), config=cfg)
engine.backward(engine(torch.randn(2, 8)).pow(2).mean())
engine.step()
print("ready", flush=True)
while True:
    engine.backward(engine(torch.randn(2, 8)).pow(2).mean())
    engine.step()
    time.sleep(0.01)
"""


def _runs(path) -> list[str]:
    return sorted(p.name for p in path.iterdir() if p.name.startswith(nvme_owner.PREFIX))


def _start(*args: str) -> subprocess.Popen:
    """``python args...`` with one thread and this checkout's meshzero, output piped."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO_ROOT / "src"))
    return subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)


def _wait_ready(proc: subprocess.Popen, timeout: float = 60) -> None:
    """Until ``proc`` prints its "ready" line (training, its NVMe files written)."""
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.strip() == "ready", (line, proc.communicate(timeout=timeout))


@pytest.mark.parametrize("signals", [
    (signal.SIGTERM,),
    # SIGKILL is the crash no handler sees
    pytest.param((signal.SIGINT, signal.SIGKILL), marks=pytest.mark.slow)])
def test_signal_removes_the_files_and_ends_the_process_by_it(tmp_path, signals):
    procs = {}
    for sig in signals:  # all at once: the imports dominate
        path = tmp_path / sig.name
        path.mkdir()
        procs[sig] = (path, _start("-c", SIGNAL_SCRIPT, str(path)))
    for sig, (path, proc) in procs.items():
        _wait_ready(proc)
        assert len(_runs(path)) == 1  # the run's directory exists while it trains
        proc.send_signal(sig)
    for sig, (path, proc) in procs.items():
        _, err = proc.communicate(timeout=60)
        # SIGTERM: died by it (as without handlers); SIGINT: KeyboardInterrupt, then the
        # interpreter ends by SIGINT as Python does
        assert proc.returncode == -sig, (sig, proc.returncode, err[-2000:])
        if sig == signal.SIGKILL:  # left behind, and reclaimed by the next run's initialize
            assert len(_runs(path)) == 1
            assert len(nvme_owner.reclaim_stale(str(path))) == 1
        assert _runs(path) == [], (sig, _runs(path))


BLOCKED_SCRIPT = """
import sys
from datetime import timedelta
import torch
import torch.distributed as dist
from torch import nn
import meshzero
cfg = {"train_batch_size": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
       "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme",
                                                               "nvme_path": sys.argv[1]}}}
engine, *_ = meshzero.initialize(model=nn.Linear(8, 8), config=cfg)
engine.backward(engine(torch.randn(2, 8)).pow(2).mean())
engine.step()
store = dist.TCPStore("127.0.0.1", 0, 1, True)
print("ready", flush=True)
# blocked in C++ with the GIL released, as in a collective's wait: Python's handler waits
store.wait(["never"], timedelta(seconds=float(sys.argv[2])))
"""


def test_sigterm_removes_the_files_while_the_main_thread_is_blocked(tmp_path):
    """The race behind files left after SIGTERM to torchrun: a rank blocked in a collective
    runs no Python handler until the wait ends, and torchrun's SIGKILL comes 30 s after its
    SIGTERM. The files go at once anyway; the process still ends by SIGTERM."""
    blocked_s = 8.0
    proc = _start("-c", BLOCKED_SCRIPT, str(tmp_path), str(blocked_s))
    _wait_ready(proc)
    assert len(_runs(tmp_path)) == 1
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    while _runs(tmp_path) and time.monotonic() - t0 < blocked_s / 2:
        time.sleep(0.05)
    removed_after = time.monotonic() - t0
    _, err = proc.communicate(timeout=60)
    assert removed_after < blocked_s / 2 and _runs(tmp_path) == [], (removed_after, err[-2000:])
    assert proc.returncode == -signal.SIGTERM, (proc.returncode, err[-2000:])


TORCHRUN_SCRIPT = """
import os, sys, time, torch
import torch.distributed as dist
from torch import nn
import meshzero
torch.manual_seed(0)
cfg = {"train_batch_size": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
       "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                             "offload_optimizer": {"device": "nvme", "nvme_path": sys.argv[1]},
                             "offload_param": {"device": "nvme", "nvme_path": sys.argv[1]}}}
model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
engine, *_ = meshzero.initialize(model=model, config=cfg)
engine.backward(engine(torch.randn(2, 8)).pow(2).mean())
engine.step()
dist.barrier()
if dist.get_rank() == 0:
    print("ready", flush=True)
while True:
    engine.backward(engine(torch.randn(2, 8)).pow(2).mean())
    engine.step()
"""


def _sigterm_torchrun(tmp_path, delay: float) -> None:
    """One torchrun of TORCHRUN_SCRIPT, SIGTERM to the launcher ``delay`` s after the
    ranks are training; no NVMe directory may be left."""
    script, nvme = tmp_path / "job.py", tmp_path / "nvme"
    nvme.mkdir(parents=True)
    script.write_text(TORCHRUN_SCRIPT)
    proc = _start("-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                  str(script), str(nvme))
    _wait_ready(proc, timeout=120)
    assert len(_runs(nvme)) == 2  # one directory per rank
    time.sleep(delay)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode != 0, err[-2000:]
    assert _runs(nvme) == [], (delay, _runs(nvme), err[-2000:])


@pytest.mark.slow
@pytest.mark.timeout(1200)  # 20 launches of about 20 s each on 2 shared cores
def test_sigterm_to_torchrun_leaves_no_nvme_files(tmp_path):
    """What Slurm and Kubernetes do at preemption: SIGTERM to the launcher, which sends it
    on to its workers; 20 launches, each killed at a random point of the training loop
    (a rank in backward, in a step, or blocked in a collective's wait)."""
    delays = random.Random(27).sample(range(0, 2000), 20)
    for i, delay_ms in enumerate(delays):
        _sigterm_torchrun(tmp_path / f"launch{i}", delay_ms / 1000)


def _many_files(path, count: int) -> None:
    path.mkdir()
    for i in range(count):
        (path / f"f{i}").write_bytes(b"\0")


def test_removal_is_tried_again_when_a_file_appears_meanwhile(tmp_path, monkeypatch):
    """A writer thread of the store opens its files with O_CREAT: a file rmtree had just
    unlinked comes back, the last rmdir fails and the directory stays (one launch in about
    140 of test_sigterm_to_torchrun_leaves_no_nvme_files, killed 0.68 s into training). The
    directory is removed again until it is gone."""
    path = tmp_path / "run"
    _many_files(path, 10)
    real, calls = nvme_owner.shutil.rmtree, []

    def rmtree_racing_a_writer(target, ignore_errors=False):
        calls.append(target)
        real(target, ignore_errors=ignore_errors)
        if len(calls) == 1:  # as if a write landed between the listing and the rmdir
            os.mkdir(target)
            with open(os.path.join(target, "grad"), "wb") as f:
                f.write(b"\0")

    monkeypatch.setattr(nvme_owner.shutil, "rmtree", rmtree_racing_a_writer)
    nvme_owner.remove_dirs([str(path)])
    assert not path.exists() and len(calls) == 2


# -- stale directories ---------------------------------------------------------------------------
def _owner_dir(parent, name: str, **changes) -> str:
    me = nvme_owner.identity()
    path = parent / f"{nvme_owner.PREFIX}{name}"
    path.mkdir()
    (path / "grad").write_bytes(b"\0" * 64)
    (path / nvme_owner.OWNER_FILE).write_text(json.dumps({**me, **changes}))
    return path.name


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_stale_directories_of_dead_runs_are_reclaimed(tmp_path):
    if nvme_owner.start_time(os.getpid()) is None:
        pytest.skip("no /proc: process start times are unknown here")
    dead = {
        _owner_dir(tmp_path, "00000-dead", pid=_dead_pid()),
        _owner_dir(tmp_path, "00001-reused", start_time=1),  # our pid, another start time
        _owner_dir(tmp_path, "00002-rebooted", boot_id="another-boot"),
    }
    kept = {
        _owner_dir(tmp_path, "00003-live"),  # this process
        _owner_dir(tmp_path, "00004-host", host=socket.gethostname() + "-other",
                   pid=_dead_pid()),
        _owner_dir(tmp_path, "00005-container", pid_ns="pid:[1]", pid=_dead_pid()),
    }
    (tmp_path / f"{nvme_owner.PREFIX}00006-unknown").mkdir()  # no owner.json: keep
    kept.add(f"{nvme_owner.PREFIX}00006-unknown")
    cfg = zero_config(2, global_batch=2)
    cfg["zero_optimization"].update(offload("nvme", "none", str(tmp_path)))
    engine, *_ = meshzero.initialize(model=build_model("mlp"), config=cfg)
    try:
        left = set(_runs(tmp_path))
        assert not dead & left, dead & left
        assert kept <= left, kept - left
        (mine,) = left - kept
        owner = json.loads((tmp_path / mine / nvme_owner.OWNER_FILE).read_text())
        assert owner == nvme_owner.identity()
    finally:
        engine.close()
    assert set(_runs(tmp_path)) == kept
