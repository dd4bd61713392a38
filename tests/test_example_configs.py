"""Every config in examples/configs/ loads, keeps one global batch at 1, 2 and 4 ranks, and
trains 3 steps on 2 ranks with the batch it gives (their warmups start at lr 0, and as in
DeepSpeed steps 0 and 1 run at the warmup's start, so step 2 is the first to move weights)."""

from __future__ import annotations

import json
import math

import pytest
import torch

import meshzero
from tests.distributed import REPO_ROOT
from tests.engine_runs import train
from tests.models import build_model

CONFIG_DIR = REPO_ROOT / "examples" / "configs"
CONFIGS = sorted(CONFIG_DIR.glob("*.json"))


def test_the_three_stages_are_shipped() -> None:
    assert {p.name for p in CONFIGS} >= {"zero1.json", "zero2.json", "zero3.json"}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_one_global_batch_at_1_2_4_ranks(path) -> None:
    config = meshzero.load_config(path)
    batches = {world: config.resolve_batch(world) for world in (1, 2, 4)}
    assert len({tbs for tbs, _, _ in batches.values()}) == 1, batches
    for world, (tbs, micro, accum) in batches.items():
        assert tbs == micro * accum * world


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_config_trains_three_steps_on_two_ranks(path, run_ranks, tmp_path) -> None:
    raw = json.loads(path.read_text())
    for key in ("offload_optimizer", "offload_param"):  # a machine's NVMe path: use tmp
        if raw["zero_optimization"].get(key, {}).get("nvme_path"):
            raw["zero_optimization"][key]["nvme_path"] = str(tmp_path)
    results = run_ranks(train, 2, "mlp", raw, 3)
    stage = raw["zero_optimization"]["stage"]
    initial = build_model("mlp", seed=0).state_dict()
    for result in results:
        assert len(result.losses) == 3 and all(math.isfinite(x) for x in result.losses)
        changed = [k for k, v in result.params.items() if not torch.equal(v, initial[k].float())]
        assert changed, f"{path.name}: three steps changed no parameter"
    # every rank ends with the same full weights
    for name, value in results[0].params.items():
        torch.testing.assert_close(results[1].params[name], value, rtol=0, atol=0)
    # the stage is the one the file names, and it shards what it says
    grads = sum(results[0].memory["grads"].values())
    full = sum(v.numel() for v in initial.values()) * 4
    assert path.stem.split("_")[0] == f"zero{stage}"
    device = raw["zero_optimization"].get("offload_optimizer", {}).get("device", "none")
    if device != "none":  # the tier the file names holds the optimizer states
        states = results[0].memory["optimizer_states"]
        assert states[{"cpu": "host", "nvme": "nvme"}[device]] > 0 == states["device"]
    if stage >= 2:
        assert grads < full
