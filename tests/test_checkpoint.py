"""Sharded checkpoints: exact resume, resharding to another world size and stage, and faults.

Every run is the TrickyModel (tied weights, a frozen layer, an unused layer, a buffer) so the
names, aliases, frozen parameters and buffers all go through save and load. One rank call
trains several stages in turn (a fresh engine each) to keep the number of process starts low.
"""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import meshzero
from meshzero import checkpoint
from meshzero.checkpoint import format as checkpoint_format
from meshzero.checkpoint import sharded as checkpoint_sharded
from tests.distributed import DistributedTestError, run_distributed
from tests.engine_runs import zero_config
from tests.models import build_model, loss_fn_for, make_batches, split_for_rank

STEPS = 6
SAVE_AFTER = 3  # steps trained before the save
GLOBAL_BATCH = 8
WARMUP = {"type": "WarmupLR", "params": {"warmup_min_lr": 1e-3, "warmup_max_lr": 2e-2,
                                         "warmup_num_steps": 5, "warmup_type": "linear"}}
# scale 16 doubling every 2 good steps, and an overflow at step 1: the scaler state changes
FP16 = {"enabled": True, "initial_scale_power": 4, "loss_scale_window": 2, "hysteresis": 1}
OVERFLOW_STEP = 1


def fp16_config(stage: int) -> dict:
    return zero_config(stage, global_batch=GLOBAL_BATCH, grad_accum=2, fp16=FP16,
                       scheduler=WARMUP)


def fp32_config(stage: int) -> dict:
    return zero_config(stage, global_batch=GLOBAL_BATCH, scheduler=WARMUP)


def make_engine(config: dict, seed: int = 0, kind: str = "tricky") -> meshzero.Engine:
    engine, *_ = meshzero.initialize(model=build_model(kind, seed), config=config)
    return engine


def train_steps(engine, rank: int, world_size: int, steps: range, *,
                overflow_step: int | None = None, on_step=None) -> list[float]:
    """Train the given optimizer steps of the fixed batch sequence; ``on_step(i)`` runs
    after step i."""
    batches = make_batches("tricky", STEPS, GLOBAL_BATCH)
    loss_fn = loss_fn_for(engine.module)
    gas = engine.gradient_accumulation_steps()
    losses = []
    for i in steps:
        total = 0.0
        for micro in range(gas):
            x, y = split_for_rank(batches[i], rank, world_size, gas, micro)
            loss = loss_fn(engine(x).float(), y)
            if i == overflow_step and rank == 0 and micro == 0:
                loss = loss * float("inf")
            engine.backward(loss)
            engine.step()
            total += loss.item() / gas
        losses.append(total)
        if on_step is not None:
            on_step(i)
    return losses


def fragment_states(engine) -> dict:
    """``{(name, start, end): {kind: tensor}}`` of this rank's optimizer state."""
    return {(frag.slot.name, frag.start, frag.end):
            {k: v.clone() for k, v in engine.optimizer.state.get(leaf, {}).items()}
            for leaf, frag, _ in engine.zero.optim_state.fragment_index}


def assemble_states(per_rank: list[dict], shapes: dict[str, torch.Size]) -> dict:
    """Full optimizer state per (name, kind): element states placed by range, scalar states
    as the set of values the fragments hold."""
    full: dict = {}
    for states in per_rank:
        for (name, a, b), state in states.items():
            for kind, value in state.items():
                if value.dim() == 0:
                    full.setdefault((name, kind), set()).add(value.item())
                    continue
                t = full.setdefault((name, kind), torch.full((shapes[name].numel(),), torch.nan))
                t[a:b] = value
    return full


