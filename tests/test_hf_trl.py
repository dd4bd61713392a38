"""TRL's trainers on meshzero (issue 34 items 1-4): ``meshzero.hf.on_meshzero(<TRL class>)`` on
2 ranks against the same TRL class without meshzero, as a user runs them
(examples/trl_trainers.py in fresh processes, a tiny Llama from a config, fp32).

SFT (LoRA), DPO (full model: TRL's implicit reference copy; and LoRA: the adapter disabled) and
the plain Trainer with LoRA are compared with one plain process on the same global batch:
losses and gradient norms equal at every step, and ``save_model`` writes what
``from_pretrained`` / ``PeftModel.from_pretrained`` read, giving the plain run's logits.

KTO and GRPO (slow) are compared with the same TRL class on the same 2 ranks without meshzero
(DDP), where both are equal to fp32 rounding; their per-rank statistics cannot equal one
process's exactly. KTO's KL estimate pairs each prompt with another completion of the same
micro-batch (its reference point, detached, moves the loss: within 1e-4 of one process here,
2e-5 seen), and GRPO samples completions from each rank's random stream, so a process with
the whole batch samples other completions (no bound: other data).

DeepSpeed behaviour mirrored, read from the sources: TRL's ``prepare_deepspeed``
(trl/models/utils.py: the reference model as an optimizer-less ZeRO-3 engine) and
``unwrap_model_for_generation`` (``GatheredParameters`` over every parameter for generation,
``ds3_gather_for_generation``); transformers' ``Trainer.save_model`` under DeepSpeed
(``_zero3_consolidated_16bit_state_dict`` then ``save_pretrained(state_dict=...)``; a ZeRO
checkpoint when ``stage3_gather_16bit_weights_on_model_save`` is false).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.distributed import REPO_ROOT

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
pytest.importorskip("trl")

EXAMPLE = REPO_ROOT / "examples" / "trl_trainers.py"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
TOL = 1e-5  # fp32
DEFAULT = "sft-lora:3,dpo:3,dpo-lora:2,trainer-lora:3"  # at W = 2
FOUR = "sft-lora:2,dpo:2,dpo-lora:3,trainer-lora:2"  # the other stage, at W = 4


def run_example(out: Path, cases: str, *args: str, ranks: int = 1) -> None:
    launcher = [*TORCHRUN, "--nproc-per-node", str(ranks)] if ranks > 1 else [sys.executable]
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO_ROOT / "src"), str(REPO_ROOT)])}
    proc = subprocess.run([*launcher, str(EXAMPLE), "--out", str(out), "--cases", cases,
                           *args], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n" \
                                 f"{proc.stderr[-6000:]}"


def losses(out: Path, case: str) -> dict:
    return json.loads((out / case / "losses.json").read_text())


def assert_same_steps(got: list[dict], want: list[dict], tol: float = TOL) -> None:
    assert len(got) == len(want) == 3
    for g, w in zip(got, want, strict=True):
        for key in ("loss", "grad_norm"):
            assert g[key] == pytest.approx(w[key], rel=tol, abs=tol), (key, got, want)


def logits(final: Path, root: Path):
    """The saved model's logits on fixed tokens: an adapter over the base model it was
    trained from, or the full model."""
    import torch

    if (final / "adapter_config.json").is_file():
        base = transformers.AutoModelForCausalLM.from_pretrained(root / "base-0")
        model = peft.PeftModel.from_pretrained(base, final)
    else:
        assert not (final / "pytorch_model.bin").exists()
        model = transformers.AutoModelForCausalLM.from_pretrained(final)
    ids = torch.arange(4, 20).view(2, 8)
    with torch.no_grad():
        return model.eval()(input_ids=ids).logits


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("trl")
    run_example(root / "plain", DEFAULT.replace(":3", "").replace(":2", "") + ",kto",
                "--plain", "--per-device", "4")
    # stage3_gather_16bit_weights_on_model_save false (Accelerate's default): saved anyway
    run_example(root / "zero", DEFAULT + ",kto:3", "--per-device", "2", "--flag", "false",
                ranks=2)
    run_example(root / "zero4", FOUR, "--per-device", "1", ranks=4)
    return {"plain": root / "plain", "zero": root / "zero", "zero4": root / "zero4"}


@pytest.mark.parametrize("run", ["zero", "zero4"])
@pytest.mark.parametrize("case", [c.split(":")[0] for c in DEFAULT.split(",")])
def test_trains_like_one_plain_process_and_saves_what_loads(runs, case, run) -> None:
    """W = 2 at one stage and W = 4 at the other (2 or 3) for every case, against one plain
    process on the same global batch of 4."""
    plain, zero = losses(runs["plain"], case), losses(runs[run], case)
    assert_same_steps(zero["train"], plain["train"])
    final = runs[run] / case / "final"
    files = {p.name for p in final.iterdir()}
    if case.endswith("-lora"):  # the adapter, as PeftModel.save_pretrained writes it
        assert {"adapter_config.json", "adapter_model.safetensors"} <= files, files
        assert not any(f.startswith("model") for f in files), files
    else:
        assert {"model.safetensors", "config.json"} <= files, files
    got = logits(final, runs[run])
    want = logits(runs["plain"] / case / "final", runs["plain"])
    assert (got - want).abs().max().item() < TOL
    if case == "dpo-lora":  # the reference is the policy with its adapter off: no model
        assert zero["ref_model"] == "NoneType" and zero["frozen"] == {}


def test_kto_at_stage_3_follows_one_plain_process(runs) -> None:
    """KTO's KL estimate is taken over each device's batch (trl's KTOTrainer), so two ranks
    of 2 differ from one process of 4 in that term only: within 1e-4 (the slow test below
    holds KTO and GRPO to the same ranks without meshzero at 1e-5)."""
    assert_same_steps(losses(runs["zero"], "kto")["train"],
                      losses(runs["plain"], "kto")["train"], tol=1e-4)
    assert losses(runs["zero"], "kto")["ref_model"] == "FrozenModel"


def test_dpo_reference_model_is_sharded(runs) -> None:
    """TRL's implicit reference copy becomes a ZeRO-3 engine without an optimizer (TRL's
    ``prepare_deepspeed`` in trl/models/utils.py: stage 3, no optimizer), holding a shard:
    its parameter bytes on a rank are those of the policy's stage-3 shard, not a replica."""
    zero = losses(runs["zero"], "dpo")
    assert zero["ref_model"] == "FrozenModel"
    model, ref = zero["memory"]["model"], zero["frozen"]["ref_model"]
    assert 0 < sum(ref.values()) <= sum(model.values())  # a shard, as the stage-3 policy
    # not a replica: 1/W of the whole, plus at most a unit's padding per rank
    assert sum(ref.values()) <= zero["full_bytes"] / zero["world"] + 4 * 4096, zero


