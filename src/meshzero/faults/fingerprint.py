"""Ranks that must agree, checked at initialize.

Every rank sends a digest of what must be the same on all of them: the config values that
decide collectives or the result (stage, batch sizes, precision, offload, mesh sizes,
buckets, optimizer, ...; not paths, monitors or logging), the resolved micro batch and
accumulation steps, and the parameter names, shapes and dtypes in order. One all-gather of
the digests; only when they differ the details follow, and every rank raises the same
:class:`RankMismatchError` naming each field and which ranks hold which value. It runs
right after the process group exists, before the mesh's groups and the model's broadcast,
so a mismatch never reaches a collective that would hang or abort in C++.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from typing import Any

import torch.distributed as dist
from torch import nn

from meshzero.comm import all_gather_objects
from meshzero.config import Config

# config keys that may differ between ranks (per-node paths, what rank 0 writes, logging)
MAY_DIFFER = ("zero_optimization.offload_optimizer.nvme_path",
              "zero_optimization.offload_param.nvme_path", "zero_optimization.offload_optimizer"
              ".pin_memory", "zero_optimization.offload_param.pin_memory", "tensorboard",
              "wandb", "csv_monitor", "comms_logger", "flops_profiler.output_file",
              "steps_per_print", "wall_clock_breakdown", "topology.ranks_per_node")
SHOWN = 6  # differing fields named in the error


class RankMismatchError(ValueError):
    """Ranks were started with configs or models that must agree and do not."""


def _flatten(value: Any, prefix: str, out: dict[str, str]) -> None:
    if isinstance(value, dict) and value:
        for key, sub in value.items():
            _flatten(sub, f"{prefix}.{key}" if prefix else str(key), out)
    elif not prefix.startswith(MAY_DIFFER):
        out[prefix] = json.dumps(value, sort_keys=True, default=str)


def fingerprint(config: Config, model: Any, world_size: int) -> dict[str, str]:
    """``{field: value}`` of what must agree on every rank."""
    fields: dict[str, str] = {}
    _flatten(config.model_dump(mode="json"), "", fields)
    try:  # the batch rule may fail: the same way on every rank once the configs agree
        batch = config.resolve_batch(config.dp_size(world_size))
        fields["resolved batch (train_batch_size, micro batch, accumulation)"] = str(batch)
    except ValueError:
        pass
    if isinstance(model, nn.Module):  # a factory builds it later, unit by unit
        fields["model parameters"] = json.dumps(_parameters(model.named_parameters()))
    return fields


def _parameters(named: Iterable[tuple[str, Any]]) -> list[list]:
    return [[name, list(p.shape), str(p.dtype).removeprefix("torch.")] for name, p in named]


def _digest(fields: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()


def check_ranks_agree(config: Config, model: Any) -> None:
    """Raise :class:`RankMismatchError` on every rank if any rank's fingerprint differs;
    collective over the world (two all-gathers when they differ, one when not)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    fields = fingerprint(config, model, dist.get_world_size())
    digests = all_gather_objects(_digest(fields), dist.group.WORLD)
    if len(set(digests)) == 1:
        return
    everyone = all_gather_objects(fields, dist.group.WORLD)
    raise RankMismatchError(describe_mismatch(everyone))


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks)) if len(ranks) <= 8 else \
        f"{', '.join(map(str, ranks[:8]))}, ... ({len(ranks)} ranks)"


def describe_mismatch(everyone: list[dict[str, str]]) -> str:
    """One line naming each field that differs and the ranks holding each value."""
    names = sorted({k for f in everyone for k in f}, key=lambda k: (k == "model parameters", k))
    parts = []
    for name in names:
        by_value: dict[str, list[int]] = {}
        for rank, f in enumerate(everyone):
            by_value.setdefault(f.get(name, "(not set)"), []).append(rank)
        if len(by_value) == 1:
            continue
        if name == "model parameters":
            parts.append(_describe_params(by_value))
        else:
            parts.append(f"{name}: " + "; ".join(
                f"{value} on rank(s) {_ranks(ranks)}" for value, ranks in by_value.items()))
    more = f" (and {len(parts) - SHOWN} more)" if len(parts) > SHOWN else ""
    return ("ranks disagree at initialize, which would hang or fail in a collective later: "
            + " | ".join(parts[:SHOWN]) + more
            + ". Start every rank with the same config and model")


def _describe_params(by_value: dict[str, list[int]]) -> str:
    """The first parameter (name, shape, dtype) where two groups of ranks differ."""
    (value_a, ranks_a), (value_b, ranks_b) = list(by_value.items())[:2]
    a, b = json.loads(value_a), json.loads(value_b)
    for i in range(max(len(a), len(b))):
        pa = a[i] if i < len(a) else None
        pb = b[i] if i < len(b) else None
        if pa != pb:
            return (f"model parameters: parameter {i} is {_param(pa)} on rank(s) "
                    f"{_ranks(ranks_a)} but {_param(pb)} on rank(s) {_ranks(ranks_b)}")
    return f"model parameters differ between rank(s) {_ranks(ranks_a)} and {_ranks(ranks_b)}"


def _param(p: list | None) -> str:
    return "missing" if p is None else f"{p[0]} of shape {tuple(p[1])} ({p[2]})"
