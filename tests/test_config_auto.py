""""auto" is filled where Hugging Face's Trainer or Accelerate fill it (config.auto), with the
values they pick without arguments, the model's where the model decides, one INFO line each."""

from __future__ import annotations

import copy
import logging
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import meshzero
from meshzero.config import ConfigError, load_config
from meshzero.config.auto import AUTO_RULES, get_value
from meshzero.config.table import render

# every key the rules know, "auto"; total_num_steps has no value without a run
EVERY = {
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                              "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR", "params": {
        "warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto"}},
    "fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"},
    "amp": {"enabled": "auto", "opt_level": "auto"},
    "zero_optimization": {
        "stage": "auto", "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
        "stage3_gather_16bit_weights_on_model_save": "auto",
        "offload_optimizer": {"device": "auto", "nvme_path": "auto"},
        "offload_param": {"device": "auto", "nvme_path": "auto"}},
}  # fmt: skip


class Tiny(torch.nn.Module):
    """A model with a Hugging Face style config (hidden size 8) in a chosen dtype."""

    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.config = SimpleNamespace(hidden_size=8)
        self.fc = torch.nn.Linear(8, 8).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


def test_every_key_gets_the_value_hugging_face_picks_without_arguments() -> None:
    config = load_config(EVERY)
    opt = config.optimizer.validated_params()  # type: ignore[union-attr]
    sched = config.scheduler.validated_params()  # type: ignore[union-attr]
    zc = config.zero_optimization
    assert config.micro_batch_pending and config.batch_sizes(4) == (None, None, 1)
    assert config.gradient_clipping == 1.0
    assert (opt["lr"], list(opt["betas"]), opt["eps"], opt["weight_decay"]) == (
        5e-5, [0.9, 0.999], 1e-8, 0.0)
    assert (sched["warmup_min_lr"], sched["warmup_max_lr"], sched["warmup_num_steps"]) == (
        0, 5e-5, 0)
    assert not config.fp16.enabled and not config.bf16.enabled
    assert zc.stage == 2  # Accelerate's default zero_stage
    assert (zc.offload_optimizer.device, zc.offload_param.device) == ("none", "none")
    assert zc.offload_optimizer.nvme_path is None
    assert zc.stage3_gather_16bit_weights_on_model_save is False  # Accelerate's default
    # no model yet: meshzero's defaults, and the model decides again at initialize
    assert (zc.reduce_bucket_size, zc.stage3_param_persistence_threshold) == (
        500_000_000, 100_000)
    # one line per key, each naming it
    keys = [rule.key for rule in AUTO_RULES if rule.key != "scheduler.params.total_num_steps"]
    assert len(config.auto_resolved) == len(keys)
    for key, line in zip(keys, config.auto_resolved, strict=True):
        assert line.startswith(f'"auto" {key}'), (key, line)


def test_total_steps_has_no_value_without_a_run() -> None:
    raw = copy.deepcopy(EVERY)
    raw["scheduler"] = {"type": "WarmupDecayLR", "params": {"total_num_steps": "auto"}}
    raw["seed"] = -1
    with pytest.raises(ConfigError) as info:
        load_config(raw)
    message = str(info.value)
    assert "(2 problems)" in message
    assert "'scheduler.params.total_num_steps' is 'auto'" in message and "seed = -1" in message


@pytest.mark.parametrize(("dtype", "fp16", "bf16"), [
    (torch.float32, False, False), (torch.bfloat16, False, True), (torch.float16, True, False)])
def test_precision_follows_the_models_parameters(dtype, fp16, bf16) -> None:
    config = load_config({"fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"}},
                         model=Tiny(dtype))
    assert (config.fp16.enabled, config.bf16.enabled) == (fp16, bf16)


def test_a_config_loaded_alone_is_resolved_again_with_the_model() -> None:
    alone = load_config({"bf16": {"enabled": "auto"},
                         "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto",
                                               "stage3_prefetch_bucket_size": "auto",
                                               "stage3_param_persistence_threshold": "auto"}})
    assert not alone.bf16.enabled
    config = load_config(alone, model=Tiny(torch.bfloat16))
    zc = config.zero_optimization
    assert config.bf16.enabled
    assert (zc.reduce_bucket_size, zc.stage3_prefetch_bucket_size,
            zc.stage3_param_persistence_threshold) == (64, 57, 80)
    plain = load_config({"zero_optimization": {"stage": 3}})
    assert load_config(plain, model=Tiny()) is plain  # nothing the model decides
    changed = alone.model_copy(update={"gradient_clipping": 0.5})
    assert load_config(changed, model=Tiny(torch.bfloat16)) is changed  # its values kept


@pytest.mark.parametrize(("given", "expected"), [
    ({"train_batch_size": 16, "train_micro_batch_size_per_gpu": "auto",
      "gradient_accumulation_steps": 2}, (16, 4, 2)),  # micro derived
    ({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4,
      "gradient_accumulation_steps": "auto"}, (16, 4, 2)),  # accumulation derived
    ({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 2,
      "gradient_accumulation_steps": "auto"}, (4, 2, 1)),  # accumulation 1
])  # fmt: skip
def test_batch_keys(given: dict[str, Any], expected: tuple[int, int, int]) -> None:
    assert load_config(given).resolve_batch(2) == expected


def test_warmup_max_lr_follows_the_optimizers_lr() -> None:
    config = load_config({"optimizer": {"type": "Adam", "params": {"lr": 3e-4}},
                          "scheduler": {"type": "WarmupLR",
                                        "params": {"warmup_max_lr": "auto"}}})
    assert config.scheduler.validated_params()["warmup_max_lr"] == 3e-4  # type: ignore[union-attr]