# -- exact resume --------------------------------------------------------------------------
def _run_and_save(rank: int, world_size: int, ckpt: str, stage: int) -> dict:
    engine = make_engine(fp16_config(stage))
    saved = {}

    def save(i: int) -> None:
        if i == SAVE_AFTER - 1:
            engine.save_checkpoint(ckpt, client_state={"stage": stage, "data": [1, 2.5]})
            engine.save_16bit_model(f"{ckpt}-16bit")
            saved.update(torch_rng=torch.get_rng_state(), py_rng=random.getstate(),
                         state_dict=engine.full_state_dict(), scale=engine.loss_scale)

    losses = train_steps(engine, rank, world_size, range(STEPS), overflow_step=OVERFLOW_STEP,
                         on_step=save)
    return dict(saved, losses=losses, params=engine.full_state_dict(),
                skipped=engine.skipped_steps)


def _resume_first(rank: int, world_size: int, root: str, stages: list[int]) -> dict:
    return {stage: _run_and_save(rank, world_size, f"{root}/stage{stage}", stage)
            for stage in stages}


def _resume_second(rank: int, world_size: int, root: str, stages: list[int]) -> dict:
    out = {}
    for stage in stages:
        engine = make_engine(fp16_config(stage), seed=1)  # other weights: the load must count
        torch.manual_seed(1234 + rank)
        path, client_state = engine.load_checkpoint(f"{root}/stage{stage}")
        loaded = dict(path=path, client_state=client_state, torch_rng=torch.get_rng_state(),
                      py_rng=random.getstate(), scale=engine.loss_scale,
                      steps=(engine.global_steps, engine.micro_steps, engine.skipped_steps))
        losses = train_steps(engine, rank, world_size, range(SAVE_AFTER, STEPS))
        out[stage] = dict(loaded, losses=losses, params=engine.full_state_dict(),
                          skipped=engine.skipped_steps)
    return out


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_exact_resume_is_bit_identical(tmp_path, world_size):
    """6 steps == 3 steps, save, new processes, load, 3 steps: fp16 with loss scaling and an
    overflow, WarmupLR, gradient accumulation; stages 0-3."""
    stages = [0, 1, 2, 3]
    root = str(tmp_path / "ckpt")
    first = run_distributed(_resume_first, world_size, tmp_path, root, stages)
    second = run_distributed(_resume_second, world_size, tmp_path, root, stages)
    for rank in range(world_size):
        for stage in stages:
            a, b = first[rank][stage], second[rank][stage]
            where = f"rank {rank} stage {stage}"
            assert b["path"] == f"{root}/stage{stage}/global_step{SAVE_AFTER}", where
            assert b["client_state"] == {"stage": stage, "data": [1, 2.5]}, where
            assert b["losses"] == a["losses"][SAVE_AFTER:], where
            for name, value in a["params"].items():
                assert torch.equal(b["params"][name], value), f"{where}: {name}"
            assert torch.equal(b["torch_rng"], a["torch_rng"]), where
            assert b["py_rng"] == a["py_rng"], where
            assert b["scale"] == a["scale"] and b["skipped"] == a["skipped"] == 1, where
            assert b["steps"] == (SAVE_AFTER, 2 * SAVE_AFTER, 1), where
    # save_16bit_model wrote the compute-dtype (fp16) weights of the step it was called at
    for stage in stages:
        written = load_file(f"{root}/stage{stage}-16bit/model.safetensors")
        want = first[0][stage]["state_dict"]
        assert written.keys() == want.keys()
        for name, value in want.items():
            assert torch.equal(written[name], value.half()), f"stage {stage}: {name}"


# -- reshard ---------------------------------------------------------------------------------
def _reshard_source(rank: int, world_size: int, root: str) -> dict:
    engine = make_engine(fp32_config(3))
    saved = {}

    def save(i: int) -> None:
        if i == SAVE_AFTER - 1:
            engine.save_checkpoint(f"{root}/ckpt", client_state=None)
            engine.save_16bit_model(f"{root}/live", save_filename="weights.safetensors")
            saved.update(state_dict=engine.full_state_dict(), states=fragment_states(engine),
                         lr=engine.get_lr())

    losses = train_steps(engine, rank, world_size, range(STEPS), on_step=save)
    return dict(saved, losses=losses, params=engine.full_state_dict())


