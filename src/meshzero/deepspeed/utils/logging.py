"""DeepSpeed's ``deepspeed.utils.logging``: ``logger`` and ``log_dist`` over meshzero's logging
(the ``meshzero.deepspeed`` logger, a child of ``meshzero``'s: its handler, its level,
``MESHZERO_LOG_LEVEL``). Levels follow meshzero's rule, not DeepSpeed's WARNING default:
once an engine exists rank 0 logs INFO and the other ranks WARNING (``MESHZERO_LOG_ALL_RANKS=1``:
every rank INFO), so ``log_dist(..., ranks=[1])`` at INFO shows on rank 1 with that set."""

from __future__ import annotations

import logging
from typing import Any

import torch.distributed as dist

from meshzero.log import warn_once

logger = logging.getLogger("meshzero.deepspeed")
_ONCE: set[tuple[str, tuple[int, ...] | None, int]] = set()  # log_dist_once's messages


def _rank_message(message: str, ranks: list[int] | None) -> str | None:
    """``[Rank r] message`` when this rank should log it (DeepSpeed's get_dist_msg): always
    before the process group exists, else when ``ranks`` holds this rank or starts with -1."""
    if not dist.is_initialized():
        return f"[Rank -1] {message}"
    rank = dist.get_rank()
    if ranks and (ranks[0] == -1 or rank in ranks):
        return f"[Rank {rank}] {message}"
    return None


def log_dist(message: str, ranks: list[int] | None = None, level: int = logging.INFO) -> None:
    """DeepSpeed's `deepspeed.utils.logging.log_dist`: log on the ``ranks`` listed ([-1]: all).

    As DeepSpeed's: once the process group exists, ``ranks=None`` logs nowhere; give
    ``ranks=[0]`` for rank 0.
    """
    final = _rank_message(message, ranks)
    if final is not None:
        logger.log(level, final)


def log_dist_once(message: str, ranks: list[int] | None = None,
                  level: int = logging.INFO) -> None:
    """DeepSpeed's `deepspeed.utils.logging.log_dist_once`: log_dist, each message once."""
    key = (message, tuple(ranks) if ranks is not None else None, level)
    if key not in _ONCE:
        _ONCE.add(key)
        log_dist(message, ranks, level)


def print_dist(message: str, ranks: list[int] | None = None) -> None:
    """DeepSpeed's `deepspeed.utils.logging.print_dist`: print on the ``ranks`` listed."""
    final = _rank_message(message, ranks)
    if final is not None:
        print(final)  # noqa: T201 (DeepSpeed's contract: printed whatever the log level)


def warning_once(*args: Any, **kwargs: Any) -> None:
    """DeepSpeed's `logger.warning_once`: meshzero's warn_once (each message once a process)."""
    warn_once(logger, str(args[0]) % args[1:] if len(args) > 1 else str(args[0]))


# DeepSpeed's logger carries these two as attributes (logger.warning_once(...))
logger.warning_once = warning_once  # type: ignore[attr-defined]
logger.log_dist_once = log_dist_once  # type: ignore[attr-defined]
