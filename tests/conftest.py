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
