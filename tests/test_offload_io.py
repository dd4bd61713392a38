"""Offload (issue 4): bad NVMe input fails before work, I/O faults apply the step on no
shard, checkpoints move between tiers, and NVMe really lowers host memory."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import meshzero
from meshzero import log as meshzero_log
from meshzero.zero.offload import NvmeIOError, OffloadOptions
from meshzero.zero.offload import nvme as nvme_tier
from meshzero.zero.offload import tier as tier_mod
from tests.distributed import REPO_ROOT, run_distributed
from tests.engine_runs import zero_config
from tests.models import build_model, make_batches, split_for_rank
from tests.test_checkpoint import SAVE_AFTER, STEPS, fp16_config, make_engine, train_steps
from tests.test_offload import offload


# -- bad input ----------------------------------------------------------------------------------
def _init(zero: dict):
    cfg = zero_config(3, global_batch=2)
    cfg["zero_optimization"].update(zero)
    return meshzero.initialize(model=build_model("mlp"), config=cfg)


def _nvme(path) -> dict:
    return offload("nvme", "none", str(path))


@pytest.mark.parametrize("case", ["missing", "file", "read-only", "full"])
def test_bad_nvme_path_fails_before_work(tmp_path, monkeypatch, case):
    target = tmp_path / "nvme"
    if case == "missing":
        want = "does not exist"
    elif case == "file":
        target.write_text("x")
        want = "is not a directory"
    else:
        target.mkdir()
        if case == "read-only":
            # root ignores permission bits: simulate the failing write of a read-only mount
            def refuse(path):
                raise PermissionError(13, "Permission denied", path)
            monkeypatch.setattr(nvme_tier, "probe_write", refuse)
            want = "is not writable: Permission denied"
        else:
            monkeypatch.setattr(nvme_tier, "disk_free", lambda path: 1000)
            want = "has 1,000 bytes free but the NVMe offload of the ranks on this node needs"
    with pytest.raises(ValueError, match=want) as info:
        _init(_nvme(target))
    assert "zero_optimization.offload_optimizer.nvme_path" in str(info.value)
    if target.is_dir():
        assert list(target.iterdir()) == []  # nothing was written


@pytest.mark.parametrize(("zero", "want"), [
    ({"stage": 2, "offload_param": {"device": "cpu"}},
     "zero_optimization.offload_param.device = 'cpu' needs zero_optimization.stage 3"),
    ({"offload_optimizer": {"device": "disk"}},
     "zero_optimization.offload_optimizer.device = 'disk': Input should be 'none', 'cpu' or"),
    ({"offload_optimizer": {"device": "nvme"}}, "needs zero_optimization.offload_optimizer"
                                                ".nvme_path"),
    ({"stage": 0, "offload_optimizer": {"device": "cpu"}}, "needs zero_optimization.stage 1"),
    ({"offload_param": {"device": "nvme", "nvme_path": "/tmp"}},
     "offload_param.device = 'nvme' needs zero_optimization.offload_optimizer.device = 'nvme'"),
])
def test_bad_offload_config(zero, want):
    with pytest.raises(ValueError, match=want.replace("(", r"\(").replace(".", r"\.")):
        _init(zero)


# -- faults ---------------------------------------------------------------------------------------
def _micro(engine, batch, rank, world_size) -> None:
    x, y = split_for_rank(batch, rank, world_size, 1, 0)
    engine.backward(F.mse_loss(engine(x), y))


def _fault_run(rank: int, world_size: int, path: str, fault: str) -> dict:
    cfg = zero_config(2, global_batch=8)
    cfg["zero_optimization"].update(offload("nvme", "none", path))
    engine, *_ = meshzero.initialize(model=build_model("mlp"), config=cfg)
    batches = make_batches("mlp", 4, 8)
    for batch in batches[:2]:
        _micro(engine, batch, rank, world_size)
        engine.step()
    before = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    _micro(engine, batches[2], rank, world_size)
    store = engine.zero.tier.store
    if rank == 1:
        if fault == "missing":
            os.remove(store.file("master", store.gen).path)
        elif fault == "truncated":
            target = store.file("exp_avg", store.gen).path
            os.truncate(target, os.path.getsize(target) // 2)
        else:  # the next generation's master cannot be written
            blocked = store.file("master", 1 - store.gen).path
            os.remove(blocked)
            os.mkdir(blocked)
    error = None
    try:
        engine.step()
    except NvmeIOError as exc:
        error = str(exc)
    unchanged = all(torch.equal(p, before[n]) for n, p in engine.module.named_parameters())
    out = {"error": error, "unchanged": unchanged, "steps": engine.global_steps}
    if fault == "unwritable":  # repaired: the same step applies once, then training goes on
        if rank == 1:
            os.rmdir(blocked)
        engine.step()
        _micro(engine, batches[3], rank, world_size)
        engine.step()
        out["params"] = engine.full_state_dict()
    engine.close()
    return out


def _plain_run(rank: int, world_size: int) -> dict:
    cfg = zero_config(2, global_batch=8)
    engine, *_ = meshzero.initialize(model=build_model("mlp"), config=cfg)
    for batch in make_batches("mlp", 4, 8):
        _micro(engine, batch, rank, world_size)
        engine.step()
    return engine.full_state_dict()


@pytest.mark.parametrize("fault", ["missing", "truncated", "unwritable"])
def test_nvme_fault_applies_the_step_on_no_shard(tmp_path, fault):
    results = run_distributed(_fault_run, 2, tmp_path, str(tmp_path), fault)
    bad, other = results[1], results[0]
    assert "NVMe offload file" in bad["error"] and "optimizer tile" in bad["error"]
    assert {"missing": "is missing", "truncated": "is truncated",
            "unwritable": "cannot be opened"}[fault] in bad["error"]
    assert "another rank" in other["error"]
    for r in results:
        assert "not applied on any rank" in r["error"]
        assert r["unchanged"] and r["steps"] == 2
    if fault == "unwritable":
        want = run_distributed(_plain_run, 2, tmp_path)[0]
        for name, value in want.items():
            assert torch.equal(results[0]["params"][name], value), name


# -- checkpoints across tiers ---------------------------------------------------------------------
def _tiered(stage: int, tier: str, path: str) -> dict:
    cfg = fp16_config(stage)
    if tier != "none":
        cfg["zero_optimization"].update(offload(tier, tier, path))
    return cfg


def _save_tiered(rank: int, world_size: int, root: str, tier: str) -> dict:
    engine = make_engine(_tiered(3, tier, root))

    def save(i: int) -> None:
        if i == SAVE_AFTER - 1:
            engine.save_checkpoint(f"{root}/ckpt")

    losses = train_steps(engine, rank, world_size, range(STEPS), overflow_step=1, on_step=save)
    return {"losses": losses, "params": engine.full_state_dict()}


def _resume_tiered(rank: int, world_size: int, root: str, tier: str) -> dict:
    engine = make_engine(_tiered(3, tier, root), seed=1)
    engine.load_checkpoint(f"{root}/ckpt")
    losses = train_steps(engine, rank, world_size, range(SAVE_AFTER, STEPS))
    return {"losses": losses, "params": engine.full_state_dict()}


@pytest.mark.parametrize(("saved", "loaded"), [("nvme", "none"), ("none", "nvme"),
                                               ("cpu", "nvme")])
def test_checkpoint_moves_between_tiers(tmp_path, saved, loaded):
    first = run_distributed(_save_tiered, 2, tmp_path, str(tmp_path), saved)
    second = run_distributed(_resume_tiered, 2, tmp_path, str(tmp_path), loaded)
    for a, b in zip(first, second, strict=True):
        assert b["losses"] == a["losses"][SAVE_AFTER:]
        for name, value in a["params"].items():
            assert torch.equal(b["params"][name], value), name


# -- host memory ------------------------------------------------------------------------------
RSS_SCRIPT = """
import json, resource, sys, torch
from torch import nn
import meshzero
tier, path = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
model = nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(6)])
zero = {"stage": 3, "stage3_param_persistence_threshold": 0, "sub_group_size": 2_000_000,
        "offload_optimizer": {"device": tier, "buffer_count": 2}}
