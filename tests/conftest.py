"""Shared fixtures. ``tests`` is a package so spawned ranks can import tests.* modules."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from tests.distributed import run_distributed


@pytest.fixture
def run_ranks(tmp_path) -> Callable[..., list]:
    """run_ranks(fn, world_size, *args, timeout=..., **kwargs): run_distributed in tmp_path."""

    def run(fn: Callable[..., Any], world_size: int, *args: Any, **kwargs: Any) -> list:
        return run_distributed(fn, world_size, tmp_path, *args, **kwargs)

    return run


@pytest.fixture
def no_default_group() -> None:
    """Estimating tensor parallelism builds the model over a fake process group, which needs
    a process without one; earlier in-process tests (a world of one) may have left theirs."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
