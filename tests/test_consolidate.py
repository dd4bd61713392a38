"""Whole-model safetensors files: consolidate (function and CLI), save_16bit_model,
load_weights into a sharded engine, and the refusal of pickles."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from meshzero.checkpoint import consolidate
from meshzero.checkpoint.model_files import WeightsReader, parse_size
from meshzero.cli import main
from tests.distributed import REPO_ROOT, run_distributed
from tests.models import build_model
from tests.test_checkpoint import (
    SAVE_AFTER,
    fp32_config,
    make_engine,
    train_steps,
    write_pickles,
)

TAG = f"global_step{SAVE_AFTER}"


def _source(rank: int, world_size: int, root: str) -> dict:
    engine = make_engine(fp32_config(2))
    train_steps(engine, rank, world_size, range(SAVE_AFTER))
    engine.save_checkpoint(f"{root}/ckpt")
    engine.save_16bit_model(f"{root}/live")
    return engine.full_state_dict()


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, dict]:
    """A checkpoint saved at world size 2, stage 2, and the full state dict it holds."""
    root = tmp_path_factory.mktemp("w2_stage2")
    return root, run_distributed(_source, 2, root, str(root))[0]


def _merged(out: Path) -> dict[str, torch.Tensor]:
    merged = {}
    for path in sorted(out.glob("*.safetensors")):
        merged.update(load_file(path))
    return merged


def test_consolidate_loads_into_a_fresh_model(saved, tmp_path):
    root, want = saved
    paths = consolidate(root / "ckpt", tmp_path)
    assert paths == [tmp_path / "model.safetensors"]
    state = load_file(paths[0])
    model = build_model("tricky", seed=7)
    model.load_state_dict(state)  # strict: every name, tied head.weight included
    assert state.keys() == want.keys()
    for name, value in want.items():
        assert torch.equal(state[name], value), name
    assert model.head.weight.data_ptr() == model.embed.weight.data_ptr()
    live = load_file(root / "live" / "model.safetensors")  # fp32 training: fp32 weights
    for name, value in want.items():
        assert torch.equal(live[name], value), name


def test_consolidate_bf16_and_sharded_with_index(saved, tmp_path):
    root, want = saved
    paths = consolidate(root / "ckpt", tmp_path, tag=TAG, dtype="bf16", max_shard_size="2KB")
    index_path = tmp_path / "model.safetensors.index.json"
    assert paths[-1] == index_path and len(paths) >= 4  # 4.3 KB of bf16 in 2 KB shards
    index = json.loads(index_path.read_text())
    files = sorted(p.name for p in paths[:-1])
    assert files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert sorted(set(index["weight_map"].values())) == files
    state = _merged(tmp_path)
    assert index["weight_map"].keys() == state.keys() == want.keys()
    assert index["metadata"]["total_size"] == sum(t.numel() * 2 for t in state.values())
    for name, value in want.items():
        assert state[name].dtype == torch.bfloat16
        assert torch.equal(state[name], value.bfloat16()), name
    for path in paths[:-1]:
        assert path.stat().st_size < 2000 + 2048  # at most 2 KB of data + its header


def test_cli_consolidate(saved, tmp_path, capsys):
    root, want = saved
    assert main(["consolidate", str(root / "ckpt"), str(tmp_path / "out"), "--dtype", "fp16",
                 "--max-shard-size", "4KB"]) == 0
    printed = capsys.readouterr().out.split()
    assert printed[-1].endswith("model.safetensors.index.json")
    state = _merged(tmp_path / "out")
    for name, value in want.items():
        assert torch.equal(state[name], value.half()), name
    assert main(["consolidate", str(root / "ckpt"), str(tmp_path / "x"), "--tag", "nope"]) == 1
    assert "manifest.json is missing" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["consolidate", str(root / "ckpt"), str(tmp_path / "x"), "--dtype", "int8"])


def test_cli_runs_as_a_module(saved, tmp_path):
    root, want = saved
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT / "src")}
    proc = subprocess.run([sys.executable, "-m", "meshzero.cli", "consolidate",
                           str(root / "ckpt"), str(tmp_path)], capture_output=True, text=True,
                          env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert load_file(tmp_path / "model.safetensors").keys() == want.keys()


def _load_weights(rank: int, world_size: int, paths: list[str]) -> list[dict]:
    out = []
    for path in paths:
        engine = make_engine(fp32_config(3), seed=5)
        engine.load_weights(path)
        out.append(engine.full_state_dict())
    return out


def test_load_weights_into_a_sharded_engine(saved, tmp_path):
    root, want = saved
    single = consolidate(root / "ckpt", tmp_path / "single")[0]
    consolidate(root / "ckpt", tmp_path / "sharded", max_shard_size="2KB")
    bf16 = consolidate(root / "ckpt", tmp_path / "bf16", dtype="bf16")[0]
    untied = dict(load_file(single))
    del untied["head.weight"]  # Hugging Face stores a tied weight once
    save_file(untied, tmp_path / "untied.safetensors", metadata={"format": "pt"})
    paths = [single, tmp_path / "sharded", tmp_path / "untied.safetensors", bf16]
    results = run_distributed(_load_weights, 2, tmp_path, [str(p) for p in paths])
    for rank_result in results:
        *exact, rounded = rank_result
        for got in exact:
            for name, value in want.items():
                assert torch.equal(got[name], value), name
        for name, value in want.items():
            assert torch.equal(rounded[name], value.bfloat16().float()), name


def test_pickles_are_refused_without_unpickling(tmp_path):
    marker = write_pickles(tmp_path)
    torch_zip = tmp_path / "model.pt"
    torch.save({"w": torch.zeros(2)}, torch_zip)  # only written: never read back
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "pytorch_model.bin").write_bytes((tmp_path / "evil.bin").read_bytes())
    index = tmp_path / "bad.index.json"
    index.write_text(json.dumps({"weight_map": {"w": "pytorch_model.bin"}}))
    for path in ["evil.bin", "evil.safetensors", "model.pt", "hf", "bad.index.json"]:
        with pytest.raises(ValueError, match="refusing to load .*never unpickles") as info:
            WeightsReader(tmp_path / path)
        assert path in str(info.value)
    renamed = tmp_path / "zip.safetensors"
    renamed.write_bytes(torch_zip.read_bytes())
    with pytest.raises(ValueError, match="zip archive"):
        WeightsReader(renamed)
    assert not marker.exists()


def test_parse_size():
    assert parse_size("5GB") == 5 * 10**9
    assert parse_size("500MiB") == 500 * 2**20
    assert parse_size("2k") == 2000 and parse_size("1024") == 1024 and parse_size(7) == 7
    for bad in ("", "5 parsecs", "-1GB", "0"):
        with pytest.raises(ValueError, match="size"):
            parse_size(bad)
