"""The migration table: every DeepSpeed key and what meshzero does with it, rendered from the
schema and the compat tables, so the docs cannot drift from the code.

    python -m meshzero.config.table docs/migration-keys.md   # rewrite the docs copy

tests/test_config_table.py fails when the docs copy is not what `render` gives.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from meshzero.config.auto import AUTO_RULES
from meshzero.config.compat import (
    ALIASES,
    HINTS,
    NOOP_VALUES,
    OFF_WHEN_DISABLED,
    OLD_OFFLOAD,
    RETIRED,
    VALUE_ALIASES,
)
from meshzero.config.optimizer import (
    DEEPSPEED_ONLY_OPTIMIZERS,
    DEEPSPEED_ONLY_SCHEDULERS,
    OPTIMIZER_PARAMS,
    SCHEDULER_PARAMS,
)
from meshzero.config.schema import Config
from meshzero.config.unsupported import UNSUPPORTED_KEYS

HEADER = """<!-- generated: python -m meshzero.config.table docs/migration-keys.md -->

# DeepSpeed config keys in meshzero

A ds_config.json loads as it is, or fails on its first read with every key meshzero cannot
honour, one per line. This table is generated from the schema (`meshzero.config`).

Where the meaning needs a word: the lr of each step of `WarmupLR`, `WarmupDecayLR` and
`WarmupCosineLR` is the one a DeepSpeed engine uses (step 0 at the schedule's start, then one
schedule step per optimizer step; `warmup_num_steps: 0`, which DeepSpeed refuses, means no
warmup); `fp16.hysteresis` is restored only after a clean `loss_scale_window`, as DeepSpeed's
scaler does; `stage3_gather_16bit_weights_on_model_save: false` at stage 3 makes
`save_16bit_model` save nothing, as in DeepSpeed (not given: it saves); `fp16.auto_cast`:
meshzero always casts floating inputs to the compute dtype; the monitors and `comms_logger`
write every `steps_per_print` steps (docs/profiling.md, Monitors), and
`comms_logger.verbose` and `comms_logger.debug` change nothing. meshzero's own keys:
`zero_optimization.unit_classes`, `flops_profiler.peak_flops`, `seed`, `tensor_parallel`,
`pipeline_parallel`, `topology`, `faults` (docs/failures.md).
"""


def _code(keys: list[str]) -> str:
    return ", ".join(f"`{k}`" for k in keys)


def _section_keys(model: type[BaseModel], prefix: str) -> list[str]:
    """Dotted keys of a section, nested sections flattened."""
    keys = []
    for name, field in model.model_fields.items():
        sub = _submodel(field.annotation)
        if sub is not None and name not in ("params",):
            keys += _section_keys(sub, f"{prefix}{name}.")
        else:
            keys.append(prefix + name)
    return keys


def _submodel(annotation: Any) -> type[BaseModel] | None:
    for candidate in (annotation, *getattr(annotation, "__args__", ())):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def _honoured_rows() -> list[str]:
    rows = []
    for name, field in Config.model_fields.items():
        if name in ("optimizer", "scheduler"):
            continue
        sub = _submodel(field.annotation)
        keys = _section_keys(sub, "") if sub is not None else []
        rows.append(f"| `{name}` | {_code(keys) if keys else 'same meaning'} |")
    for what, kinds in (("optimizer", OPTIMIZER_PARAMS), ("scheduler", SCHEDULER_PARAMS)):
        for kind, params in kinds.items():
            rows.append(f"| `{what}` type `{kind}` | params {_code(list(params.model_fields))} |")
    return rows


def _value(values: tuple[Any, ...]) -> str:
    shown = ["null" if v is None else str(v).lower() if isinstance(v, bool) else repr(v)
             for v in values]
    return " or ".join(f"`{v}`" for v in shown)


IGNORED_TEXT = (
    "A top-level key that is none of these and no misspelling of one is ignored with one "
    "WARNING, as DeepSpeed's parser ignores it (`cuda_visible_devices`, a project's own "
    "settings). A misspelling stays an error naming the key meant: within edit distance 2 of "
    "a known top-level key, or a key of a section written at the top level (`stage`). Keys "
    "inside a section are always checked. An `aio` block written inside `zero_optimization` "
    "is read as the top-level `aio`, with a warning; `optimizer.params.max_grad_norm` on "
    "`Adam` / `AdamW` is ignored with a warning pointing to `gradient_clipping` (DeepSpeed's "
    "fused Adam ignores it too).")


def _auto_rows() -> list[str]:
    """The "auto" table: config.auto's rules, one row per key."""
    rows = ["", '## `"auto"`', "",
            "Filled where Hugging Face's Trainer or Accelerate fill it, with the value they pick "
            "when no `TrainingArguments` or Accelerate settings are given; one INFO line per "
            "key at `initialize`. `MeshzeroTrainer` fills the Trainer's keys from its "
            "arguments first ([Hugging Face Trainer](trainer.md)). An `\"auto\"` anywhere "
            "else is refused, listed with every other problem.", "",
            "| key | Trainer / Accelerate | meshzero without their arguments |",
            "| --- | --- | --- |"]
    rows += [f"| `{rule.key}` | {rule.hf} | {rule.rule} |" for rule in AUTO_RULES]
    return rows + [""]


