"""A checkpoint written by an older meshzero still loads: the on-disk format is a contract.

``tests/fixtures/checkpoint_v1/`` was written once, before the checkpoint code moved into the
``meshzero.checkpoint`` package, by ``python -m tests.test_checkpoint_fixture`` (world size 2,
ZeRO stage 3, fp32, AdamW + WarmupLR, a tiny tied/frozen/buffer model): the sharded tag
``ckpt/global_step2``, the 16-bit model file ``model16/model.safetensors`` and, recorded by
that same run, ``expected.json`` (steps, scheduler, scaler, client state, the losses of the
two steps trained after the save) and ``expected_optim.safetensors`` (the full optimizer
state, assembled from both ranks' fragments). The tests load them with today's code.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

import meshzero
from tests.distributed import run_distributed
from tests.engine_runs import zero_config
from tests.models import TrickyModel, make_batches, split_for_rank, tricky_loss

FIXTURE = Path(__file__).parent / "fixtures" / "checkpoint_v1"
VOCAB, SEQ = 11, 3
GLOBAL_BATCH = 4
SAVE_AFTER, STEPS = 2, 4
SCHEDULER = {"type": "WarmupLR", "params": {"warmup_min_lr": 1e-3, "warmup_max_lr": 2e-2,
                                            "warmup_num_steps": 5}}


def _config(stage: int) -> dict:
    return zero_config(stage, global_batch=GLOBAL_BATCH, scheduler=SCHEDULER)


def _engine(stage: int) -> meshzero.Engine:
    torch.manual_seed(0)
    model = TrickyModel(vocab=VOCAB, dim=4, hidden=5, num_blocks=2)
    engine, *_ = meshzero.initialize(model=model, config=_config(stage))
    return engine


def _train(engine, rank: int, world_size: int, steps: range) -> list[float]:
    batches = make_batches("tricky", STEPS, GLOBAL_BATCH, vocab=VOCAB, seq_len=SEQ)
    losses = []
    for i in steps:
        x, y = split_for_rank(batches[i], rank, world_size, 1, 0)
        loss = tricky_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _optimizer_state(engine) -> dict:
    """``{(name, start, end, kind): tensor}`` of this rank's optimizer fragments."""
    return {(frag.slot.name, frag.start, frag.end, kind): value.clone()
            for leaf, frag, _ in engine.zero.optim_state.fragment_index
            for kind, value in engine.optimizer.state.get(leaf, {}).items()}


def _assemble(per_rank: list[dict], shapes: dict[str, torch.Size]) -> dict[str, torch.Tensor]:
    """``{"name|kind": tensor}``: element states put together by range; a scalar state as
    the one value every fragment holds."""
    full: dict[str, torch.Tensor] = {}
    for states in per_rank:
        for (name, a, b, kind), value in states.items():
            key = f"{name}|{kind}"
            if value.dim() == 0:
                full[key] = value.reshape(1).float()
                continue
            t = full.setdefault(key, torch.full((shapes[name].numel(),), torch.nan))
            t[a:b] = value
    return full


def _mean_losses(ranks: list[dict]) -> list[float]:
    """The global batch's loss per step: the mean of the ranks' (equal-sized) batches."""
    return [sum(r["losses_after"][i] for r in ranks) / len(ranks)
            for i in range(STEPS - SAVE_AFTER)]


# -- writing the fixture (run once, with the code of the day) ---------------------------------
def _write(rank: int, world_size: int, out: str) -> dict:
    engine = _engine(3)
    _train(engine, rank, world_size, range(SAVE_AFTER))
    engine.save_checkpoint(f"{out}/ckpt", client_state={"note": "fixture", "n": [1, 2.5]})
    engine.save_16bit_model(f"{out}/model16")
    saved = dict(optim=_optimizer_state(engine), lr=engine.get_lr(),
                 scheduler=engine.lr_scheduler.state_dict(),
                 scaler=engine.loss_scaler.state_dict(),
                 steps=[engine.global_steps, engine.micro_steps, engine.skipped_steps],
                 shapes={n: p.shape for n, p in engine.module.named_parameters()})
    saved["losses_after"] = _train(engine, rank, world_size, range(SAVE_AFTER, STEPS))
    return saved