def test_on_meshzero_composes_once_with_the_subclass_first() -> None:
    import trl

    from meshzero.hf import MeshzeroTrainer, on_meshzero

    cls = on_meshzero(trl.DPOTrainer)
    assert on_meshzero(trl.DPOTrainer) is cls and cls.__name__ == "MeshzeroDPOTrainer"
    mro = cls.__mro__
    assert mro.index(trl.DPOTrainer) < mro.index(MeshzeroTrainer) < mro.index(
        transformers.Trainer)
    assert on_meshzero(MeshzeroTrainer) is MeshzeroTrainer
    assert on_meshzero(transformers.Trainer) is MeshzeroTrainer
    with pytest.raises(TypeError, match="transformers.Trainer subclass"):
        on_meshzero(dict)


@pytest.mark.slow
def test_kto_and_grpo_equal_the_same_ranks_without_meshzero(tmp_path) -> None:
    """GRPO at stage 3 generates with its parameters gathered once (hf/generation.py)."""
    run_example(tmp_path / "ddp", "kto,grpo", "--plain", "--per-device", "2", ranks=2)
    run_example(tmp_path / "zero", "kto:2,grpo:3", "--per-device", "2", ranks=2)
    run_example(tmp_path / "one", "kto", "--plain", "--per-device", "4")
    assert_same_steps(losses(tmp_path / "zero", "kto")["train"],
                      losses(tmp_path / "one", "kto")["train"], tol=1e-4)
    for case in ("kto", "grpo"):
        assert_same_steps(losses(tmp_path / "zero", case)["train"],
                          losses(tmp_path / "ddp", case)["train"])
        got = logits(tmp_path / "zero" / case / "final", tmp_path / "zero")
        want = logits(tmp_path / "ddp" / case / "final", tmp_path / "ddp")
        assert (got - want).abs().max().item() < TOL


