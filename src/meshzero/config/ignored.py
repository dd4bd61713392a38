"""Top-level keys nobody reads: DeepSpeed's parser ignores a top-level key it does not know
(``cuda_visible_devices``, a project's own settings), so meshzero ignores it too, with one
WARNING naming it. A near miss of a known key stays an error with the key meant: within edit
distance 2 of a known top-level key (``train_batch_sizes``), or a known key of a section
written at the top level (``stage`` for ``zero_optimization.stage``)."""

from __future__ import annotations

import functools
from typing import Any

from pydantic import BaseModel

from meshzero.config.compat import deepspeed_keys
from meshzero.config.optimizer import OPTIMIZER_PARAMS, SCHEDULER_PARAMS
from meshzero.config.schema import Config
from meshzero.config.unsupported import UNSUPPORTED_KEYS

NEAR = 2  # the largest edit distance that makes a key a misspelling
# top-level keys DeepSpeed reads that meshzero has no rule for yet (another issue's): never
# ignored, so the schema refuses them as unknown until the rule lands
DEEPSPEED_READS = frozenset({"seq_parallel_communication_data_type", "sequence_parallel_size"})


def drop_ignored(raw: dict[str, Any]) -> tuple[list[str], list[str]]:
    """Remove the unknown top-level keys of `raw` (in place): (a WARNING line for each key no
    known key is near, which DeepSpeed would ignore; an error line for each near miss)."""
    warnings, problems = [], []
    top, leaves = _known()
    for key in [k for k in raw if isinstance(k, str) and k not in top | DEEPSPEED_READS]:
        meant = _nearest(key, top) or leaves.get(key)
        if meant is None:
            warnings.append(f"{key}: not a DeepSpeed key; ignored, as DeepSpeed ignores it")
        else:
            problems.append(f"unknown config key '{key}'; did you mean '{meant}'?")
        del raw[key]
    return warnings, problems


def _nearest(key: str, known: frozenset[str]) -> str | None:
    scored = sorted((edit_distance(key, k), k) for k in known)
    return scored[0][1] if scored and scored[0][0] <= NEAR else None


def edit_distance(a: str, b: str) -> int:
    """Levenshtein distance: single-character insertions, deletions and substitutions."""
    row = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        diagonal, row[0] = row[0], i
        for j, cb in enumerate(b, 1):
            diagonal, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, diagonal + (ca != cb))
    return row[-1]


@functools.cache
def _known() -> tuple[frozenset[str], dict[str, str]]:
    """(every top-level key meshzero reads or accepts; each key of a section -> its dotted
    key, the first one in the schema's order when several sections have it)."""
    dotted = [*_section_keys(Config, ""), *deepspeed_keys(), *UNSUPPORTED_KEYS]
    for section, kinds in (("optimizer", OPTIMIZER_PARAMS), ("scheduler", SCHEDULER_PARAMS)):
        dotted += [f"{section}.params.{name}" for model in kinds.values()
                   for name in model.model_fields]
    top = frozenset(key.split(".")[0] for key in dotted)
    leaves: dict[str, str] = {}
    for key in dotted:
        parts = key.split(".")
        for depth in range(1, len(parts)):
            leaves.setdefault(parts[depth], ".".join(parts[:depth + 1]))
    return top, leaves


def _section_keys(model: type[BaseModel], prefix: str) -> list[str]:
    keys = []
    for name, field in model.model_fields.items():
        keys.append(prefix + name)
        for sub in (field.annotation, *getattr(field.annotation, "__args__", ())):
            if isinstance(sub, type) and issubclass(sub, BaseModel):
                keys += _section_keys(sub, f"{prefix}{name}.")
    return keys
