"""Checkpoints under tensor parallelism, pipeline parallelism and MiCS: training k steps,
saving, and in new processes loading and training m more steps equals training k + m steps
without a break (bit-identical on the same mesh; on a smaller dp, within the tolerance of
tests/test_mesh_parallel.py). Every case is the demo GPT (4 layers, tied head) with AdamW,
WarmupLR and gradient accumulation. To keep the number of process starts low, one rank call
runs every case in turn (a fresh engine each)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import meshzero
from meshzero.checkpoint import consolidate
from meshzero.demo.gpt import GPT
from meshzero.demo.gpt import loss_fn as gpt_loss
from meshzero.demo.layout import GPT_LAYOUT
from tests.distributed import run_distributed
from tests.engine_runs import zero_config
from tests.test_checkpoint import WARMUP
from tests.test_mesh_parallel import ATOL, _full_params, train_steps
from tests.test_pipeline import GPT_CFG

STEPS, SAVE_AFTER = 4, 2  # train 2 steps, save, train 2 more
GLOBAL_BATCH, GRAD_ACCUM = 8, 2
# name -> (ZeRO stage, tp, pp, mics_shard_size), all on 4 ranks
CASES = {
    "tp2_dp2_zero3": (3, 2, 1, 0),
    "tp2_dp2_zero1": (1, 2, 1, 0),
    "pp2_dp2_zero1": (1, 1, 2, 0),
    "tp2_pp2": (1, 2, 2, 0),
    "mics2_zero3": (3, 1, 1, 2),
}


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    shape = (GLOBAL_BATCH, GPT_CFG.block_size)
    return [(torch.randint(0, GPT_CFG.vocab_size, shape, generator=gen),
             torch.randint(0, GPT_CFG.vocab_size, shape, generator=gen)) for _ in range(STEPS)]


def _engine(world_size: int, stage: int, tp: int, pp: int, mics: int, seed: int = 0):
    cfg = zero_config(stage, global_batch=GLOBAL_BATCH, grad_accum=GRAD_ACCUM, scheduler=WARMUP)
    if tp > 1:
        cfg["tensor_parallel"] = {"size": tp, "plan": "gpt"}
    if pp > 1:
        cfg["pipeline_parallel"] = {"size": pp, "schedule": "1f1b"}
    if mics:
        cfg["zero_optimization"]["mics_shard_size"] = mics
        cfg["topology"] = {"ranks_per_node": mics}
    micro = GLOBAL_BATCH // (world_size // (tp * pp) * GRAD_ACCUM)
    torch.manual_seed(seed)  # seed 1: other weights than the saved run, so the load must count
    engine, *_ = meshzero.initialize(model=GPT(GPT_CFG), config=cfg, loss_fn=gpt_loss,
                                     example_inputs=_batches()[0][0][:micro],
                                     pipeline_layout=GPT_LAYOUT)
    return engine


def _train(engine, steps: range) -> list[float]:
    """This rank's loss of each step (the mean over its micro-batches)."""
    batches = _batches()
    return train_steps(engine, [batches[i] for i in steps], gpt_loss, GRAD_ACCUM)


def _save_runs(rank: int, world_size: int, root: str) -> dict:
    out = {}
    for name, sizes in CASES.items():
        engine = _engine(world_size, *sizes)
        _train(engine, range(SAVE_AFTER))
        engine.save_checkpoint(f"{root}/{name}",  # a tensor: client_state.safetensors at the top
                               client_state={"case": name, "step": torch.tensor([SAVE_AFTER])})
        losses = _train(engine, range(SAVE_AFTER, STEPS))
        engine.save_checkpoint(f"{root}/{name}-final")  # for consolidate
        engine.save_16bit_model(f"{root}/{name}-16bit")  # fp32 training: fp32 weights
        out[name] = {"losses": losses, "params": _full_params(engine)}
    return out


def _resume_runs(rank: int, world_size: int, root: str) -> dict:
    out = {}
    for name, sizes in CASES.items():
        engine = _engine(world_size, *sizes, seed=1)
        path, client_state = engine.load_checkpoint(f"{root}/{name}")
        client_state["step"] = client_state["step"].tolist()
        loaded = {"path": path, "client_state": client_state, "lr": engine.get_lr(),
                  "steps": (engine.global_steps, engine.micro_steps)}
        losses = _train(engine, range(SAVE_AFTER, STEPS))
        out[name] = dict(loaded, losses=losses, params=_full_params(engine))
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, list[dict], list[dict]]:
    root = tmp_path_factory.mktemp("mesh_ckpt")
    saved = run_distributed(_save_runs, 4, root, str(root))
    resumed = run_distributed(_resume_runs, 4, root, str(root))
    return root, saved, resumed


@pytest.mark.parametrize("name", list(CASES))
def test_resume_is_bit_identical(runs, name):
    root, saved, resumed = runs
    for rank in range(4):
        a, b = saved[rank][name], resumed[rank][name]
        where = f"{name} rank {rank}"
        assert b["path"] == f"{root}/{name}/global_step{SAVE_AFTER}", where
        assert b["client_state"] == {"case": name, "step": [SAVE_AFTER]}, where
        assert b["steps"] == (SAVE_AFTER, SAVE_AFTER * GRAD_ACCUM), where
        assert b["losses"] == a["losses"], where
        assert a["params"].keys() == b["params"].keys()
        for key, value in a["params"].items():
            assert torch.equal(b["params"][key], value), f"{where}: {key}"


def _keys(path: Path) -> set[str]:
    with safe_open(str(path), framework="pt") as f:
        return set(f.keys())


