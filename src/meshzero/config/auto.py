"""``"auto"``: the value Hugging Face's Trainer or Accelerate would put in its place.

Hugging Face's configs write ``"auto"`` for every key the Trainer (its DeepSpeed integration)
or Accelerate (``Accelerator.prepare`` and its DeepSpeed plugin) fills before DeepSpeed reads
the config. meshzero fills each of those keys with the value they pick when no
``TrainingArguments`` or Accelerate settings are given: the arguments' defaults, Accelerate's
defaults, and what only the model can say (its hidden size, its parameters' dtype) from the
model ``initialize`` is given. ``MeshzeroTrainer`` fills them from its arguments first
(meshzero.hf.config); what it leaves is resolved here.

`AUTO_RULES` is the one source: `resolve_auto` applies it, and docs/migration-keys.md shows it
(config.table). Each resolved key is said in one INFO line at ``initialize``. An ``"auto"``
nowhere in it, or whose rule has no value without a run (the scheduler's total steps), stays
for ``load_config`` to refuse with every other problem.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

# TrainingArguments' defaults, which the Trainer writes into the "auto" keys it fills
TRAINING_ARGUMENTS = {"learning_rate": 5e-5, "adam_beta1": 0.9, "adam_beta2": 0.999,
                      "adam_epsilon": 1e-8, "weight_decay": 0.0, "max_grad_norm": 1.0,
                      "warmup_steps": 0}


@dataclass(frozen=True)
class ModelFacts:
    """What the model tells the "auto" rules: Hugging Face's hidden size (None: the model has
    no config that gives one) and its floating parameters' dtype ("fp32", "fp16", "bf16";
    None: no model, or a factory not built yet)."""

    hidden_size: int | None = None
    dtype: str | None = None


@dataclass(frozen=True)
class Resolution:
    """The config being resolved (keys already resolved hold their values) and the model."""

    raw: dict[str, Any]
    model: ModelFacts

    def number(self, dotted: str) -> Any:
        """The value at ``dotted`` when it is a number (not "auto", not missing), else None."""
        value = get_value(self.raw, dotted)
        is_number = isinstance(value, int | float) and not isinstance(value, bool)
        return value if is_number else None


LEAVE_OUT = object()  # the key is removed: derived from the others, or the schema's default
NO_VALUE = object()  # nothing to put there without a run: left to be refused
# the micro batch: removed now, taken at initialize from training_data's batch size or from
# the first batch the engine sees (Config.micro_batch_pending; data/batch.py)
FROM_DATA = object()


@dataclass(frozen=True)
class AutoRule:
    key: str
    hf: str  # what the Trainer / Accelerate fill in
    rule: str  # what meshzero fills in without their arguments
    resolve: Callable[[Resolution], Any]


def _hidden(scale: Callable[[int], int]) -> Callable[[Resolution], Any]:
    return lambda r: LEAVE_OUT if r.model.hidden_size is None else scale(r.model.hidden_size)


def _micro(r: Resolution) -> Any:
    return LEAVE_OUT if r.number("train_batch_size") is not None else FROM_DATA


def _accumulation(r: Resolution) -> Any:
    given = r.number("train_batch_size") is not None and r.number(
        "train_micro_batch_size_per_gpu") is not None
    return LEAVE_OUT if given else 1


def _warmup_max_lr(r: Resolution) -> Any:
    lr = r.number("optimizer.params.lr")
    return TRAINING_ARGUMENTS["learning_rate"] if lr is None else lr


_H = "from the model's hidden size h (config.hidden_size, else the largest of hidden_sizes): "
_NO_H = "; meshzero's default when no model given to initialize has one"

AUTO_RULES: tuple[AutoRule, ...] = (
    AutoRule("train_batch_size", "world size x micro batch x accumulation steps",
             "derived: micro batch x accumulation steps x data-parallel size",
             lambda r: LEAVE_OUT),
    AutoRule("train_micro_batch_size_per_gpu",
             "per_device_train_batch_size (Accelerate: the DataLoader's batch size)",
             "derived from train_batch_size when that is a number, else training_data's "
             "batch size (a DataLoader) or the leading dimension of the first batch "
             "engine(...) sees; with neither (or pipeline parallelism without a DataLoader) "
             "refused, as Accelerate refuses",
             _micro),
    AutoRule("gradient_accumulation_steps",
             "gradient_accumulation_steps (Accelerate: its plugin's, default 1)",
             "derived when the other two batch keys are numbers, else 1", _accumulation),
    AutoRule("gradient_clipping", "max_grad_norm (Accelerate: 1.0)",
             "1.0, TrainingArguments' default max_grad_norm", lambda r: TRAINING_ARGUMENTS[
                 "max_grad_norm"]),
    AutoRule("optimizer.params.lr", "learning_rate", "5e-05, TrainingArguments' default",
             lambda r: TRAINING_ARGUMENTS["learning_rate"]),
    AutoRule("optimizer.params.betas", "[adam_beta1, adam_beta2]",
             "[0.9, 0.999], TrainingArguments' defaults",
             lambda r: [TRAINING_ARGUMENTS["adam_beta1"], TRAINING_ARGUMENTS["adam_beta2"]]),
    AutoRule("optimizer.params.eps", "adam_epsilon", "1e-08, TrainingArguments' default",
             lambda r: TRAINING_ARGUMENTS["adam_epsilon"]),
    AutoRule("optimizer.params.weight_decay", "weight_decay",
             "0.0, TrainingArguments' default",
             lambda r: TRAINING_ARGUMENTS["weight_decay"]),
    AutoRule("scheduler.params.warmup_min_lr", "0", "0, as Hugging Face", lambda r: 0),
    AutoRule("scheduler.params.warmup_max_lr", "learning_rate",
             "optimizer.params.lr when that is a number, else 5e-05",
             _warmup_max_lr),
    AutoRule("scheduler.params.warmup_num_steps", "warmup_steps (or warmup_ratio x steps)",
             "0, TrainingArguments' default", lambda r: TRAINING_ARGUMENTS["warmup_steps"]),
    AutoRule("scheduler.params.total_num_steps", "the run's optimizer steps",
             "no value without a run: refused (give the number, or use MeshzeroTrainer)",
             lambda r: NO_VALUE),
    AutoRule("fp16.enabled", "fp16 (Accelerate: mixed_precision fp16)",
             "true when the model given to initialize has fp16 parameters, else false",
             lambda r: r.model.dtype == "fp16"),
    AutoRule("bf16.enabled", "bf16 (Accelerate: mixed_precision bf16)",
             "true when the model given to initialize has bf16 parameters, else false",
             lambda r: r.model.dtype == "bf16"),
    AutoRule("amp.enabled", "fp16 with the apex backend", "false, as fp16", lambda r: False),
    AutoRule("amp.opt_level", "fp16_opt_level", "O1, TrainingArguments' default",
             lambda r: "O1"),
    AutoRule("zero_optimization.stage", "Accelerate's zero_stage", "2, Accelerate's default",
             lambda r: 2),
    AutoRule("zero_optimization.offload_optimizer.device",
             "Accelerate's offload_optimizer_device", "none, Accelerate's default",
             lambda r: "none"),
    AutoRule("zero_optimization.offload_param.device", "Accelerate's offload_param_device",
             "none, Accelerate's default", lambda r: "none"),
    AutoRule("zero_optimization.offload_optimizer.nvme_path",
             "Accelerate's offload_optimizer_nvme_path", "none, Accelerate's default",
             lambda r: None),
    AutoRule("zero_optimization.offload_param.nvme_path",
             "Accelerate's offload_param_nvme_path", "none, Accelerate's default",
             lambda r: None),
    AutoRule("zero_optimization.stage3_gather_16bit_weights_on_model_save",
             "Accelerate's zero3_save_16bit_model", "false, Accelerate's default",
             lambda r: False),
    AutoRule("zero_optimization.reduce_bucket_size", "h*h", _H + "h*h" + _NO_H,
             _hidden(lambda h: h * h)),
    AutoRule("zero_optimization.stage3_prefetch_bucket_size", "0.9*h*h",
             _H + "int(0.9*h*h)" + _NO_H,
             _hidden(lambda h: int(0.9 * h * h))),
    AutoRule("zero_optimization.stage3_param_persistence_threshold", "10*h",
             _H + "10*h" + _NO_H,
             _hidden(lambda h: 10 * h)),
)  # fmt: skip

# the keys whose value depends on the model: a config loaded without one is resolved again
# when initialize gives it
MODEL_KEYS = ("fp16.enabled", "bf16.enabled", "zero_optimization.reduce_bucket_size",
              "zero_optimization.stage3_prefetch_bucket_size",
              "zero_optimization.stage3_param_persistence_threshold")


def is_auto(value: Any) -> bool:
    return isinstance(value, str) and value.strip().lower() == "auto"


def get_value(raw: dict[str, Any], dotted: str) -> Any:
    node: Any = raw
    for part in dotted.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def resolve_auto(raw: dict[str, Any], model: ModelFacts) -> list[str]:
    """Fill every "auto" of `AUTO_RULES` in `raw` (in place, in the rules' order); one line
    per key filled, saying the value and why."""
    notes = []
    for rule in AUTO_RULES:
        *parents, last = rule.key.split(".")
        parent = get_value(raw, ".".join(parents)) if parents else raw
        if not isinstance(parent, dict) or not is_auto(parent.get(last)):
            continue
        value = rule.resolve(Resolution(raw, model))
        if value is NO_VALUE:
            continue
        if value is FROM_DATA:
            del parent[last]
            notes.append(f'"auto" {rule.key}: no train_batch_size to derive it from; taken '
                         "from training_data's batch size or the first batch engine(...) sees")
        elif value is LEAVE_OUT:
            del parent[last]
            why = rule.rule if rule.key not in MODEL_KEYS else (
                "meshzero's default until a model with a hidden size is given to initialize")
            notes.append(f'"auto" {rule.key}: {why}')
        else:
            parent[last] = value
            notes.append(f'"auto" {rule.key} = {_json(value)} (rule: {rule.rule})')
    return notes


def _json(value: Any) -> str:
    return json.dumps(value)


def needs_model(raw: dict[str, Any]) -> bool:
    """Whether `raw` holds an "auto" whose value the model decides."""
    return any(is_auto(get_value(raw, key)) for key in MODEL_KEYS)


def model_facts(model: Any) -> ModelFacts:
    """The hidden size Hugging Face reads (config.hidden_size, the largest of hidden_sizes;
    also the d_model and n_embd spellings) and the dtype of the first floating parameter."""
    return ModelFacts(_hidden_size(model), _dtype(model))


def _hidden_size(model: Any) -> int | None:
    cfg = getattr(model, "config", None)
    for name in ("hidden_size", "d_model", "n_embd"):
        value = getattr(cfg, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    sizes = getattr(cfg, "hidden_sizes", None)
    if isinstance(sizes, list | tuple) and sizes and all(isinstance(s, int) for s in sizes):
        return max(sizes)
    return None


def _dtype(model: Any) -> str | None:
    if not isinstance(model, torch.nn.Module):
        return None  # a factory (a class or a function): its parameters do not exist yet
    names = {"torch.float32": "fp32", "torch.float16": "fp16", "torch.bfloat16": "bf16"}
    for param in model.parameters():
        if param.is_floating_point():
            return names.get(str(param.dtype), "fp32")
    return None