def write_fixture(tmp: Path) -> None:
    shutil.rmtree(FIXTURE, ignore_errors=True)
    FIXTURE.mkdir(parents=True)
    ranks = run_distributed(_write, 2, tmp, str(FIXTURE))
    first = ranks[0]
    save_file(_assemble([r["optim"] for r in ranks], first["shapes"]),
              FIXTURE / "expected_optim.safetensors")
    expected = {k: first[k] for k in ("lr", "scheduler", "scaler", "steps")}
    expected["losses_after"] = _mean_losses(ranks)
    expected["client_state"] = {"note": "fixture", "n": [1, 2.5]}
    (FIXTURE / "expected.json").write_text(json.dumps(expected, indent=1) + "\n")


# -- loading it with today's code -------------------------------------------------------------
def _load(rank: int, world_size: int, stage: int) -> dict:
    engine = _engine(stage)
    path, client = engine.load_checkpoint(str(FIXTURE / "ckpt"))
    out = dict(path=path, client=client, optim=_optimizer_state(engine), lr=engine.get_lr(),
               scheduler=engine.lr_scheduler.state_dict(),
               scaler=engine.loss_scaler.state_dict(), params=engine.full_state_dict(),
               steps=[engine.global_steps, engine.micro_steps, engine.skipped_steps],
               shapes={n: p.shape for n, p in engine.module.named_parameters()})
    out["losses_after"] = _train(engine, rank, world_size, range(SAVE_AFTER, STEPS))
    engine.load_weights(FIXTURE / "model16" / "model.safetensors")
    out["weights"] = engine.full_state_dict()
    return out


def _check_load(tmp_path: Path, world_size: int, stage: int, exact: bool) -> None:
    expected = json.loads((FIXTURE / "expected.json").read_text())
    model16 = load_file(FIXTURE / "model16" / "model.safetensors")
    ranks = run_distributed(_load, world_size, tmp_path, stage)
    got = ranks[0]
    assert got["path"] == str(FIXTURE / "ckpt" / "global_step2")
    assert got["client"] == expected["client_state"]
    assert got["steps"] == expected["steps"]
    assert got["lr"] == expected["lr"]
    # every scaler field the old checkpoint saved is restored; fields added since (DeepSpeed's
    # consecutive_hysteresis, from the config) keep their defaults
    assert {k: got["scaler"][k] for k in expected["scaler"]} == expected["scaler"]
    assert {k: v for k, v in got["scaler"].items() if k not in expected["scaler"]} == {
        "consecutive_hysteresis": False}
    assert got["scheduler"] == expected["scheduler"]
    # the fp32 16-bit file is the full state dict of the saving run at the save
    assert got["params"].keys() == model16.keys()
    for name, value in model16.items():
        assert torch.equal(got["params"][name], value), name
        assert torch.equal(got["weights"][name], value), f"load_weights: {name}"
    want = load_file(FIXTURE / "expected_optim.safetensors")
    optim = _assemble([r["optim"] for r in ranks], got["shapes"])
    assert optim.keys() == want.keys()
    for key, value in want.items():
        assert torch.equal(optim[key], value), key
    # the loaded state is bit-exact (above); the steps after it may round differently when a
    # later version changes the order of a reduction, so the losses agree to a few fp32 ulps at
    # the saved size and stage and to 1e-5 elsewhere (a different reduction tree)
    torch.testing.assert_close(torch.tensor(_mean_losses(ranks)),
                               torch.tensor(expected["losses_after"]),
                               rtol=1e-6 if exact else 1e-5, atol=0)


def test_fixture_loads_at_saved_size_and_stage(tmp_path):
    _check_load(tmp_path, world_size=2, stage=3, exact=True)


def test_fixture_loads_resharded_to_one_rank_stage2(tmp_path):
    _check_load(tmp_path, world_size=1, stage=2, exact=False)


def test_fixture_consolidates_to_the_16bit_file(tmp_path):
    from meshzero.checkpoint import consolidate

    consolidate(FIXTURE / "ckpt", tmp_path / "out")
    got = load_file(tmp_path / "out" / "model.safetensors")
    want = load_file(FIXTURE / "model16" / "model.safetensors")
    assert got.keys() == want.keys()
    for name, value in want.items():
        assert torch.equal(got[name], value), name


if __name__ == "__main__":  # python -m tests.test_checkpoint_fixture TMPDIR: rewrite it
    write_fixture(Path(sys.argv[1]))
