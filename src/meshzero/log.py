"""The one logging setup: the standard ``logging`` module, everything under the ``meshzero``
logger (each module's ``logging.getLogger(__name__)``), propagating to the root logger so a
user's ``logging.basicConfig`` or framework sees the records.

- Level: ``MESHZERO_LOG_LEVEL`` (DEBUG, INFO, WARNING, ERROR, CRITICAL) when set; otherwise
  INFO when meshzero prints through its own handler, else the user's configuration decides.
- Ranks: INFO and DEBUG come from rank 0 only; warnings and errors from every rank.
  ``MESHZERO_LOG_ALL_RANKS=1`` lets every rank log at the level. The filtering is the level
  of the ``meshzero`` logger on the other ranks, so it holds for every child logger and every
  handler, the user's included.
- Handler: one, ``[meshzero rank R] LEVEL message`` on stderr, only while the root logger has
  no handler; once the user configures logging, their handlers print the records instead.
"""

from __future__ import annotations

import logging
import os

LEVEL_ENV = "MESHZERO_LOG_LEVEL"
ALL_RANKS_ENV = "MESHZERO_LOG_ALL_RANKS"
LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
TRUE, FALSE = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")

_WARNED: set[str] = set()


class _FallbackHandler(logging.StreamHandler):
    """meshzero's own stderr handler, silent while the root logger has a handler (the
    records reach that one by propagation: printing here too would print them twice)."""

    def __init__(self, rank: int):
        super().__init__()
        self.set_rank(rank)

    def set_rank(self, rank: int) -> None:
        self.setFormatter(logging.Formatter(f"[meshzero rank {rank}] %(levelname)s %(message)s"))

    def filter(self, record: logging.LogRecord) -> bool:
        return not logging.getLogger().handlers and super().filter(record)


def env_level() -> int | None:
    """``MESHZERO_LOG_LEVEL`` as a logging level, None when unset."""
    raw = os.environ.get(LEVEL_ENV, "").strip()
    if not raw:
        return None
    if raw.upper() not in LEVELS:
        raise ValueError(f"{LEVEL_ENV}={raw!r} is not a level; use one of {', '.join(LEVELS)}")
    return getattr(logging, raw.upper())


def env_all_ranks() -> bool:
    raw = os.environ.get(ALL_RANKS_ENV, "").strip().lower()
    if raw not in TRUE + FALSE:
        raise ValueError(f"{ALL_RANKS_ENV}={raw!r}: use 1 (every rank logs) or 0 (rank 0 "
                         "logs INFO/DEBUG, every rank warnings)")
    return raw in TRUE


def setup_logging(rank: int | None = None) -> None:
    """Set the ``meshzero`` logger's level and, if nothing prints its records, a handler.
    ``rank``: this process's global rank (default: ``$RANK``, else 0). Safe to call again."""
    rank = int(os.environ.get("RANK", "0")) if rank is None else rank
    logger = logging.getLogger("meshzero")
    level, all_ranks = env_level(), env_all_ranks()  # both checked on every rank
    ours = [h for h in logger.handlers if isinstance(h, _FallbackHandler)]
    if not ours and not logging.getLogger().handlers and not logger.handlers:
        logger.addHandler(_FallbackHandler(rank))
        if level is None and logger.level == logging.NOTSET:
            level = logging.INFO  # the root's default, WARNING, would hide meshzero's reports
    for handler in ours:
        handler.set_rank(rank)
    if level is not None:
        logger.setLevel(level)
    if rank != 0 and not all_ranks:
        logger.setLevel(max(logger.getEffectiveLevel(), logging.WARNING))


def warn_once(logger: logging.Logger, message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        logger.warning(message)