def render() -> str:
    """The whole table as markdown."""
    out = [HEADER, "## Honoured: the same meaning as in DeepSpeed", "",
           "| key | keys inside it |", "| --- | --- |", *_honoured_rows(), ""]
    out += ["## Other spellings DeepSpeed accepts (renamed; deprecated ones said once)", "",
            "| DeepSpeed spelling | meshzero key |", "| --- | --- |"]
    out += [f"| `{old}` | `{new}`{' (deprecated)' if dep else ''} |"
            for old, (new, dep) in ALIASES.items()]
    out += [f"| `zero_optimization.{old}: true` | `zero_optimization.{block}.{key}` "
            f"{'cpu' if key == 'device' else 'true'} (deprecated) |"
            for old, (block, key) in OLD_OFFLOAD.items()]
    out += [f"| `{key}: {old!r}` | `{key}: {new!r}` |"
            for key, spellings in VALUE_ALIASES.items()
            for old, new in spellings.items() if old != new]
    out += ["", "## Accepted hints: no effect on results (one INFO line at `initialize`)", "",
            "| key | why it changes nothing here |", "| --- | --- |"]
    out += [f"| `{key}` | {why} |" for key, why in HINTS.items()]
    out += ["| `zero_optimization.contiguous_gradients`, `reduce_scatter`, "
            "`allgather_partitions` set to `false` | meshzero always does them |",
            "| `zero_optimization.sub_group_size: 0` | the default tile is used |"]
    out += ["", "## Accepted because the value asks for nothing", "",
            "| key | value |", "| --- | --- |"]
    out += [f"| `{key}` | {_value(values)} |" for key, values in NOOP_VALUES.items()]
    out += [f"| `{name}` | `{{\"enabled\": false, ...}}` |" for name in OFF_WHEN_DISABLED]
    out += [f"| `zero_optimization.{old}` | `false` |" for old in OLD_OFFLOAD]
    out += _auto_rows()
    out += ["## Retired in DeepSpeed: accepted as no-ops (a deprecation line)", "",
            "| key | what DeepSpeed does with it |", "| --- | --- |"]
    out += [f"| `{key}` | {why} |" for key, why in RETIRED.items()]
    out += ["| `zero_optimization: true` / `false` | DeepSpeed's oldest spelling of "
            "`zero_optimization.stage` 1 / 0 (renamed) |", "",
            "## Keys nobody reads", "", IGNORED_TEXT, ""]
    out += ["## Refused: would change results, not implemented yet", "",
            "| key | what it asks for |", "| --- | --- |"]
    out += [f"| `{key}` | {note} |" for key, note in UNSUPPORTED_KEYS.items()]
    out += [f"| `optimizer.type` {_code(list(DEEPSPEED_ONLY_OPTIMIZERS))} | DeepSpeed's own "
            "optimizers; pass any `torch.optim` optimizer to `initialize` instead |",
            f"| `scheduler.type` {_code(list(DEEPSPEED_ONLY_SCHEDULERS))} | DeepSpeed's own "
            "schedulers; pass `lr_scheduler=` instead |", ""]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m meshzero.config.table",
        description="Render the DeepSpeed-key migration table (docs/migration-keys.md): "
                    "every ds_config key and what meshzero does with it.")
    parser.add_argument("output", nargs="?", type=Path, default=None,
                        help="write the table to this file (default: print it)")
    args = parser.parse_args(argv)
    text = render()
    if args.output is None:
        print(text, end="")
    else:
        args.output.write_text(text)


if __name__ == "__main__":
    main()