def test_the_trainers_values_win_over_the_defaults() -> None:
    from meshzero.hf.config import resolve_auto

    filled = resolve_auto(EVERY, {"optimizer.params.lr": (1e-3, True),
                                  "bf16.enabled": (True, True)})
    config = load_config(filled)
    assert config.optimizer.validated_params()["lr"] == 1e-3  # type: ignore[union-attr]
    assert config.bf16.enabled
    assert config.scheduler.validated_params()["warmup_max_lr"] == 1e-3  # type: ignore[union-attr]


def test_initialize_logs_one_info_line_per_resolved_key_and_warns_ignored_keys() -> None:
    raw = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 2,
           "bf16": {"enabled": "auto"}, "zero_optimization": {
               "stage": 1, "reduce_bucket_size": "auto",
               "stage3_gather_16bit_weights_on_model_save": "auto"},
           "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "cuda_visible_devices": 0}
    records = _capture(lambda: meshzero.initialize(model=Tiny(), config=raw))
    warned = [m for level, m in records if level == logging.WARNING]
    assert warned == ["cuda_visible_devices: not a DeepSpeed key; ignored, as DeepSpeed "
                      "ignores it"]
    auto = [m for level, m in records if m.startswith('"auto"')]
    assert [m.split()[1] for m in auto] == [
        "train_batch_size:", "bf16.enabled", "zero_optimization.stage3_gather_16bit_weights_on_"
        "model_save", "zero_optimization.reduce_bucket_size"]
    assert all(level == logging.INFO for level, m in records if m.startswith('"auto"'))
    assert '"auto" zero_optimization.reduce_bucket_size = 64 ' in auto[-1]


def test_docs_table_lists_every_rule() -> None:
    text = render()
    for rule in AUTO_RULES:
        assert f"| `{rule.key}` | {rule.hf} | {rule.rule} |" in text


def test_every_rule_names_a_key_a_config_can_hold() -> None:
    """Each rule's key is one the schema validates (or the amp block it drops when off)."""
    for rule in AUTO_RULES:
        assert get_value(EVERY, rule.key) == "auto" or rule.key.endswith("total_num_steps")


def _capture(run: Any) -> list[tuple[int, str]]:
    records: list[tuple[int, str]] = []

    class Handler(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append((record.levelno, record.getMessage()))

    handler, log = Handler(logging.INFO), logging.getLogger("meshzero")
    log.addHandler(handler)
    level = log.level
    log.setLevel(logging.INFO)  # setLevel also clears the loggers' isEnabledFor caches
    try:
        engine, *_ = run()
        engine.close()
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
    return records


# -- "auto" micro batch with nothing in the config to derive it from ---------------------------
PENDING = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
           "gradient_accumulation_steps": 3, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
NOT_YET = 'train_micro_batch_size_per_gpu is "auto" and train_batch_size is not a number'


def test_pending_micro_batch_comes_from_the_first_batch() -> None:
    """Accelerate's ``_prepare_deepspeed`` takes it from the DataLoader's batch size and
    raises without one; meshzero also takes the first batch's leading dimension (INFO)."""
    engine, *_ = meshzero.initialize(model=Tiny(), config=PENDING)
    assert engine.gradient_accumulation_steps() == 3  # known: it does not depend on it
    for ask in (engine.train_batch_size, engine.train_micro_batch_size_per_gpu):
        with pytest.raises(ValueError, match=NOT_YET):
            ask()

    def first_forward() -> tuple[meshzero.Engine]:
        engine(torch.zeros(5, 8))
        return (engine,)

    records = _capture(first_forward)
    assert [m for _, m in records if "from the leading dimension" in m] == [
        '"auto" train_micro_batch_size_per_gpu = 5, from the leading dimension of the first '
        "batch engine(...) saw: train_batch_size = 15 (x 3 accumulation steps x 1 "
        "data-parallel ranks)"]
    assert (engine.train_batch_size(), engine.config["train_micro_batch_size_per_gpu"]) == (15, 5)


def test_pending_micro_batch_comes_from_a_dataloader() -> None:
    from torch.utils.data import DataLoader, TensorDataset

    data = TensorDataset(torch.zeros(12, 8))
    records = _capture(lambda: meshzero.initialize(model=Tiny(), config=PENDING,
                                                   training_data=DataLoader(data, batch_size=4)))
    assert '"auto" train_micro_batch_size_per_gpu = 4, from training_data\'s batch_size' in [
        m for _, m in records]
    with pytest.raises(ValueError, match="training_data is a Dataset, which has no batch size"):
        meshzero.initialize(model=Tiny(), config=PENDING, training_data=data)


def test_pending_micro_batch_is_refused_where_it_must_be_known() -> None:
    """With pipeline parallelism the schedule is built at initialize (DeepSpeed's
    PipelineEngine asserts train_batch_size = micro x micro_batches x dp there); and a
    first batch with no tensor says nothing."""
    piped = load_config({**PENDING, "gradient_accumulation_steps": "auto",
                         "pipeline_parallel": {"size": 2}})
    with pytest.raises(ConfigError, match="with pipeline_parallel.size > 1 the micro batch "
                       "is needed at initialize"):
        piped.batch_sizes(1)
    engine, *_ = meshzero.initialize(model=Tiny(), config=PENDING)
    with pytest.raises(ValueError, match="holds no tensor with a batch dimension"):
        engine([1.0] * 8)