def _reshard_target(rank: int, world_size: int, ckpt: str, stage: int) -> dict:
    engine = make_engine(fp32_config(stage), seed=1)
    engine.load_checkpoint(ckpt)
    out = dict(state_dict=engine.full_state_dict(), states=fragment_states(engine),
               lr=engine.get_lr(), steps=engine.global_steps)
    out["losses"] = train_steps(engine, rank, world_size, range(SAVE_AFTER, STEPS))
    out["params"] = engine.full_state_dict()
    if world_size == 1:  # model (and scheduler) only
        fresh = make_engine(fp32_config(stage), seed=2)
        fresh.load_checkpoint(ckpt, load_optimizer_states=False)
        out["model_only"] = dict(state_dict=fresh.full_state_dict(), lr=fresh.get_lr(),
                                 num_states=len(fresh.optimizer.state))
    return out


@pytest.fixture(scope="module")
def w4_stage3(tmp_path_factory) -> tuple[Path, list[dict]]:
    """A checkpoint saved at world size 4, stage 3, fp32, after 3 of 6 steps."""
    root = tmp_path_factory.mktemp("w4_stage3")
    return root, run_distributed(_reshard_source, 4, root, str(root))


@pytest.mark.parametrize(("world_size", "stage"), [(2, 1), (1, 0)])
def test_reshard_from_4_ranks_stage3(w4_stage3, tmp_path, world_size, stage):
    root, source = w4_stage3
    results = run_distributed(_reshard_target, world_size, tmp_path, str(root / "ckpt"), stage)
    want = source[0]["state_dict"]
    shapes = {name: t.shape for name, t in want.items()}
    want_states = assemble_states([r["states"] for r in source], shapes)
    got_states = assemble_states([r["states"] for r in results], shapes)
    assert got_states.keys() == want_states.keys() and want_states
    for key, value in want_states.items():
        if isinstance(value, set):
            assert got_states[key] == value, key
        else:
            assert not value.isnan().any() and torch.equal(got_states[key], value), key
    for r in results:
        assert r["steps"] == SAVE_AFTER and r["lr"] == source[0]["lr"]
        for name, value in want.items():
            assert torch.equal(r["state_dict"][name], value), name
        # training on agrees with the uninterrupted run up to fp32 summation order
        for name, value in source[0]["params"].items():
            torch.testing.assert_close(r["params"][name], value, rtol=1e-5, atol=1e-6)
    mean = [sum(r["losses"][i] for r in results) / world_size for i in range(STEPS - SAVE_AFTER)]
    want_mean = [sum(r["losses"][i] for r in source) / 4 for i in range(SAVE_AFTER, STEPS)]
    assert mean == pytest.approx(want_mean, rel=1e-5)
    if world_size == 1:
        model_only = results[0]["model_only"]
        assert model_only["num_states"] == 0 and model_only["lr"] == source[0]["lr"]
        for name, value in want.items():
            assert torch.equal(model_only["state_dict"][name], value), name


# -- faults ----------------------------------------------------------------------------------
def _save_then_die(rank: int, world_size: int, root: str, kill_at: str) -> str:
    engine = make_engine(fp32_config(2))
    train_steps(engine, rank, world_size, range(1))
    engine.save_checkpoint(root, tag="good", client_state={"tag": "good"})
    train_steps(engine, rank, world_size, range(1, 2))
    if kill_at == "rank1-after-its-file":
        write = checkpoint_sharded.write_rank_state

        def write_then_die(*args, **kwargs):
            write(*args, **kwargs)
            if rank == 1:
                os._exit(3)

        checkpoint_sharded.write_rank_state = write_then_die
    else:  # rank 0, after the rename, before 'latest' moves
        def die(*args, **kwargs):
            os._exit(3)

        checkpoint_format.write_latest = die
    engine.save_checkpoint(root, tag="bad", client_state={"tag": "bad"})
    return "survived"


