"""Real ds_config key/value sets (tests/real_configs.py) load as they are and train one step
of a tiny Hugging Face model at world size 1, or fail in one read naming every refused key.

``"auto"`` is handled as under Hugging Face's Trainer: the values it takes from its
TrainingArguments (lr, betas, eps, weight decay, clipping, warmup, total steps, fp16/bf16,
the micro batch) are filled by `hf_fill` here, as the Trainer does before it hands the config
over; the rest (the other batch keys, bucket sizes, the persistence threshold) is left for
``meshzero.initialize`` to resolve from the model and the other keys.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch

import meshzero
from tests.real_configs import AUTOTP_ALONE, LOADS, REFUSED

transformers = pytest.importorskip("transformers")

HIDDEN, VOCAB, SEQ = 16, 32, 8
# TrainingArguments as a run would give them (the Trainer's defaults, 2 warmup of 10 steps)
ARGS = {"lr": 5e-5, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0,
        "max_grad_norm": 1.0, "warmup_steps": 2, "max_steps": 10, "micro_batch": 2}
FILL = {  # dotted key -> the TrainingArguments value the Trainer puts in place of "auto"
    "train_micro_batch_size_per_gpu": ARGS["micro_batch"],
    "gradient_clipping": ARGS["max_grad_norm"],
    "optimizer.params.lr": ARGS["lr"],
    "optimizer.params.betas": ARGS["betas"],
    "optimizer.params.eps": ARGS["eps"],
    "optimizer.params.weight_decay": ARGS["weight_decay"],
    "scheduler.params.warmup_min_lr": 0,
    "scheduler.params.warmup_max_lr": ARGS["lr"],
    "scheduler.params.warmup_num_steps": ARGS["warmup_steps"],
    "scheduler.params.total_num_steps": ARGS["max_steps"],
    "fp16.enabled": False,
    "bf16.enabled": False,
    "bfloat16.enabled": False,
}


def hf_fill(raw: dict[str, Any]) -> dict[str, Any]:
    """The config as Hugging Face's Trainer hands it over: its own "auto" keys filled."""
    out = copy.deepcopy(raw)
    for dotted, value in FILL.items():
        *parents, last = dotted.split(".")
        node: Any = out
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict) and node.get(last) == "auto":
            node[last] = value
    if "optimizer" not in out:  # the Trainer builds its own and lets DeepSpeed take it
        out["zero_allow_untested_optimizer"] = True
    return out


def tiny_gpt2() -> torch.nn.Module:
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=HIDDEN, n_head=2, vocab_size=VOCAB,
                                     n_positions=SEQ, resid_pdrop=0.0, embd_pdrop=0.0,
                                     attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(config)


def train_one_step(raw: dict[str, Any]) -> meshzero.Engine:
    model = tiny_gpt2()
    optimizer = None
    if "optimizer" not in raw:
        optimizer = torch.optim.AdamW(model.parameters(), lr=ARGS["lr"])
    engine, _, _, _ = meshzero.initialize(model=model, optimizer=optimizer, config=raw)
    gen = torch.Generator().manual_seed(0)
    try:
        for _ in range(engine.gradient_accumulation_steps()):
            tokens = torch.randint(0, VOCAB, (engine.train_micro_batch_size_per_gpu(), SEQ),
                                   generator=gen)
            loss = engine(input_ids=tokens, labels=tokens).loss
            assert math.isfinite(loss.item())
            engine.backward(loss)
            engine.step()
    finally:
        engine.close()
    return engine


def _with_tmp(raw: dict[str, Any], tmp: str) -> dict[str, Any]:
    out = copy.deepcopy(raw)
    for block in ("csv_monitor", "tensorboard"):
        if isinstance(out.get(block), dict) and out[block].get("output_path") == "{tmp}":
            out[block]["output_path"] = tmp
    return out


@pytest.mark.parametrize("name", list(LOADS))
def test_real_config_loads_and_trains_one_step(name: str, tmp_path) -> None:
    raw = _with_tmp(hf_fill(LOADS[name]), str(tmp_path))
    engine = train_one_step(raw)
    assert engine.global_steps == 1
    zc, given = engine.config.zero_optimization, raw.get("zero_optimization", {})
    if given.get("reduce_bucket_size") == "auto":  # resolved from the model, as HF does
        assert zc.reduce_bucket_size == HIDDEN * HIDDEN
    if given.get("stage3_param_persistence_threshold") == "auto":
        assert zc.stage3_param_persistence_threshold == 10 * HIDDEN
    if given.get("stage3_prefetch_bucket_size") == "auto":
        assert zc.stage3_prefetch_bucket_size == int(0.9 * HIDDEN * HIDDEN)


@pytest.mark.parametrize("name", list(LOADS))
def test_real_config_loads_unfilled_but_for_the_run_length(name: str) -> None:
    """Without the Trainer's fill, meshzero fills every "auto" itself but the scheduler's
    total steps, which only a run knows."""
    try:
        meshzero.load_config(LOADS[name], model=tiny_gpt2())
    except meshzero.ConfigError as exc:
        problems = str(exc).splitlines()[1:]
        assert problems and all("scheduler.params.total_num_steps" in p for p in problems), exc


@pytest.mark.parametrize("name", list(REFUSED))
def test_real_config_refused_naming_every_key_in_one_read(name: str) -> None:
    raw, keys = REFUSED[name]
    with pytest.raises(meshzero.ConfigError) as info:
        meshzero.initialize(model=tiny_gpt2(), config=hf_fill(raw))
    message = str(info.value)
    for key in keys:
        assert key in message, (key, message)
    assert f"({len(keys)} problem" in message.splitlines()[0], message


def test_collection_is_large_enough() -> None:
    assert len(LOADS) + len(REFUSED) + len(AUTOTP_ALONE) + 1 >= 55  # + AUTOTP
    # issue 36: OneBitAdam, progressive layer drop, torch_autocast with bf16 and ZeRO++
    # quantized frozen weights load; random-LTD (data_efficiency) and ZenFlow stay refused
    assert len(LOADS) >= 66 and len(REFUSED) <= 2


@pytest.mark.parametrize("name", list(AUTOTP_ALONE))
def test_autotp_config_loads_without_the_model(name: str) -> None:
    raw = AUTOTP_ALONE[name]
    size = raw["tensor_parallel"]["autotp_size"]
    config = meshzero.load_config(hf_fill(raw))
    assert (config.tensor_parallel.size, config.tensor_parallel.plan) == (size, None)
    assert config.dp_size(2 * size) == 2


def test_autotp_config_loads_with_the_inferred_plan() -> None:
    from tests.real_configs import AUTOTP

    name, raw = AUTOTP
    from meshzero.estimate.mesh_search import inferred_tp_plan

    model = tiny_gpt2()
    config = meshzero.load_config(hf_fill(raw), model=model,
                                  tp_plan=lambda: inferred_tp_plan(model))
    assert (config.tensor_parallel.size, config.tensor_parallel.plan) == (2, "hf_gpt2")
    with pytest.raises(ValueError, match="tensor_parallel"):  # a world of one has no tp 2
        meshzero.initialize(model=tiny_gpt2(), config=hf_fill(raw))
    alone = meshzero.load_config(hf_fill(raw))  # without the model: the plan waits for it
    assert (alone.tensor_parallel.size, alone.tensor_parallel.plan) == (2, None)
    assert meshzero.load_config(alone, model=model, tp_plan=lambda: inferred_tp_plan(
        model)).tensor_parallel.plan == "hf_gpt2"
