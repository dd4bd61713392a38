"""MeshzeroTrainer's config: "auto" resolved from TrainingArguments as Hugging Face does for
DeepSpeed, disagreements and unsupported arguments refused before any work (in-process, no
engine is built)."""

from __future__ import annotations

import pytest

from meshzero import ConfigError
from meshzero.hf.config import argument_values, read_raw_config, resolve_auto

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")


def _args(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path), per_device_train_batch_size=4,
                gradient_accumulation_steps=2, learning_rate=5e-4, adam_beta1=0.8,
                adam_beta2=0.95, adam_epsilon=1e-7, weight_decay=0.1, max_grad_norm=0.5,
                warmup_steps=3, report_to=[], use_cpu=True)
    return transformers.TrainingArguments(**{**base, **kw})


FULL_AUTO = {
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                               "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupDecayLR", "params": {
        "warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto",
        "total_num_steps": "auto"}},
    "bf16": {"enabled": "auto"},
    "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto",
                          "stage3_prefetch_bucket_size": "auto",
                          "stage3_param_persistence_threshold": "auto"},
}


def test_auto_values_take_the_arguments(tmp_path) -> None:
    values = argument_values(_args(tmp_path), world_size=2, max_steps=40, hidden_size=32)
    got = resolve_auto(FULL_AUTO, values)
    assert (got["train_batch_size"], got["train_micro_batch_size_per_gpu"],
            got["gradient_accumulation_steps"], got["gradient_clipping"]) == (16, 4, 2, 0.5)
    assert got["optimizer"]["params"] == {"lr": 5e-4, "betas": [0.8, 0.95], "eps": 1e-7,
                                          "weight_decay": 0.1}
    assert got["scheduler"]["params"] == {"warmup_min_lr": 0.0, "warmup_max_lr": 5e-4,
                                          "warmup_num_steps": 3, "total_num_steps": 40}
    assert got["bf16"] == {"enabled": False}
    assert got["zero_optimization"] == {"stage": 3, "reduce_bucket_size": 1024,
                                        "stage3_prefetch_bucket_size": 921,
                                        "stage3_param_persistence_threshold": 320}
    assert FULL_AUTO["train_batch_size"] == "auto"  # the caller's dict is left alone


def test_missing_batch_keys_are_filled_and_others_keep_defaults(tmp_path) -> None:
    values = argument_values(_args(tmp_path), world_size=3, max_steps=None, hidden_size=None)
    got = resolve_auto({"zero_optimization": {"stage": 2}}, values)
    assert got == {"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": 4,
                   "gradient_accumulation_steps": 2, "train_batch_size": 24}
    values = argument_values(_args(tmp_path, bf16=True), world_size=1, max_steps=None,
                             hidden_size=None)
    assert resolve_auto({}, values)["bf16"] == {"enabled": True}
    with pytest.raises(ConfigError, match="'bf16.enabled' = False disagrees"):
        resolve_auto({"bf16": {"enabled": False}}, values)


def test_numbers_that_disagree_with_the_arguments_fail_naming_both(tmp_path) -> None:
    values = argument_values(_args(tmp_path), world_size=1, max_steps=10, hidden_size=None)
    raw = {"train_micro_batch_size_per_gpu": 8, "gradient_clipping": 0.5,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    with pytest.raises(ConfigError) as err:
        resolve_auto(raw, values)
    msg = str(err.value)
    assert "'train_micro_batch_size_per_gpu' = 8" in msg and "per_device_train_batch_size" in msg
    assert "'optimizer.params.lr' = 0.001" in msg and "learning_rate gives 0.0005" in msg
    assert "gradient_clipping" not in msg  # 0.5 agrees


def test_read_raw_config_errors(tmp_path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        read_raw_config(tmp_path / "nope.json")
    (tmp_path / "list.json").write_text("[1]")
    with pytest.raises(ConfigError, match="JSON object"):
        read_raw_config(tmp_path / "list.json")
    with pytest.raises(ConfigError, match="dict or a JSON file path"):
        read_raw_config(3)  # type: ignore[arg-type]


def _model():
    config = transformers.GPT2Config(vocab_size=32, n_positions=8, n_embd=16, n_layer=1,
                                     n_head=2)
    return transformers.GPT2LMHeadModel(config)


def test_trainer_refuses_bad_setups_at_construction(tmp_path) -> None:
    from meshzero.hf import MeshzeroTrainer

    with pytest.raises(ConfigError, match="zero_optimisation"):
        MeshzeroTrainer(model=_model(), args=_args(tmp_path),
                        meshzero_config={"zero_optimisation": {"stage": 3}})
    with pytest.raises(ConfigError, match="per_device_train_batch_size gives 4"):
        MeshzeroTrainer(model=_model(), args=_args(tmp_path),
                        meshzero_config={"train_micro_batch_size_per_gpu": 2})
    model = _model()
    opt = __import__("torch").optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="optimizers="):
        MeshzeroTrainer(model=model, args=_args(tmp_path), optimizers=(opt, None),
                        meshzero_config={"zero_optimization": {"stage": 1}})


def test_trainer_resolves_its_config_for_the_run(tmp_path) -> None:
    from meshzero.hf import MeshzeroTrainer

    trainer = MeshzeroTrainer(model=_model(), args=_args(tmp_path), meshzero_config=FULL_AUTO)
    config = trainer.engine_config(max_steps=12)
    assert config.train_micro_batch_size_per_gpu == 4 and config.gradient_clipping == 0.5
    assert config.scheduler.params["total_num_steps"] == 12
    assert config.zero_optimization.reduce_bucket_size == 16 * 16
