"""The checkpoint keywords real DeepSpeed code passes, and ``client_state`` holding tensors,
numpy arrays and argparse Namespaces (issue 33, items 4 and 7), at world sizes 1, 2, 4 and
ZeRO stages 1 (fp32) and 3 (bf16), on the TrickyModel (tied, frozen, unused, buffer).

What each keyword must do is read from DeepSpeed 0.19.6's source
(deepspeed/runtime/engine.py), cited in each test; the truth for values is the engine's own
``full_state_dict()`` at the save (itself held to plain torch by test_equivalence.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import os
from pathlib import Path, PurePosixPath

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import meshzero
from tests.distributed import run_distributed
from tests.engine_runs import zero_config
from tests.models import build_model
from tests.test_checkpoint import GLOBAL_BATCH, fragment_states, train_steps

STAGES = {1: {}, 3: {"bf16": {"enabled": True}}}
TRAINED = 2  # steps before the saves
FROZEN = ("frozen.weight", "frozen.bias")


@dataclasses.dataclass
class RunInfo:
    """A dataclass in client_state (its module is imported when the load runs)."""

    name: str
    sizes: tuple
    where: Path | None = None


class Phase(enum.Enum):
    WARMUP = "warmup"
    MAIN = 2


def client_state(rank: int) -> dict:
    """What real training scripts put in client_state (Megatron-DeepSpeed's args and RNG
    states, DeepSpeed-Chat's counters), plus every container and scalar type."""
    torch.manual_seed(100 + rank)
    return {
        "args": argparse.Namespace(lr=3e-4, dtype=torch.bfloat16, seq=(128, 256), out=None,
                                   device=torch.device("cpu"), path=Path("/data/run"),
                                   nested=argparse.Namespace(flag=True)),
        "iteration": 5, "loss": float("nan"), "big": 2 ** 70, "name": "run",
        "rng": torch.get_rng_state(), "np_state": np.random.RandomState(rank).get_state(),
        "tokens_seen": torch.tensor(123), "half": torch.randn(3, 2).to(torch.bfloat16),
        "param": torch.nn.Parameter(torch.ones(2)),
        "arrays": [np.arange(6, dtype=np.float16).reshape(2, 3), np.array([1, 2], np.uint64),
                   np.zeros((0, 4), np.int8), np.array(True)],
        "scalars": (np.float32(1.5), np.int64(-3), np.bool_(True)),
        "sets": {1, 2}, "frozenset": frozenset({"a"}), "int_keys": {0: "a", (1, 2): [3]},
        "reserved": {"__meshzero__": "user's own key"}, "bytes": b"\x00\xff",
        "info": RunInfo("r", (1, 2), PurePosixPath("a/b")), "phase": Phase.MAIN,
        "size": torch.Size([2, 3]), "complex": 1 + 2j, "range": range(1, 9, 2),
    }


def assert_same(a, b, where: str = "client_state") -> None:
    """Deep equality that also holds types, tensor dtypes and numpy dtypes/shapes; the
    error names the key path."""
    assert type(a) is type(b), f"{where}: {type(a)} != {type(b)}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), where
    elif isinstance(a, np.ndarray | np.generic):
        assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b), where
    elif isinstance(a, argparse.Namespace):
        assert_same(vars(a), vars(b), where)
    elif isinstance(a, dict):
        assert list(a) == list(b), f"{where}: keys {list(a)} != {list(b)}"
        for k in a:
            assert_same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{i}]")
    elif isinstance(a, float) and a != a:
        assert b != b, where
    elif dataclasses.is_dataclass(a):
        assert_same(dataclasses.asdict(a), dataclasses.asdict(b), where)
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def engine_for(stage: int, seed: int, model=None) -> meshzero.Engine:
    config = zero_config(stage, global_batch=GLOBAL_BATCH, **STAGES[stage])
    engine, *_ = meshzero.initialize(model=model or build_model("tricky", seed), config=config)
    return engine


def renamed_model(seed: int) -> torch.nn.Module:
    """The TrickyModel without ``unused`` (unexpected in the checkpoint) and with ``extra``
    (missing from it)."""
    model = build_model("tricky", seed)
    del model.unused
    model.extra = torch.nn.Linear(3, 2)
    return model


