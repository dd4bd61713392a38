"""``generate`` on a stage-3 engine's model and TRL's frozen models as optimizer-less engines
(issue 34 items 3 and 4), at W = 2 (and 4) on gloo, against the plain model in one process.

Mirrors TRL's ``unwrap_model_for_generation`` (trl/models/utils.py: ``GatheredParameters``
over ``model.parameters()`` for the whole generation when ``ds3_gather_for_generation``) and
DeepSpeed's ``runtime/hybrid_engine.py`` ``DeepSpeedHybridEngine.generate`` (gathers the
parameters once, then generates); TRL's ``prepare_deepspeed`` for the reference model
(ZeRO-3, no optimizer), whose engine is DeepSpeed's ``initialize`` without an optimizer."""

from __future__ import annotations

import logging

import pytest
import torch

import meshzero
from meshzero.estimate import Estimator, load_model, settings_from_config
from meshzero.hf.frozen import frozen_config
from tests.distributed import run_distributed
from tests.engine_runs import zero_config
from tests.test_hf_save import tiny_llama

transformers = pytest.importorskip("transformers")

NEW_TOKENS = 6


def _prompts(rank: int) -> torch.Tensor:
    return torch.randint(4, 60, (2, 5), generator=torch.Generator().manual_seed(10 + rank))


def _generate(rank: int, world_size: int, gather: bool) -> tuple:
    from meshzero.hf.generation import wrap_generate

    engine, *_ = meshzero.initialize(model=tiny_llama(), config=zero_config(3, global_batch=2
                                                                             * world_size))
    mode = wrap_generate(engine, gather)
    engine.comm_stats.reset()
    out = engine.module.generate(_prompts(rank), max_new_tokens=NEW_TOKENS, do_sample=False,
                                 pad_token_id=0, eos_token_id=None)
    gathers = engine.comm_stats.by_op().get("all_gather", {}).get("count", 0)
    units = len(engine.zero.sharder.units)
    released = not any(engine.zero.sharder.gathered)
    return mode, out, gathers, units, released


@pytest.mark.parametrize("world_size,gather", [(2, True), (2, False),
                                               pytest.param(4, True, marks=pytest.mark.slow)])
def test_generate_at_stage_3_equals_the_plain_model(tmp_path, world_size, gather) -> None:
    results = run_distributed(_generate, world_size, tmp_path, gather, timeout=240)
    plain = tiny_llama()
    for rank, (mode, out, gathers, units, released) in enumerate(results):
        want = plain.generate(_prompts(rank), max_new_tokens=NEW_TOKENS, do_sample=False,
                              pad_token_id=0, eos_token_id=None)
        assert torch.equal(out, want), rank
        assert released  # nothing stays gathered after generate
        if gather:  # one all-gather per unit for the whole generation
            assert mode == "once" and gathers <= units, (gathers, units)
        else:  # every unit per token
            assert mode == "per_unit" and gathers >= units * NEW_TOKENS, (gathers, units)


def test_choose_mode_says_why(caplog) -> None:
    from meshzero.hf import generation

    class Engine:
        zero_stage = 3
        device = torch.device("cpu")

        class zero:  # noqa: N801 - stands in for the ZeRO state
            class sharder:  # noqa: N801
                units = [[type("G", (), {"full_nbytes": 2**40})()]]

    mode, why = generation.choose_mode(Engine())  # type: ignore[arg-type]
    assert mode == "per_unit" and "does not fit" in why
    assert generation.choose_mode(Engine(), False)[0] == "per_unit"  # type: ignore[arg-type]
    Engine.zero.sharder.units = [[type("G", (), {"full_nbytes": 1024})()]]
    assert generation.choose_mode(Engine())[0] == "once"  # type: ignore[arg-type]
    # wrap_generate says which it chose, and why, in one INFO line
    caplog.set_level(logging.INFO, logger="meshzero.hf.generation")
    for gather, words in ((None, "once for each generate call (the full model"),
                          (False, "unit by unit per token")):
        caplog.clear()
        engine = Engine()
        engine.module = type("M", (), {"generate": lambda self, *a, **k: None})()
        generation.wrap_generate(engine, gather)  # type: ignore[arg-type]
        assert f"generate at ZeRO stage 3: parameters gathered {words}" in caplog.text, \
            caplog.text