def test_files_on_disk(runs):
    """tp/pp: one normal checkpoint per (pp, tp) piece in pp{p}_tp{t}/, files named by dp
    rank; MiCS alone: the format without a mesh, the second block's files hold only RNG."""
    root, _, _ = runs
    tag = root / "tp2_pp2" / f"global_step{SAVE_AFTER}"
    top = json.loads((tag / "manifest.json").read_text())
    assert top["pieces"] == ["pp0_tp0", "pp0_tp1", "pp1_tp0", "pp1_tp1"]
    assert [f["name"] for f in top["files"]] == ["client_state.safetensors"]
    assert top["mesh"] == {"pp": 2, "dp": 1, "tp": 2} and top["world_size"] == 4
    assert top["client_state"]["case"] == "tp2_pp2"
    assert top["client_state"]["step"]["__meshzero__"] == "tensor"
    for piece in top["pieces"]:
        manifest = json.loads((tag / piece / "manifest.json").read_text())
        assert [f["name"] for f in manifest["files"]] == ["rank00000.safetensors"]
        assert manifest["piece"] == {"pp": int(piece[2]), "tp": int(piece[-1])}
    assert sorted(p.name for p in tag.iterdir()) == ["client_state.safetensors", "manifest.json",
                                                      *top["pieces"]]
    tp_dp = root / "tp2_dp2_zero3" / f"global_step{SAVE_AFTER}"
    assert sorted(p.name for p in (tp_dp / "pp0_tp1").iterdir()) == [
        "manifest.json", "rank00000.safetensors", "rank00001.safetensors"]
    mics = root / "mics2_zero3" / f"global_step{SAVE_AFTER}"
    manifest = json.loads((mics / "manifest.json").read_text())
    assert "pieces" not in manifest and manifest["world_size"] == 4
    assert all(k.startswith("rng|2|") for k in _keys(mics / "rank00002.safetensors"))
    assert any(k.endswith("|master") for k in _keys(mics / "rank00001.safetensors"))


@pytest.mark.parametrize("name", list(CASES))
def test_whole_model_files(runs, tmp_path, name):
    """consolidate puts the (pp, tp) pieces of a checkpoint together, and save_16bit_model
    writes the live model (one file per pipeline stage, with an index): both are the model
    under its own names, equal to the run's gathered parameters; a plain GPT loads them
    strictly."""
    root, saved, _ = runs
    consolidate(root / f"{name}-final", tmp_path)
    consolidated = load_file(tmp_path / "model.safetensors")
    live = {}
    for file in sorted((root / f"{name}-16bit").glob("*.safetensors")):
        live.update(load_file(file))
    pp = CASES[name][2]
    assert (root / f"{name}-16bit" / "model.safetensors.index.json").exists() == (pp > 1)
    want = saved[0][name]["params"]
    for written in (consolidated, live):
        GPT(GPT_CFG).load_state_dict(written)  # strict: every name, nothing more
        for key, value in want.items():
            assert torch.equal(written[key], value), key


def _smaller_dp(rank: int, world_size: int, root: str) -> dict:
    """tp2 x dp2 ZeRO-3 -> tp2 x dp1 ZeRO-1; weights files into other meshes; the errors."""
    engine = _engine(world_size, 1, 2, 1, 0, seed=1)
    engine.load_checkpoint(f"{root}/tp2_dp2_zero3")
    out = {"losses": _train(engine, range(SAVE_AFTER, STEPS)), "params": _full_params(engine)}
    tp_engine = _engine(world_size, 3, 2, 1, 0, seed=1)
    tp_engine.load_weights(f"{root}/tp2_pp2-16bit")  # written by 2 stages: an index
    pp_engine = _engine(world_size, 1, 1, 2, 0, seed=1)
    pp_engine.load_weights(f"{root}/tp2_dp2_zero3-16bit")
    out["weights"] = {"tp2_pp2": _full_params(tp_engine), "tp2_dp2_zero3": _full_params(pp_engine)}
    errors = {}
    calls = {
        "tp1": lambda: _engine(world_size, 1, 1, 1, 0).load_checkpoint(f"{root}/tp2_dp2_zero3"),
        "pp2": lambda: _engine(world_size, 1, 1, 2, 0).load_checkpoint(f"{root}/tp2_pp2"),
    }
    for what, call in calls.items():
        with pytest.raises(ValueError) as info:
            call()
        errors[what] = str(info.value)
    return dict(out, errors=errors)


def test_smaller_dp_other_meshes_and_bad_mesh(runs, tmp_path):
    root, saved, _ = runs
    results = run_distributed(_smaller_dp, 2, tmp_path, str(root))
    name = "tp2_dp2_zero3"
    for r in results:
        for key, want in saved[0][name]["params"].items():
            torch.testing.assert_close(r["params"][key], want, rtol=1e-5, atol=ATOL,
                                       msg=lambda m, k=key: f"{k}: {m}")
        # ranks 0 and 2 were tp rank 0 of the two dp replicas: their mean is the global loss
        want = [(a + b) / 2 for a, b in zip(saved[0][name]["losses"], saved[2][name]["losses"],
                                            strict=True)]
        assert r["losses"] == pytest.approx(want, rel=1e-5)
        errors = r["errors"]
        assert ("saved with tensor_parallel.size 2 and pipeline_parallel.size 1; this engine "
                "has tensor_parallel.size 1 and pipeline_parallel.size 1") in errors["tp1"]
        assert ("saved with tensor_parallel.size 2 and pipeline_parallel.size 2; this engine "
                "has tensor_parallel.size 1 and pipeline_parallel.size 2") in errors["pp2"]
        for source, params in r["weights"].items():  # load_weights into tp2 and pp2
            for key, want in saved[0][source]["params"].items():
                assert torch.equal(params[key], want), f"{source}: {key}"
