"""``meshzero.hf.save.save_pretrained`` (issue 34 item 1): a sharded engine's model saved as
``from_pretrained`` / ``PeftModel.from_pretrained`` read it, at stages 2 and 3, whatever
``stage3_gather_16bit_weights_on_model_save`` says. Each save is loaded back by one plain
process and its logits compared with the trained model's (the engine's own forward).

DeepSpeed's behaviour this replaces: ``transformers.Trainer.save_model`` under DeepSpeed
(``trainer.py`` ``save_model``: ``_zero3_consolidated_16bit_state_dict`` then
``save_pretrained(state_dict=...)``; with the flag false ``save_checkpoint`` and a warning),
DeepSpeed's ``runtime/engine.py`` ``DeepSpeedEngine.save_16bit_model`` /
``_zero3_consolidated_16bit_state_dict`` (returns nothing useful when the flag is false)."""

from __future__ import annotations

import json
import logging
import weakref

import pytest
import torch

import meshzero
from tests.distributed import run_distributed
from tests.engine_runs import zero_config

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

VOCAB, SEQ = 64, 8
TOL = 1e-6  # fp32


def tiny_llama(seed: int = 0, tie: bool = False):
    transformers.logging.set_verbosity_error()
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=32,
        bos_token_id=0, eos_token_id=0, tie_word_embeddings=tie))


def lora(model):
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                             target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    return peft.get_peft_model(model, config)


def _tokens(n: int = 4) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(3))


def _train_and_save(rank: int, world_size: int, stage: int, use_lora: bool, tie: bool,
                    flag: bool | None, out: str) -> torch.Tensor:
    from meshzero.hf.save import save_pretrained

    model = tiny_llama(tie=tie)
    model = lora(model) if use_lora else model
    extra = {} if flag is None else {"zero_optimization": {
        "stage": stage, "stage3_param_persistence_threshold": 0,
        "stage3_gather_16bit_weights_on_model_save": flag}}
    engine, *_ = meshzero.initialize(model=model, config=zero_config(
        stage, global_batch=4, lr=5e-2, **extra))
    tokens = _tokens()
    rows = tokens[rank * 4 // world_size:(rank + 1) * 4 // world_size]
    for _ in range(2):
        loss = engine(input_ids=rows, labels=rows).loss
        engine.backward(loss)
        engine.step()
    # the full fp32 groups alive at once while saving (each gathered from its shards)
    live: list[weakref.ref] = []
    peak = [0]
    inner = engine.zero.full_fp32

    def tracked(group):
        flat = inner(group)
        live[:] = [r for r in live if r() is not None] + [weakref.ref(flat)]
        peak[0] = max(peak[0], sum(r().numel() * 4 for r in live if r() is not None))
        return flat

    engine.zero.full_fp32 = tracked
    save_pretrained(engine, out, max_shard_size=20_000)  # a few shards for the full model
    del engine.zero.full_fp32
    sizes = sorted(g.layout.padded_numel * 4 for g in engine.zero.groups)
    held = (peak[0], sum(sizes[-2:]), sum(sizes))
    engine.eval()
    with torch.no_grad():
        return engine(input_ids=tokens).logits, held


def _load_logits(out, use_lora: bool, tie: bool) -> torch.Tensor:
    if use_lora:
        base = tiny_llama(tie=tie)
        model = peft.PeftModel.from_pretrained(base, out)
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(out)
    with torch.no_grad():
        return model.eval()(input_ids=_tokens()).logits


SLOW = pytest.mark.slow  # the Trainer's saves at stages 2 and 3 run in tests/test_hf_trl.py


@pytest.mark.parametrize("world_size,stage,use_lora,tie,flag", [
    # (world size, stage, lora, tied embeddings, stage3_gather_16bit_weights_on_model_save)
    (2, 3, False, True, False),
    (2, 3, True, False, False),
    pytest.param(2, 2, False, False, None, marks=SLOW),
    pytest.param(2, 2, True, False, None, marks=SLOW),
    pytest.param(4, 3, True, True, None, marks=SLOW),
    pytest.param(4, 3, False, False, True, marks=SLOW)])
def test_save_loads_back_to_the_trained_model(tmp_path, world_size, stage, use_lora, tie, flag):
    out = tmp_path / "saved"
    logits = run_distributed(_train_and_save, world_size, tmp_path, stage, use_lora, tie, flag,
                             str(out), timeout=240)
    files = sorted(p.name for p in out.iterdir())
    if use_lora:
        assert {"adapter_config.json", "adapter_model.safetensors"} <= set(files), files
        assert not any(f.startswith("model") for f in files), files
        from safetensors import safe_open

        with safe_open(str(out / "adapter_model.safetensors"), "pt") as f:
            keys = sorted(f.keys())
        assert keys and all("lora_" in k and ".default." not in k for k in keys), keys
    else:
        index = json.loads((out / "model.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) > 1, index
        assert ("lm_head.weight" in index["weight_map"]) is not tie  # dropped as HF drops it
        assert json.loads((out / "config.json").read_text())["architectures"] == [
            "LlamaForCausalLM"]
    if not use_lora:  # one group gathered at a time (the last one's tensor still queued)
        for _, (peak, two_largest, whole) in logits:
            assert 0 < peak <= two_largest < whole, (peak, two_largest, whole)
    logits = [got for got, _ in logits]
    for got in logits:  # every rank's forward of the trained model is the same
        assert (got - logits[0]).abs().max().item() == 0.0
    loaded = _load_logits(out, use_lora, tie)
    assert (loaded - logits[0]).abs().max().item() < TOL
    untrained = _load_logits_untrained(use_lora, tie)
    assert (untrained - logits[0]).abs().max().item() > 1e-3  # training moved the logits


def _load_logits_untrained(use_lora: bool, tie: bool) -> torch.Tensor:
    model = tiny_llama(tie=tie)
    model = lora(model) if use_lora else model
    with torch.no_grad():
        return model.eval()(input_ids=_tokens()).logits


def test_adapter_names_are_peft_own() -> None:
    """The tensors picked are exactly those PeftModel.save_pretrained would save."""
    from meshzero.hf.save import adapter_names

    model = lora(tiny_llama())
    names = adapter_names(model)
    want = peft.utils.get_peft_model_state_dict(model)
    assert len(names) == len(want) == 8
    assert all("lora_" in n and ".default." in n for n in names)


def test_tied_names_dropped_as_transformers_drops_them() -> None:
    from meshzero.hf.save import tied_names_dropped_on_save

    assert tied_names_dropped_on_save(tiny_llama(tie=True)) == {"lm_head.weight"}
    assert tied_names_dropped_on_save(tiny_llama(tie=False)) == frozenset()
    assert tied_names_dropped_on_save(torch.nn.Linear(2, 2)) == frozenset()


def test_info_line_where_deepspeed_would_write_a_zero_checkpoint(caplog) -> None:
    from meshzero.hf.save import _say_when_deepspeed_would_not

    class Fake:
        zero_stage = 3

        class config:  # noqa: N801 - stands in for the engine's Config
            class zero_optimization:  # noqa: N801
                stage3_gather_16bit_weights_on_model_save = False

    with caplog.at_level(logging.INFO, logger="meshzero.hf.save"):
        _say_when_deepspeed_would_not(Fake())  # type: ignore[arg-type]
    assert len(caplog.records) == 1 and "zero_to_fp32" in caplog.records[0].getMessage()