# -- the rank function: saves, then loads with each keyword ------------------------------------
def _saves(rank: int, world_size: int, root: str, stage: int) -> dict:
    engine = engine_for(stage, seed=0)
    train_steps(engine, rank, world_size, range(TRAINED))
    ckpt = f"{root}/stage{stage}"
    engine.save_checkpoint(ckpt, tag="full", client_state=client_state(rank))
    engine.save_checkpoint(ckpt, tag="nofrozen", save_latest=False,
                           exclude_frozen_parameters=True)
    full16 = engine.consolidated_16bit_state_dict()
    trainable16 = engine.consolidated_16bit_state_dict(exclude_frozen_parameters=True)
    engine.save_16bit_model(f"{ckpt}-16bit", exclude_frozen_parameters=True)
    tied = bool(full16) and full16["head.weight"] is full16["embed.weight"]
    return dict(full=engine.full_state_dict(), full16=full16, trainable16=trainable16,
                tied=tied, latest=Path(ckpt, "latest").read_text(),
                lr=engine.get_lr(), steps=engine.global_steps)


def _loads(rank: int, world_size: int, root: str, stage: int) -> dict:
    ckpt = f"{root}/stage{stage}"
    out = {}
    engine = engine_for(stage, seed=1)
    out["path"], loaded = engine.load_checkpoint(ckpt)  # latest: "full"
    try:  # compared here: tensors come back from a rank as plain tensors, not Parameters
        assert_same(loaded, client_state(0), f"rank {rank} stage {stage} client_state")
        out["client_state"] = "equal"
    except AssertionError as exc:
        out["client_state"] = str(exc)
    out["loaded"] = engine.full_state_dict()

    engine = engine_for(stage, seed=1)
    out["own_frozen"] = {n: engine.full_state_dict()[n] for n in FROZEN}
    engine.load_checkpoint(ckpt, tag="nofrozen")
    out["nofrozen"] = engine.full_state_dict()

    engine = engine_for(stage, seed=2)
    train_steps(engine, rank, world_size, range(1))  # its own counters and optimizer state
    before = dict(states=fragment_states(engine), lr=engine.get_lr(), steps=engine.global_steps)
    engine.load_checkpoint(ckpt, tag="full", load_module_only=True)
    out["module_only"] = dict(params=engine.full_state_dict(), states=fragment_states(engine),
                              lr=engine.get_lr(), steps=engine.global_steps, before=before)

    engine = engine_for(stage, seed=3, model=renamed_model(3))
    own = engine.full_state_dict()
    with pytest.raises(ValueError) as info:
        engine.load_checkpoint(ckpt, tag="full")
    path, state = engine.load_checkpoint(ckpt, tag="full", load_module_strict=False)
    out["non_strict"] = dict(error=str(info.value), own=own, params=engine.full_state_dict(),
                             path=path)

    with pytest.raises(Exception) as bad:  # only the last rank's client_state is bad
        engine.save_checkpoint(f"{root}/bad{stage}", client_state=(
            {"opt": {"fn": print}} if rank == world_size - 1 else {}))
    out["bad"] = (type(bad.value).__name__, str(bad.value))
    return out


def _run(rank: int, world_size: int, root: str) -> dict:
    return {stage: dict(saved=_saves(rank, world_size, root, stage),
                        loaded=_loads(rank, world_size, root, stage)) for stage in STAGES}


@pytest.fixture(scope="module", params=[1, 2, 4], ids=lambda w: f"W{w}")
def runs(request, tmp_path_factory) -> tuple[int, Path, list[dict]]:
    world_size = request.param
    root = tmp_path_factory.mktemp(f"keywords_w{world_size}")
    return world_size, root, run_distributed(_run, world_size, root, str(root))


def _assert_equal_dicts(got: dict, want: dict, where: str) -> None:
    assert got.keys() == want.keys(), where
    for name, value in want.items():
        assert got[name].dtype == value.dtype and torch.equal(got[name], value), \
            f"{where}: {name}"


# -- client_state ----------------------------------------------------------------------------
def test_client_state_round_trip(runs):
    """client_state with tensors, numpy arrays, a Namespace, tuples, sets and plain values
    comes back equal, types and dtypes included, on every rank. DeepSpeed
    (engine.py ``_save_checkpoint``: ``state.update(client_state)`` into a ``torch.save``
    pickle; ``_load_checkpoint``: ``client_state`` = the checkpoint's keys that are not
    DeepSpeed's) returns rank 0's dict, as saved; meshzero stores it without pickle."""
    world_size, root, results = runs
    for rank in range(world_size):  # world rank 0's is saved; every rank gets it back
        for stage in STAGES:
            got = results[rank][stage]["loaded"]
            assert got["path"] == str(root / f"stage{stage}" / "full")
            assert got["client_state"] == "equal"
    files = os.listdir(root / "stage1" / "full")
    assert "client_state.safetensors" in files and not any(f.endswith((".pt", ".bin"))
                                                            for f in files)


