"""The one logging setup: rank in every line, rank-0 filtering in one place, warn_once."""

from __future__ import annotations

import logging
import os

_WARNED: set[str] = set()


class _RankFilter(logging.Filter):
    """Adds ``rank`` to records; drops non-zero ranks' records below WARNING."""

    def filter(self, record: logging.LogRecord) -> bool:
        rank = int(os.environ.get("RANK", "0"))
        record.rank = rank
        return rank == 0 or record.levelno >= logging.WARNING


def setup_logging(level: int = logging.INFO) -> None:
    """Attach a handler to the ``meshzero`` logger once (no-op if the user configured one)."""
    logger = logging.getLogger("meshzero")
    if logger.handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("[meshzero rank %(rank)s] %(levelname)s %(message)s"))
    handler.addFilter(_RankFilter())
    logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False


def warn_once(logger: logging.Logger, message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        logger.warning(message)