def _load_after_crash(rank: int, world_size: int, root: str) -> dict:
    engine = make_engine(fp32_config(1), seed=1)
    path, client_state = engine.load_checkpoint(root)
    engine.save_checkpoint(root, tag="bad", client_state={"tag": "bad"})  # stale tmp is no bar
    return dict(path=path, client_state=client_state)


@pytest.mark.parametrize("kill_at", ["rank1-after-its-file", "rank0-before-latest"])
def test_killed_save_leaves_previous_tag(tmp_path, kill_at):
    root = tmp_path / "ckpt"
    with pytest.raises(DistributedTestError, match="exited with code 3"):
        run_distributed(_save_then_die, 2, tmp_path, str(root), kill_at)
    assert (root / "latest").read_text() == "good"
    results = run_distributed(_load_after_crash, 2, tmp_path, str(root))
    for r in results:
        assert r == {"path": str(root / "good"), "client_state": {"tag": "good"}}
    assert (root / "latest").read_text() == "bad"
    assert sorted(p.name for p in root.iterdir()) == ["bad", "good", "latest"]


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x10
    path.write_bytes(data)


def _fault_checks(rank: int, world_size: int, ckpt: str, corrupt: str, root: str) -> dict:
    errors = {}
    engine = make_engine(fp32_config(0))
    for what, call in {
        "corrupt": lambda: engine.load_checkpoint(corrupt),
        "client_state": lambda: engine.save_checkpoint(f"{root}/new",
                                                       client_state={"x": {"fn": print}}),
        "pickle_bin": lambda: engine.load_weights(f"{root}/evil.bin"),
        "pickle_named_safetensors": lambda: engine.load_weights(f"{root}/evil.safetensors"),
        "other_model": lambda: make_engine(fp32_config(1), kind="mlp").load_checkpoint(ckpt),
    }.items():
        with pytest.raises(ValueError) as info:
            call()
        errors[what] = str(info.value)
    return errors


class _Evil:
    """Unpickling this creates the file ``marker``: proof that something unpickled it."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def write_pickles(root: Path) -> Path:
    import pickle

    marker = root / "UNPICKLED"
    for name in ("evil.bin", "evil.safetensors"):
        (root / name).write_bytes(pickle.dumps(_Evil(marker)))
    return marker


def test_faults_fail_with_clear_errors(w4_stage3, tmp_path):
    root, _ = w4_stage3
    corrupt = tmp_path / "corrupt"
    shutil.copytree(root / "ckpt", corrupt)
    _flip_byte(corrupt / "global_step3" / "rank00002.safetensors")
    marker = write_pickles(tmp_path)
    (errors,) = run_distributed(_fault_checks, 1, tmp_path, str(root / "ckpt"), str(corrupt),
                                str(tmp_path))
    assert "rank00002.safetensors" in errors["corrupt"] and "checksum" in errors["corrupt"]
    assert errors["client_state"].startswith("client_state['x']['fn']: a function")
    assert not (tmp_path / "new").exists(), "nothing may be written before the check"
    for key in ("pickle_bin", "pickle_named_safetensors"):
        assert "refusing to load" in errors[key] and "never unpickles" in errors[key]
    assert not marker.exists()
    other = errors["other_model"]
    assert "missing" in other and "'input.weight'" in other  # an MLPStack name
    assert "unexpected" in other and "'embed.weight'" in other  # a TrickyModel name


@pytest.mark.parametrize("damage", ["bit-flip", "truncate"])
def test_damaged_file_fails_checksum_in_consolidate(w4_stage3, tmp_path, damage):
    root, _ = w4_stage3
    ckpt = tmp_path / "ckpt"
    shutil.copytree(root / "ckpt", ckpt)
    victim = ckpt / "global_step3" / "rank00001.safetensors"
    if damage == "bit-flip":
        _flip_byte(victim)
    else:
        victim.write_bytes(victim.read_bytes()[:-100])
    with pytest.raises(ValueError, match=r"rank00001\.safetensors fails its checksum"):
        checkpoint.consolidate(ckpt, tmp_path / "out")