def test_unsavable_client_state_fails_on_every_rank_before_writing(runs):
    """An object that cannot be saved without pickle raises, naming its key path, before
    anything is written, on every rank even when only one rank holds it (DeepSpeed's
    ``torch.save`` would pickle it; meshzero refuses)."""
    world_size, root, results = runs
    for rank in range(world_size):
        for stage in STAGES:
            kind, message = results[rank][stage]["loaded"]["bad"]
            if rank == world_size - 1:
                assert kind == "ValueError"
                assert message.startswith("client_state['opt']['fn']: a function (print)")
            else:
                assert kind == "RuntimeError" and "client_state failed on 1 other" in message
            assert not (root / f"bad{stage}").exists()


# -- save keywords ---------------------------------------------------------------------------
def test_save_latest_false_leaves_latest(runs):
    """``save_checkpoint(save_latest=False)`` does not write ``latest`` (engine.py
    ``save_checkpoint``: ``if save_latest and self.global_rank == 0`` writes it)."""
    world_size, root, results = runs
    for stage in STAGES:
        assert results[0][stage]["saved"]["latest"] == "full"
        assert (root / f"stage{stage}" / "nofrozen").is_dir()


def test_exclude_frozen_parameters_save_and_load(runs):
    """``exclude_frozen_parameters=True`` leaves frozen parameters out of the saved model
    states (engine.py ``module_state_dict`` deletes ``not p.requires_grad`` names,
    ``_save_checkpoint`` sets ``save_frozen_param`` false) and a load keeps the model's own
    frozen values (``load_module_state_dict`` loads what the checkpoint holds)."""
    world_size, root, results = runs
    for rank in range(world_size):
        for stage in STAGES:
            saved, loaded = results[rank][stage]["saved"], results[rank][stage]["loaded"]
            where = f"rank {rank} stage {stage}"
            for name, value in saved["full"].items():
                want = loaded["own_frozen"][name] if name in FROZEN else value
                assert torch.equal(loaded["nofrozen"][name], want), f"{where}: {name}"
            assert not torch.equal(loaded["own_frozen"]["frozen.weight"],
                                   saved["full"]["frozen.weight"])
            _assert_equal_dicts(loaded["loaded"], saved["full"], where)  # the "full" tag
    written = load_file(root / "stage3-16bit" / "model.safetensors")
    assert not set(FROZEN) & written.keys() and "embed.weight" in written


def test_consolidated_16bit_state_dict(runs):
    """``consolidated_16bit_state_dict`` is rank 0's full model in the compute dtype on the
    CPU, tied names sharing one tensor, and ``{}`` on the others (engine.py
    ``_zero3_consolidated_16bit_state_dict``: ``state_dict = OrderedDict() if
    dist.get_rank() == 0``, shared params by ``ds_id``); stage 1 too."""
    world_size, root, results = runs
    for stage, extra in STAGES.items():
        dtype = torch.bfloat16 if extra else torch.float32
        saved = results[0][stage]["saved"]
        want = {n: v.to(dtype) for n, v in saved["full"].items()}
        _assert_equal_dicts(saved["full16"], want, f"stage {stage}")
        assert list(saved["full16"]) == list(build_model("tricky").state_dict())
        assert saved["tied"]
        _assert_equal_dicts(saved["trainable16"],
                            {n: v for n, v in want.items() if n not in FROZEN}, "trainable")
        for rank in range(1, world_size):
            assert results[rank][stage]["saved"]["full16"] == {}


# -- load keywords ---------------------------------------------------------------------------
def test_load_module_only(runs):
    """``load_module_only=True`` loads the weights and nothing else: no optimizer state, lr
    scheduler or step counters (engine.py ``_load_checkpoint``: ``if load_module_only:
    deepspeed_states = ['module']`` and the optimizer, scheduler and ``global_steps`` loads
    are skipped; ``load_checkpoint`` skips ``_load_zero_checkpoint``)."""
    world_size, root, results = runs
    for rank in range(world_size):
        for stage in STAGES:
            saved = results[rank][stage]["saved"]
            got = results[rank][stage]["loaded"]["module_only"]
            where = f"rank {rank} stage {stage}"
            _assert_equal_dicts(got["params"], saved["full"], where)
            assert got["steps"] == got["before"]["steps"] == 1 != saved["steps"], where
            assert got["lr"] == got["before"]["lr"], where
            assert got["states"].keys() == got["before"]["states"].keys(), where
            for key, state in got["before"]["states"].items():
                for kind, value in state.items():
                    assert torch.equal(got["states"][key][kind], value), f"{where}: {key}"