if tier == "nvme":
    zero["offload_optimizer"]["nvme_path"] = path
cfg = {"train_batch_size": 2, "zero_optimization": zero,
       "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
engine, *_ = meshzero.initialize(model=model, config=cfg)
for _ in range(2):
    engine.backward(engine(torch.randn(2, 2048)).pow(2).mean())
    engine.step()
psi = sum(p.numel() for p in model.parameters())
print(json.dumps({"peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                  "optimizer_state_bytes": 8 * psi}))
"""


def test_nvme_lowers_peak_rss_by_the_optimizer_states(tmp_path):
    # glibc keeps freed blocks of up to 32 MB in its heap once it has seen one (dynamic mmap
    # threshold), which makes peak RSS depend on allocation order; a fixed threshold makes
    # the peak track live memory
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO_ROOT / "src"),
               MALLOC_MMAP_THRESHOLD_="65536")
    out = {}
    for tier in ("cpu", "nvme"):
        proc = subprocess.run([sys.executable, "-c", RSS_SCRIPT, tier, str(tmp_path)],
                              capture_output=True, text=True, env=env, timeout=240, check=True)
        out[tier] = json.loads(proc.stdout.strip().splitlines()[-1])
    drop = out["cpu"]["peak_rss"] - out["nvme"]["peak_rss"]
    states = out["cpu"]["optimizer_state_bytes"]  # 201 MB of Adam m and v
    print(f"peak RSS cpu {out['cpu']['peak_rss']:,} B, nvme {out['nvme']['peak_rss']:,} B: "
          f"drop {drop:,} B = {drop / states:.2f}x the {states:,} B of Adam states")  # -s
    assert drop >= 0.8 * states, (out, drop / states)


def test_pin_memory_without_cuda_warns_once(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("pins for real where CUDA exists")
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger(tier_mod.__name__)
    logger.addHandler(handler)
    monkeypatch.setattr(meshzero_log, "_WARNED", set())  # warn_once: once per process
    try:
        cfg = zero_config(3, global_batch=2)["zero_optimization"]
        cfg["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        for _ in range(2):
            options = OffloadOptions.from_config(meshzero.load_config(
                {"zero_optimization": cfg}).zero_optimization)
            assert options.pin_memory is False
    finally:
        logger.removeHandler(handler)
    assert [r.getMessage() for r in records] == [
        "offload pin_memory is ignored: there is no CUDA device to pin for"]