def _frozen(rank: int, world_size: int) -> tuple:
    from meshzero.hf.frozen import FrozenModel, shard_frozen_models

    class Trainer:  # what shard_frozen_models reads of a TRL trainer
        ref_model = tiny_llama(seed=1)
        reward_funcs = [len, tiny_llama(seed=2)]

    trainer = Trainer()
    raw = zero_config(2, global_batch=2 * world_size)  # the run's config: stage 2, AdamW
    engines = shard_frozen_models(trainer, raw)
    assert isinstance(trainer.ref_model, FrozenModel) and trainer.reward_funcs[0] is len
    tokens = _prompts(rank)
    ref = trainer.ref_model(input_ids=tokens).logits
    reward = trainer.reward_funcs[1](input_ids=tokens).logits
    report = engines["ref_model"].memory_report()
    return (sorted(engines), ref, reward, trainer.ref_model.config.hidden_size,
            engines["ref_model"].optimizer, engines["ref_model"].zero_stage, report)


@pytest.mark.parametrize("world_size", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_frozen_models_become_stage_3_engines_without_optimizer(tmp_path, world_size,
                                                                 caplog) -> None:
    caplog.set_level(logging.INFO)
    results = run_distributed(_frozen, world_size, tmp_path, timeout=240)
    numel = sum(p.numel() for p in tiny_llama().parameters())
    for rank, (names, ref, reward, hidden, optimizer, stage, report) in enumerate(results):
        assert names == ["ref_model", "reward_funcs[1]"] and hidden == 32
        assert optimizer is None and stage == 3
        with torch.no_grad():
            want = tiny_llama(seed=1)(input_ids=_prompts(rank)).logits
            want_reward = tiny_llama(seed=2)(input_ids=_prompts(rank)).logits
        assert (ref - want).abs().max().item() < 1e-6
        assert (reward - want_reward).abs().max().item() < 1e-6
        held = sum(report["params"].values())
        assert 0 < held <= (numel // world_size + 4096) * 4  # a shard, not a replica
        assert sum(report["optimizer_states"].values()) == 0
        # the estimator sizes the frozen engine as meshzero.estimate --trainable none does
        estimator = Estimator(load_model(lambda: tiny_llama(seed=1)))
        settings = settings_from_config(frozen_config(zero_config(2, global_batch=2 * world_size)),
                                        world_size, trainable="none")
        want = estimator.states(settings, world_size).report(rank)
        assert want == {k: report[k] for k in want}, (rank, want, report)


class _Rows(torch.utils.data.Dataset):
    """Prompts of 5 tokens as a causal LM's eval rows (labels: the prompt)."""

    def __init__(self, n: int):
        self.ids = torch.randint(4, 60, (n, 5), generator=torch.Generator().manual_seed(3))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _predict_with_generate(rank: int, world_size: int, out_dir: str) -> tuple:
    from meshzero.hf import on_meshzero

    cls = on_meshzero(transformers.Seq2SeqTrainer)
    args = transformers.Seq2SeqTrainingArguments(
        output_dir=out_dir, per_device_train_batch_size=2, per_device_eval_batch_size=2,
        max_steps=1, predict_with_generate=True, generation_max_length=5 + NEW_TOKENS,
        report_to=[], use_cpu=True, save_strategy="no", learning_rate=1e-2)
    config = zero_config(3, global_batch=2 * world_size)
    del config["optimizer"]  # the Trainer's AdamW from its arguments
    trainer = cls(model=tiny_llama(), args=args, train_dataset=_Rows(4 * world_size),
                  meshzero_config=config)
    trainer.train()  # the engine exists, its weights moved off the initial ones
    model = trainer.model
    model.generation_config.update(pad_token_id=0, eos_token_id=None, do_sample=False)
    model.config.pad_token_id = 0  # Seq2SeqTrainer pads the predictions with it
    predictions = trainer.predict(_Rows(2 * world_size)).predictions
    return predictions, trainer.model_wrapped.full_state_dict()


@pytest.mark.parametrize("world_size", [2])
def test_predict_with_generate_at_stage_3(tmp_path, world_size) -> None:
    """``Seq2SeqTrainer.predict`` with ``predict_with_generate`` (transformers'
    ``Seq2SeqTrainer.prediction_step`` calls ``self.model.generate``) on a trained stage-3
    engine: the tokens the plain model with the trained weights generates."""
    results = run_distributed(_predict_with_generate, world_size, tmp_path, str(tmp_path),
                              timeout=240)
    predictions, weights = results[0]
    plain = tiny_llama()
    plain.load_state_dict(weights)
    want = plain.generate(_Rows(2 * world_size).ids, max_new_tokens=NEW_TOKENS,
                          do_sample=False, pad_token_id=0, eos_token_id=None)
    got = torch.as_tensor(predictions)
    assert torch.equal(got[:, :want.shape[1]], want), (got, want)