def test_load_module_strict_false(runs):
    """``load_module_strict=False`` is torch's ``load_state_dict(strict=False)`` (engine.py
    ``load_module_state_dict(strict=...)``): the names the model lacks are ignored, the ones
    the checkpoint lacks keep their values; strict (the default) refuses, naming both."""
    world_size, root, results = runs
    for rank in range(world_size):
        for stage in STAGES:
            saved = results[rank][stage]["saved"]["full"]
            got = results[rank][stage]["loaded"]["non_strict"]
            where = f"rank {rank} stage {stage}"
            assert "'extra.weight'" in got["error"] and "'unused.weight'" in got["error"]
            assert got["path"].endswith("full")
            for name, value in got["params"].items():
                want = got["own"][name] if name.startswith("extra.") else saved[name]
                assert torch.equal(value, want), f"{where}: {name}"
            assert "unused.weight" not in got["params"]


# -- zero_to_fp32 over meshzero checkpoints --------------------------------------------------
def test_get_fp32_state_dict_from_zero_checkpoint(runs):
    """DeepSpeed's zero_to_fp32 (deepspeed/utils/zero_to_fp32.py
    ``get_fp32_state_dict_from_zero_checkpoint``: the tag ``latest`` names, buffers and fp32
    weights, tied names sharing one tensor (``to_torch_tensor``), ``exclude_frozen_parameters``
    dropping frozen ones, ``lazy_mode`` values read by ``.contiguous()``) gives the engine's
    own full_state_dict at the save, for tags saved at W = 1, 2, 4 and stages 1 and 3."""
    from meshzero.deepspeed.utils import zero_to_fp32

    world_size, root, results = runs
    for stage in STAGES:
        want = results[0][stage]["saved"]["full"]
        ckpt = root / f"stage{stage}"
        got = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(ckpt)
        _assert_equal_dicts(got, want, f"stage {stage}")
        assert got["head.weight"] is got["embed.weight"]
        trainable = {n: v for n, v in want.items() if n not in FROZEN}
        _assert_equal_dicts(zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(
            str(ckpt), tag="nofrozen"), trainable, "nofrozen")
        _assert_equal_dicts(zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(
            ckpt, "full", exclude_frozen_parameters=True), trainable, "exclude_frozen")
        lazy = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(ckpt, lazy_mode=True)
        assert lazy.keys() == want.keys()
        for name, value in want.items():
            assert lazy[name].shape == value.shape and lazy[name].dtype == value.dtype
            assert torch.equal(lazy[name].contiguous(), value), name
    with pytest.raises(FileNotFoundError, match="global_step9"):
        zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(root / "stage1", "global_step9")


def test_convert_and_load_state_dict_from_zero_checkpoint(runs, tmp_path, caplog):
    """``convert_zero_checkpoint_to_fp32_state_dict`` writes the fp32 weights (sharded above
    ``max_shard_size``, one file for None) and, where DeepSpeed would ``torch.save`` a
    pickle (``safe_serialization=False``), safetensors with one warning;
    ``load_state_dict_from_zero_checkpoint`` loads them into a plain model on the CPU with
    ``strict=False`` and returns it (deepspeed/utils/zero_to_fp32.py)."""
    from meshzero.deepspeed.utils import zero_to_fp32

    world_size, root, results = runs
    want = results[0][3]["saved"]["full"]
    ckpt = root / "stage3"
    with caplog.at_level("WARNING"):
        paths = zero_to_fp32.convert_zero_checkpoint_to_fp32_state_dict(ckpt, tmp_path / "one")
    assert paths == [tmp_path / "one" / "model.safetensors"]
    assert "safe_serialization=False writes model.safetensors anyway" in caplog.text
    _assert_equal_dicts(load_file(paths[0]), {n: v.contiguous() for n, v in want.items()},
                        "converted")
    again = zero_to_fp32.convert_zero_checkpoint_to_fp32_state_dict(  # replaces, as DeepSpeed
        ckpt, tmp_path / "one", max_shard_size=None, safe_serialization=True, tag="nofrozen")
    assert not set(FROZEN) & load_file(again[0]).keys()
    shards = zero_to_fp32.convert_zero_checkpoint_to_fp32_state_dict(
        ckpt, tmp_path / "many", max_shard_size="2KB", safe_serialization=True)
    assert len(shards) > 2 and (tmp_path / "many" / "model.safetensors.index.json").exists()
    merged: dict = {}
    for path in shards:
        if path.suffix == ".safetensors":
            merged.update(load_file(path))
    assert merged.keys() == want.keys()
    model = zero_to_fp32.load_state_dict_from_zero_checkpoint(build_model("tricky", 5), ckpt)
    _assert_equal_dicts(dict(model.state_dict()), want, "loaded model")
    assert zero_to_fp32.main([str(ckpt), str(tmp_path / "cli"), "-t", "full"]) == 0
    assert (tmp_path / "cli" / "model.safetensors").exists()
